# The fixed-order GEMM (host.fixed_order_matmul) at narrow widths, one thread, and its bits against the reference for
# every ISA version: python benchmarks/results/cpu-layer-calls/narrow_gemm.py (run at 4f79183 and 83762ff)
import time

import torch

from dsv41.model.kernels import host, reference

torch.set_num_threads(1)
for (M, K, N) in ((200, 256, 24), (200, 256, 32), (200, 256, 64), (200, 64, 8), (200, 64, 16), (1, 256, 24)):
    x, wt = torch.randn(M, K), torch.randn(K, N)
    ok = all(torch.equal(host.head_logits(x, wt, v), reference.fixed_order_matmul(x, wt)) for v in ("base", "avx2", "avx512"))
    for _ in range(20):
        host.fixed_order_matmul(x, wt)
    t = time.perf_counter()
    for _ in range(200):
        host.fixed_order_matmul(x, wt)
    dt = (time.perf_counter() - t) / 200
    print(M, K, N, f"{dt * 1e6:.1f} us", f"{M * K * N / dt / 1e9:.2f} GMAC/s", "bits equal" if ok else "BITS DIFFER")
