"""Indexer scores over packed MXFP4 keys, and the Top-K built on them (model/indexer.py).

    score_{t,g} = sum_h w_{t,h} ReLU(q_{t,h} . k_g)

The keys stay packed as the cache stores them (E2M1 pairs + one UE8M0 per 32: 68 bytes per 128-dim key)
and are decoded in the kernel; the only full-size output is the fp32 score row the Top-K reads (4 bytes
per entry against 68 read). Two modes:

* dense: every entry 0..N-1, masked -inf at g >= visible[t] (the candidate-source layer's full scan);
* gather: the entries of a candidate list per token (a Reindex layer inside the hierarchical pool), so the
  work per query is the pool size whatever the context length.

One program holds its queries (BT tokens x all heads) and head weights in registers and walks many tiles of
128 entries (a grid-stride loop: about one wave of programs whatever N), each tile one contiguous block of
packed key bytes, so the key loads of successive tiles are software-pipelined instead of every program
paying one dependent chain (q load, key load, decode, dot, store) for 64 keys.

Numerics: q and the decoded keys are exact in bf16 (MXFP4 values), so the bf16 matrix products are exact
per term with fp32 accumulation; only the order of the fp32 sums differs from the reference.
"""

from __future__ import annotations

import torch

from dsv41.model.kernels import decode_mode, interpreting, opaque, quant, reference, use_triton


# The score kernel's schedule (benchmarks/bench_indexer.py times the alternatives against it in one run):
# programs per SM, warps, pipeline stages, entries per tile, and the key decode (bf16 from bits, True; through
# fp32 as before, False; "e4m3": the codes / 64 by the hardware's E4M3 conversion, the queries times 64, the same
# products). TUNE.update(...) changes it for a benchmark; tests/test_kernels.py runs both decodes.
# Chosen by h200-2026-12-02-c (graph replays, dense B=4): the bf16 decode takes 1M from 576.9 to 412.6 µs and
# 64K from 45.3 to 35.8; 64-entry tiles at 4 programs of 4 warps per SM then 405.5 / 34.3 (the best of 8).
# The previous schedule: per_sm=2, num_warps=8, num_stages=3, BN=128, decode_bf16=False. Since h200-2026-12-04
# (graph replays, dense B=4, the same run; ncu had found the kernel compute-bound, SM throughput 69-80%, DRAM
# 12-15%): the E4M3-conversion decode at 6 programs per SM, 28.6 / 308.4 µs at 64K / 1M against 33.9 / 401.7 for
# the bits decode at 4 (e4m3 at 4: 29.3 / 324.3; bits at 6: 33.9 / 394.1).
TUNE = dict(per_sm=6, num_warps=4, num_stages=3, BN=64, decode_bf16="e4m3")
# indexer_topk's method "auto": the fused radix Top-K up to this many scores per row, torch.topk above it
# (h200-2026-12-02-c, graph replays, B=4: fused 83 / 226 / 786 µs against torch 143 / 274 / 731 at 64K /
# 256K / 1M entries; four full passes over a 1M row cost more than torch's radix select there)
FUSED_TOPK_MAX = 1 << 18


