"""Triton kernel of model/kernels/indexer.py (imported only when it runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import (as_mma, e2m1_decode_bf16, e2m1_to_f32, e8m0_to_bf16, e8m0_to_f32,
                                                 mul_exact, round_cast)


# a row of topk_select's workspace: 4 histograms of 256 counts, then the two slot counters of the collection
HROW = tl.constexpr(4 * 256 + 2)


@triton.jit
def score_tile(hist, q_e, q_o, w, t_out, visible, b, tile, codes_ptr, scales_ptr, cand_ptr, out_ptr, N, C,
               stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
               DK2: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
               GATHER: tl.constexpr, MASK_VISIBLE: tl.constexpr, BF16_SCORES: tl.constexpr,
               DECODE_BF16: tl.constexpr, HIST: tl.constexpr, INTERPRET: tl.constexpr):
    """Score entries tile*BN .. tile*BN+BN-1 for the program's BT tokens and store them; with HIST (one
    token per program) also add the tile's first radix digits to `hist` (the Top-K's first pass, fused).

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
    sb = tl.load(key_s + tl.arange(0, DK2 // 16)[None, :], mask=present[:, None], other=127)
    if DECODE_BF16:  # codes and scales straight to bf16 (2: the codes / 64, the queries were multiplied by 64);
        # the power-of-two product is exact in bf16
        s = e8m0_to_bf16(sb)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, DK2 // 16, 16)), (BN, DK2))
        k_e = mul_exact(e2m1_decode_bf16(byte & 15, DECODE_BF16), s, INTERPRET)
        k_o = mul_exact(e2m1_decode_bf16(byte >> 4, DECODE_BF16), s, INTERPRET)
    else:
        s = e8m0_to_f32(sb.to(tl.int32))  # [BN, DK/32]: one scale per 16 code bytes (32 values)
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
    if HIST:  # BT == 1: the token's scores of this tile, binned by their top 8 order bits
        digit = (order_key(tl.reshape(scores, (BN,))) >> 24) & 255
        hist += tl.histogram(digit, 256, mask=(offs < n_out) & (tl.max(t_out, axis=0) >= 0))
    return hist


# N (entries), C (candidates) and the output strides grow by one entry every m decode steps. Triton would
# specialize them (divisible by 16 or not) and compile a second variant the first time N crosses a multiple of
# 16 mid-decode: a 0.5 s stall per kernel variant, seen in the 8K decode row of bench_flash_layers.
@triton.jit(do_not_specialize=["N", "C", "stride_ob", "stride_ot"])
def scores_kernel(q_ptr, w_ptr, codes_ptr, scales_ptr, cand_ptr, vis_ptr, out_ptr, hist_ptr,
           T, H, N, C,
           stride_qb, stride_qt, stride_qh, stride_wb, stride_wt,
           stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob, stride_ot,
           DK2: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
           GATHER: tl.constexpr, MASK_VISIBLE: tl.constexpr, BF16_SCORES: tl.constexpr,
           DECODE_BF16: tl.constexpr, HIST: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (b, block of BT tokens, p): scores [BT, BN] = sum_h w ReLU(q_h . k) for the entry tiles
    p, p + P, p + 2P, ... (P = programs on axis 2), so one program walks many tiles with its queries and
    head weights loaded once and kept in registers.

    Columns of the query operand are (token, head) pairs, BT*HP of them, so one product serves BT tokens;
    the keys are MXFP4 (E2M1 pairs, UE8M0 per 32), decoded into even/odd halves as in sparse attention.
    The CPU interpreter cannot take a runtime bound in range() with NumPy 2, so there the same tiles are
    walked with a while loop; compiled code keeps the for loop (software-pipelined). HIST (BT == 1): the
    program's 256-bin histogram of its scores' top radix digit goes to hist_ptr[(b*T + t), 0] with one
    atomic add at the end (the first pass of topk_select)."""
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
    q_e = tl.load(q_row + 2 * cols[:, None], mask=rmask[None, :], other=0.0)  # [DK2, BT*HP]
    q_o = tl.load(q_row + 2 * cols[:, None] + 1, mask=rmask[None, :], other=0.0)
    if DECODE_BF16 == 2:  # the keys come as value / 64: the same products with the queries times 64 (exact)
        q_e, q_o = q_e.to(tl.float32) * 64.0, q_o.to(tl.float32) * 64.0
    q_e, q_o = as_mma(q_e, INTERPRET), as_mma(q_o, INTERPRET)
    w = tl.load(w_ptr + b * stride_wb + tok * stride_wt + head, mask=rmask, other=0.0).to(tl.float32)

    t_out = t0 + tl.arange(0, BT)
    if MASK_VISIBLE:
        visible = tl.load(vis_ptr + t_out, mask=t_out < T, other=0)
    else:
        visible = t_out
    t_out = tl.where(t_out < T, t_out, -1)  # -1: padding token, not stored
    n_tiles = tl.cdiv(C if GATHER else N, BN)
    hist = tl.zeros((256,), dtype=tl.int32)
    if INTERPRET:
        tile = p
        while tile < n_tiles:
            hist = score_tile(hist, q_e, q_o, w, t_out, visible, b, tile, codes_ptr, scales_ptr, cand_ptr, out_ptr,
                              N, C, stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob,
                              stride_ot, DK2, HP, BT, BN, GATHER, MASK_VISIBLE, BF16_SCORES, DECODE_BF16, HIST,
                              INTERPRET)
            tile += P
    else:
        for tile in range(p, n_tiles, P):
            hist = score_tile(hist, q_e, q_o, w, t_out, visible, b, tile, codes_ptr, scales_ptr, cand_ptr, out_ptr,
                              N, C, stride_cb, stride_cr, stride_sb, stride_sr, stride_ib, stride_it, stride_ob,
                              stride_ot, DK2, HP, BT, BN, GATHER, MASK_VISIBLE, BF16_SCORES, DECODE_BF16, HIST,
                              INTERPRET)
    if HIST:
        if t0 < T:
            tl.atomic_add(hist_ptr + (b * T + t0) * HROW + tl.arange(0, 256), hist)


# ------------------------------------------------------------------------------- Top-K (radix select)
# topk_select in indexer.py: the k largest scores of each row found by their 32-bit order keys, 8 bits per
# pass (4 passes: a 256-bin histogram of the digit under the prefix fixed so far), then one pass that
# collects the entries above the threshold key and as many equal to it as are still needed, and one program
# per row that sorts the chosen ids. Every pass reads the row once (4 bytes an entry); nothing leaves the GPU.


@triton.jit
def order_key(x):
    """fp32 -> the bits (held in int32) of a 32-bit key whose UNSIGNED order is the float order (-inf lowest,
    -0 just below +0): digits are read with shifts and masks, comparisons go through signed_key. (int32, not
    uint32: Triton 3.6's interpreter cannot invert a uint32.)"""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b) ^ -2147483648


@triton.jit
def signed_key(key):
    """An order key as int32 whose signed order is the keys' unsigned order."""
    return key ^ -2147483648


@triton.jit
def threshold(hist_row_ptr, k, PASSES: tl.constexpr):
    """From the histograms of passes 0 .. PASSES-1: the order-key prefix of the k-th largest entry (its top
    8 * PASSES bits, the rest 0) and how many entries equal to that prefix are still to be taken (kk, >= 1).
    Each pass picks the highest digit d whose bins d..255 hold at least kk entries."""
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.int32)
    kk = k
    for j in tl.static_range(PASSES):
        h = tl.load(hist_row_ptr + j * 256 + bins)
        above = tl.cumsum(h, axis=0, reverse=True)  # entries in bins >= b
        d = tl.max(tl.where(above >= kk, bins, -1), axis=0)
        kk = kk - tl.sum(tl.where(bins > d, h, 0), axis=0)
        prefix = prefix | (d << (24 - 8 * j))  # the top digit wraps into the sign bit
    return prefix, kk


@triton.jit(do_not_specialize=["L", "k"])
def radix_pass_kernel(scores_ptr, hist_ptr, L, k, PASS: tl.constexpr, BL: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (row, p): chunks p, p + P, ... of BL scores; counts the digit of pass PASS (order-key bits
    31-8*PASS .. 24-8*PASS) of the entries whose higher digits equal the prefix the earlier passes fixed, and
    adds its 256 counts to the row's histogram of this pass with one atomic add."""
    r = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    row = scores_ptr + r.to(tl.int64) * L
    hrow = hist_ptr + r * HROW
    prefix, kk = threshold(hrow, k, PASS)
    h = tl.zeros((256,), dtype=tl.int32)
    c = p
    n_chunks = tl.cdiv(L, BL)
    while c < n_chunks:  # a while loop also compiled: the trip count is a handful of chunks
        offs = c * BL + tl.arange(0, BL)
        m = offs < L
        key = order_key(tl.load(row + offs, mask=m, other=0.0))
        if PASS > 0:
            m = m & ((key >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
        h += tl.histogram((key >> (24 - 8 * PASS)) & 255, 256, mask=m)
        c += P
    tl.atomic_add(hrow + PASS * 256 + tl.arange(0, 256), h)


@triton.jit(do_not_specialize=["L", "k"])
def radix_collect_kernel(scores_ptr, hist_ptr, sel_ptr, L, k, KP: tl.constexpr, BL: tl.constexpr):
    """Program (row, p): with the threshold key tau of the four passes, writes the positions of its entries
    with key > tau (k - kk of them in the whole row) to sel[row, 0 ..] and of those with key == tau to
    sel[row, k - kk ..] while slots remain; slots are claimed with one atomic add per chunk and kind, so the
    order inside sel is the claims' order (topk_finish sorts)."""
    r = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    row = scores_ptr + r.to(tl.int64) * L
    tau, kk = threshold(hist_ptr + r * HROW, k, 4)
    count_ptr = hist_ptr + r * HROW + 4 * 256
    n_gt = k - kk
    sel = sel_ptr + r * KP
    c = p
    n_chunks = tl.cdiv(L, BL)
    while c < n_chunks:
        offs = c * BL + tl.arange(0, BL)
        m = offs < L
        key = order_key(tl.load(row + offs, mask=m, other=0.0))
        gt = m & (signed_key(key) > signed_key(tau))
        eq = m & (key == tau)
        n1 = tl.sum(gt.to(tl.int32), axis=0)
        if n1 > 0:
            base = tl.atomic_add(count_ptr, n1)
            tl.store(sel + base + tl.cumsum(gt.to(tl.int32), axis=0) - 1, offs, mask=gt)
        n2 = tl.sum(eq.to(tl.int32), axis=0)
        if n2 > 0:
            base = tl.atomic_add(count_ptr + 1, n2)
            pos = n_gt + base + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            tl.store(sel + pos, offs, mask=eq & (pos < k))
        c += P


@triton.jit(do_not_specialize=["L", "k"])
def topk_finish_kernel(sel_ptr, scores_ptr, cand_ptr, out_ptr, L, k, KP: tl.constexpr, GATHER: tl.constexpr):
    """Program (row): the k chosen positions -> entry ids (the candidate list's in GATHER mode), a pick whose
    score is not finite -> -1, sorted ascending with the -1s last (indexer_topk's order)."""
    r = tl.program_id(0)
    i = tl.arange(0, KP)
    m = i < k
    pos = tl.load(sel_ptr + r * KP + i, mask=m, other=0)
    s = tl.load(scores_ptr + r.to(tl.int64) * L + pos, mask=m, other=float("-inf"))
    ok = m & (s > float("-inf")) & (s < float("inf"))
    if GATHER:
        ids = tl.load(cand_ptr + r.to(tl.int64) * L + pos, mask=ok, other=0)
    else:
        ids = pos
    BIG: tl.constexpr = 2147483647
    ids = tl.sort(tl.where(ok, ids, BIG))
    tl.store(out_ptr + r * k + i, tl.where(ids == BIG, -1, ids).to(tl.int64), mask=m)
