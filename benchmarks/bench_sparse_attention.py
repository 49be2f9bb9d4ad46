"""Sparse attention over packed KV (FP8 window + FP4 main): decode and prefill at V4.1-Flash width.

Per query token: H = 64 heads of D = 512, Kw = 128 window rows (528 B each), Km = 512 Top-K rows (288 B each).
Bytes (floor): q and o (2 * H D * 2), indices (4 (Kw + Km)), and the rows: decode reads Kw*528 + Km*288 per
sequence (every sequence has its own cache); prefill reads at least the whole stores once (W*528 + N*288).
FLOPs: 4 H D (Kw + Km) per token (two products). The floor leaves out the split kernel's fp32 partial outputs
(written and read back once: 2 * splits * H * D * 4 bytes per token), which are the price of the split.

Every case (decode and prefill) is timed for both kernels on the same inputs: "split" (flash-decoding: split
kernel per segment + combine, the default at T = 1; a prefill's tokens go in groups of
sparse_attention.SPLIT_GROUP_ROWS) and "tiles" (the first kernel, one program per (token, 16 heads), the default
prefill path, sparse_attention.PREFILL_VARIANT), plus the split path replayed from a CUDA graph (its launches without CPU cost). The split row
carries tiles_over_split, the tile kernel's time over the split kernel's in the same run.
Usage: python benchmarks/bench_sparse_attention.py [--json F] [--variant auto|split|tiles|both] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, graph_bench, print_table, record, set_quick, write_json

H, D, KW, KM = 64, 512, 128, 512
WROW, MROW = 528, 288
CASES = [("decode B=64 ctx=8K (N=4K)", 64, 1, 4096),
         ("decode B=64 ctx=128K (N=64K)", 64, 1, 65536),
         ("decode B=8 ctx=1M (N=1M, m=1)", 8, 1, 1 << 20),
         ("decode B=1 ctx=128K", 1, 1, 65536),
         ("prefill T=4096 N=4096", 1, 4096, 4096)]


def make(B, T, N, device="cuda"):
    from dsv41.model import formats

    q = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)
    wc, ws = formats.pack_fp8_ue8m0(torch.randn(B, KW, D, device=device))
    mc = torch.randint(0, 256, (B, N, D // 2), dtype=torch.uint8, device=device)
    ms = formats.to_e4m3(torch.rand(B, N, D // 16, device=device) + 0.1).view(torch.uint8)
    sink = torch.randn(H, device=device)
    widx = torch.arange(KW, device=device).expand(B, T, KW).contiguous()
    midx = torch.randint(0, N, (B, T, KM), device=device)
    return q, wc, ws, mc, ms, sink, widx, midx


# the split kernel's launch knobs (sparse_attention.SPLIT_*) timed from graphs at B=64, N=4K against the
# defaults in the same run: 4 warps (253 registers x 128 threads: two programs fit an SM), more or fewer
# programs per SM (fewer partials), pipeline depth, 32-row tiles
SWEEP = [dict(SPLIT_BK=16, SPLIT_STAGES=2),  # the launch before 2026-12-02
         dict(SPLIT_BK=16, SPLIT_STAGES=1), dict(SPLIT_PER_SM=1), dict(SPLIT_PER_SM=4), dict(SPLIT_STAGES=2),
         dict(SPLIT_WARPS=4),
         dict(SPLIT_RULE="share")]  # the segments' splits by split_config's shared tile count (before h200-2026-12-04)


def sweep(rows, args, label, io_bytes, flops):
    from dsv41.model.kernels import sparse_attention as sa

    base = {k: getattr(sa, k) for k in ("SPLIT_WARPS", "SPLIT_PER_SM", "SPLIT_STAGES", "SPLIT_BK", "SPLIT_RULE")}
    for change in [{}] + SWEEP:
        for k, v in {**base, **change}.items():
            setattr(sa, k, v)
        try:
            g = graph_bench(lambda: sa.sparse_attention_packed(*args, variant="split"))
            rows.append(record("sparse_attention_sweep", f"sweep {label} {change or 'default'}", g, io_bytes, flops,
                               graph_us=g * 1e6))
        except Exception as e:  # a configuration that does not compile or fit: keep the others
            print(f"!! sweep {change}: {type(e).__name__}: {e}")
    for k, v in base.items():
        setattr(sa, k, v)


def run(json_path=None, variant="both", do_sweep=True):
    from dsv41.model.kernels import reference
    from dsv41.model.kernels import sparse_attention as sa

    rows = []
    for label, B, T, N in CASES:
        q, wc, ws, mc, ms, sink, widx, midx = make(B, T, N)
        args = (q, wc, ws, mc, ms, sink, widx, midx, D ** -0.5)
        flops = 4 * H * D * (KW + KM) * B * T
        io = B * T * (2 * H * D * 2 + 4 * (KW + KM))
        if T == 1:
            kv_bytes = B * (KW * WROW + KM * MROW)
        else:
            kv_bytes = B * (KW * WROW + N * MROW)
        variants = [variant] if variant != "both" else ["split", "tiles"]
        ref_us = None
        if B * T * N <= 64 * 65536:  # the torch reference (unpack everything, gather) on the same inputs
            ref_us = bench(lambda: reference.sparse_attention_packed(*args), rep_ms=50) * 1e6
        case_rows = {}
        for v in variants:
            fn = lambda: sa.sparse_attention_packed(*args, variant=v)  # noqa: E731
            extra = {"variant": v}
            if v == "split" or (v == "auto" and H <= sa.SPLIT_MAX_HEADS and (T == 1 or sa.PREFILL_VARIANT == "split")):
                group = min(B * T, sa.SPLIT_GROUP_ROWS)  # _launch_split's split choice: one group's rows
                _, plan = sa.segment_splits(group, [KW, KM], D, sa._sm_count(q.device))
                seg_splits = [n for _, n in plan]
                extra.update(splits=sum(seg_splits), tiles_per_split=[t for t, _ in plan], groups=-(-B * T // group),
                             partial_bytes=2 * B * T * sum(seg_splits) * H * D * 4,
                             graph_us=graph_bench(fn) * 1e6)
            if ref_us is not None:
                extra["torch_ref_us"] = ref_us
            name = "sparse_attention_packed[tiles]" if v == "tiles" else "sparse_attention_packed"
            case_rows[v] = record(name, label, bench(fn), io + kv_bytes, flops, **extra)
            rows.append(case_rows[v])
        if "split" in case_rows and "tiles" in case_rows:  # the ratio against the previous kernel, same run
            case_rows["split"]["tiles_over_split"] = case_rows["tiles"]["us"] / case_rows["split"]["us"]
        if do_sweep and B == 64:
            sweep(rows, args, label, io + kv_bytes, flops)
        args = None  # free the case's tensors before the next one
        del q, wc, ws, mc, ms
        torch.cuda.empty_cache()
    print_table(rows, "sparse attention (packed FP8 window + FP4 main, H=64, D=512, Kw=128, Km=512)")
    write_json(json_path, "sparse_attention", rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--variant", choices=("auto", "split", "tiles", "both"), default="both",
                    help="kernel(s) to time; both = split and tiles, decode and prefill")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the split kernel's launch sweep")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, a.variant, not a.no_sweep)
