"""Fused quantize-and-pack of KV entries: main FP4 (E2M1 + E4M3/16, 288 B per 512-dim entry) and window
FP8 (E4M3 + UE8M0/32, 528 B). bytes = rows * (D * 2 read (bf16) + packed bytes written); FLOPs ~ 0 (bytes-bound).
Usage: python benchmarks/bench_kv_pack.py [--json F] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, print_table, record, set_quick, write_json

D = 512


def run(json_path=None):
    from dsv41.model.kernels import quant, reference

    rows = []
    for M in (64, 65536, 1 << 20):
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        for name, out_bytes in (("pack_fp4_e4m3", 288), ("pack_fp8_ue8m0", 528)):
            fn = getattr(quant, name)
            t = bench(lambda: fn(x))
            extra = {"torch_ref_us": bench(lambda: getattr(reference, name)(x), rep_ms=50) * 1e6} if M <= 65536 else {}
            rows.append(record(name, f"{name} rows={M}", t, M * (2 * D + out_bytes), 0, **extra))
    print_table(rows, "KV quantize-and-pack (D=512, bf16 in)")
    write_json(json_path, "kv_pack", rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json)
