"""Triton kernel of model/kernels/indexer.py (imported only when it runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import as_mma, e2m1_to_f32, e8m0_to_f32, round_cast


@triton.jit
def score_tile(q_e, q_o, w, t_out, visible, b, tile, codes_ptr, scales_ptr, cand_ptr, out_ptr, N, C,
               stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
               DK2: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
               GATHER: tl.constexpr, MASK_VISIBLE: tl.constexpr, BF16_SCORES: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Score entries tile*BN .. tile*BN+BN-1 for the program's BT tokens and store them.

    The keys are the rows of the products ([BN, DK2] x [DK2, BT*HP]), so the tile of packed bytes is one
    contiguous [BN, DK2] block (dense mode) and the query, the loop-invariant operand, stays put. Each key's
    UE8M0 scales are loaded once ([BN, DK/32] bytes) and broadcast over their 16 code bytes."""
    offs = tile * BN + tl.arange(0, BN)
    if GATHER:  # one token per program: its candidate list
        rows = tl.load(cand_ptr + b * stride_ib + t_out * stride_it + offs, mask=offs < C, other=-1)
        present = rows >= 0
        rows = tl.where(present, rows, 0)
        n_out = C
    else:
        rows = offs
        present = offs < N
        n_out = N
    cols = tl.arange(0, DK2)
    key_c = codes_ptr + b * stride_cb + rows[:, None].to(tl.int64) * stride_cr
    key_s = scales_ptr + b * stride_sb + rows[:, None].to(tl.int64) * stride_sr
    byte = tl.load(key_c + cols[None, :], mask=present[:, None], other=0).to(tl.int32)
    sb = tl.load(key_s + tl.arange(0, DK2 // 16)[None, :], mask=present[:, None], other=127).to(tl.int32)
    s = e8m0_to_f32(sb)  # [BN, DK/32]: one scale per 16 code bytes (32 values)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, DK2 // 16, 16)), (BN, DK2))
    k_e = as_mma(e2m1_to_f32(byte & 15) * s, INTERPRET)
    k_o = as_mma(e2m1_to_f32(byte >> 4) * s, INTERPRET)

    dots = tl.dot(k_e, q_e) + tl.dot(k_o, q_o)  # [BN, BT*HP]
    if BF16_SCORES:  # REF's precision: each product, each weighted term and the head sum rounded to bf16
        dots = round_cast(dots, tl.bfloat16, INTERPRET).to(tl.float32)
        weighted = round_cast(tl.maximum(dots, 0.0) * w[None, :], tl.bfloat16, INTERPRET).to(tl.float32)
        scores = tl.sum(tl.reshape(weighted, (BN, BT, HP)), axis=2)
        scores = round_cast(scores, tl.bfloat16, INTERPRET).to(tl.float32)
    else:
        weighted = tl.maximum(dots, 0.0) * w[None, :]
        scores = tl.sum(tl.reshape(weighted, (BN, BT, HP)), axis=2)  # [BN, BT]

    hidden = ~present[:, None]
    if MASK_VISIBLE:
        hidden = hidden | (rows[:, None] >= visible[None, :])
    scores = tl.where(hidden, float("-inf"), scores)
    out = out_ptr + b * stride_ob + t_out[None, :] * stride_ot + offs[:, None]
    tl.store(out, scores, mask=(t_out[None, :] >= 0) & (offs[:, None] < n_out))


# N (entries), C (candidates) and the output strides grow by one entry every m decode steps. Triton would
# specialize them (divisible by 16 or not) and compile a second variant the first time N crosses a multiple of
# 16 mid-decode: a 0.5 s stall per kernel variant, seen in the 8K decode row of bench_flash_layers.
@triton.jit(do_not_specialize=["N", "C", "stride_ob", "stride_ot"])
def kernel(q_ptr, w_ptr, codes_ptr, scales_ptr, cand_ptr, vis_ptr, out_ptr,
           T, H, N, C,
           stride_qb, stride_qt, stride_qh, stride_wb, stride_wt,
           stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
           DK2: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
           GATHER: tl.constexpr, MASK_VISIBLE: tl.constexpr, BF16_SCORES: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (b, block of BT tokens, p): scores [BT, BN] = sum_h w ReLU(q_h . k) for the entry tiles
    p, p + P, p + 2P, ... (P = programs on axis 2), so one program walks many tiles with its queries and
    head weights loaded once and kept in registers.

    Columns of the query operand are (token, head) pairs, BT*HP of them, so one product serves BT tokens;
    the keys are MXFP4 (E2M1 pairs, UE8M0 per 32), decoded into even/odd halves as in sparse attention.
    The CPU interpreter cannot take a runtime bound in range() with NumPy 2, so there the same tiles are
    walked with a while loop; compiled code keeps the for loop (software-pipelined)."""
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BT
    p = tl.program_id(2)
    P = tl.num_programs(2)
    r = tl.arange(0, BT * HP)
    tok = t0 + r // HP
    head = r % HP
    rmask = (tok < T) & (head < H)
    cols = tl.arange(0, DK2)
    q_row = q_ptr + b * stride_qb + tok[None, :] * stride_qt + head[None, :] * stride_qh  # [1, BT*HP]
    q_e = as_mma(tl.load(q_row + 2 * cols[:, None], mask=rmask[None, :], other=0.0), INTERPRET)  # [DK2, BT*HP]
    q_o = as_mma(tl.load(q_row + 2 * cols[:, None] + 1, mask=rmask[None, :], other=0.0), INTERPRET)
    w = tl.load(w_ptr + b * stride_wb + tok * stride_wt + head, mask=rmask, other=0.0).to(tl.float32)

    t_out = t0 + tl.arange(0, BT)
    if MASK_VISIBLE:
        visible = tl.load(vis_ptr + t_out, mask=t_out < T, other=0)
    else:
        visible = t_out
    t_out = tl.where(t_out < T, t_out, -1)  # -1: padding token, not stored
    n_tiles = tl.cdiv(C if GATHER else N, BN)
    if INTERPRET:
        tile = p
        while tile < n_tiles:
            score_tile(q_e, q_o, w, t_out, visible, b, tile, codes_ptr, scales_ptr, cand_ptr, out_ptr, N, C,
                       stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
                       DK2, HP, BT, BN, GATHER, MASK_VISIBLE, BF16_SCORES, INTERPRET)
            tile += P
    else:
        for tile in range(p, n_tiles, P):
            score_tile(q_e, q_o, w, t_out, visible, b, tile, codes_ptr, scales_ptr, cand_ptr, out_ptr, N, C,
                       stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
                       DK2, HP, BT, BN, GATHER, MASK_VISIBLE, BF16_SCORES, INTERPRET)
