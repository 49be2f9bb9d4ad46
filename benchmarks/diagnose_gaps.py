"""Where the missed kernel targets of docs/performance.md lose their time (issue #9: "where a target is
missed, the measured gap and its cause"). Each question is answered by timing the same call under a
controlled change, on the shapes of the main benchmarks:

* host or GPU? The call timed by do_bench and replayed from a CUDA graph (no Python or launch cost).
* sparse-attention decode (B=64, N=4K): how the split count trades partial-output traffic against
  parallelism (forced 1..10 splits per segment); the packed rows against bf16 rows (the in-kernel FP4/FP8
  decode); random main indices against contiguous ones (the row gather).
* indexer, deep (pool 16384): candidates as random single entries (what bench_indexer.py draws) against
  the real pool's shape, 2048 blocks of 8 consecutive entries; scores alone against scores + Top-K.
* mHC (M=4096): the residual kernel's tile shape (BM tokens x BD channels: BD=16 reads 32-byte pieces of
  rows 10 KB apart), forced to other shapes.

Usage (GPU): python benchmarks/diagnose_gaps.py --json F
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_common import bench, ceilings, graph_bench, machine  # noqa: E402

RESULTS: list[dict] = []


def note(section: str, case: str, fn, graph: bool = True, **extra) -> None:
    """Time fn plainly and (if asked) from a CUDA graph; print and keep the row. A failure is a row too."""
    row = {"section": section, "case": case, **extra}
    try:
        row["do_bench_us"] = round(bench(fn) * 1e6, 2)
        if graph:
            row["graph_us"] = round(graph_bench(fn) * 1e6, 2)
    except Exception as e:  # noqa: BLE001 - a diagnosis keeps going and records why a case failed
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def sparse_attention() -> None:
    import bench_sparse_attention as bsa

    from dsv41.model.kernels import sparse_attention as sa

    B, N = 64, 4096
    q, wc, ws, mc, ms, sink, widx, midx = bsa.make(B, 1, N)
    scale = bsa.D ** -0.5
    packed = lambda m=midx: sa.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, m, scale)  # noqa: E731
    note("sparse_attention", "B=64 N=4K packed, auto split", packed)
    note("sparse_attention", "B=64 N=4K packed, contiguous main indices",
         lambda: packed(torch.arange(bsa.KM, device="cuda").expand_as(midx).contiguous()))
    original = sa.split_config
    try:
        for per_seg in (1, 2, 3, 5, 10):
            def forced(rows, counts, D, sms, per_seg=per_seg):
                BK, _, _ = original(rows, counts, D, sms)
                seg_tiles = [-(-k // BK) for k in counts]
                tiles = max(1, -(-max(seg_tiles) // per_seg))
                return BK, tiles, [-(-n // tiles) for n in seg_tiles]
            sa.split_config = forced
            splits = sum(forced(B, [bsa.KW, bsa.KM], bsa.D, 132)[2])
            note("sparse_attention", f"B=64 N=4K packed, {splits} splits in all", packed,
                 partial_bytes=2 * B * splits * bsa.H * bsa.D * 4)
    finally:
        sa.split_config = original
    kv = torch.randn(B, bsa.KW + N, bsa.D, device="cuda", dtype=torch.bfloat16)
    idx = torch.cat([widx, midx + bsa.KW], -1)
    note("sparse_attention", "B=64 bf16 rows (no in-kernel decode), same indices",
         lambda: sa.sparse_attention(q, kv, sink, idx, scale))
    q1, wc1, ws1, mc1, ms1, sink1, widx1, midx1 = bsa.make(1, 1, 65536)
    note("sparse_attention", "B=1 N=64K packed, auto split",
         lambda: sa.sparse_attention_packed(q1, wc1, ws1, mc1, ms1, sink1, widx1, midx1, scale))


def indexer() -> None:
    from bench_indexer import POOL, pool_blocks

    from dsv41.model import formats
    from dsv41.model.kernels.indexer import indexer_scores, indexer_topk

    H, DK, B = 32, 128, 4
    q = formats.mxfp4_fake_quant(torch.randn(B, 1, H, DK, device="cuda"))
    w = torch.randn(B, 1, H, device="cuda") * (H * DK) ** -0.5
    for ctx in (65536, 1 << 20):
        kc = torch.randint(0, 256, (B, ctx, DK // 2), dtype=torch.uint8, device="cuda")
        ks = torch.randint(120, 130, (B, ctx, DK // 32), dtype=torch.uint8, device="cuda")
        vis = torch.tensor([ctx], device="cuda")
        label = f"ctx={ctx >> 10}K"
        note("indexer", f"dense scores {label}", lambda: indexer_scores(q, w, kc, ks, vis))
        note("indexer", f"dense scores + top-512 {label}", lambda: indexer_topk(q, w, kc, ks, vis, 512))
        single = torch.randint(0, ctx, (B, 1, POOL), device="cuda", dtype=torch.int32)
        blocks = pool_blocks(B, ctx)
        for name, cand in (("random single entries", single), ("2048 blocks of 8 (the pool's shape)", blocks)):
            note("indexer", f"deep scores, {name}, {label}", lambda c=cand: indexer_scores(q, w, kc, ks, vis, c))
            note("indexer", f"deep scores + top-512, {name}, {label}",
                 lambda c=cand: indexer_topk(q, w, kc, ks, vis, 512, candidates=c))


def mhc() -> None:
    from dsv41.model.kernels import mhc as mk

    n, d = 4, 5120
    original = mk.launch_config
    for M in (4096, 16384):
        x = torch.randn(M, 1, n, d, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(M, 1, d, device="cuda", dtype=torch.bfloat16)
        pre, post = torch.rand(M, 1, n, device="cuda"), torch.rand(M, 1, n, device="cuda")
        comb = torch.rand(M, 1, n, n, device="cuda")
        fn = torch.randn((n + 2) * n, n * d, device="cuda") * 0.007
        sc, base = torch.rand(3, device="cuda"), torch.randn((n + 2) * n, device="cuda")
        step = lambda: mk.mhc_step(x, pre, fn, sc, base, 20, 1e-6, 1e-6, y, post, comb)  # noqa: E731
        note("mhc", f"M={M} as launched", step, config=original(M, d, torch.device("cuda")))
        try:
            for tile in ((64, 32, 2), (32, 64, 2), (16, 128, 2), (128, 16, 2)):
                def forced(M_, d_, device, tile=tile):
                    return original(M_, d_, device, tile=tile)
                mk.launch_config = forced
                BM, BD, _ = tile
                note("mhc", f"M={M} BM={BM} BD={BD}", step, config=forced(M, d, torch.device("cuda")))
        finally:
            mk.launch_config = original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("sparse_attention", "indexer", "mhc"))
    a = ap.parse_args(argv)
    print("ceilings", ceilings(), flush=True)
    for name, fn in (("sparse_attention", sparse_attention), ("indexer", indexer), ("mhc", mhc)):
        if a.only in (None, name):
            try:
                fn()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            if a.json:
                Path(a.json).write_text(json.dumps({"machine": machine(), "ceilings": ceilings(), "rows": RESULTS,
                                                    "command": " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
