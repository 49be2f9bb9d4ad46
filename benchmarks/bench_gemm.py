"""FP8 block-scaled GEMM (model/kernels/gemm.py) at V4.1-Flash projection shapes, decode and prefill.

y = fp8_fake_quant(x) @ dequant(W)^T with W E4M3 [N, K] and one UE8M0 per 32x32 tile, x bf16 [M, K].
    bytes (floor) = N K (weight) + ceil(N/32) ceil(K/32) (scales) + 2 M K (x) + 2 M N (y);  FLOPs = 2 M N K.
Shapes (preset v4.1-flash, dim 5120): wq_a 1280x5120, wq_b 32768x1280 (64 heads x 512), wo_b 5120x8192,
shared-expert w1/w3 2304x5120 and w2 5120x2304; M = 1, 16, 64 (decode) and 4096 (prefill).

Each case also times
  * bf16_us: cuBLAS bf16 matmul of the same shape with a bf16 weight (what a dense checkpoint would cost;
    twice the weight bytes of FP8),
  * ref_us: the reference (model/kernels/reference.py: fake-quant, dequantize the weight to fp32, fp32
    matmul), i.e. the torch path without the cached fp32 weight that Linear keeps,
  * graph_us (M <= 64): the kernel replayed from a CUDA graph, the GPU time without the Python launch cost.
"variant" rows time the decode launch choices (K split, fused activation quantization) on one shape.
"dequant" rows time the weight dequantization of the cuBLAS path (from gemm.CUBLAS_MIN_M tokens) alone, FP8 and
FP4 weights of the DEQUANT_SHAPES: gemm.dequant_weight (one Triton pass) against `formats_us`, the torch
functions it replaced (reference.dequant_weight); bytes = weight + scales read, bf16 weight written. Its
"variant" rows time other tiles (DEQUANT_VARIANTS) beside the default gemm.DEQUANT_TILE.
Usage: python benchmarks/bench_gemm.py [--json F] [--quick] [--dequant-only]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, graph_bench, print_table, record, set_quick, write_json

DEVICE = "cuda"  # a module constant so that a CPU smoke run (interpreter, tiny shapes) can change it

SHAPES = (("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("shared_w1", 2304, 5120),
          ("shared_w2", 5120, 2304))
M_LIST = (1, 16, 64, 4096)
VARIANTS = (("wq_a", 1, dict(split=1)), ("wq_a", 1, dict(fuse=False)), ("wq_a", 1, dict(split=4)),
            ("wq_a", 64, dict(fuse=True)), ("wo_b", 16, dict(split=1)),
            # M >= gemm.CUBLAS_MIN_M: the Triton kernel beside the default cuBLAS product
            ("wq_b", 4096, dict(cublas=False)), ("wo_b", 4096, dict(cublas=False)))
DEQUANT_SHAPES = ("wq_b", "wo_b")
DEQUANT_VARIANTS = (dict(BN=16, BK=512, num_warps=4), dict(BN=64, BK=256, num_warps=8),
                    dict(BN=8, BK=1024, num_warps=4))


def _weight(N, K):
    from dsv41.model import formats

    w = torch.randn(N, K, device=DEVICE)
    return formats.quant_fp8_weight(w)


def _fp4_weight(N, K):
    from dsv41.model import formats

    return formats.quant_fp4_weight(torch.randn(N, K, device=DEVICE))


def run(json_path=None, quick=False, dequant_only=False):
    from dsv41.model.kernels import gemm, reference

    rows = []
    weights = {name: (_weight(N, K), N, K) for name, N, K in SHAPES}
    for name, N, K in () if dequant_only else SHAPES:
        (w, s), _, _ = weights[name]
        wb = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)
        for M in M_LIST:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            t = bench(lambda: gemm.fp8_block_gemm(x, w, s))
            extra = {"bf16_us": bench(lambda: x @ wb.T) * 1e6}
            extra["ref_us"] = bench(lambda: reference.fp8_block_gemm(x, w, s), rep_ms=50) * 1e6
            if M <= 64:
                extra["graph_us"] = graph_bench(lambda: gemm.fp8_block_gemm(x, w, s)) * 1e6
            cfg = gemm.launch_config(M, N, K, 32, 32, x.device)
            extra["config"] = (f"BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} split{cfg['split']} fuse{int(cfg['fuse'])}"
                               + (" cublas" if cfg.get("cublas") else ""))
            nbytes = N * K + -(-N // 32) * -(-K // 32) + 2 * M * K + 2 * M * N
            rows.append(record("fp8_block_gemm", f"{name} {N}x{K} M={M}", t, nbytes, 2 * M * N * K, **extra))
            print(f"  {rows[-1]['case']}: {t * 1e6:.1f} us", flush=True)
    for name, M, over in () if dequant_only else VARIANTS:
        (w, s), N, K = weights[name]
        x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
        t = graph_bench(lambda: gemm.fp8_block_gemm(x, w, s, config=over))
        cfg = {**gemm.launch_config(M, N, K, 32, 32, x.device), **over}
        nbytes = N * K + -(-N // 32) * -(-K // 32) + 2 * M * K + 2 * M * N
        rows.append(record("fp8_block_gemm", f"variant {name} M={M} {over} (graph)", t, nbytes, 2 * M * N * K,
                           config=f"BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} split{cfg['split']} fuse{int(cfg['fuse'])}"
                                  f"{' cublas' if cfg.get('cublas') else ''}"))
    for name in (n for n in DEQUANT_SHAPES if n in weights):
        (w8, s8), N, K = weights[name]
        for fmt, (w, s) in (("fp8", (w8, s8)), ("fp4", _fp4_weight(N, K))):
            fp4 = fmt == "fp4"
            nbytes = w.numel() + s.numel() + 2 * N * K
            torch_us = bench(lambda: reference.dequant_weight(w, s, 32, fp4), rep_ms=50) * 1e6
            for over in (None, *DEQUANT_VARIANTS):
                t = bench(lambda: gemm.dequant_weight(w, s, 32, fp4, config=over))
                tile = {**gemm.DEQUANT_TILE, **(over or {})}
                rows.append(record("dequant_weight", f"dequant {fmt} {name} {N}x{K}" + (" variant" if over else ""),
                                   t, nbytes, 0, formats_us=torch_us, speedup=torch_us / (t * 1e6),
                                   config=f"BN{tile['BN']} BK{tile['BK']} warps{tile['num_warps']}"))
    print_table(rows, "FP8 block-scaled GEMM (E4M3 weight, UE8M0 per 32x32; bf16 activations quantized per 32)")
    write_json(json_path, "gemm", rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    ap.add_argument("--dequant-only", action="store_true", help="only the weight dequantization rows")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, a.quick, a.dequant_only)