def _target_programs(device: torch.device) -> int:
    """Programs to launch for one scoring call: TUNE["per_sm"] per SM on a GPU (2: what fits at ~110
    registers x 8 warps, so one wave); 2 under the CPU interpreter, so its tests walk several tiles per program."""
    if device.type != "cuda":
        return 2
    return TUNE["per_sm"] * torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(B: int, T: int, H: int, N: int, C: int, gather: bool, device: torch.device) -> dict:
    """The kernel's tiling for a call (also recorded by benchmarks/bench_indexer.py): BT tokens x HP heads
    per program, BN entries per tile, and a grid (B, token blocks, P) in which program p walks the tiles
    p, p + P, ... of its sequence (N entries dense, C candidates gathered)."""
    import triton

    HP = max(triton.next_power_of_2(H), 1)
    if gather:
        BT = 1
        HP = max(HP, 16)  # a candidate list belongs to one token: pad the heads to tl.dot's 16 columns
    else:
        BT = 1 if T == 1 else max(1, 64 // HP)
        BT = max(BT, triton.cdiv(16, HP))  # or take more tokens per program
    BN = TUNE["BN"]
    token_blocks = triton.cdiv(T, BT)
    n_tiles = triton.cdiv(C if gather else N, BN)
    # each program walks several entry tiles (queries loaded once); enough programs to fill the machine
    per_seq = max(1, triton.cdiv(_target_programs(device), B * token_blocks))
    return dict(BT=BT, HP=HP, BN=BN, grid=(B, token_blocks, max(1, min(n_tiles, per_seq))), tiles=n_tiles,
                num_warps=TUNE["num_warps"], num_stages=TUNE["num_stages"],
                decode_bf16=decode_mode(TUNE["decode_bf16"]))


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                   visible: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                   bf16_scores: bool = False, by_entry: bool = False, force_triton: bool = False,
                   _hist: torch.Tensor | None = None) -> torch.Tensor:
    """See reference.indexer_scores (same signature and result up to fp32 summation order; with bf16_scores,
    up to the bf16 roundings that order moves). The kernel sums in its own order whatever `by_entry` says.
    _hist (indexer_topk's workspace, one token per program only): the kernel also bins the scores for the
    Top-K's first radix pass."""
    if not use_triton(q, key_codes, force=force_triton):
        return reference.indexer_scores(q, weights, key_codes, key_scales, visible, candidates, bf16_scores,
                                        by_entry, unpack=quant.unpack)
    return _launch_scores(q, weights, key_codes, key_scales, visible, candidates, bf16_scores, _hist)


@opaque
def _launch_scores(q, weights, key_codes, key_scales, visible, candidates, bf16_scores, _hist):
    """indexer_scores on the Triton path."""
    from dsv41.model.kernels._triton_indexer import scores_kernel

    B, T, H, DK = q.shape
    N = key_codes.size(1)
    if DK < 32 or DK & (DK - 1):
        raise ValueError(f"indexer kernel needs a power-of-two head dim >= 32, got {DK}")
    q = q.float().contiguous() if q.dtype not in (torch.bfloat16, torch.float32) else q.contiguous()
    weights = weights.float().contiguous()
    key_codes, key_scales = key_codes.contiguous(), key_scales.contiguous()
    gather = candidates is not None
    if gather:
        candidates = candidates.to(torch.int32).expand(B, T, -1).contiguous()
        C = candidates.size(2)
        out = torch.empty(B, T, C, dtype=torch.float32, device=q.device)
    else:
        C = 0
        out = torch.empty(B, T, N, dtype=torch.float32, device=q.device)
    cfg = launch_config(B, T, H, N, C, gather, q.device)
    vis = (visible.to(torch.int32).contiguous() if visible is not None
           else torch.zeros(1, dtype=torch.int32, device=q.device))
    cand = candidates if gather else vis
    hist = _hist is not None and cfg["BT"] == 1
    scores_kernel[cfg["grid"]](q, weights, key_codes, key_scales, cand, vis, out, _hist if hist else vis, T, H, N, C,
                        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
                        key_codes.stride(0), key_codes.stride(1), key_scales.stride(0), key_scales.stride(1),
                        cand.stride(0) if gather else 0, cand.stride(1) if gather else 0, out.stride(0),
                        out.stride(1), DK2=DK // 2, HP=cfg["HP"], BT=cfg["BT"], BN=cfg["BN"], GATHER=gather,
                        MASK_VISIBLE=visible is not None, BF16_SCORES=bf16_scores,
                        DECODE_BF16=cfg["decode_bf16"], HIST=hist, INTERPRET=interpreting(),
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if _hist is not None and not hist:  # several tokens per program: the first pass runs on its own
        _radix_passes(out.view(B * T, -1), _hist, 1, range(1))  # pass 0 reads no k
    return out


RADIX_BL = 1024  # scores per chunk of a radix pass (4 warps: 8 per thread)


def _radix_programs(R: int, L: int, bl: int, device: torch.device) -> int:
    """Programs per row of a radix pass: about 4 per SM over all rows (2 under the interpreter, so its
    tests walk several chunks per program), at most one per chunk."""
    import triton

    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(triton.cdiv(L, bl), triton.cdiv(target, R)))


