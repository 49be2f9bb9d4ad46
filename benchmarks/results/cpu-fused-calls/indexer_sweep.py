"""host.indexer_decode against the torch lines it replaces (reference.indexer_scores' exact path, the masks, the
stable Top-K, the sort, the -1s) at 4 index heads of 32, N entries and B rows, one torch thread; the best of 5 rounds
of 20 calls each. Ad hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-fused-calls/indexer_sweep.py
"""
import time, torch
from dsv41.model import formats
from dsv41.model.kernels import host, reference, quant
from dsv41.model.indexer import top_indices
import torch.nn.functional as F
torch.set_num_threads(1)
def bench(f):
    for _ in range(5): f()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20): f()
        ts.append((time.perf_counter() - t0) / 20 * 1e3)
    return min(ts)
for N in (64, 260, 1000):
    for B in (1, 2, 4, 8, 16, 32):
        g = torch.Generator().manual_seed(0)
        q = formats.mxfp4_fake_quant(torch.randn(B, 1, 4, 32, generator=g) * 2, 32).bfloat16()
        w = (torch.randn(B, 1, 4, generator=g) * 0.3).bfloat16()
        codes, scales = formats.pack_mxfp4(torch.randn(B, N, 32, generator=g), 32)
        visible = torch.full((B, 1), N)
        def tp():
            scores = reference.indexer_scores(q, w, codes, scales, bf16_scores=True, by_entry=True, unpack=quant.unpack)
            scores = scores.masked_fill(torch.arange(N) >= visible.unsqueeze(-1), -torch.inf)
            idx = top_indices(scores, min(32, N), True).sort(dim=-1).values
            return F.pad(torch.where(idx < visible.unsqueeze(-1), idx, -1), (0, 0))
        with torch.inference_mode():
            c = bench(lambda: host.indexer_decode(q, w, codes, scales, visible, None, 32)); t = bench(tp)
        print(f"N={N:5d} B={B:3d}  C {c:7.3f} ms  torch {t:7.3f} ms  C/torch {c/t:5.2f}")
