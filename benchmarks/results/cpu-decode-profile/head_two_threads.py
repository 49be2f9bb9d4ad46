"""The fp32 fixed-order head (host.fixed_order_matmul, [R, 64] x [64, 129280]) on one thread against its columns
split between two threads (ctypes releases the GIL; the same bits, checked), and the bf16 column-block head
(host.head_logits_bf16) on one thread, by rows R; medians of 30 calls. Ad hoc timing; its numbers are in NOTES.md.

    python benchmarks/results/cpu-decode-profile/head_two_threads.py
"""
import time, torch
from concurrent.futures import ThreadPoolExecutor
from dsv41.model.kernels import host
torch.manual_seed(0)
K, V = 64, 129280
wt = torch.randn(K, V)
h = V // 2 // 64 * 64
w1, w2 = wt[:, :h].contiguous(), wt[:, h:].contiguous()
pool = ThreadPoolExecutor(1)
def bench(fn, n=30):
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3
for R in (1, 4, 8, 16, 32):
    x = torch.randn(R, K)
    out = torch.empty(R, V)
    one = bench(lambda: host.fixed_order_matmul(x, wt, out))
    def two():
        f = pool.submit(host.fixed_order_matmul, x, w2, out[:, h:])
        host.fixed_order_matmul(x, w1, out[:, :h]); f.result()
    t2 = bench(two)
    ref = host.fixed_order_matmul(x, wt); two(); assert torch.equal(ref, out)
    blocks = host.head_blocks(wt.t().contiguous().bfloat16())
    bf = bench(lambda: host.head_logits_bf16(x, blocks, V))
    print(f"R={R}: fp32 one thread {one:.2f} ms, two threads {t2:.2f} ms ({one/t2:.2f}x); bf16 blocks one thread {bf:.2f} ms")
