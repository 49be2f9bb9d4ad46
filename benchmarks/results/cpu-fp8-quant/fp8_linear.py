"""The host path of a quantized linear layer (host.fp8_linear: bf16 in, the FP8 activation grid per block of 32, the
fixed-order product, bf16 out) and the activation grid alone (host.fp8_fake_quant_f32), in this tree and in a
revision (default a1b51bc, before the vector form of the grid), each tree in its own processes (its own
host_kernels.c), alternated over 5 rounds; one thread, the best of 3 runs of 300 calls a round, the median over the
rounds. Checks that both trees give the same bits. Ad hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-fp8-quant/fp8_linear.py [REV]
"""
import json, statistics, subprocess, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_startup import REPO, env_for, export_revision  # noqa: E402

SHAPES = ((1, 64, 256), (32, 64, 256), (200, 64, 64), (200, 64, 256), (200, 256, 64))
WORKER = r'''
import hashlib, json, sys, time, torch
from dsv41.model.kernels import host
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
out, digest = {}, hashlib.sha256()
def best(f, n=300):
    f(); b = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n): f()
        b = min(b, (time.perf_counter() - t) / n)
    return b
for R, K, N in json.loads(sys.argv[1]):
    x = (torch.randn(R, K, generator=g) * torch.exp(torch.randn(R, K, generator=g))).bfloat16()
    wt = torch.randn(K, N, generator=g)
    digest.update(host.fp8_linear(x, 32, wt).view(torch.int16).numpy().tobytes())
    digest.update(host.fp8_fake_quant_f32(x.float(), 32).view(torch.int32).numpy().tobytes())
    xf = x.float()
    out[f"linear/{R}x{K}x{N}"] = best(lambda: host.fp8_linear(x, 32, wt))
    out[f"grid/{R}x{K}"] = best(lambda: host.fp8_fake_quant_f32(xf, 32))
out["digest"] = digest.hexdigest()
print(json.dumps(out))
'''


def run(tree: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(SHAPES)], cwd=tree, env=env_for(tree),
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "a1b51bc"
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        commit = export_revision(rev, old)
        got = {"rev": [], "tree": []}
        for _ in range(5):
            got["rev"].append(run(old))
            got["tree"].append(run(REPO))
    same = {r["digest"] for runs in got.values() for r in runs}
    med = {k: {key: statistics.median(r[key] for r in runs) * 1e6 for key in runs[0] if key != "digest"}
           for k, runs in got.items()}
    print(f"{rev} = {commit[:7]}; the same bits in both trees: {len(same) == 1}")
    print(f"| call | {commit[:7]} us | this tree us | ratio |")
    print("|---|---:|---:|---:|")
    for key in med["tree"]:
        a, b = med["rev"][key], med["tree"][key]
        print(f"| {key} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
