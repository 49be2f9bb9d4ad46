"""Manifold-constrained hyper-connections (mHC), single-pass form (spec §3.2, §4.3).

The residual is carried as n = hc_mult parallel streams X in R^{n x d}. Each sub-layer predicts
24 = (n+2)n coefficients from its own input, mu = (W_fn flatten(X)) * rsqrt(mean(X^2) + eps):

    pre_j   = sigmoid(mu_j s0 + b_j) + eps_hc                  (input collapse weights, 1 x n)
    post_k  = 2 sigmoid(mu_{n+k} s1 + b_{n+k})                 (output expansion, n x 1)
    comb    = Sinkhorn(softmax_k(mu_{2n+nj+k} s2 + b) + eps)   (residual mixing, n x n, doubly stochastic)

and updates X' = post (x) y + comb^T X. Single-pass mHC shifts the collapse by one sub-layer: the
input of a sub-layer is sum_j pre_j X_j with the *previous* sub-layer's `pre`, so the collapse no
longer waits for this sub-layer's own reduction over X (that is what lets the deployment kernel
read X once). Block wiring lives in transformer.py; this module is the arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int = 20,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (n+2)n] -> pre [..., n], post [..., n], comb [..., n, n], all fp32.

    comb starts as a row softmax plus eps, is column-normalized once, then alternates row and column
    normalization iters-1 more times, each divisor padded by eps: the order REF's kernel uses."""
    m, scale, base = mixes.float(), scale.float(), base.float()
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))  # the softmax written out, as REF's kernel
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_coefficients(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                    hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, n, d] -> (pre, post, comb). The RMS statistic is over the flattened n*d stream, one per
    token, and is folded in after the projection (mu = (W x) * rsqrt(mean x^2 + eps))."""
    n = x.size(-2)
    flat = x.flatten(-2).float()
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat, fn.float()) * rstd
    return sinkhorn_split(mixes, scale, base, n, iters, hc_eps)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Input mixing: sum_j pre_j X_j. [B,T,n,d] x [B,T,n] -> [B,T,d] in x's dtype.

    The sum runs in fp32 in the fixed order j = 0, 1, ..., n-1 (not through a reduction kernel whose
    order may depend on the CPU's vector width); this is the order ATen's sum used on the golden's CPU,
    so the result is bit for bit the one `tests/test_fidelity.py` pins (docs/fidelity.md §7)."""
    xf = x.float()
    out = pre[..., 0, None] * xf[..., 0, :]
    for j in range(1, x.size(-2)):
        out = out + pre[..., j, None] * xf[..., j, :]
    return out.to(x.dtype)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Residual update: X'_k = post_k y + sum_j comb_{jk} X_j (the residual is indexed by comb's first index).
    The sum over j runs in fp32 in the fixed order j = 0..n-1, as in `collapse`."""
    r = residual.float()
    mixed = comb[..., 0, :, None] * r[..., 0, None, :]
    for j in range(1, r.size(-2)):
        mixed = mixed + comb[..., j, :, None] * r[..., j, None, :]
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(y.dtype)


def identity_pre(x: torch.Tensor) -> torch.Tensor:
    """The collapse weights before the first block: stream 0 only (all streams start equal)."""
    pre = x.new_zeros(*x.shape[:-1], dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