@opaque
def _radix_passes(scores: torch.Tensor, hist: torch.Tensor, k: int, passes) -> None:
    from dsv41.model.kernels._triton_indexer import radix_pass_kernel

    R, L = scores.shape
    bl = RADIX_BL if scores.is_cuda else 64
    grid = (R, _radix_programs(R, L, bl, scores.device))
    for j in passes:
        radix_pass_kernel[grid](scores, hist, L, k, PASS=j, BL=bl, INTERPRET=interpreting(), num_warps=4)


@opaque
def topk_select(scores: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
                hist: torch.Tensor | None = None, first_pass_done: bool = False) -> torch.Tensor:
    """On the GPU (Triton), what indexer_topk's torch tail computes from the scores [B,T,L] (L = N entries,
    or C candidates with candidates [B,T,C]): the ids of the k = min(k, L) largest scores per row, ascending,
    -1 for picks that are not finite (fewer than k visible), [B,T,k] int64. Radix select on the scores'
    order keys (4 passes of 8 bits), one collecting pass and one sort of k ids per row: 6 launches after
    the workspace's zeroing, no host sync. Between scores equal to the k-th largest the pick is whichever
    claimed a slot first (torch.topk promises no order there either)."""
    import triton

    from dsv41.model.kernels._triton_indexer import radix_collect_kernel, topk_finish_kernel

    B, T, L = scores.shape
    R = B * T
    k = min(k, L)
    flat = scores.contiguous().view(R, L)
    if hist is None:
        hist = torch.zeros(R, 4 * 256 + 2, dtype=torch.int32, device=scores.device)
    _radix_passes(flat, hist, k, range(1 if first_pass_done else 0, 4))
    KP = max(16, triton.next_power_of_2(k))
    sel = torch.empty(R, KP, dtype=torch.int32, device=scores.device)
    bl = RADIX_BL if scores.is_cuda else 64
    grid = (R, _radix_programs(R, L, bl, scores.device))
    radix_collect_kernel[grid](flat, hist, sel, L, k, KP=KP, BL=bl, num_warps=4)
    out = torch.empty(B, T, k, dtype=torch.long, device=scores.device)
    cand = candidates.to(torch.int32).expand(B, T, L).contiguous() if candidates is not None else sel
    topk_finish_kernel[(R,)](sel, flat, cand, out, L, k, KP=KP, GATHER=candidates is not None, num_warps=4)
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                 visible: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
                 force_triton: bool = False, method: str = "auto") -> torch.Tensor:
    """Top-k entries per query, ascending, -1 where fewer than k are visible (Indexer.forward's selection):
    over all entries, or over a candidate list [B,T,C] (then the chosen candidates' entry ids).
    method "fused" (on the Triton path): the score kernel also runs the Top-K's first radix pass and
    topk_select finishes it on the GPU; "torch": torch.topk + sort after the kernel's scores (the previous
    path, kept for the benchmark's comparison); "auto": fused up to FUSED_TOPK_MAX scores per row. Off the
    Triton path the reference and torch always."""
    if method not in ("auto", "fused", "torch"):
        raise ValueError(f"indexer_topk method must be auto, fused or torch, got {method!r}")
    width = candidates.size(-1) if candidates is not None else key_codes.size(1)
    fused = method == "fused" or (method == "auto" and width <= FUSED_TOPK_MAX)
    if fused and use_triton(q, key_codes, force=force_triton):
        B, T = q.shape[:2]
        hist = torch.zeros(B * T, 4 * 256 + 2, dtype=torch.int32, device=q.device)
        scores = indexer_scores(q, weights, key_codes, key_scales, visible, candidates, force_triton=force_triton,
                                _hist=hist)
        return topk_select(scores, k, candidates, hist, first_pass_done=True)
    scores = indexer_scores(q, weights, key_codes, key_scales, visible, candidates, force_triton=force_triton)
    k = min(k, scores.size(-1))
    top = scores.topk(k, dim=-1, sorted=False)
    ids = top.indices if candidates is None else torch.gather(candidates.long().expand(*scores.shape[:2], -1),
                                                              -1, top.indices)
    ids = torch.where(torch.isfinite(top.values), ids, torch.full_like(ids, torch.iinfo(torch.long).max))
    ids = ids.sort(dim=-1).values
    return torch.where(ids == torch.iinfo(torch.long).max, -1, ids)
