"""Triton kernels of model/kernels/mhc.py (imported only when they run)."""

from __future__ import annotations

import triton
import triton.language as tl

from model.kernels._triton_formats import as_mma


@triton.jit
def residual_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fn_hi_ptr, fn_lo_ptr,
                    x_new_ptr, collapsed_ptr, acc_ptr, M, d,
                    N: tl.constexpr, NMP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                    HAS_Y: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (block of BM tokens, block of BD residual channels), every stream:

        X'_k = post_k y + sum_j comb_jk X_j       (HAS_Y; else X' = X), rounded to the residual dtype
        collapsed = sum_j pre_j X'_j               (the next sub-layer's input)
        acc[:, :NMP] += X' . W_fn^T over these channels, acc[:, NMP] += sum X'^2   (split-K partials)

    The projection runs on the matrix units as X' (exact in bf16) times W_fn = hi + lo (two bf16 parts),
    which keeps fp32 accuracy. x [M, N, d], y / collapsed [M, d], post / pre [M, N], comb [M, N, N]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ch = tl.program_id(1) * BD + tl.arange(0, BD)
    streams = tl.arange(0, N)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    m2 = rmask[:, None]
    m3 = rmask[:, None, None]
    x_offs = r64[:, None, None] * (N * d) + streams[None, :, None] * d + ch[None, None, :]  # [BM, N, BD]
    if HAS_Y:
        post = tl.load(post_ptr + r64[:, None] * N + streams[None, :], mask=m2, other=0.0)
        y = tl.load(y_ptr + r64[:, None] * d + ch[None, :], mask=m2, other=0.0).to(tl.float32)
        acc = post[:, :, None] * y[:, None, :]
        for j in tl.static_range(N):
            xj = tl.load(x_ptr + r64[:, None] * (N * d) + j * d + ch[None, :], mask=m2, other=0.0).to(tl.float32)
            cj = tl.load(comb_ptr + r64[:, None] * (N * N) + j * N + streams[None, :], mask=m2, other=0.0)
            acc += cj[:, :, None] * xj[:, None, :]
        x_new = acc.to(x_new_ptr.dtype.element_ty)
        tl.store(x_new_ptr + x_offs, x_new, mask=m3)
        xr = x_new.to(tl.float32)
    else:
        xr = tl.load(x_ptr + x_offs, mask=m3, other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + r64[:, None] * N + streams[None, :], mask=m2, other=0.0)
    collapsed = tl.sum(pre[:, :, None] * xr, axis=1)
    tl.store(collapsed_ptr + r64[:, None] * d + ch[None, :], collapsed.to(collapsed_ptr.dtype.element_ty), mask=m2)

    flat = tl.reshape(xr, (BM, N * BD))  # column k*BD + c <-> W_fn column k*d + ch0 + c
    kc = tl.arange(0, N * BD)
    fn_cols = (kc // BD) * d + tl.program_id(1) * BD + (kc % BD)
    mix_rows = tl.arange(0, NMP)
    fn_offs = mix_rows[:, None].to(tl.int64) * (N * d) + fn_cols[None, :]
    xm = as_mma(flat, INTERPRET)
    part = tl.dot(xm, tl.trans(as_mma(tl.load(fn_hi_ptr + fn_offs).to(tl.float32), INTERPRET)))
    part += tl.dot(xm, tl.trans(as_mma(tl.load(fn_lo_ptr + fn_offs).to(tl.float32), INTERPRET)))
    tl.atomic_add(acc_ptr + r64[:, None] * (NMP + 1) + mix_rows[None, :], part, mask=m2)
    tl.atomic_add(acc_ptr + r64 * (NMP + 1) + NMP, tl.sum(tl.sum(xr * xr, axis=2), axis=1), mask=rmask)


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
