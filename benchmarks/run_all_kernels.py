"""Every kernel benchmark in one process (one GPU run): ceilings, sparse attention, indexer, mHC, KV
packing, the FP8 block GEMM, the FP4 routed experts, end to end. Writes one JSON per benchmark into --out.
Usage: python benchmarks/run_all_kernels.py --out DIR [--only NAME ...] [--quick] [--json F]
(--json F: every benchmark's rows in one file as well, {name: rows}, with the machine and the ceilings)"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402
import bench_experts  # noqa: E402
import bench_gemm  # noqa: E402
import bench_indexer  # noqa: E402
import bench_kv_pack  # noqa: E402
import bench_mhc  # noqa: E402
import bench_sparse_attention  # noqa: E402
from kernels_common import ceilings, machine, set_quick  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--quick", action="store_true", help="timing windows divided by 5 (benchmarks/device_batch.sh)")
    ap.add_argument("--json", help="also write every benchmark's rows into this one file")
    args = ap.parse_args()
    out, only = Path(args.out), args.only
    set_quick(args.quick)
    out.mkdir(parents=True, exist_ok=True)
    c = ceilings()
    print("machine", machine())
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s")
    (out / "ceilings.json").write_text(json.dumps({"machine": machine(), "ceilings": c}, indent=1))
    every = {}
    for name, mod in (("kv_pack", bench_kv_pack), ("mhc", bench_mhc), ("sparse_attention", bench_sparse_attention),
                      ("indexer", bench_indexer), ("gemm", bench_gemm), ("experts", bench_experts), ("e2e", bench_e2e)):
        if only and name not in only:
            continue
        try:
            every[name] = mod.run(str(out / f"{name}.json"))
        except Exception as e:  # keep the other benchmarks' numbers
            print(f"!! {name} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine(), "ceilings": c, "rows": every,
                                               "command": " ".join(sys.argv)}, indent=1, default=str))
