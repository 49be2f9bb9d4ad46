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

from dsv41.model.kernels import interpreting, reference, use_triton


def _target_programs(device: torch.device) -> int:
    """Programs to launch for one scoring call: 2 per SM on a GPU (what fits at ~110 registers x 8 warps, so
    one wave); 2 under the CPU interpreter, so its tests walk several tiles per program."""
    if device.type != "cuda":
        return 2
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


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
    BN = 128
    token_blocks = triton.cdiv(T, BT)
    n_tiles = triton.cdiv(C if gather else N, BN)
    # each program walks several entry tiles (queries loaded once); enough programs to fill the machine
    per_seq = max(1, triton.cdiv(_target_programs(device), B * token_blocks))
    return dict(BT=BT, HP=HP, BN=BN, grid=(B, token_blocks, max(1, min(n_tiles, per_seq))), tiles=n_tiles,
                num_warps=8, num_stages=3)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                   visible: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                   bf16_scores: bool = False, by_entry: bool = False, force_triton: bool = False) -> torch.Tensor:
    """See reference.indexer_scores (same signature and result up to fp32 summation order; with bf16_scores,
    up to the bf16 roundings that order moves). The kernel sums in its own order whatever `by_entry` says."""
    if not use_triton(q, key_codes, force=force_triton):
        return reference.indexer_scores(q, weights, key_codes, key_scales, visible, candidates, bf16_scores,
                                        by_entry)
    from dsv41.model.kernels._triton_indexer import kernel

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
    kernel[cfg["grid"]](q, weights, key_codes, key_scales, cand, vis, out, T, H, N, C,
                        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
                        key_codes.stride(0), key_codes.stride(1), key_scales.stride(0), key_scales.stride(1),
                        cand.stride(0) if gather else 0, cand.stride(1) if gather else 0, out.stride(0),
                        out.stride(1), DK2=DK // 2, HP=cfg["HP"], BT=cfg["BT"], BN=cfg["BN"], GATHER=gather,
                        MASK_VISIBLE=visible is not None, BF16_SCORES=bf16_scores, INTERPRET=interpreting(),
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                 visible: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
                 force_triton: bool = False) -> torch.Tensor:
    """Top-k entries per query, ascending, -1 where fewer than k are visible (Indexer.forward's selection):
    over all entries, or over a candidate list [B,T,C] (then the chosen candidates' entry ids)."""
    scores = indexer_scores(q, weights, key_codes, key_scales, visible, candidates, force_triton=force_triton)
    k = min(k, scores.size(-1))
    top = scores.topk(k, dim=-1, sorted=False)
    ids = top.indices if candidates is None else torch.gather(candidates.long().expand(*scores.shape[:2], -1),
                                                              -1, top.indices)
    ids = torch.where(torch.isfinite(top.values), ids, torch.full_like(ids, torch.iinfo(torch.long).max))
    ids = ids.sort(dim=-1).values
    return torch.where(ids == torch.iinfo(torch.long).max, -1, ids)
