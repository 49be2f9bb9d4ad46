"""The fp32 head and the bf16 column-block head of this tree interleaved in one process: 8 to 64 rows, 5 rounds, the
minimum of 5 calls a round, the median of the rounds. Ad hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-head-avx2/head_ab.py
"""
import torch, time, statistics
from dsv41.model.kernels import host
torch.set_num_threads(1)
V, K = 129280, 64
w = (torch.randn(V, K) * 0.05).bfloat16()
wt = w.float().t().contiguous(); blocks = host.head_blocks(w)
res = {}
for rnd in range(5):
    for R in (8, 16, 24, 32, 48, 64):
        x = torch.randn(R, K)
        for name, f in (("fp32", lambda: host.head_logits(x, wt)), ("bf16", lambda: host.head_logits_bf16(x, blocks, V))):
            f(); ts = []
            for _ in range(5):
                a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
            res.setdefault((R, name), []).append(min(ts))
for R in (8, 16, 24, 32, 48, 64):
    a, b = statistics.median(res[(R, "fp32")]) * 1e3, statistics.median(res[(R, "bf16")]) * 1e3
    print(f"{R} rows: fp32 {a:.2f} ms, bf16 blocks {b:.2f} ms, fp32/bf16 {a/b:.2f}")
