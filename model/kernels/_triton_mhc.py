"""Triton kernels of model/kernels/mhc.py (imported only when they run)."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import as_mma, round_cast


@triton.jit
def residual_block(part, sq, x_rows, y_rows, x_new_rows, collapsed_rows, fn_hi_ptr, fn_lo_ptr, fn_t,
                   post_ptr, comb_ptr, pre_ptr, r64, rmask, ch0, d,
                   N: tl.constexpr, NMP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                   HAS_Y: tl.constexpr, X_ONCE: tl.constexpr, INTERPRET: tl.constexpr):
    """Channels ch0 .. ch0+BD-1 of the program's tokens: write X' and the collapse, and return the
    projection and sum-of-squares partials with this block's share added.

    One stream at a time, in [BM, BD] tiles: the per-token coefficients are [BM] vectors (L1-resident after
    the first block) and the W_fn tile of stream k is [BD, NMP], so little is live across the loop. The
    residual update adds post_k y then comb_jk X_j in j order, as the [BM, N, BD] form did; X_ONCE loads
    the n stream tiles once per block and sums comb_jk X_j as one reduction over j (the sum's order is then
    the compiler's; X' is rounded to bf16 either way)."""
    m2 = rmask[:, None]
    collapsed = tl.zeros((BM, BD), dtype=tl.float32)
    if HAS_Y:
        y = tl.load(y_rows + ch0, mask=m2, other=0.0).to(tl.float32)
        if X_ONCE:  # the block's n stream tiles loaded once, [BM, N, BD], instead of once per output stream
            streams = tl.arange(0, N)
            x3 = tl.load(x_rows[:, None, :] + streams[None, :, None] * d + ch0, mask=m2[:, :, None],
                         other=0.0).to(tl.float32)
    for k in tl.static_range(N):
        if HAS_Y:
            acc = tl.load(post_ptr + r64 * N + k, mask=rmask, other=0.0)[:, None] * y
            if X_ONCE:
                comb_k = tl.load(comb_ptr + r64[:, None] * (N * N) + streams[None, :] * N + k, mask=m2, other=0.0)
                acc += tl.sum(comb_k[:, :, None] * x3, axis=1)
            else:
                for j in tl.static_range(N):
                    xj = tl.load(x_rows + j * d + ch0, mask=m2, other=0.0).to(tl.float32)
                    acc += tl.load(comb_ptr + r64 * (N * N) + j * N + k, mask=rmask, other=0.0)[:, None] * xj
            x_new = round_cast(acc, x_new_rows.dtype.element_ty, INTERPRET)  # nearest-even, as the GPU casts
            tl.store(x_new_rows + k * d + ch0, x_new, mask=m2)
            xk = x_new.to(tl.float32)
        else:
            xk = tl.load(x_rows + k * d + ch0, mask=m2, other=0.0).to(tl.float32)
        collapsed += tl.load(pre_ptr + r64 * N + k, mask=rmask, other=0.0)[:, None] * xk
        sq += tl.sum(xk * xk, axis=1)
        xm = as_mma(xk, INTERPRET)
        part += tl.dot(xm, as_mma(tl.load(fn_hi_ptr + k * d + ch0 + fn_t).to(tl.float32), INTERPRET))
        part += tl.dot(xm, as_mma(tl.load(fn_lo_ptr + k * d + ch0 + fn_t).to(tl.float32), INTERPRET))
    tl.store(collapsed_rows + ch0, round_cast(collapsed, collapsed_rows.dtype.element_ty, INTERPRET), mask=m2)
    return part, sq


@triton.jit
def residual_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fn_hi_ptr, fn_lo_ptr,
                    x_new_ptr, collapsed_ptr, acc_ptr, M, d, blocks_per_range,
                    N: tl.constexpr, NMP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                    HAS_Y: tl.constexpr, X_ONCE: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (block of BM tokens, range of channel blocks), every stream; it walks its range BD channels
    at a time:

        X'_k = post_k y + sum_j comb_jk X_j       (HAS_Y; else X' = X), rounded to the residual dtype
        collapsed = sum_j pre_j X'_j               (the next sub-layer's input)
        acc[:, :NMP] += X' . W_fn^T over the range, acc[:, NMP] += sum X'^2   (split-K partials)

    The partials stay in registers across the range and go out with one atomic add per token and range
    (NMP + 1 values), and each program reads its range's slice of W_fn once per BM tokens. The projection
    runs on the matrix units as X' (exact in bf16) times W_fn = hi + lo (two bf16 parts), which keeps fp32
    accuracy. x [M, N, d], y / collapsed [M, d], post / pre [M, N], comb [M, N, N]. The CPU interpreter
    cannot take a runtime bound in range() with NumPy 2, so there the blocks are walked with a while loop."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    c = tl.arange(0, BD)
    x_rows = x_ptr + r64[:, None] * (N * d) + c[None, :]  # + stream * d + ch0
    x_new_rows = x_new_ptr + r64[:, None] * (N * d) + c[None, :]
    y_rows = y_ptr + r64[:, None] * d + c[None, :]
    collapsed_rows = collapsed_ptr + r64[:, None] * d + c[None, :]
    fn_t = c[:, None] + tl.arange(0, NMP)[None, :] * (N * d)  # [BD, NMP]: W_fn^T, + stream * d + ch0
    part = tl.zeros((BM, NMP), dtype=tl.float32)
    sq = tl.zeros((BM,), dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_range
    last = tl.minimum(first + blocks_per_range, d // BD)
    if INTERPRET:
        blk = first
        while blk < last:
            part, sq = residual_block(part, sq, x_rows, y_rows, x_new_rows, collapsed_rows, fn_hi_ptr, fn_lo_ptr,
                                      fn_t, post_ptr, comb_ptr, pre_ptr, r64, rmask, blk * BD, d,
                                      N, NMP, BM, BD, HAS_Y, X_ONCE, INTERPRET)
            blk += 1
    else:
        for blk in range(first, last):
            part, sq = residual_block(part, sq, x_rows, y_rows, x_new_rows, collapsed_rows, fn_hi_ptr, fn_lo_ptr,
                                      fn_t, post_ptr, comb_ptr, pre_ptr, r64, rmask, blk * BD, d,
                                      N, NMP, BM, BD, HAS_Y, X_ONCE, INTERPRET)
    tl.atomic_add(acc_ptr + r64[:, None] * (NMP + 1) + tl.arange(0, NMP)[None, :], part, mask=rmask[:, None])
    tl.atomic_add(acc_ptr + r64 * (NMP + 1) + NMP, sq, mask=rmask)


@triton.jit
def coefficient_kernel(acc_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M, width, norm_eps, hc_eps,
                       N: tl.constexpr, NMP: tl.constexpr, BM: tl.constexpr, ITERS: tl.constexpr):
    """mu = mixes * rsqrt(mean X'^2 + eps), then pre / post / comb as mhc.sinkhorn_split computes them."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    m2 = rmask[:, None]
    streams = tl.arange(0, N)
    row_acc = acc_ptr + r64 * (NMP + 1)
    rstd = 1.0 / tl.sqrt(tl.load(row_acc + NMP, mask=rmask, other=1.0) / width + norm_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    mu_pre = tl.load(row_acc[:, None] + streams[None, :], mask=m2, other=0.0) * rstd[:, None]
    mu_post = tl.load(row_acc[:, None] + N + streams[None, :], mask=m2, other=0.0) * rstd[:, None]
    pre = tl.sigmoid(mu_pre * s0 + tl.load(base_ptr + streams)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(mu_post * s1 + tl.load(base_ptr + N + streams)[None, :])
    jk = streams[:, None] * N + streams[None, :]  # [N(j), N(k)]
    mu_comb = tl.load(row_acc[:, None, None] + 2 * N + jk[None, :, :], mask=rmask[:, None, None], other=0.0)
    logits = mu_comb * rstd[:, None, None] * s2 + tl.load(base_ptr + 2 * N + jk)[None, :, :]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(pre_ptr + r64[:, None] * N + streams[None, :], pre, mask=m2)
    tl.store(post_ptr + r64[:, None] * N + streams[None, :], post, mask=m2)
    tl.store(comb_ptr + r64[:, None, None] * (N * N) + jk[None, :, :], comb, mask=rmask[:, None, None])


@triton.jit
def expand_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, M, d,
                  N: tl.constexpr, BD: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (token, BD channels): X'_k = post_k y + sum_j comb_jk X_j for every stream k, the sum over j in
    order, in fp32, rounded to y's dtype (reference.expand: a block's last residual update). x / out [M, N, d],
    y [M, d], post [M, N], comb [M, N, N], all contiguous."""
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = c < d
    y = tl.load(y_ptr + m * d + c, mask=cm, other=0.0).to(tl.float32)
    for k in tl.static_range(N):
        mixed = tl.load(comb_ptr + m * (N * N) + k) * tl.load(x_ptr + m * N * d + c, mask=cm, other=0.0).to(tl.float32)
        for j in tl.static_range(1, N):
            mixed += tl.load(comb_ptr + m * (N * N) + j * N + k) * \
                tl.load(x_ptr + (m * N + j) * d + c, mask=cm, other=0.0).to(tl.float32)
        out = tl.load(post_ptr + m * N + k) * y + mixed
        tl.store(out_ptr + (m * N + k) * d + c, round_cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=cm)
