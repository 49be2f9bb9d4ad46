"""The kernels of issue #24's missed targets, once each at their target shapes, for Nsight Compute (ncu).

Each case is built as its benchmark builds it (bench_mhc.py, bench_indexer.py, bench_sparse_attention.py), run
three times to compile and warm up, then once between cudaProfilerStart and Stop inside an NVTX range named after
it, so `ncu --profile-from-start off --nvtx` records exactly these launches, labelled:

    mhc M=4096 / M=16384          the single-pass mHC step (coefficient and residual kernels)
    indexer dense 64K / 1M        indexer scores, B=4 decode queries, 32 heads x 128, MXFP4 keys
    attention decode 128K         sparse attention, split kernel + combine, B=64, Kw=128, Km=512 of N=64K
    attention prefill 4096        sparse attention prefill, T=4096 tokens over N=4096 entries (the split path)
    experts T=64 / T=4096         the routed FP4 experts of one MoE layer (384 x 5120 -> 2304 -> 5120, top-6)

    ncu --clock-control none --profile-from-start off --nvtx --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --csv --page details python3 benchmarks/ncu_targets.py > ncu.csv
    python3 benchmarks/ncu_targets.py --only mhc     (one family)
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def mhc_cases():
    from bench_mhc import DIM, N_S
    from dsv41.model.kernels.mhc import mhc_step

    n_mix = (N_S + 2) * N_S
    fn = torch.randn(n_mix, N_S * DIM, device="cuda") * (N_S * DIM) ** -0.5
    scale, base = torch.rand(3, device="cuda"), torch.randn(n_mix, device="cuda") * 0.1
    for M in (4096, 16384):
        x = torch.randn(M, 1, N_S, DIM, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(M, 1, DIM, device="cuda", dtype=torch.bfloat16)
        pre, post = torch.rand(M, 1, N_S, device="cuda"), torch.rand(M, 1, N_S, device="cuda")
        comb = torch.rand(M, 1, N_S, N_S, device="cuda")
        args = (x, pre, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb)
        yield f"mhc M={M}", (lambda a=args: mhc_step(*a))


def indexer_cases():
    from bench_indexer import DK, H
    from dsv41.model import formats
    from dsv41.model.kernels.indexer import indexer_scores

    for N in (65536, 1 << 20):
        B = 4
        q = formats.mxfp4_fake_quant(torch.randn(B, 1, H, DK, device="cuda"))
        w = torch.randn(B, 1, H, device="cuda") * (H * DK) ** -0.5
        kc = torch.randint(0, 256, (B, N, DK // 2), dtype=torch.uint8, device="cuda")
        ks = torch.randint(120, 130, (B, N, DK // 32), dtype=torch.uint8, device="cuda")
        vis = torch.tensor([N], device="cuda")
        yield f"indexer dense {N >> 10}K", (lambda a=(q, w, kc, ks, vis): indexer_scores(*a))


def attention_cases():
    from bench_sparse_attention import D, make
    from dsv41.model.kernels import sparse_attention as sa

    for label, B, T, N in (("attention decode 128K", 64, 1, 65536), ("attention prefill 4096", 1, 4096, 4096)):
        args = (*make(B, T, N), D ** -0.5)
        yield label, (lambda a=args: sa.sparse_attention_packed(*a, variant="split"))


def experts_cases():
    from bench_experts import LIMIT, make_experts, routed_inputs
    from dsv41.model.kernels import experts as ek

    ew = make_experts()
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (64, 4096):
        x, w, idx = routed_inputs(T, g)
        yield f"experts T={T}", (lambda a=(x, w, idx): ek.routed_experts(*a, ew, LIMIT))


FAMILIES = {"mhc": mhc_cases, "indexer": indexer_cases, "attention": attention_cases, "experts": experts_cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    a = ap.parse_args()
    for family in a.only:
        for label, call in FAMILIES[family]():
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push(label)
            call()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"ran {label}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
