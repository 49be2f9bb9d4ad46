"""Indexer scores + Top-K over packed MXFP4 keys (68 B per 128-dim key) at V4.1-Flash width (32 heads).

Dense (the candidate-source layer, m = 1): N = context entries per sequence.
    bytes = N*68 (keys) + N*4 (scores written) + N*4 (scores read by Top-K) + q; FLOPs = 2*32*128*N per query.
Deep (a Reindex layer inside the hierarchical pool): C = 2048 blocks x 8 = 16384 candidates per query,
whatever the context: bytes = C*(68 + 4 + 4 + 4 (candidate id)); the time per query should be flat in context.
The candidates come as the pool makes them, 2048 blocks of 8 consecutive entries ("blocks", the target's
case), and as 16384 random single entries ("random": a harder access pattern than the model produces).
Decode: one query per sequence, B sequences. Each row records the kernel's tiling (indexer.launch_config:
tokens x heads per program, entries per tile, grid; a program walks tiles p, p + P, ...).
Top-K: method "fused" (the score kernel runs the first radix pass, topk_select the rest on the GPU) against
"torch" (torch.topk + sort after the scores, the previous path), both timed with do_bench and replayed from a
CUDA graph ("graph_us", GPU time only) in the same run. Schedules of the score kernel (indexer.TUNE: programs
per SM, warps, stages, tile, key decode) are timed from graphs on the dense 64K and 1M cases ("sweep" rows).
Usage: python benchmarks/bench_indexer.py [--json F] [--quick] [--no-sweep]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, graph_bench, print_table, record, set_quick, write_json

H, DK, TOPK, POOL = 32, 128, 512, 2048 * 8


def pool_blocks(B: int, N: int, block: int = 8) -> torch.Tensor:
    """A deep layer's candidates as the hierarchical pool makes them: POOL / block distinct blocks of
    `block` consecutive entries, ascending [B, 1, POOL] (model/indexer.py select_candidate_blocks)."""
    starts = torch.stack([torch.randperm(N // block, device="cuda")[:POOL // block] for _ in range(B)]) * block
    ids = starts.sort(-1).values[..., None] + torch.arange(block, device="cuda")
    return ids.reshape(B, 1, POOL).to(torch.int32).contiguous()


# score-kernel schedules timed against the default (TUNE) in the same run
SWEEP = [dict(per_sm=2, num_warps=8, num_stages=3, BN=128, decode_bf16=False),  # the schedule before 2026-12-02
         dict(per_sm=2, num_warps=8, BN=128), dict(BN=128), dict(num_stages=4), dict(per_sm=6), dict(BN=32, per_sm=8),
         dict(decode_bf16="e4m3"), dict(decode_bf16="e4m3", per_sm=6), dict(decode_bf16=True)]


def sweep(rows, q, w, kc, ks, vis, B, N):
    from dsv41.model.kernels import indexer

    base = dict(indexer.TUNE)
    for change in [{}] + SWEEP:
        indexer.TUNE.update(base, **change)
        try:
            t = graph_bench(lambda: indexer.indexer_scores(q, w, kc, ks, vis))
            rows.append(record("indexer_sweep", f"sweep dense scores ctx={N >> 10}K {change or 'default'}", t,
                               B * N * (68 + 4), 2 * H * DK * N * B, graph_us=t * 1e6, tune=dict(indexer.TUNE)))
        except Exception as e:  # a schedule that does not compile or fit: keep the others
            print(f"!! sweep {change}: {type(e).__name__}: {e}")
    indexer.TUNE.update(base)


def run(json_path=None, do_sweep=True):
    from dsv41.model import formats
    from dsv41.model.kernels.indexer import indexer_scores, indexer_topk, launch_config

    rows = []
    for ctx in (65536, 262144, 1 << 20):
        B = 4
        N = ctx  # m = 1 at the candidate source (layer 20)
        q = formats.mxfp4_fake_quant(torch.randn(B, 1, H, DK, device="cuda"))
        w = torch.randn(B, 1, H, device="cuda") * (H * DK) ** -0.5
        kc = torch.randint(0, 256, (B, N, DK // 2), dtype=torch.uint8, device="cuda")
        ks = torch.randint(120, 130, (B, N, DK // 32), dtype=torch.uint8, device="cuda")
        vis = torch.tensor([N], device="cuda")
        t_s = bench(lambda: indexer_scores(q, w, kc, ks, vis))
        g_s = graph_bench(lambda: indexer_scores(q, w, kc, ks, vis))
        flops = 2 * H * DK * N * B
        dense = launch_config(B, 1, H, N, 0, False, q.device)
        rows.append(record("indexer_scores", f"dense scores B={B} ctx={ctx >> 10}K", t_s, B * N * (68 + 4), flops,
                           us_per_query=t_s * 1e6 / B, graph_us=g_s * 1e6, launch=dense))
        for method in ("torch", "fused"):
            t_k = bench(lambda: indexer_topk(q, w, kc, ks, vis, TOPK, method=method))
            g_k = graph_bench(lambda: indexer_topk(q, w, kc, ks, vis, TOPK, method=method))
            rows.append(record("indexer_topk", f"dense scores+topk ({method}) B={B} ctx={ctx >> 10}K", t_k,
                               B * N * (68 + 8), flops, us_per_query=t_k * 1e6 / B, graph_us=g_k * 1e6,
                               launch=dense))
        for shape, cand in (("blocks", pool_blocks(B, N)),
                            ("random", torch.randint(0, N, (B, 1, POOL), device="cuda", dtype=torch.int32))):
            for method in ("torch", "fused"):
                t_d = bench(lambda: indexer_topk(q, w, kc, ks, vis, TOPK, candidates=cand, method=method))
                g_d = graph_bench(lambda: indexer_topk(q, w, kc, ks, vis, TOPK, candidates=cand, method=method))
                rows.append(record("indexer_topk", f"deep pool={POOL} ({shape}, {method}) B={B} ctx={ctx >> 10}K",
                                   t_d, B * POOL * (68 + 12), 2 * H * DK * POOL * B, us_per_query=t_d * 1e6 / B,
                                   graph_us=g_d * 1e6, graph_us_per_query=g_d * 1e6 / B,
                                   launch=launch_config(B, 1, H, N, POOL, True, q.device)))
        if do_sweep and ctx in (65536, 1 << 20):
            sweep(rows, q, w, kc, ks, vis, B, N)
        torch.cuda.empty_cache()  # the next context's keys replace these
    for r in rows:  # the ratio of the GPU time (graph replay) to the floor
        if "graph_us" in r:
            r["graph_x_floor"] = r["graph_us"] / r["floor_us"]
    print_table(rows, "indexer (MXFP4 keys, 32 heads x 128, Top-512)")
    write_json(json_path, "indexer", rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the score kernel's schedule sweep")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, not a.no_sweep)
