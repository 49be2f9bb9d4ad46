"""Triton kernel of model/kernels/indexer.py (imported only when it runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels._triton_formats import as_mma, e2m1_to_f32, e8m0_to_f32


@triton.jit
def kernel(q_ptr, w_ptr, codes_ptr, scales_ptr, cand_ptr, vis_ptr, out_ptr,
           T, H, N, C,
           stride_qb, stride_qt, stride_qh, stride_wb, stride_wt,
           stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
           DK2: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
           GATHER: tl.constexpr, MASK_VISIBLE: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (b, block of BT tokens, block of BN entries): scores [BT, BN] = sum_h w ReLU(q_h . k).

    Rows of the q tile are (token, head) pairs, BT*HP of them, so one product serves BT tokens; the
    keys are MXFP4 (E2M1 pairs, UE8M0 per 32), decoded into even/odd halves as in sparse attention."""
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BT
    n0 = tl.program_id(2) * BN
    r = tl.arange(0, BT * HP)
    tok = t0 + r // HP
    head = r % HP
    rmask = (tok < T) & (head < H)
    cols = tl.arange(0, DK2)
    q_row = q_ptr + b * stride_qb + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_e = as_mma(tl.load(q_row + 2 * cols[None, :], mask=rmask[:, None], other=0.0), INTERPRET)
    q_o = as_mma(tl.load(q_row + 2 * cols[None, :] + 1, mask=rmask[:, None], other=0.0), INTERPRET)
    w = tl.load(w_ptr + b * stride_wb + tok * stride_wt + head, mask=rmask, other=0.0).to(tl.float32)

    offs = n0 + tl.arange(0, BN)
    if GATHER:  # one token per program: its candidate list
        rows = tl.load(cand_ptr + b * stride_ib + t0 * stride_it + offs, mask=offs < C, other=-1)
        present = rows >= 0
        rows = tl.where(present, rows, 0)
        n_out = C
    else:
        rows = offs
        present = offs < N
        n_out = N
    key_c = codes_ptr + b * stride_cb + rows[:, None].to(tl.int64) * stride_cr
    key_s = scales_ptr + b * stride_sb + rows[:, None].to(tl.int64) * stride_sr
    byte = tl.load(key_c + cols[None, :], mask=present[:, None], other=0).to(tl.int32)
    s = e8m0_to_f32(tl.load(key_s + cols[None, :] // 16, mask=present[:, None], other=127).to(tl.int32))
    k_e = as_mma(e2m1_to_f32(byte & 15) * s, INTERPRET)
    k_o = as_mma(e2m1_to_f32(byte >> 4) * s, INTERPRET)

    dots = tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o))  # [BT*HP, BN]
    weighted = tl.maximum(dots, 0.0) * w[:, None]
    scores = tl.sum(tl.reshape(weighted, (BT, HP, BN)), axis=1)  # [BT, BN]

    t_out = t0 + tl.arange(0, BT)
    hidden = ~present[None, :]
    if MASK_VISIBLE:
        visible = tl.load(vis_ptr + t_out, mask=t_out < T, other=0)
        hidden = hidden | (rows[None, :] >= visible[:, None])
    scores = tl.where(hidden, float("-inf"), scores)
    out = out_ptr + b * stride_ob + t_out[:, None] * stride_ot + offs[None, :]
    tl.store(out, scores, mask=(t_out[:, None] < T) & (offs[None, :] < n_out))
