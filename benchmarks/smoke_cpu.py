"""Run bench_gemm.py, bench_experts.py and bench_decode_gemms.py (its FP8 and expert parts with their sweeps; the
head's bf16 GEMM with fp32 output is CUDA only) end to end on the CPU, through Triton's interpreter at tiny
shapes, to check the scripts themselves (every case, JSON written) before GPU time is spent on them. The
timings are one wall-clock call each (no CUDA graph) and the ceilings are placeholders: the numbers mean
nothing.

Usage: python benchmarks/smoke_cpu.py [--out DIR] [--json F]     (sets TRITON_INTERPRET=1 itself;
--json F: both benchmarks' rows in one file)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="bench_smoke_"))
    import bench_decode_gemms
    import bench_experts
    import bench_gemm
    import kernels_common

    from dsv41.model.kernels import experts, gemm

    kernels_common._CEILINGS = {"copy_GBps": 1000.0, "bf16_TFLOPs": 100.0, "copy_bytes": 0, "matmul_shape": []}

    def once(fn, warmup_ms=0, rep_ms=0):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for mod in (gemm, experts):  # CPU tensors take the kernels (interpreted), as CUDA tensors would
        mod.use_triton = lambda *t, force=False: True
    for mod in (bench_gemm, bench_experts):
        mod.bench, mod.graph_bench, mod.DEVICE = once, once, "cpu"
    bench_gemm.SHAPES = (("wq_a", 40, 64), ("wo_b", 48, 96))
    bench_gemm.M_LIST = (1, 65)
    bench_gemm.VARIANTS = (("wq_a", 1, dict(split=2)), ("wo_b", 16, dict(fuse=False)))
    bench_gemm.DEQUANT_VARIANTS = (dict(BN=16, BK=64, num_warps=2),)
    # the interpreter's time goes by programs, about one per expert and tile: 4 small experts (the up stage's 128
    # output channels still several 32-channel tiles)
    bench_experts.DIM, bench_experts.INTER, bench_experts.N_EXPERTS, bench_experts.TOPK = 64, 64, 4, 2
    bench_experts.T_LIST, bench_experts.REF_MAX_T = (1, 20), 1
    bench_experts.SWEEP_T = (20,)
    # one sweep row, which overrides two settings: the sweep's code path runs once, as for any row
    bench_experts.SWEEP = (("BN32 dec16", dict(BN=32, dec16=True)),)
    bench_gemm.run(str(out / "gemm.json"))
    bench_experts.run(str(out / "experts.json"), sweep=True)
    dg = bench_decode_gemms
    # one routing and the fewest FP8 weight copies (4), of which only the first call is timed: the others would run
    # the same code on other weights
    dg.DEVICE, dg.EXPERT_CALLS, dg.COLD_BYTES = "cpu", 1, 1
    dg.cold_graph = lambda fns: once(fns[0])
    dg.FP8_SHAPES = (("wq_a", 40, 256), ("wo_b", 48, 1024))  # wo_b's K: the default, GEMV and tile K splits (2, 2, 3)
    full_configs = dg.fp8_configs
    dg.fp8_configs = lambda N, K: [c for c in full_configs(N, K) if c[0] in (  # a tile and the GEMV
        "BN16 BK128 2/SM", "gemv BN8 BK256 4/SM")]
    dg.EXPERT_CONFIGS = [c for c in dg.EXPERT_CONFIGS if c[0] == "BN32 BK64 split 2/2"]  # a tile and a K split
    dg.run(str(out / "decode_gemms.json"), sweep=True, only=("fp8", "experts"))
    every = {}
    # gemm: 4 cases, 2 variants, 4 dequant rows (wo_b); experts: 2 cases, the default and one sweep row;
    # decode_gemms: 2 x (1 + 2) FP8 rows, 3 x (1 + 1) expert rows, the fastest variant of each of the 5 products
    for name, n in (("gemm", 10), ("experts", 4), ("decode_gemms", 17)):
        rows = json.loads((out / f"{name}.json").read_text())["rows"]
        assert len(rows) == n, (name, len(rows))
        every[name] = rows
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"benchmark": "smoke_cpu", "note": "interpreter at tiny shapes: the "
                                            "timings mean nothing", "out": str(out), "rows": every}, indent=1))
    print(f"smoke run ok: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
