# The head at 1-64 rows: the fp32 fixed-order GEMM against the bf16 column blocks, one thread:
# python benchmarks/results/cpu-layer-calls/head_rows.py (run at 4f79183, the machine idle)
import time, torch
from dsv41.model.kernels import host
torch.set_num_threads(1)
V, K = 129280, 64
w = torch.randn(V, K).bfloat16()
wt = w.float().t().contiguous()
print(host.HEAD_BF16_MAX_ROWS); blocks = host.head_blocks(w)
def bench(f, n=5):
    f(); f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e3
for R in (1, 4, 8, 16, 17, 24, 32, 48, 64):
    x = torch.randn(R, K)
    a = bench(lambda: host.fixed_order_matmul(x, wt))
    b = bench(lambda: host.head_logits_bf16(x, blocks, V))
    print(R, f"fp32 {a:.2f} ms  bf16-blocks {b:.2f} ms")
