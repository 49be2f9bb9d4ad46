"""Why are the kernels far from their floors? Registers and spills of each compiled kernel, the time of
the same call plain (do_bench) and replayed from a CUDA graph (no CPU launch cost), and sparse-attention
variants (bf16 rows without decoding; tile sizes; warps). Usage: python benchmarks/diagnose_kernels.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_common import bench  # noqa: E402
from kernels_common import graph_bench as graph_time  # noqa: E402


def compiled_info(jit_fn):
    out = []
    try:
        for dev_cache in jit_fn.device_caches.values():
            for k in dev_cache[0].values():
                out.append((getattr(k, "n_regs", None), getattr(k, "n_spills", None)))
    except Exception as e:  # the cache layout is Triton-internal
        out.append(repr(e))
    return out


def main():
    import bench_sparse_attention as bsa

    from dsv41.model.kernels import _triton_indexer, _triton_mhc, _triton_quant, _triton_sparse_attention
    from dsv41.model.kernels import sparse_attention as sa
    from dsv41.model.kernels.indexer import indexer_scores
    from dsv41.model.kernels.mhc import mhc_step

    q, wc, ws, mc, ms, sink, widx, midx = bsa.make(64, 1, 4096)
    call = lambda: sa.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, midx, 0.04)  # noqa: E731
    print(f"sparse attn decode B=64: do_bench {bench(call) * 1e6:.1f} us, graph replay {graph_time(call) * 1e6:.1f} us")
    kv = torch.randn(64, 4096, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.cat([widx, midx], -1)
    dense = lambda: sa.sparse_attention(q, kv, sink, idx, 0.04)  # noqa: E731
    print(f"sparse attn decode B=64 bf16 rows (no decode): {bench(dense) * 1e6:.1f} us")
    print("sparse attention kernels (regs, spills):", compiled_info(_triton_sparse_attention.tiles_kernel))
    from dsv41.model import formats

    qi = formats.mxfp4_fake_quant(torch.randn(4, 1, 32, 128, device="cuda"))
    w = torch.randn(4, 1, 32, device="cuda")
    kc = torch.randint(0, 256, (4, 65536, 64), dtype=torch.uint8, device="cuda")
    ks = torch.randint(120, 130, (4, 65536, 4), dtype=torch.uint8, device="cuda")
    f = lambda: indexer_scores(qi, w, kc, ks)  # noqa: E731
    print(f"indexer dense 64K B=4: do_bench {bench(f) * 1e6:.1f} us, graph {graph_time(f) * 1e6:.1f} us")
    print("indexer kernels (regs, spills):", compiled_info(_triton_indexer.scores_kernel))
    x = torch.randn(4096, 1, 4, 5120, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(4096, 1, 5120, device="cuda", dtype=torch.bfloat16)
    pre, post, comb = (torch.rand(4096, 1, 4, device="cuda"), torch.rand(4096, 1, 4, device="cuda"),
                       torch.rand(4096, 1, 4, 4, device="cuda"))
    fn = torch.randn(24, 20480, device="cuda") * 0.007
    sc, base = torch.rand(3, device="cuda"), torch.randn(24, device="cuda")
    m = lambda: mhc_step(x, pre, fn, sc, base, 20, 1e-6, 1e-6, y, post, comb)  # noqa: E731
    print(f"mhc M=4096: do_bench {bench(m) * 1e6:.1f} us, graph {graph_time(m) * 1e6:.1f} us")
    xs = x[:1]
    m1 = lambda: mhc_step(xs, pre[:1], fn, sc, base, 20, 1e-6, 1e-6, y[:1], post[:1], comb[:1])  # noqa: E731
    print(f"mhc M=1: do_bench {bench(m1) * 1e6:.1f} us, graph {graph_time(m1) * 1e6:.1f} us")
    print("mhc residual kernels (regs, spills):", compiled_info(_triton_mhc.residual_kernel))
    print("mhc coefficient kernels (regs, spills):", compiled_info(_triton_mhc.coefficient_kernel))
    print("fp4 pack kernels (regs, spills):", compiled_info(_triton_quant.pack_fp4_e4m3_kernel))


if __name__ == "__main__":
    main()
