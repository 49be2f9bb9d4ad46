"""Triton kernels of model/kernels/gemm.py and model/kernels/experts.py (imported only when they run).

Every product is computed "swapped": acc [BN weight rows, BM tokens] = W_tile [BN, BK] @ X_tile^T [BK, BM].
The weight tile, dequantized in registers, is the left operand (the one the matrix units may take from
registers), and the token count is the small right dimension, so a decode step with one token pads it to 16
rather than to 64 or 128.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import (as_mma, e2m1_decode_bf16, e2m1_to_f32, e2m1_to_f32_bits, e8m0_to_f32,
                                                 e8m0_to_f32_every_byte, f32_to_e4m3_value, mul_exact, round_cast)


@triton.jit
def fp8_fake_quant(x, BM: tl.constexpr, BK: tl.constexpr, QA: tl.constexpr):
    """x [BM, BK] fp32 -> formats.fp8_fake_quant(x, QA) along axis 1, fp32 (bit-exact).

    Per group of QA: amax (floor 1e-4), scale = 2^ceil(log2(amax * fp32(1/448))) from the fp32 bits,
    E4M3 nearest-even of x / scale (a power of two, so the product with its inverse is exact), times scale.
    The values are exact in bf16 (4 significant bits)."""
    g = tl.reshape(x, (BM, BK // QA, QA))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    ratio_bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    biased = ((ratio_bits >> 23) & 255) + ((ratio_bits & 0x7FFFFF) != 0).to(tl.int32)
    inverse = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    scale = (biased << 23).to(tl.float32, bitcast=True)
    y = g * inverse[:, :, None]
    v = f32_to_e4m3_value(tl.abs(y))
    v = tl.where(y < 0, -v, v)
    return tl.reshape(v * scale[:, :, None], (BM, BK))


@triton.jit
def weight_scales(s_ptr, rows, rmask, k0, K, stride_sn,
                  W_FP4: tl.constexpr, QW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVERY_BYTE: tl.constexpr = False):
    """The UE8M0 scales of rows `rows` [BN] x columns k0 .. k0+BK, as fp32 [BN, BK/QW].

    FP8 weights have one per QW x QW block ([ceil(N/QW), ceil(K/QW)]), FP4 weights one per row and QW
    columns ([N, K/QW]). Columns past K read as 1. The GEMM loops load these one K step ahead: they are
    byte gathers, which the software pipeliner does not stage through shared memory, so a load issued in
    the step that uses it would stall that step on its latency. EVERY_BYTE: bytes 0 and 255 decoded as
    formats.e8m0_to_float decodes them (2^-127 and NaN; e8m0_to_f32_every_byte)."""
    KB: tl.constexpr = BK // QW
    col_blocks = k0 // QW + tl.arange(0, KB)
    mask = rmask[:, None] & (col_blocks[None, :] * QW < K)
    if W_FP4:
        srow = rows.to(tl.int64)
    else:
        srow = (rows // QW).to(tl.int64)
    b = tl.load(s_ptr + srow[:, None] * stride_sn + col_blocks[None, :], mask=mask, other=127).to(tl.int32)
    if EVERY_BYTE:
        return e8m0_to_f32_every_byte(b)
    else:
        return e8m0_to_f32(b)


@triton.jit
def weight_tile(w_ptr, s, rows, rmask, k0, KP, stride_wn,
                W_FP4: tl.constexpr, QW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DEC16: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """Rows `rows` [BN] x columns k0 .. k0+BK of a stored weight, times their scales s [BN, BK/QW]
    (weight_scales) -> fp32 [BN, BK], exact values. DEC16 (FP4 only): the E2M1 codes decoded from their bits
    straight to bf16 and scaled in bf16 (exact: at most 2 significant bits times a power of two), the tile
    returned as bf16 with the same values; half the registers and fewer instructions than the fp32 decode.

    FP8: E4M3 bytes [N, K]. FP4: E2M1 pairs [N, K/2], element 2i in the low nibble. KP = bytes per row
    (K or K/2; an argument of its own so that its divisibility, which the loads' vector width depends on, is
    known to the compiler). The tile is handled as [BN, BK/QW, QW] so that each block's scale broadcasts over
    the last axis."""
    KB: tl.constexpr = BK // QW
    kb = tl.arange(0, KB)
    r64 = rows.to(tl.int64)
    if W_FP4:
        half = tl.arange(0, QW // 2)
        cols = k0 // 2 + kb[:, None] * (QW // 2) + half[None, :]  # byte columns [KB, QW/2]
        mask = rmask[:, None, None] & (cols[None, :, :] < KP)
        b = tl.load(w_ptr + r64[:, None, None] * stride_wn + cols[None, :, :], mask=mask, other=0).to(tl.int32)
        if DEC16:
            v = tl.join(e2m1_decode_bf16(b & 15, DEC16), e2m1_decode_bf16(b >> 4, DEC16))
            if DEC16 == 2:  # the codes came / 64: the scales x 64 (one multiply per 32 weights)
                s = s * 64.0
            v = mul_exact(v, s.to(tl.bfloat16)[:, :, None, None], INTERPRET)
        else:
            v = tl.join(e2m1_to_f32(b & 15), e2m1_to_f32(b >> 4))  # [BN, KB, QW/2, 2]: elements 2i, 2i+1
            v = v * s[:, :, None, None]
    else:
        q = tl.arange(0, QW)
        cols = k0 + kb[:, None] * QW + q[None, :]  # [KB, QW]
        mask = rmask[:, None, None] & (cols[None, :, :] < KP)
        b = tl.load(w_ptr + r64[:, None, None] * stride_wn + cols[None, :, :], mask=mask, other=0)
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # exact (E4M3 fits fp16 and fp32)
        v = v * s[:, :, None]
    return tl.reshape(v, (BN, BK))


@triton.jit
def act_quant_kernel(x_ptr, y_ptr, M, K, stride_x, stride_y,
                     QA: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """y = fp8_fake_quant(x) for a [BM, BK] tile (K is a multiple of QA, so groups are never cut)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = fp8_fake_quant(x, BM, BK, QA)
    tl.store(y_ptr + r64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, KP, stride_xm, stride_ym, split_stride, stride_wn, stride_sn,
                K_SPLIT: tl.constexpr, W_FP4: tl.constexpr, QA: tl.constexpr, QW: tl.constexpr,
                QUANT_A: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                INTERPRET: tl.constexpr, GEMV: tl.constexpr = False):
    """Program (BN weight rows, BM tokens, K range K_SPLIT): y[m, n] (+)= sum_k xq[m, k] W[n, k].

    QUANT_A: x is raw and is fake-quantized here per QA (decode: saves the separate act-quant launch);
    otherwise x already holds the quantized values. With a split K, program k writes its fp32 partial at
    y + k * split_stride and split_sum_kernel adds the partials in order. GEMV (BM = 1, one program per token):
    the tile's products summed along K on the CUDA cores instead of the matrix units, which take at least 16
    tokens (a decode step's one token padded to 16); the same exact products, fp32 sums in another order."""
    pid_k = tl.program_id(2)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    nmask = n < N
    mmask = m < M
    m64 = m.to(tl.int64)
    k_lo = pid_k * K_SPLIT
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    s_next = weight_scales(s_ptr, n, nmask, k_lo, K, stride_sn, W_FP4, QW, BN, BK)
    for i in range(K_SPLIT // BK):
        k0 = k_lo + i * BK
        s_cur = s_next
        s_next = weight_scales(s_ptr, n, nmask, k0 + BK, K, stride_sn, W_FP4, QW, BN, BK)
        kk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + m64[:, None] * stride_xm + kk[None, :], mask=mmask[:, None] & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        if QUANT_A:
            a = fp8_fake_quant(a, BM, BK, QA)
        w = weight_tile(w_ptr, s_cur, n, nmask, k0, KP, stride_wn, W_FP4, QW, BN, BK)
        if GEMV:
            acc += tl.sum(w * a, axis=1)[:, None]
        else:
            acc += tl.dot(as_mma(w, INTERPRET), as_mma(tl.trans(a), INTERPRET))
    out = y_ptr + pid_k * split_stride + m64[None, :] * stride_ym + n[:, None]
    tl.store(out, round_cast(acc, y_ptr.dtype.element_ty, INTERPRET), mask=nmask[:, None] & mmask[None, :])


@triton.jit
def split_sum_kernel(p_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """y = sum_s partial[s] (in order s = 0, 1, ...: deterministic), rounded to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, round_cast(acc, y_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def dequant_weight_kernel(w_ptr, s_ptr, y_ptr, N, K, KP, stride_wn, stride_sn, stride_yn,
                          W_FP4: tl.constexpr, QW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          INTERPRET: tl.constexpr):
    """Program (BN rows, BK columns): y = the stored weight times its UE8M0 scales, bf16, equal bit for bit to
    formats.dequant_fp8_weight / dequant_fp4_weight(..., torch.bfloat16) (gemm.dequant_weight).

    As there, the element and the scale (every byte decoded as formats does, 0 and 255 included) are exact
    fp32 values whose fp32 product is rounded once to bf16: E4M3 / E2M1 times a power of two is a bf16 value
    unless it falls below bf16's normal range or past its largest value, where both round alike. FP4 codes
    are decoded from their bits with the sign copied (e2m1_to_f32_bits: code 8 is -0.0, as in formats).
    One pass, memory-bound: the weight bytes and the scales are read once, the bf16 weight written once."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    k0 = tl.program_id(1) * BK
    s = weight_scales(s_ptr, rows, rmask, k0, K, stride_sn, W_FP4, QW, BN, BK, EVERY_BYTE=True)
    if W_FP4:  # weight_tile's FP4 load, [BN, BK/QW, QW/2] bytes
        kb = tl.arange(0, BK // QW)
        cols = k0 // 2 + kb[:, None] * (QW // 2) + tl.arange(0, QW // 2)[None, :]
        mask = rmask[:, None, None] & (cols[None, :, :] < KP)
        b = tl.load(w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn + cols[None, :, :], mask=mask,
                    other=0).to(tl.int32)
        v = tl.join(e2m1_to_f32_bits(b & 15), e2m1_to_f32_bits(b >> 4))  # elements 2i, 2i+1
        w = tl.reshape(v * s[:, :, None, None], (BN, BK))
    else:
        w = weight_tile(w_ptr, s, rows, rmask, k0, KP, stride_wn, W_FP4, QW, BN, BK)
    cols = k0 + tl.arange(0, BK)
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :]
    tl.store(out, round_cast(w, tl.bfloat16, INTERPRET), mask=rmask[:, None] & (cols[None, :] < K))


# ------------------------------------------------------------------------------------------ experts
@triton.jit
def expert_base(base_ptr, table_ptr, which, e, E, ALIGNED: tl.constexpr):
    """Pointer to tensor `which` (0..5: w1, s1, w3, s3, w2, s2) of expert e: the tables hold byte offsets
    from one base tensor, so every expert's separately allocated weights are reached from one argument."""
    off = tl.load(table_ptr + which * E + e)
    if ALIGNED:
        off = tl.multiple_of(off, 16)  # checked on the host: lets the weight loads vectorize
    return base_ptr + off


@triton.jit
def tile_rows_channels(t, e, tile_r_ptr, off_ptr, N, BM: tl.constexpr, BN: tl.constexpr):
    """Row tile t of expert e (its BM sorted rows, masked at the expert's end) and the program's BN channels
    (masked at N): (rows, rmask, n, nmask)."""
    row0 = tl.load(tile_r_ptr + t)
    row_end = tl.load(off_ptr + e + 1)
    rows = row0 + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    return rows, rows < row_end, n, n < N


@triton.jit
def swiglu_quant_store(acc_g, acc_u, rows, rmask, n, nmask, wts_ptr, h_ptr, stride_h, limit,
                       HAS_LIMIT: tl.constexpr, QA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """The up stage's epilogue on fp32 sums acc_g = w1 xq, acc_u = w3 xq [BN channels, BM rows]:

        gate = round(acc_g), up = round(acc_u)             (rounded to the activation dtype, as Linear returns)
        h = w_route * silu(min(gate, L)) * clamp(up, -L, L)
        store fp8_fake_quant(round(h)) per QA           (w2's input, quantized once here)"""
    gate = round_cast(acc_g, h_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    up = round_cast(acc_u, h_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up  # F.silu(gate) * up
    route = tl.load(wts_ptr + rows, mask=rmask, other=0.0)
    h = route[None, :] * h
    h = round_cast(h, h_ptr.dtype.element_ty, INTERPRET).to(tl.float32)  # w2's input, in the activation dtype
    hq = fp8_fake_quant(tl.trans(h), BM, BN, QA)  # [BM, BN], groups of QA along the channels
    out = h_ptr + rows.to(tl.int64)[:, None] * stride_h + n[None, :]
    tl.store(out, hq.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def expert_up_kernel(xq_ptr, tok_ptr, wts_ptr, tile_e_ptr, tile_r_ptr, off_ptr, base_ptr, table_ptr, h_ptr, part_ptr,
                     E, K, KP, N, PLANE, stride_x, stride_h, stride_wn, stride_sn, limit,
                     HAS_LIMIT: tl.constexpr, W_FP4: tl.constexpr, QA: tl.constexpr, QW: tl.constexpr,
                     ALIGNED: tl.constexpr, NK: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr, DEC16: tl.constexpr):
    """Program (tile of BM rows of one expert, BN intermediate channels, K range k): the w1 and w3 products
    over NK steps of BK from k NK BK. SPLIT = 1: swiglu_quant_store. SPLIT > 1 (a decode step's few rows:
    more programs, each streaming a shorter range of the weights): the fp32 sums go to part [SPLIT, 2, R, N]
    (PLANE = R N) and expert_up_finish_kernel adds them in order.

    Rows are the expert-sorted (token, slot) assignments; xq holds every token's quantized input, gathered
    by token id. Tiles past the last real one (the grid is an upper bound) have expert E and do nothing."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < E:
        rows, rmask, n, nmask = tile_rows_channels(t, e, tile_r_ptr, off_ptr, N, BM, BN)
        tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        pid_k = tl.program_id(2)
        k_lo = pid_k * (NK * BK)
        w1 = expert_base(base_ptr, table_ptr, 0, e, E, ALIGNED)
        s1 = expert_base(base_ptr, table_ptr, 1, e, E, False)
        w3 = expert_base(base_ptr, table_ptr, 2, e, E, ALIGNED)
        s3 = expert_base(base_ptr, table_ptr, 3, e, E, False)
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
        sg_next = weight_scales(s1, n, nmask, k_lo, K, stride_sn, W_FP4, QW, BN, BK)
        su_next = weight_scales(s3, n, nmask, k_lo, K, stride_sn, W_FP4, QW, BN, BK)
        for i in range(NK):
            k0 = k_lo + i * BK
            sg = sg_next
            su = su_next
            sg_next = weight_scales(s1, n, nmask, k0 + BK, K, stride_sn, W_FP4, QW, BN, BK)
            su_next = weight_scales(s3, n, nmask, k0 + BK, K, stride_sn, W_FP4, QW, BN, BK)
            kk = k0 + tl.arange(0, BK)
            a = tl.load(xq_ptr + tok[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K),
                        other=0.0)
            at = as_mma(tl.trans(a.to(tl.float32)), INTERPRET)
            wg = weight_tile(w1, sg, n, nmask, k0, KP, stride_wn, W_FP4, QW, BN, BK, DEC16, INTERPRET)
            acc_g += tl.dot(as_mma(wg, INTERPRET), at)
            wu = weight_tile(w3, su, n, nmask, k0, KP, stride_wn, W_FP4, QW, BN, BK, DEC16, INTERPRET)
            acc_u += tl.dot(as_mma(wu, INTERPRET), at)
        if SPLIT == 1:
            swiglu_quant_store(acc_g, acc_u, rows, rmask, n, nmask, wts_ptr, h_ptr, stride_h, limit, HAS_LIMIT, QA,
                               BM, BN, INTERPRET)
        else:
            at_rn = rows.to(tl.int64)[None, :] * N + n[:, None]
            m2 = nmask[:, None] & rmask[None, :]
            k2 = 2 * pid_k.to(tl.int64)
            tl.store(part_ptr + k2 * PLANE + at_rn, acc_g, mask=m2)
            tl.store(part_ptr + (k2 + 1) * PLANE + at_rn, acc_u, mask=m2)


@triton.jit
def expert_up_finish_kernel(part_ptr, wts_ptr, tile_e_ptr, tile_r_ptr, off_ptr, h_ptr, E, N, PLANE, stride_h, limit,
                            HAS_LIMIT: tl.constexpr, QA: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (tile of BM rows of one expert, BN channels) of a split up stage: the SPLIT partial sums of w1 xq
    and w3 xq added in order (k = 0, 1, ...: deterministic), then swiglu_quant_store."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < E:
        rows, rmask, n, nmask = tile_rows_channels(t, e, tile_r_ptr, off_ptr, N, BM, BN)
        at_rn = rows.to(tl.int64)[None, :] * N + n[:, None]
        m2 = nmask[:, None] & rmask[None, :]
        acc_g = tl.load(part_ptr + at_rn, mask=m2, other=0.0)
        acc_u = tl.load(part_ptr + PLANE + at_rn, mask=m2, other=0.0)
        for k in tl.static_range(1, SPLIT):
            acc_g += tl.load(part_ptr + (2 * k) * PLANE + at_rn, mask=m2, other=0.0)
            acc_u += tl.load(part_ptr + (2 * k + 1) * PLANE + at_rn, mask=m2, other=0.0)
        swiglu_quant_store(acc_g, acc_u, rows, rmask, n, nmask, wts_ptr, h_ptr, stride_h, limit, HAS_LIMIT, QA,
                           BM, BN, INTERPRET)


@triton.jit
def expert_down_kernel(h_ptr, tile_e_ptr, tile_r_ptr, off_ptr, base_ptr, table_ptr, out_ptr,
                       E, K, KP, N, PLANE, stride_h, stride_o, stride_wn, stride_sn,
                       W_FP4: tl.constexpr, QW: tl.constexpr, ALIGNED: tl.constexpr, NK: tl.constexpr,
                       SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       INTERPRET: tl.constexpr, DEC16: tl.constexpr):
    """Program (tile of BM sorted rows of one expert, BN model channels, K range k): out = round(w2 hq) over
    NK steps of BK from k NK BK. SPLIT > 1: out is fp32 [SPLIT, R, N] (PLANE = R N), the range's sum
    unrounded (expert_combine_kernel adds the ranges in order and rounds)."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < E:
        rows, rmask, n, nmask = tile_rows_channels(t, e, tile_r_ptr, off_ptr, N, BM, BN)
        r64 = rows.to(tl.int64)
        pid_k = tl.program_id(2)
        k_lo = pid_k * (NK * BK)
        w2 = expert_base(base_ptr, table_ptr, 4, e, E, ALIGNED)
        s2 = expert_base(base_ptr, table_ptr, 5, e, E, False)
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        s_next = weight_scales(s2, n, nmask, k_lo, K, stride_sn, W_FP4, QW, BN, BK)
        for i in range(NK):
            k0 = k_lo + i * BK
            s_cur = s_next
            s_next = weight_scales(s2, n, nmask, k0 + BK, K, stride_sn, W_FP4, QW, BN, BK)
            kk = k0 + tl.arange(0, BK)
            a = tl.load(h_ptr + r64[:, None] * stride_h + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K),
                        other=0.0)
            w = weight_tile(w2, s_cur, n, nmask, k0, KP, stride_wn, W_FP4, QW, BN, BK, DEC16, INTERPRET)
            acc += tl.dot(as_mma(w, INTERPRET), as_mma(tl.trans(a.to(tl.float32)), INTERPRET))
        out = out_ptr + pid_k.to(tl.int64) * PLANE + r64[None, :] * stride_o + n[:, None]
        if SPLIT == 1:
            tl.store(out, round_cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=nmask[:, None] & rmask[None, :])
        else:
            tl.store(out, acc, mask=nmask[:, None] & rmask[None, :])


@triton.jit
def expert_combine_kernel(out_ptr, pos_ptr, y_ptr, act_ptr, T, N, PLANE, stride_o, stride_y,
                          SLOTS: tl.constexpr, SPLIT: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                          INTERPRET: tl.constexpr):
    """y[t] = sum over t's slots, in ascending expert order, of out[pos] in fp32 (as MoE.routed adds them);
    pos -1 = an expert another rank holds (skipped). SPLIT > 1: out is the down stage's fp32 partial sums
    [SPLIT, R, N] (PLANE = R N), added in order and rounded to the activation dtype (act_ptr's) before the slots' sum."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    tmask = t < T
    nmask = n < N
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        p = tl.load(pos_ptr + t * SLOTS + j, mask=tmask, other=-1)
        present = p >= 0
        at = tl.where(present, p, 0).to(tl.int64)[:, None] * stride_o + n[None, :]
        m2 = present[:, None] & nmask[None, :]
        v = tl.load(out_ptr + at, mask=m2, other=0.0).to(tl.float32)
        if SPLIT > 1:
            for k in tl.static_range(1, SPLIT):
                v += tl.load(out_ptr + k * PLANE + at, mask=m2, other=0.0)
            v = round_cast(v, act_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
        acc = tl.where(present[:, None], acc + v, acc)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * stride_y + n[None, :], acc, mask=tmask[:, None] & nmask[None, :])


@triton.jit
def expert_sort_kernel(w_ptr, idx_ptr, held_ptr, token_ptr, route_ptr, off_ptr, tile_e_ptr, tile_r_ptr, pos_ptr,
                       scratch_ptr, T, R, E, k, n_tiles, BM,
                       RP: tl.constexpr, EP: tl.constexpr, JP: tl.constexpr, NTP: tl.constexpr, TP: tl.constexpr,
                       KP: tl.constexpr):
    """experts.sort_by_expert in one program (a decode step's few assignments): the same outputs. Keys are the
    experts (E for one not held), counted by a histogram; the stable order is a sort of key * RP + row; each
    token's slots get their sorted rows through a scratch row; the tile table is scattered expert by expert."""
    r = tl.arange(0, RP)
    rm = r < R
    expert = tl.load(idx_ptr + r, mask=rm, other=0).to(tl.int32)
    held = tl.load(held_ptr + expert, mask=rm, other=0)
    key = tl.where(held != 0, expert, E)
    bins = tl.arange(0, EP)
    counts = tl.histogram(key, EP, mask=rm)
    starts = tl.cumsum(counts, axis=0) - counts  # offsets[e]: rows of the experts before e
    tl.store(off_ptr + bins, starts, mask=bins <= E)
    order = tl.sort(tl.where(rm, key * RP + r, EP * RP + r)) % RP  # stable: equal keys keep their row order
    tl.store(token_ptr + r, order // k, mask=rm)
    tl.store(route_ptr + r, tl.load(w_ptr + order, mask=rm, other=0.0), mask=rm)
    tl.store(scratch_ptr + order, r, mask=rm)  # the sorted row of each assignment
    tl.debug_barrier()
    t = tl.arange(0, TP)[:, None]
    j = tl.arange(0, KP)[None, :]
    m2 = (t < T) & (j < k)
    a = t * k + j
    row = tl.load(scratch_ptr + a, mask=m2, other=0)
    slot_held = tl.load(held_ptr + tl.load(idx_ptr + a, mask=m2, other=0).to(tl.int32), mask=m2, other=0)
    row = tl.where(slot_held != 0, row, -1)
    row = tl.sort(tl.where(m2, row, 2147483647), dim=1)  # ascending, -1 (not held) first, padding last
    tl.store(pos_ptr + a, row, mask=m2)
    tiles = tl.where(bins < E, (counts + BM - 1) // BM, 0)
    tile_start = tl.cumsum(tiles, axis=0) - tiles
    total = tl.sum(tiles, axis=0)
    jj = tl.arange(0, JP)[None, :]
    real = jj < tiles[:, None]
    at = tile_start[:, None] + jj
    tl.store(tile_e_ptr + at, tl.broadcast_to(bins[:, None], (EP, JP)), mask=real)
    tl.store(tile_r_ptr + at, starts[:, None] + jj * BM, mask=real)
    # tiles past the real ones: expert E, and the row the searchsorted formula gives them (clamped to E - 1)
    last_start = tl.sum(tl.where(bins == E - 1, starts, 0), axis=0)
    last_tile = tl.sum(tl.where(bins == E - 1, tile_start, 0), axis=0)
    tv = tl.arange(0, NTP)
    pad = (tv >= total) & (tv < n_tiles)
    tl.store(tile_e_ptr + tv, tl.zeros((NTP,), dtype=tl.int32) + E, mask=pad)
    tl.store(tile_r_ptr + tv, last_start + (tv - last_tile) * BM, mask=pad)
