"""Manifold-constrained hyper-connections (mHC), single-pass form (spec §3.2, §4.3).

The residual is carried as n = hc_mult parallel streams X in R^{n x d}. Each sub-layer predicts
24 = (n+2)n coefficients from its own input, mu = (W_fn flatten(X)) * rsqrt(mean(X^2) + eps):

    pre_j   = sigmoid(mu_j s0 + b_j) + eps_hc                  (input collapse weights, 1 x n)
    post_k  = 2 sigmoid(mu_{n+k} s1 + b_{n+k})                 (output expansion, n x 1)
    comb    = Sinkhorn(softmax_k(mu_{2n+nj+k} s2 + b) + eps)   (residual mixing, n x n, doubly stochastic)

and updates X' = post (x) y + comb^T X. Single-pass mHC shifts the collapse by one sub-layer: the
input of a sub-layer is sum_j pre_j X_j with the *previous* sub-layer's `pre`, so the collapse no
longer waits for this sub-layer's own reduction over X (that is what lets the deployment kernel
read X once). Block wiring lives in block.py; this module names the arithmetic:

    sinkhorn_split(mixes, ...)            mu -> pre, post, comb (the Sinkhorn iterations in REF's order)
    hc_coefficients(X, W_fn, ...)         X -> mu -> pre, post, comb
    collapse(X, pre)                      sum_j pre_j X_j
    expand(y, X, post, comb)              post (x) y + comb^T X

which is written once, in model/kernels/reference.py, where the single-pass mHC kernel takes it as its
reference (the model calls the kernels, never the reverse).
"""

from __future__ import annotations

import torch

from dsv41.model.kernels.reference import collapse, expand, hc_coefficients, sinkhorn_split

__all__ = ["collapse", "expand", "hc_coefficients", "identity_pre", "sinkhorn_split"]


def identity_pre(x: torch.Tensor) -> torch.Tensor:
    """The collapse weights before the first block: stream 0 only (all streams start equal)."""
    pre = x.new_zeros(*x.shape[:-1], dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
