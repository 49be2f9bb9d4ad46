"""Three host kernels on the bundled model's shapes, in this tree and in a revision (default cc921fc, the commit
before 3de93f9), each tree in its own processes (its own host_kernels.c), alternated over 5 rounds; the minimum of 5
calls a round (20 for the small ones), the median over rounds. Each case checks that both trees give the same numbers
(the outputs' checksums, exact). Ad hoc; its numbers are in NOTES.md beside the command.
- the C sparse attention (host.sparse_attention_packed; H 4, D 64, the window's fp32 values given, as the engine
  calls it): a prefill chunk of T tokens of one sequence (window 64, 32 main entries of N = T/2, or none), and a
  decode step of B rows (T 1, the same indices), each in the ISA version the CPU runs and in the baseline's;
- the mHC mixes (host.expand, host.collapse; n 4, d 64) over T tokens, bf16 and fp32;
- Sinkhorn (host.sinkhorn_normalize_; 4 x 4, 20 iterations) of T matrices.

    python benchmarks/results/cpu-attention-tiles/kernels.py [REV]
"""
import json, statistics, subprocess, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_startup import REPO, env_for, export_revision  # noqa: E402

CASES = [("prefill", 1, 400, 32), ("prefill", 1, 400, 0), ("prefill", 1, 100, 32), ("decode", 32, 1, 32),
         ("decode", 8, 1, 32), ("decode", 1, 1, 32), ("decode", 32, 1, 0)]
SMALL = [("expand", 400, "bf16"), ("expand", 400, "fp32"), ("expand", 32, "bf16"), ("collapse", 400, "bf16"),
         ("collapse", 32, "bf16"), ("sinkhorn", 400, "fp32"), ("sinkhorn", 32, "fp32"), ("sinkhorn", 1, "fp32")]
WORKER = r'''
import json, sys, time, torch
from dsv41.model import formats
from dsv41.model.attention import window_indices
from dsv41.model.kernels import host
torch.set_num_threads(1)
out = {"isa": host.head_isa()}
def timed(f, n):
    f(); ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts)
cases, small = json.loads(sys.argv[1])
for kind, B, T, Km in cases:
    g = torch.Generator().manual_seed(0)
    H, D, window = 4, 64, 64
    W = T if kind == "prefill" else window
    N = max(T // 2, 64)
    q = torch.randn(B, T, H, D, generator=g).bfloat16()
    wc, ws = formats.pack_fp8_ue8m0(torch.randn(B, W, D, generator=g) * 3, formats.FP8_BLOCK)
    wv = formats.unpack_fp8_ue8m0(wc, ws, formats.FP8_BLOCK, torch.float32)
    mc, ms = formats.pack_fp4_e4m3(torch.randn(B, N, D, generator=g), formats.FP4_E4M3_BLOCK)
    if kind == "prefill":
        w_idx = window_indices(0, T, 0, window, "cpu").expand(B, T, -1).contiguous()
    else:
        w_idx = torch.arange(window).expand(B, T, -1).contiguous()
    m_idx = torch.randint(0, N, (B, T, Km), generator=g) if Km else None
    sink = torch.randn(H, generator=g)
    key = f"attention {kind} B{B} T{T} Km{Km}"
    for version in (None, "base"):
        f = lambda: host.sparse_attention_packed(q, wc, ws, mc if Km else None, ms if Km else None, sink, w_idx, m_idx,
                                                 0.125, wv, version)
        name = key + (" (baseline ISA)" if version else "")
        out[name] = timed(f, 5)
        out["sum " + name] = float(f().float().double().sum())
for kind, T, dt in small:
    g = torch.Generator().manual_seed(T)
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    y, r = torch.randn(T, 64, generator=g).to(dtype), torch.randn(T, 4, 64, generator=g).to(dtype)
    post, comb, pre = torch.rand(T, 4, generator=g), torch.rand(T, 4, 4, generator=g), torch.rand(T, 4, generator=g)
    f = {"expand": lambda: host.expand(y, r, post, comb), "collapse": lambda: host.collapse(r, pre),
         "sinkhorn": lambda: host.sinkhorn_normalize_(comb.clone() + 0.1, 20, 1e-6)}[kind]
    key = f"{kind} T{T} {dt}"
    out[key] = timed(f, 20)
    out["sum " + key] = float(f().float().double().sum())
print(json.dumps(out))
'''


def run(tree: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps([CASES, SMALL])], cwd=tree, env=env_for(tree),
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    rev = sys.argv[1] if len(sys.argv) > 1 else "cc921fc"
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "tree"
        old.mkdir()
        export_revision(rev, old)
        runs = {"current": [], rev: []}
        for r in range(5):
            for label, tree in ((("current", REPO), (rev, old)) if r % 2 == 0 else ((rev, old), ("current", REPO))):
                runs[label].append(run(tree))
    print("isa", runs["current"][0]["isa"])
    print(f"| case | {rev} us | current us | speed-up | same numbers |")
    print("|---|---:|---:|---:|---|")
    for key in [k for k in runs["current"][0] if k != "isa" and not k.startswith("sum ")]:
        a = statistics.median(x[key] for x in runs[rev]) * 1e6
        b = statistics.median(x[key] for x in runs["current"]) * 1e6
        same = runs[rev][0]["sum " + key] == runs["current"][0]["sum " + key]
        print(f"| {key} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {same} |")


if __name__ == "__main__":
    main()
