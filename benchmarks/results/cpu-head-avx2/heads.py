"""The output head's two host kernels by rows, in this tree and in a revision (default d728b2b, the commit before
AVX2's 4-row bf16 tile), each tree in its own processes (its own host_kernels.c), alternated over 5 rounds: the
fp32 head (host.head_logits) and the bf16 column-block head (host.head_logits_bf16, the step's pick up to 16 rows),
on the bundled model's shape (129,280 x 64), one thread, the minimum of 5 calls a round, the median over rounds.
Checks that both trees' bf16 heads give the fp32 head's bits. Ad hoc; its numbers are in NOTES.md beside the
command.

    python benchmarks/results/cpu-head-avx2/heads.py [REV]
"""
import json, os, statistics, subprocess, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_startup import REPO, env_for, export_revision  # noqa: E402

ROWS = (1, 2, 4, 8, 12, 16, 24, 32)
WORKER = r'''
import json, sys, time, torch
from dsv41.model.kernels import host
torch.set_num_threads(1)
V, K = 129280, 64
g = torch.Generator().manual_seed(0)
w = (torch.randn(V, K, generator=g) * 0.05).bfloat16()
wt = w.float().t().contiguous(); blocks = host.head_blocks(w)
out = {"isa": host.head_isa()}
for R in json.loads(sys.argv[1]):
    x = torch.randn(R, K, generator=g)
    assert torch.equal(host.head_logits(x, wt).view(torch.int32), host.head_logits_bf16(x, blocks, V).view(torch.int32))
    for name, f in (("fp32", lambda: host.head_logits(x, wt)), ("bf16", lambda: host.head_logits_bf16(x, blocks, V))):
        f(); ts = []
        for _ in range(5):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        out[f"{name}/{R}"] = min(ts)
print(json.dumps(out))
'''


def run(tree: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(ROWS)], cwd=tree, env=env_for(tree),
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "d728b2b"
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        commit = export_revision(rev, old)
        trees = {"rev": old, "tree": REPO}
        got = {k: [] for k in trees}
        for _ in range(5):
            for k, t in trees.items():
                got[k].append(run(t))
    med = {k: {key: statistics.median(r[key] for r in runs) * 1e3 for key in runs[0] if key != "isa"}
           for k, runs in got.items()}
    print(f"ISA {got['tree'][0]['isa']}; {rev} = {commit[:7]}")
    print(f"| rows | fp32 head ms | bf16 blocks, {commit[:7]} ms | bf16 blocks, this tree ms | bf16 old / new |")
    print("|---:|---:|---:|---:|---:|")
    for R in ROWS:
        a, b, f = med["rev"][f"bf16/{R}"], med["tree"][f"bf16/{R}"], med["tree"][f"fp32/{R}"]
        print(f"| {R} | {f:.2f} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
