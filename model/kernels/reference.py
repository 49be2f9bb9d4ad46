"""Plain-PyTorch references of the kernels, with the kernels' signatures.

Each is written with the model's own functions, so a kernel that matches its reference computes what the
model computes: `sparse_attention_packed` unpacks with model/formats.py and calls
model.attention.sparse_attention; `indexer_scores` is Indexer.head_scores on unpacked keys plus the
visibility mask of Indexer.forward; `mhc_step` is mhc.expand, mhc.collapse and mhc.hc_coefficients in the
order model/transformer.py's Block.mix calls them; the packers are model/formats.py's.
"""

from __future__ import annotations

import torch

from model import formats, mhc
from model.attention import sparse_attention


# --------------------------------------------------------------------------------- sparse attention
def sparse_attention_packed(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                            main_codes: torch.Tensor | None, main_scales: torch.Tensor | None,
                            sink: torch.Tensor, window_idx: torch.Tensor, main_idx: torch.Tensor | None,
                            scale: float) -> torch.Tensor:
    """Sparse MQA with a sink over packed KV.

    q [B,T,H,D]; window rows packed FP8 E4M3 + UE8M0 per 32 (codes [B,W,D] uint8, scales [B,W,D/32] uint8);
    main rows packed E2M1 + E4M3 per 16 (codes [B,N,D/2] uint8, scales [B,N,D/16] uint8), or None (a
    window-only layer); window_idx [B,T,Kw] into the window rows, main_idx [B,T,Km] into the main rows,
    -1 = empty. Returns [B,T,H,D] in q's dtype: sparse_attention over [window ; main] with the indices
    concatenated, the main ones shifted by W."""
    window = formats.unpack_fp8_ue8m0(window_codes, window_scales, formats.FP8_BLOCK, torch.float32)
    kv, idx = window, window_idx
    if main_codes is not None and main_idx is not None:
        main = formats.unpack_fp4_e4m3(main_codes, main_scales, formats.FP4_E4M3_BLOCK, torch.float32)
        kv = torch.cat([window, main], dim=1)
        idx = torch.cat([window_idx, torch.where(main_idx >= 0, main_idx + window.size(1), -1)], dim=-1)
    return sparse_attention(q, kv, sink, idx.long(), scale)


# --------------------------------------------------------------------------------- indexer
def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                   visible: torch.Tensor | None = None, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """score_{t,g} = sum_h w_{t,h} ReLU(q_{t,h} . k_g) over packed MXFP4 keys, fp32.

    q [B,T,H,Dk] (MXFP4-valued floats), weights [B,T,H] (already scaled by (Dk H)^-1/2), keys packed MXFP4
    (codes [B,N,Dk/2], scales [B,N,Dk/32] uint8). visible [T]: entries g >= visible[t] score -inf (None:
    all visible). candidates [B,T,C] (-1 = none): score only those entries, returning [B,T,C] (-inf at -1);
    otherwise [B,T,N]."""
    keys = formats.unpack_mxfp4(key_codes, key_scales, formats.MXFP4_BLOCK, torch.float32)
    n = keys.size(1)
    if candidates is None:
        scores = torch.einsum("bthd,bnd->bthn", q.float(), keys).relu_()
        scores = (scores * weights.float().unsqueeze(-1)).sum(dim=2)
        if visible is not None:
            scores = scores.masked_fill(torch.arange(n, device=q.device) >= visible.view(-1, 1), -torch.inf)
        return scores
    batch = torch.arange(keys.size(0), device=q.device).view(-1, 1, 1)
    gathered = keys[batch, candidates.clamp_min(0).long()]  # [B,T,C,Dk]
    scores = torch.einsum("bthd,btcd->bthc", q.float(), gathered).relu_()
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=2)
    hidden = candidates < 0
    if visible is not None:
        hidden = hidden | (candidates >= visible.view(1, -1, 1))
    return scores.masked_fill(hidden, -torch.inf)


# --------------------------------------------------------------------------------- single-pass mHC
def mhc_step(x: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             iters: int, hc_eps: float, norm_eps: float, y: torch.Tensor | None = None,
             post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
    """One single-pass mHC step around a sub-layer boundary.

    With y (the previous sub-layer's output [B,T,d]) and its post [B,T,n] / comb [B,T,n,n]: the residual
    update X' = post (x) y + comb^T X; without y, X' = X. Then, from X' alone: the next sub-layer's input
    collapse(X', pre_prev) [B,T,d] and its coefficients (pre, post, comb) = hc_coefficients(X', fn, ...).
    Returns (X' [B,T,n,d], collapsed, pre, post, comb), as Block.mix computes them."""
    x_new = x if y is None else mhc.expand(y, x, post, comb)
    collapsed = mhc.collapse(x_new, pre_prev)
    pre_n, post_n, comb_n = mhc.hc_coefficients(x_new, fn, scale, base, iters, hc_eps, norm_eps)
    return x_new, collapsed, pre_n, post_n, comb_n


# --------------------------------------------------------------------------------- KV packing
def pack_fp4_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed E2M1 [..., D/2] uint8, E4M3 scale bytes [..., D/16] uint8): the main KV format."""
    return formats.pack_fp4_e4m3(x, formats.FP4_E4M3_BLOCK)


def pack_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bytes [..., D] uint8, UE8M0 bytes [..., D/32] uint8): the window KV format."""
    return formats.pack_fp8_ue8m0(x, formats.FP8_BLOCK)
