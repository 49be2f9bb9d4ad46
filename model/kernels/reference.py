"""Plain-PyTorch references of the kernels, with the kernels' signatures.

Each is written with the model's own functions, so a kernel that matches its reference computes what the
model computes: `sparse_attention_packed` unpacks with model/formats.py and calls
model.attention.sparse_attention; `indexer_scores` is Indexer.head_scores on unpacked keys plus the
visibility mask of Indexer.forward; `mhc_step` is mhc.expand, mhc.collapse and mhc.hc_coefficients in the
order model/transformer.py's Block.mix calls them; the packers are model/formats.py's; the GEMMs are
model/layers.py's Linear in the "fast" gemm mode, and `routed_experts` is model/moe.py's MoE.routed over
Expert.forward in that mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv41.model import formats, mhc


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
    from dsv41.model.attention import sparse_attention  # here: attention.py imports the kernels (and so this module)

    return sparse_attention(q, kv, sink, idx.long(), scale)


# --------------------------------------------------------------------------------- indexer
def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                   visible: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                   bf16_scores: bool = False) -> torch.Tensor:
    """score_{t,g} = sum_h w_{t,h} ReLU(q_{t,h} . k_g) over packed MXFP4 keys, fp32.

    q [B,T,H,Dk] (MXFP4-valued floats), weights [B,T,H] (already scaled by (Dk H)^-1/2), keys packed MXFP4
    (codes [B,N,Dk/2], scales [B,N,Dk/32] uint8). visible [T]: entries g >= visible[t] score -inf (None:
    all visible). candidates [B,T,C] (-1 = none): score only those entries, returning [B,T,C] (-inf at -1);
    otherwise [B,T,N]. bf16_scores: the products, the weighted terms and the head sum rounded to bf16 (REF's
    score precision, Indexer.head_scores with index_score_dtype "bf16"; weights then hold bf16 values)."""
    from dsv41.model.indexer import weighted_relu_scores  # here: model/indexer.py imports the kernels (and this module)

    keys = formats.unpack_mxfp4(key_codes, key_scales, formats.MXFP4_BLOCK, torch.float32)
    n = keys.size(1)
    if candidates is None:
        scores = weighted_relu_scores(q, keys, weights, bf16_scores)
        if visible is not None:
            scores = scores.masked_fill(torch.arange(n, device=q.device) >= visible.view(-1, 1), -torch.inf)
        return scores
    batch = torch.arange(keys.size(0), device=q.device).view(-1, 1, 1)
    gathered = keys[batch, candidates.clamp_min(0).long()]  # [B,T,C,Dk]
    scores = weighted_relu_scores(q, gathered, weights, bf16_scores)
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


# --------------------------------------------------------------------------------- quantized GEMMs
def fp8_act_quant(x: torch.Tensor, block: int = formats.FP8_BLOCK) -> torch.Tensor:
    """The activation entering a quantized GEMM: E4M3 with one UE8M0 scale per `block` along the last dim,
    dequantized straight back (formats.fp8_fake_quant), in x's dtype."""
    return formats.fp8_fake_quant(x, block)


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block: int = formats.FP8_BLOCK) -> torch.Tensor:
    """y = fp8_fake_quant(x) @ W^T for an FP8 E4M3 weight [N, K] with one UE8M0 scale per block x block tile
    ([ceil(N/block), ceil(K/block)]): both operands dequantized exactly, one fp32 matmul, rounded to x's
    dtype. This is Linear.forward for FP8 weights in the "fast" gemm mode (model/layers.py)."""
    xq = formats.fp8_fake_quant(x, block).float()
    return F.linear(xq, formats.dequant_fp8_weight(weight, scale, block)).to(x.dtype)


def fp4_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             act_block: int = formats.FP8_BLOCK) -> torch.Tensor:
    """y = fp8_fake_quant(x, act_block) @ W^T for a packed FP4 weight [N, K/2] (E2M1 pairs, element 2i in the
    low nibble) with one UE8M0 per row and 32 columns ([N, K/32]): Linear.forward for FP4 weights in the
    "fast" gemm mode."""
    xq = formats.fp8_fake_quant(x, act_block).float()
    return F.linear(xq, formats.dequant_fp4_weight(weight, scale, formats.FP4_WEIGHT_BLOCK)).to(x.dtype)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts,
                   swiglu_limit: float) -> torch.Tensor:
    """sum over each token's selected experts of the routing weight times the SwiGLU expert, fp32 [T, dim].

    x [T, dim]; weights / indices [T, k] (fp32 / expert ids); experts: a model.kernels.experts.ExpertWeights
    (per-expert stored weights, None for experts held by another rank, which contribute nothing). Each
    expert runs once on its tokens and the results are added in ascending expert order: MoE.routed with
    Expert.forward, in the "fast" gemm mode."""
    gemm = fp4_gemm if experts.fmt == "fp4" else fp8_block_gemm
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(indices).tolist():
        if experts.w1[e] is None:
            continue
        rows, slot = torch.where(indices == e)
        xe = x[rows]
        gate = gemm(xe, experts.w1[e], experts.s1[e], experts.block).float()
        up = gemm(xe, experts.w3[e], experts.s3[e], experts.block).float()
        if swiglu_limit > 0:
            up = up.clamp(-swiglu_limit, swiglu_limit)
            gate = gate.clamp(max=swiglu_limit)
        h = weights[rows, slot, None] * (F.silu(gate) * up)
        y[rows] += gemm(h.to(x.dtype), experts.w2[e], experts.s2[e], experts.block).float()
    return y
