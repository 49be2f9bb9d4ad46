"""Triton kernels of model/kernels/norm.py and model/kernels/routing.py (imported only when they run): a row
each, the whole row in registers."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import round_cast


@triton.jit
def store_as(ptr, y, mask, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Store fp32 y at ptr as bf16 (nearest even, also under the interpreter) or as fp32."""
    if OUT_BF16:
        tl.store(ptr, round_cast(y, tl.bfloat16, INTERPRET), mask=mask)
    else:
        tl.store(ptr, y, mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, D, stride_x, eps,
                    BD: tl.constexpr, BM: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows [BM, D]: y = w * (x * rsqrt(sum(x^2) / D + eps)), fp32 inside (reference.rms_norm's formula);
    y is contiguous [M, D]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = w[None, :] * (x * r[:, None])
    store_as(y_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], y, mask, OUT_BF16, INTERPRET)


@triton.jit
def log1p_exp(x):
    """log(1 + e^x) to a few ulp for x <= 20 (log(u) * e / (u - 1), u = 1 + e: the rounding of u cancels)."""
    e = tl.exp(x)
    u = 1.0 + e
    exact = u == 1.0  # e below half an ulp of 1: log1p(e) is e
    return tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def route_kernel(s_ptr, b_ptr, w_ptr, i_ptr, E, stride_s, stride_b, gate_temp, route_scale,
                 K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, TEMP: tl.constexpr, NORM: tl.constexpr):
    """One token: s = sqrt(softplus(scores / temp)) (torch's softplus: x itself above 20), the k largest of
    s + bias in descending order (the lowest index first among equals), their weights s_I / (sum + 1e-20) *
    route_scale (reference.route with score_func "sqrtsoftplus")."""
    n = tl.program_id(0)
    e = tl.arange(0, BE)
    m = e < E
    x = tl.load(s_ptr + n.to(tl.int64) * stride_s + e, mask=m, other=0.0)
    if TEMP:
        x = x / gate_temp
    s = tl.sqrt(tl.where(x > 20.0, x, log1p_exp(tl.minimum(x, 20.0))))
    sel = tl.where(m, s + tl.load(b_ptr + n.to(tl.int64) * stride_b + e, mask=m, other=0.0), float("-inf"))
    slot = tl.arange(0, KP)
    weights = tl.zeros((KP,), dtype=tl.float32)
    picks = tl.zeros((KP,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(sel, axis=0)
        pick = tl.min(tl.where(sel == best, e, BE), axis=0)
        weights = tl.where(slot == j, tl.sum(tl.where(e == pick, s, 0.0), axis=0), weights)
        picks = tl.where(slot == j, pick.to(tl.int64), picks)
        sel = tl.where(e == pick, float("-inf"), sel)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(w_ptr + n.to(tl.int64) * K + slot, weights * route_scale, mask=slot < K)
    tl.store(i_ptr + n.to(tl.int64) * K + slot, picks, mask=slot < K)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, h_ptr, M, N, stride_g, stride_u, limit, BM: tl.constexpr, BN: tl.constexpr,
                  HAS_LIMIT: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """h = silu(min(g, L)) * clamp(u, -L, L) in fp32 over a [BM, BN] tile (reference.swiglu), h contiguous."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    store_as(h_ptr + r64 * N + cols[None, :], h, mask, OUT_BF16, INTERPRET)


@triton.jit
def rope_tail_kernel(x_ptr, f_ptr, out_ptr, T, H, D, first, PER_ROW: tl.constexpr, BH: tl.constexpr,
                     BD: tl.constexpr, INVERSE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (token row b*T + t, block of BH heads): channels < first copied, channel pairs from `first` on
    rotated by the token's (cos, sin) = f[t] (f[b, t] when PER_ROW), conjugated when INVERSE; fp32 inside."""
    r = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    cols = tl.arange(0, BD)
    mask = (heads[:, None] < H) & (cols[None, :] < D)
    base = (r.to(tl.int64) * H + heads[:, None]) * D
    x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0)
    rot = (cols >= first) & (cols < D)
    odd = ((cols - first) & 1) == 1
    partner = tl.where(odd, cols - 1, cols + 1)
    y = tl.load(x_ptr + base + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    frow = r if PER_ROW else r % T
    pair = tl.where(rot, (cols - first) // 2, 0)
    c = tl.load(f_ptr + frow.to(tl.int64) * (D - first) + 2 * pair, mask=rot, other=1.0)
    s = tl.load(f_ptr + frow.to(tl.int64) * (D - first) + 2 * pair + 1, mask=rot, other=0.0)
    if INVERSE:
        s = -s
    xf = x.to(tl.float32)
    # (a + ib)(c + is): the real part a c - b s at the even channel, the imaginary a s + b c at the odd one
    rotated = tl.where(odd[None, :], y * s[None, :] + xf * c[None, :], xf * c[None, :] - y * s[None, :])
    if OUT_BF16:
        out = tl.where(rot[None, :], round_cast(rotated, tl.bfloat16, INTERPRET), x)
    else:
        out = tl.where(rot[None, :], rotated, x)
    tl.store(out_ptr + base + cols[None, :], out, mask=mask)
