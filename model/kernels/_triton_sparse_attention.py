"""Triton kernel of model/kernels/sparse_attention.py (imported only when it runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import (as_mma, e2m1_to_bf16, e2m1_to_f32, e4m3_to_bf16, e4m3_to_f32,
                                           e8m0_to_bf16, e8m0_to_f32, mul_exact, round_cast)


@triton.jit
def load_rows(codes_ptr, scales_ptr, b, stride_cb, stride_cr, stride_sb, stride_sr, rows, valid,
              D2: tl.constexpr, FMT: tl.constexpr):
    """Rows `rows` [BK] of one store -> (even half, odd half), each [BK, D2] fp32 (exact values)."""
    cols = tl.arange(0, D2)
    mask = valid[:, None]
    row_c = codes_ptr + b * stride_cb + rows[:, None].to(tl.int64) * stride_cr
    row_s = scales_ptr + b * stride_sb + rows[:, None].to(tl.int64) * stride_sr
    if FMT == 0:  # bf16 rows
        even = tl.load(row_c + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(row_c + 2 * cols[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 1:  # E4M3 bytes, one UE8M0 per 32 values: elements 2i and 2i+1 share scale (2i) // 32
        s = e8m0_to_f32(tl.load(row_s + cols[None, :] // 16, mask=mask, other=127).to(tl.int32))
        even = (e4m3_to_f32(tl.load(row_c + 2 * cols[None, :], mask=mask, other=0).to(tl.int32)) * s)
        odd = (e4m3_to_f32(tl.load(row_c + 2 * cols[None, :] + 1, mask=mask, other=0).to(tl.int32)) * s)
    else:  # E2M1 pairs, one E4M3 per 16 values: byte i holds elements 2i, 2i+1, scale i // 8
        s = e4m3_to_f32(tl.load(row_s + cols[None, :] // 8, mask=mask, other=0).to(tl.int32))
        byte = tl.load(row_c + cols[None, :], mask=mask, other=0).to(tl.int32)
        even = e2m1_to_f32(byte & 15) * s
        odd = e2m1_to_f32(byte >> 4) * s
    return even, odd

@triton.jit
def attend_tile(acc_e, acc_o, m_i, l_i, q_e, q_o, scale, b, t, k0,
                codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb, stride_sr,
                idx_ptr, stride_ib, stride_it, K,
                D2: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold the rows of indices k0..k0+BK-1 of one segment into the online-softmax state."""
    offs = k0 + tl.arange(0, BK)
    idx = tl.load(idx_ptr + b * stride_ib + t * stride_it + offs, mask=offs < K, other=-1)
    valid = idx >= 0
    rows = tl.where(valid, idx, 0)
    kv_e, kv_o = load_rows(codes_ptr, scales_ptr, b, stride_cb, stride_cr, stride_sb, stride_sr,
                           rows, valid, D2, FMT)
    kv_e = as_mma(kv_e, INTERPRET)
    kv_o = as_mma(kv_o, INTERPRET)
    logits = tl.dot(q_e, tl.trans(kv_e)) + tl.dot(q_o, tl.trans(kv_o))
    logits = tl.where(valid[None, :], logits * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pb = as_mma(p, INTERPRET)
    acc_e = acc_e * alpha[:, None] + tl.dot(pb, kv_e)
    acc_o = acc_o * alpha[:, None] + tl.dot(pb, kv_o)
    return acc_e, acc_o, m_new, l_i


@triton.jit
def attend(acc_e, acc_o, m_i, l_i, q_e, q_o, scale, b, t,
           codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb, stride_sr,
           idx_ptr, stride_ib, stride_it, K,
           D2: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold one segment's rows into the online-softmax state. The CPU interpreter cannot take a
    runtime bound in range() with NumPy 2 (it converts a 1-element array to an index), so there the
    same tiles are walked with a while loop; compiled code keeps the for loop (software-pipelined)."""
    if INTERPRET:
        k0 = 0
        while k0 < K:
            acc_e, acc_o, m_i, l_i = attend_tile(acc_e, acc_o, m_i, l_i, q_e, q_o, scale, b, t, k0,
                                                 codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb,
                                                 stride_sr, idx_ptr, stride_ib, stride_it, K, D2, BK, FMT, INTERPRET)
            k0 += BK
    else:
        for k0 in range(0, K, BK):
            acc_e, acc_o, m_i, l_i = attend_tile(acc_e, acc_o, m_i, l_i, q_e, q_o, scale, b, t, k0,
                                                 codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb,
                                                 stride_sr, idx_ptr, stride_ib, stride_it, K, D2, BK, FMT, INTERPRET)
    return acc_e, acc_o, m_i, l_i


@triton.jit
def tiles_kernel(q_ptr, o_ptr, sink_ptr, stride_qb, stride_qt, stride_qh, T, H, scale,
           a_codes, a_scales, a_cb, a_cr, a_sb, a_sr, a_idx, a_ib, a_it, a_K,
           b_codes, b_scales, b_cb, b_cr, b_sb, b_sr, b_idx, b_ib, b_it, b_K,
           D2: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, FMT_A: tl.constexpr, FMT_B: tl.constexpr,
           INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // T
    t = pid % T
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    cols = tl.arange(0, D2)
    q_row = q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh
    q_e = tl.load(q_row + 2 * cols[None, :], mask=hmask[:, None], other=0.0)
    q_o = tl.load(q_row + 2 * cols[None, :] + 1, mask=hmask[:, None], other=0.0)
    q_e = as_mma(q_e, INTERPRET)
    q_o = as_mma(q_o, INTERPRET)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    m_i = sink  # the sink joins the max, so an empty row ends with l = 1 and o = 0
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc_e = tl.zeros([BH, D2], dtype=tl.float32)
    acc_o = tl.zeros([BH, D2], dtype=tl.float32)
    acc_e, acc_o, m_i, l_i = attend(acc_e, acc_o, m_i, l_i, q_e, q_o, scale, b, t,
                                    a_codes, a_scales, a_cb, a_cr, a_sb, a_sr, a_idx, a_ib, a_it, a_K,
                                    D2, BK, FMT_A, INTERPRET)
    if FMT_B != 3:
        acc_e, acc_o, m_i, l_i = attend(acc_e, acc_o, m_i, l_i, q_e, q_o, scale, b, t,
                                        b_codes, b_scales, b_cb, b_cr, b_sb, b_sr, b_idx, b_ib, b_it, b_K,
                                        D2, BK, FMT_B, INTERPRET)
    l_i = l_i + tl.exp(sink - m_i)
    o_row = o_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh
    tl.store(o_row + 2 * cols[None, :], (acc_e / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(o_row + 2 * cols[None, :] + 1, (acc_o / l_i[:, None]).to(o_ptr.dtype.element_ty),
             mask=hmask[:, None])



# ---------------------------------------- split-K (flash-decoding): decode, and prefill in groups of tokens
@triton.jit
def load_rows_natural(codes_ptr, scales_ptr, b, stride_cb, stride_cr, stride_sb, stride_sr, rows, valid,
                      D: tl.constexpr, FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows `rows` [BK] of one store -> [BK, D] in element order (exact values), each row read as contiguous
    bytes (FP4: the byte tile's low and high nibbles are decoded apart and interleaved with join + reshape,
    element 2i = low nibble of byte i). The packed formats decode straight to bf16 (hardware E4M3
    conversion, E2M1 and UE8M0 from bits) and the power-of-two (FP8) or E4M3 (FP4) scale multiplies in
    bf16, exact since the products have at most 6 significant bits and stay bf16 normals for every cache
    value (the quantizers' amax floors); decoding through fp32 costs registers and spills on sm_90."""
    mask = valid[:, None]
    row_c = codes_ptr + b.to(tl.int64) * stride_cb + rows[:, None].to(tl.int64) * stride_cr  # stores > 2 GB
    row_s = scales_ptr + b.to(tl.int64) * stride_sb + rows[:, None].to(tl.int64) * stride_sr
    if FMT == 0:  # bf16 rows
        cols = tl.arange(0, D)
        kv = tl.load(row_c + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FMT == 1:  # E4M3 bytes, one UE8M0 per 32 values
        cols = tl.arange(0, D)
        s = e8m0_to_bf16(tl.load(row_s + cols[None, :] // 32, mask=mask, other=127))
        kv = mul_exact(e4m3_to_bf16(tl.load(row_c + cols[None, :], mask=mask, other=0)), s, INTERPRET)
    else:  # E2M1 pairs, one E4M3 per 16 values: byte i holds elements 2i (low), 2i+1 (high), scale i // 8
        cols = tl.arange(0, D // 2)
        s = e4m3_to_bf16(tl.load(row_s + cols[None, :] // 8, mask=mask, other=0))
        byte = tl.load(row_c + cols[None, :], mask=mask, other=0).to(tl.int32)
        lo = mul_exact(e2m1_to_bf16(byte & 15), s, INTERPRET)
        hi = mul_exact(e2m1_to_bf16(byte >> 4), s, INTERPRET)
        kv = tl.reshape(tl.join(lo, hi), (valid.shape[0], D))
    return kv


@triton.jit
def split_tile(acc, m_i, l_i, q, scale, b, t, k0,
               codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb, stride_sr,
               idx_ptr, stride_ib, stride_it, K,
               D: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold the rows of indices k0..k0+BK-1 of one segment into the online-softmax state of all heads:
    each row is decoded once and serves every head (one [BH, D] x [D, BK] and one [BH, BK] x [BK, D] product)."""
    offs = k0 + tl.arange(0, BK)
    idx = tl.load(idx_ptr + b * stride_ib + t * stride_it + offs, mask=offs < K, other=-1)
    valid = idx >= 0
    rows = tl.where(valid, idx, 0)
    kv = load_rows_natural(codes_ptr, scales_ptr, b, stride_cb, stride_cr, stride_sb, stride_sr, rows, valid, D, FMT,
                           INTERPRET)
    kv = as_mma(kv, INTERPRET)
    logits = tl.dot(q, tl.trans(kv))
    logits = tl.where(valid[None, :], logits * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(as_mma(p, INTERPRET), kv)
    return acc, m_new, l_i


@triton.jit
def split_range(acc, m_i, l_i, q, scale, b, t, k_lo, k_hi,
                codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb, stride_sr,
                idx_ptr, stride_ib, stride_it, K,
                D: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """Indices k_lo..k_hi-1 (k_lo a multiple of BK) of one segment, tile by tile (while loop under the
    interpreter, for the reason given in `attend`)."""
    if INTERPRET:
        k0 = k_lo
        while k0 < k_hi:
            acc, m_i, l_i = split_tile(acc, m_i, l_i, q, scale, b, t, k0, codes_ptr, scales_ptr, stride_cb,
                                       stride_cr, stride_sb, stride_sr, idx_ptr, stride_ib, stride_it, K,
                                       D, BK, FMT, INTERPRET)
            k0 += BK
    else:
        for k0 in range(k_lo, k_hi, BK):
            acc, m_i, l_i = split_tile(acc, m_i, l_i, q, scale, b, t, k0, codes_ptr, scales_ptr, stride_cb,
                                       stride_cr, stride_sb, stride_sr, idx_ptr, stride_ib, stride_it, K,
                                       D, BK, FMT, INTERPRET)
    return acc, m_i, l_i


@triton.jit
def split_kernel(q_ptr, sink_ptr, po_ptr, pm_ptr, pl_ptr, stride_qb, stride_qt, stride_qh, T, H, scale,
                 ROW0, TILES, SPLIT0, SPLITS,
                 codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb, stride_sr, idx_ptr, stride_ib, stride_it, K,
                 D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per (token, split) of one segment (one launch per segment: the two segments' loops in
    one program spill on sm_90, each alone does not): all heads over TILES tiles of BK indices. The launch
    covers a group of G tokens, query rows ROW0 .. ROW0+G-1 of the B*T; program_id(0) is the token's slot in
    the group's partials. Writes the split's normalised partial output po [G, SPLITS, H, D] (fp32), its max
    pm and sum pl [G, SPLITS, H] at split SPLIT0 + program_id(1). The running max starts at the sink
    (finite), so a split with no valid row ends with l = 0, o = 0 and no NaN; the sink itself is added once,
    by the combine kernel."""
    slot = tl.program_id(0)
    row = ROW0 + slot
    split = tl.program_id(1)
    b = row // T
    t = row % T
    heads = tl.arange(0, BH)
    hmask = heads < H
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=hmask[:, None], other=0.0)
    q = as_mma(q, INTERPRET)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    m_i = sink
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    lo = split * TILES * BK
    acc, m_i, l_i = split_range(acc, m_i, l_i, q, scale, b, t, lo, tl.minimum(lo + TILES * BK, K),
                                codes_ptr, scales_ptr, stride_cb, stride_cr, stride_sb, stride_sr,
                                idx_ptr, stride_ib, stride_it, K, D, BK, FMT, INTERPRET)
    part = slot * SPLITS + SPLIT0 + split
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(po_ptr + (part * H + heads[:, None]).to(tl.int64) * D + cols[None, :], o, mask=hmask[:, None])
    tl.store(pm_ptr + part * H + heads, m_i, mask=hmask)
    tl.store(pl_ptr + part * H + heads, l_i, mask=hmask)


@triton.jit
def split_combine_kernel(po_ptr, pm_ptr, pl_ptr, sink_ptr, o_ptr, stride_ob, stride_ot, stride_oh, T, H, ROW0,
                   SPLITS: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Log-sum-exp merge of the splits of one token, for BH heads x BD columns, with the sink:
    M = max(sink, m_s), o = sum_s l_s e^(m_s - M) o_s / (e^(sink - M) + sum_s l_s e^(m_s - M)).
    The token of partial slot program_id(0) is query row ROW0 + program_id(0) (split_kernel's group)."""
    slot = tl.program_id(0)
    row = ROW0 + slot
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    cols = tl.program_id(2) * BD + tl.arange(0, BD)
    hmask = heads < H
    b = row // T
    t = row % T
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    m = sink
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(pm_ptr + (slot * SPLITS + s) * H + heads, mask=hmask, other=0.0))
    den = tl.exp(sink - m)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    for s in range(SPLITS):
        part = slot * SPLITS + s
        w = tl.load(pl_ptr + part * H + heads, mask=hmask, other=0.0) * \
            tl.exp(tl.load(pm_ptr + part * H + heads, mask=hmask, other=0.0) - m)
        den += w
        o_s = tl.load(po_ptr + (part * H + heads[:, None]).to(tl.int64) * D + cols[None, :], mask=hmask[:, None],
                      other=0.0)
        acc += w[:, None] * o_s
    out = acc / den[:, None]
    tl.store(o_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + cols[None, :],
             round_cast(out, o_ptr.dtype.element_ty, INTERPRET), mask=hmask[:, None])
