"""Plain-PyTorch references of the kernels, with the kernels' signatures: the arithmetic the kernels fall
back to and the model computes with.

The model's own arithmetic for these steps lives here, and the model imports it (the model calls the
kernels, never the reverse): `sparse_attention` is model/attention.py's sparse softmax with a sink (REF's
kernel step for step), `weighted_relu_scores` the indexer's score (model/indexer.py), `sinkhorn_split`,
`hc_coefficients`, `collapse` and `expand` the mHC arithmetic (model/mhc.py). The kernels' references are
written with them, so a kernel that matches its reference computes what the model computes:
`sparse_attention_packed` unpacks with model/formats.py and calls `sparse_attention`; `indexer_scores` is
Indexer.head_scores on unpacked keys plus the visibility mask of Indexer.forward; `mhc_step` is expand,
collapse and hc_coefficients in the order model/block.py's Block.mix calls them; the packers are
model/formats.py's; the GEMMs are model/layers.py's Linear in the "fast" gemm mode, and `routed_experts`
is model/moe.py's MoE.routed over Expert.forward in that mode.

This module imports nothing of the model but model/formats.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import torch
import torch.nn.functional as F

from dsv41.model import formats


# ------------------------------------------------------------------- row-invariant elementwise functions
# ATen's CPU elementwise loops run their vector code over whole chunks of 2 x (floats per vector) contiguous
# elements and a scalar loop over the rest, and for sigmoid and softplus the two round differently (SLEEF's vector
# exp against the C library's; torch.exp is MKL's vector function on every element, silu's rows of 128 fill
# whole chunks). A decode step's small per-row tensors (an mHC token's 4 pre and 4 post coefficients, a token's 8
# router scores, an Engram token's 4 gates) fall in the scalar tail when the step has one row and in the vector
# chunks when it has eight or more: measured on 4,000 rows of 4, 15% (sigmoid) and 38% (softplus) of the rows came
# out different alone and together (benchmarks/results/cpu-batch-invariance/position_dependence.py), and one
# request of 32 changed a token on the bundled model. Inside `row_invariant()` (the engine's decode step,
# Transformer.decode_rows) `per_row` hands ATen a strided view, which it never vectorizes, so every element takes
# the scalar formula, as a one-row step's did before; elsewhere (the prefill, and the one-sequence forward that
# reproduces the official code) the functions see their tensors as is.
_ROW_INVARIANT = contextvars.ContextVar("dsv41_row_invariant", default=False)
VECTOR_CHUNK = 32  # floats: ATen's loop step on AVX-512 (2 x 16), a multiple of AVX2's (2 x 8)


@contextlib.contextmanager
def row_invariant():
    """Within it, `per_row` computes every element by ATen's scalar formula, whatever the tensor's size."""
    token = _ROW_INVARIANT.set(True)
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


# A forward over several sequences of one length that must give each the bits of its forward alone (the
# scheduler's batched prefill, model/engine.py): `per_row` then computes fn over each sequence's part apart, so
# that every element sits where it sits in that sequence's own tensor (its place decides vector or scalar code).
_SEQUENCES = contextvars.ContextVar("dsv41_sequences", default=1)


@contextlib.contextmanager
def sequences_apart(n: int):
    """Within it, `per_row` computes fn over each of the n equal leading parts of its tensor (sequence-major) on
    its own."""
    token = _SEQUENCES.set(n)
    try:
        yield
    finally:
        _SEQUENCES.reset(token)


def scalar_loop_applies(n: int) -> bool:
    """Whether `per_row` computes rows of n elements by ATen's scalar formula here (inside `row_invariant()`, n not
    whole vector chunks)."""
    return _ROW_INVARIANT.get() and n % VECTOR_CHUNK != 0


def per_row(fn, t: torch.Tensor, scalar=None) -> torch.Tensor:
    """fn(t) for an elementwise fn (sigmoid, softplus); inside `row_invariant()` each element computed by ATen's
    scalar loop (t read through a view with a stride of 2 elements), so its bits do not depend on its place.
    Rows of whole vector chunks (a last dim that is a multiple of VECTOR_CHUNK: V4.1's 256 router scores) take
    the vector code in any batch and are left to it. Inside `sequences_apart(n)`, fn of each sequence's part.
    scalar(t): that scalar loop's values in one call, or None where it does not take t (host.scalar_sigmoid and
    scalar_softplus, passed by the CPU dispatch); used only where the scalar loop is what runs."""
    if scalar_loop_applies(t.shape[-1]):
        out = scalar(t) if scalar is not None else None
        return out if out is not None else fn(torch.stack((t, t), dim=-1)[..., 0])
    n = _SEQUENCES.get()
    if n > 1:
        return torch.cat([fn(part) for part in t.contiguous().view(n, -1)]).view(t.shape)
    return fn(t)


# ------------------------------------------------------------------- RMSNorm, router, shared SwiGLU
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * x / sqrt(mean(x^2) + eps) in fp32, cast back to x's dtype (model/layers.py RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    # the weight joins as it is stored: the multiply promotes it to fp32 exactly (one call fewer than
    # weight.float() * xf, the same products)
    return torch.mul(weight, xf).to(x.dtype)


def route(scores: torch.Tensor, bias: torch.Tensor, topk: int, score_func: str = "sqrtsoftplus",
          gate_temp: float = 1.0, norm_topk_prob: bool = True, route_scale: float = 1.0, scalar_softplus=None):
    """The MoE router after its GEMM (model/moe.py Gate): fp32 scores [N, E] (x W_g^T), the selection bias [E] or
    [N, E] -> (weights [N, k] fp32, indices [N, k] int64, descending by biased score). scalar_softplus: per_row's
    `scalar` for the softplus."""
    if gate_temp != 1.0:  # (x / 1.0 is x, bit for bit)
        scores = scores / gate_temp
    if score_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif score_func == "sigmoid":
        scores = per_row(torch.sigmoid, scores)
    else:
        scores = per_row(F.softplus, scores, scalar_softplus).sqrt()
    indices = (scores + bias).topk(topk, dim=-1).indices
    weights = scores.gather(-1, indices)
    if norm_topk_prob and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, indices


def gate_route(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, topk: int, gate_temp: float = 1.0,
               norm_topk_prob: bool = True, route_scale: float = 1.0):
    """The router with its GEMM, as the CPU decode step computes it (model/moe.py Gate): x [N, d] times w [E, d]
    in the fixed order (fixed_order_matmul), then `route` with sqrt-softplus scores -> (weights [N, k] fp32,
    indices [N, k]). host.gate_route is this in two C calls around torch's sqrt."""
    scores = fixed_order_matmul(x.float(), w.float().t().contiguous())
    return route(scores, bias, topk, "sqrtsoftplus", gate_temp, norm_topk_prob, route_scale)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L) in fp32 (no clamp for L <= 0), cast to dtype: an Expert's hidden
    layer without routing weight (model/moe.py Expert._hidden: the shared expert)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return (F.silu(gate) * up).to(dtype)


# ---------------------------------------------------------------------------------------------- RoPE
def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of x's last dim by freqs (interleaved / GPT-J layout).

    x: [B, T, r] or [B, T, H, r]; freqs: [T, r/2] complex, or [B, T, r/2] when the rows of the batch sit
    at different positions. Returns a new tensor in x's dtype; `inverse` applies the conjugate rotation
    (used to un-rotate the attention output)."""
    # the shapes are read once from x and freqs (each size or dim query is an operator call); the complex
    # product sees the same operands as ever (its vectorized and scalar paths round differently)
    shape = x.shape
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    f = freqs.conj() if inverse else freqs
    fshape = f.shape
    lead = fshape[0] if len(fshape) == 3 else 1
    f = f.view(lead, shape[1], *([1] * (len(shape) - 3)), shape[-1] // 2)
    return torch.view_as_real(xc * f).flatten(-2).to(x.dtype)


def rope_tail(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """RoPE on the LAST rope_dim channels of x only (model/layers.py rope_tail); the leading channels carry no
    position and are returned as they are."""
    head, tail = x.tensor_split([-rope_dim], dim=-1)  # x[..., :-rope_dim], x[..., -rope_dim:] in one call
    return torch.cat([head, apply_rope(tail, freqs, inverse)], dim=-1)


# --------------------------------------------------------------------------------- sparse attention
SPARSE_BLOCK = 64  # indices per block of REF's sparse-attention kernel


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Sparse MQA with a sink over unpacked rows: model/attention.py's sparse_attention off the kernel.
    q [B,T,H,D], kv [B,N,D] (K = V), sink [H] (fp32 logit that joins the denominator only), idx [B,T,K]
    with -1 = empty. A row with no valid index gives 0.

        o = sum_j e^{l_j - M} kv_j / (sum_j e^{l_j - M} + e^{sink - M}),   l_j = scale q.kv_{idx_j}

    (An empty row: the denominator is e^{sink + 1e30}, i.e. 0/0 avoided as in REF: acc stays 0.)
    """
    # REF's kernel, step for step: an online softmax over blocks of 64 indices whose running max starts
    # at -1e30 and covers the logits only; probabilities are rounded to bf16 before P.V (relative to the
    # running max), the sink joins the denominator at the end. Reproducing the rounding matters: one
    # bf16 ulp here moves the FP8 activation grid of wo_b and grows from layer to layer.
    # The two products are the batched GEMMs einsum("bthd,btkd->bthk") and einsum("bthk,btkd->bthd") make, called
    # directly on the operands einsum lays out (the same bits, tested), and the rows are gathered as embedding rows
    # of the flattened kv (the same values): the decode step runs this in every layer, where each einsum's
    # parsing and each advanced-indexing gather cost more than their arithmetic.
    B, T, H, D = q.shape
    qf, kvf = q.float(), kv.float()
    N = kvf.size(1)
    rows_kv = kvf.reshape(B * N, D)
    offsets = torch.arange(0, B * N, N, device=kv.device).view(-1, 1, 1) if B > 1 else None
    q_rows = qf.reshape(B * T, H, D)
    acc = q.new_zeros(B, T, H, D, dtype=torch.float32)
    denom = q.new_zeros(B, T, H, dtype=torch.float32)
    run_max = torch.full((B, T, H), -1e30, dtype=torch.float32, device=q.device)
    for start in range(0, idx.size(-1), SPARSE_BLOCK):
        block = idx[..., start:start + SPARSE_BLOCK].long()
        valid = block >= 0
        k = block.size(-1)
        rows = block.clamp_min(0) if offsets is None else block.clamp_min(0) + offsets
        keys = F.embedding(rows, rows_kv) * valid.unsqueeze(-1)  # [B,T,k,D]
        keys_bt = keys.view(B * T, k, D)
        logits = torch.bmm(q_rows, keys_bt.transpose(1, 2)).view(B, T, H, k)
        logits = torch.where(valid.unsqueeze(2), logits, -torch.inf) * scale
        new_max = torch.maximum(run_max, logits.amax(dim=-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(logits - new_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)
        pv = torch.bmm(p.to(torch.bfloat16).float().view(B * T, H, k), keys_bt).view(B, T, H, D)
        acc = acc * rescale.unsqueeze(-1) + pv
        run_max = new_max
    denom = denom + torch.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(q.dtype)


SINK_EXP_MAX = 88.0  # host_kernels.c's ATTN_SINK_MAX: e^88 is still finite in fp32


def sparse_attention_fixed_order(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """sparse_attention (the same operands, REF's online softmax over blocks of SPARSE_BLOCK indices, its bf16
    probabilities before P.V, the sink at the end) with every sum in one fixed order and one exp: each dot product
    q.kv over d = 0, 1, ..., D-1, each block's sum of probabilities and each P.V output over the block's indices in
    order, every sum from 0.0; exp by exp_poly (the sink's term at most e^SINK_EXP_MAX, which only an empty row
    reaches: its output is 0 either way). Invalid indices (-1) give a zero row and a -inf logit.

    This is the CPU's fast path (host.sparse_attention_packed, one C call per layer; "exact" GEMM mode keeps
    `sparse_attention`, whose MKL batched GEMMs and vectorized exp round in an order that depends on the CPU):
    a token's output depends only on its own operands, on any x86-64 CPU. The same products; fp32 sums in
    another order, and another exp within a few ulps. Written as loops of torch operators (D + 2k per block), the
    test oracle of the C function, not a fast path itself."""
    B, T, H, D = q.shape
    qf, kvf = q.float(), kv.float()
    batch = torch.arange(B, device=q.device).view(B, 1, 1)
    acc = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device)
    denom = torch.zeros(B, T, H, dtype=torch.float32, device=q.device)
    run_max = torch.full((B, T, H), -1e30, dtype=torch.float32, device=q.device)
    for start in range(0, idx.size(-1), SPARSE_BLOCK):
        block = idx[..., start:start + SPARSE_BLOCK].long()
        valid = block >= 0
        rows = torch.where(valid.unsqueeze(-1), kvf[batch, block.clamp_min(0)], 0.0)  # [B, T, k, D]
        logit = torch.zeros(B, T, H, block.size(-1), dtype=torch.float32, device=q.device)
        for d in range(D):
            logit = logit + qf[..., d:d + 1] * rows[..., d].unsqueeze(2)
        logit = torch.where(valid.unsqueeze(2), logit * scale, -torch.inf)
        new_max = torch.maximum(run_max, logit.amax(dim=-1))
        rescale = exp_poly(run_max - new_max)
        p = exp_poly(logit - new_max.unsqueeze(-1))
        psum = torch.zeros_like(denom)
        pv = torch.zeros_like(acc)
        pb = p.to(torch.bfloat16).float()
        for j in range(block.size(-1)):
            psum = psum + p[..., j]
            pv = pv + pb[..., j:j + 1] * rows[:, :, j].unsqueeze(2)
        denom = denom * rescale + psum
        acc = acc * rescale.unsqueeze(-1) + pv
        run_max = new_max
    total = denom + exp_poly((sink.float() - run_max).clamp(max=SINK_EXP_MAX))
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def sparse_attention_packed(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                            main_codes: torch.Tensor | None, main_scales: torch.Tensor | None,
                            sink: torch.Tensor, window_idx: torch.Tensor, main_idx: torch.Tensor | None,
                            scale: float, window_values: torch.Tensor | None = None,
                            unpack=None, attend=None) -> torch.Tensor:
    """Sparse MQA with a sink over packed KV.

    q [B,T,H,D]; window rows packed FP8 E4M3 + UE8M0 per 32 (codes [B,W,D] uint8, scales [B,W,D/32] uint8);
    main rows packed E2M1 + E4M3 per 16 (codes [B,N,D/2] uint8, scales [B,N,D/16] uint8), or None (a
    window-only layer); window_idx [B,T,Kw] into the window rows, main_idx [B,T,Km] into the main rows,
    -1 = empty. Returns [B,T,H,D] in q's dtype: sparse_attention over [window ; main] with the indices
    concatenated, the main ones shifted by W. window_values: the window rows already decoded to fp32 (a
    BatchCache keeps them as it writes them), used instead of decoding window_codes and window_scales.
    unpack(fmt, codes, scales, block): the bytes' fp32 values (default formats' unpackers; the CPU dispatch passes
    kernels.quant.unpack, the same values in one C call). attend: the attention over the unpacked rows
    (default `sparse_attention`; `sparse_attention_fixed_order` is the oracle of host.sparse_attention_packed)."""
    unpack = unpack or _formats_unpack
    if window_values is None:
        window_values = unpack("fp8_ue8m0", window_codes, window_scales, formats.FP8_BLOCK)
    window = window_values
    kv, idx = window, window_idx
    if main_codes is not None and main_idx is not None:
        B, T, K = main_idx.shape
        if T == 1 and K < main_codes.size(1):
            # one query per row (decode): unpack only the K selected entries, not all N of them (the same
            # values, gathered before the decode instead of after it), and point the indices at them
            batch = torch.arange(B, device=main_idx.device).unsqueeze(1)
            chosen = main_idx[:, 0].clamp_min(0).long()
            main_codes, main_scales = main_codes[batch, chosen], main_scales[batch, chosen]
            main_idx = torch.where(main_idx >= 0, torch.arange(K, device=main_idx.device), -1)
        main = unpack("fp4_e4m3", main_codes, main_scales, formats.FP4_E4M3_BLOCK)
        kv = torch.cat([window, main], dim=1)
        idx = torch.cat([window_idx, torch.where(main_idx >= 0, main_idx + window.size(1), -1)], dim=-1)
    return (attend or sparse_attention)(q, kv, sink, idx.long(), scale)


def _formats_unpack(fmt: str, codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """formats.unpack_<fmt> to fp32: the references' unpacker."""
    return getattr(formats, "unpack_" + fmt)(codes, scales, block, torch.float32)


# --------------------------------------------------------------------------------- indexer
def entry_bucket(n: int) -> int:
    """The padded entry count of a by-entry score GEMM on the CPU: 64, or the next power of two."""
    return max(64, 1 << (n - 1).bit_length())


def weighted_relu_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, bf16: bool,
                         by_entry: bool = False, mxfp4: bool = False) -> torch.Tensor:
    """score = sum_h w_h ReLU(q_h . k), fp32. q [B, T, H, D], weights [B, T, H]; keys [B, N, D] (every entry:
    [B, T, N]) or [B, T, C, D] (a candidate list per token: [B, T, C]). bf16: q, k, the products, the weighted
    terms and the head sum in bf16, as REF keeps them (and breaks Top-K ties on those values).

    by_entry (one query per sequence, keys [B, N, D]): the product taken as keys @ q^T, entries as the GEMM's
    rows, and the head sum over the last dim. A score then does not depend on how many entries are scored
    (the decode step of a continuous batch scores as many as its fullest row holds; model/batch_cache.py),
    where q @ keys^T sums a column differently for some widths. Same terms, fp32 sums in another order.

    mxfp4: q and keys hold MXFP4 values (indexer_scores). Where one MXFP4 block spans the head dim, each bf16
    product is then exact in fp32 whatever the order of its sum (`mxfp4_products_exact`), so on the CPU it is
    taken as an fp32 GEMM and rounded to bf16 once: the same bits as the bf16 GEMM, which ATen runs 4-25x
    slower there (benchmarks/results/cpu-indexer-exact), and a score that depends on no other row or width."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    exact = bf16 and mxfp4 and mxfp4_products_exact(q, keys)
    # the products' operand dtype: fp32 where they are exact there (then rounded to bf16 once), else `dtype`
    operand = torch.float32 if exact else dtype
    if by_entry and keys.dim() == 3 and q.size(1) == 1:
        n, k = keys.size(1), keys.to(operand)
        rows = entry_bucket(n) if bf16 and not exact and keys.device.type == "cpu" else n
        if rows != n:
            # On the CPU a bf16 GEMM of a shape not seen before builds a oneDNN primitive, about 0.5 ms, where the
            # product itself takes ~20 us; a decode step scores one more entry every step or few, so it would pay
            # that at every step. Zero rows pad the entries to a few sizes; a row's score does not depend on them.
            k = F.pad(k, (0, 0, 0, rows - n))
        scores = torch.bmm(k, q[:, 0].to(operand).transpose(1, 2))[:, :n].to(dtype).relu_()  # [B, N, H]
        return (scores * weights.to(dtype)).sum(dim=-1).float().unsqueeze(1)
    pattern = "bthd,bnd->bthn" if keys.dim() == 3 else "bthd,btcd->bthc"
    scores = torch.einsum(pattern, q.to(operand), keys.to(operand)).to(dtype).relu_()
    return (scores * weights.to(dtype).unsqueeze(-1)).sum(dim=2).float()


def mxfp4_products_exact(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether every q . k of MXFP4-valued CPU operands is exact in fp32, whatever the order of its sum: true when
    the head dim is one MXFP4 block. Each element is then s m with one power-of-two scale s per operand and m an
    E2M1 value (a multiple of 1/2, |m| <= 6), so each product is s_q s_k times a multiple of 1/4 of at most 36,
    and any partial sum of 32 of them a multiple of 1/4 below 1,152: 13 significant bits, fp32 holds it exactly
    (away from fp32's ends: products below 2^-126 or sums past 2^127, which would need block scales far from the
    indexer's normalized activations). Several blocks would add terms of different scales, which fp32 rounds in an
    order-dependent way: those stay on the bf16 GEMM."""
    return q.device.type == "cpu" and keys.device.type == "cpu" and q.size(-1) == formats.MXFP4_BLOCK


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                   visible: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                   bf16_scores: bool = False, by_entry: bool = False, unpack=None) -> torch.Tensor:
    """score_{t,g} = sum_h w_{t,h} ReLU(q_{t,h} . k_g) over packed MXFP4 keys, fp32 (by_entry: see
    weighted_relu_scores; unpack: as sparse_attention_packed's).

    q [B,T,H,Dk] (MXFP4-valued floats), weights [B,T,H] (already scaled by (Dk H)^-1/2), keys packed MXFP4
    (codes [B,N,Dk/2], scales [B,N,Dk/32] uint8). visible [T]: entries g >= visible[t] score -inf (None:
    all visible). candidates [B,T,C] (-1 = none): score only those entries, returning [B,T,C] (-inf at -1);
    otherwise [B,T,N]. bf16_scores: the products, the weighted terms and the head sum rounded to bf16 (REF's
    score precision, Indexer.head_scores with index_score_dtype "bf16"; weights then hold bf16 values)."""
    keys = (unpack or _formats_unpack)("mxfp4", key_codes, key_scales, formats.MXFP4_BLOCK)
    n = keys.size(1)
    if candidates is None:
        scores = weighted_relu_scores(q, keys, weights, bf16_scores, by_entry, mxfp4=True)
        if visible is not None:
            scores = scores.masked_fill(torch.arange(n, device=q.device) >= visible.view(-1, 1), -torch.inf)
        return scores
    batch = torch.arange(keys.size(0), device=q.device).view(-1, 1, 1)
    gathered = keys[batch, candidates.clamp_min(0).long()]  # [B,T,C,Dk]
    scores = weighted_relu_scores(q, gathered, weights, bf16_scores, mxfp4=True)
    hidden = candidates < 0
    if visible is not None:
        hidden = hidden | (candidates >= visible.view(1, -1, 1))
    return scores.masked_fill(hidden, -torch.inf)


# --------------------------------------------------------------------------------- single-pass mHC
# The mHC arithmetic (spec §3.2, §4.3; model/mhc.py re-exports it under these names).
def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int = 20,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (n+2)n] -> pre [..., n], post [..., n], comb [..., n, n], all fp32.

    comb starts as a row softmax plus eps, is column-normalized once, then alternates row and column
    normalization iters-1 more times, each divisor padded by eps: the order REF's kernel uses."""
    return _sinkhorn_split(mixes.float(), scale, base, n, iters, eps)


def _sinkhorn_split(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                    eps: float, normalize=None, scalar_sigmoid=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sinkhorn_split of fp32 mixes. `normalize(comb, iters, eps)`, in place, replaces the torch loop
    `_sinkhorn_normalize_` off the graph (model/kernels/mhc.py passes host.py's C loop on the CPU);
    scalar_sigmoid: per_row's `scalar` for the sigmoids."""
    if torch.is_grad_enabled():  # training: the graph wants the out-of-place form and the live parameters
        return _sinkhorn_split_graph(m, scale, base, n, iters, eps)
    # Operator count matters here (a decode step runs this 2 x layers times, one token each): the three
    # affine maps are one multiply and one add over all (n+2)n mixes with the scales spread per mix (the
    # same products and sums, element by element), and the normalizations run in place on temporaries.
    # The transcendental functions (sigmoid, exp) see the same shapes and memory layouts as written out
    # per part, since their vectorized and scalar code paths may round differently; each sum runs over
    # the same 4-element rows and columns as before.
    scale_per_mix, base = _mix_affine(scale, base, n)
    z = m * scale_per_mix
    z += base
    pre = per_row(torch.sigmoid, z[..., :n].contiguous(), scalar_sigmoid).add_(eps)
    post = per_row(torch.sigmoid, z[..., n:2 * n].contiguous(), scalar_sigmoid).mul_(2)
    comb = z[..., 2 * n:].unflatten(-1, (n, n))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))  # the softmax written out, as REF's kernel
    return pre, post, (normalize or _sinkhorn_normalize_)(comb, iters, eps)


def _sinkhorn_normalize_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """In place on the exponentials of comb [..., n, n]: the softmax's division and + eps, a column
    normalization, then iters-1 rounds of rows and columns, each divisor padded by eps (host.py's C loop
    does the same operations in the same order)."""
    comb = comb.div_(comb.sum(dim=-1, keepdim=True)).add_(eps)
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return comb


def _sinkhorn_split_graph(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sinkhorn_split written out per part, out of place (the same numbers; autograd records it)."""
    scale, base = scale.float(), base.float()
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


_MIX_AFFINE: dict = {}


def _mix_affine(scale: torch.Tensor, base: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale spread over the (n+2)n mixes: s0 for pre, s1 for post, s2 for comb; base), both fp32, cached
    per live pair of tensors and their versions (a weak reference checks the cached tensor is the same
    object, as model/kernels/mhc.py's split of W_fn does)."""
    key = (id(scale), id(base), n)
    hit = _MIX_AFFINE.get(key)
    if hit is not None and hit[0]() is scale and hit[1]() is base and hit[2] == (scale._version, base._version):
        return hit[3], hit[4]
    with torch.inference_mode(False), torch.no_grad():
        s = scale.detach().float()
        spread = torch.cat([s[0:1].expand(n), s[1:2].expand(n), s[2:3].expand(n * n)])
        b = base.detach().float().clone()
    if len(_MIX_AFFINE) > 256:
        _MIX_AFFINE.clear()
    _MIX_AFFINE[key] = (weakref.ref(scale), weakref.ref(base), (scale._version, base._version), spread, b)
    return spread, b


def hc_coefficients(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                    hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, n, d] -> (pre, post, comb). The RMS statistic is over the flattened n*d stream, one per
    token, and is folded in after the projection (mu = (W x) * rsqrt(mean x^2 + eps))."""
    return _hc_coefficients(x.float(), fn, scale, base, iters, hc_eps, norm_eps)


def _hc_coefficients(xf: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                     hc_eps: float, norm_eps: float,
                     normalize=None, project=None, rstd=None,
                     scalar_sigmoid=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_coefficients of x already in fp32 (x.float().flatten(-2) is x.flatten(-2).float(), value for value).
    project(flat, fn): the projection W_fn flat in fp32 (default F.linear; the host step sums it in a fixed
    order, host.fixed_order_linear). rstd(flat, eps): the RMS statistic below (the host step's is one C call of
    the same bits, host.rms_rstd). scalar_sigmoid: _sinkhorn_split's."""
    *_, n, d = xf.shape
    flat = xf.flatten(-2)
    if rstd is not None:
        rstd = rstd(flat, norm_eps)
    else:
        rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = (project(flat, fn) if project is not None else F.linear(flat, fn.float())) * rstd
    return _sinkhorn_split(mixes, scale, base, n, iters, hc_eps, normalize, scalar_sigmoid)  # mixes are fp32


def fixed_order_matmul(x: torch.Tensor, wt: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 times wt [K, N] fp32 -> [M, N] fp32 (into `out` when given), each output summed over k in
    the fixed order 0, 1, ..., K-1 from the first product, ((x_0 w_0 + x_1 w_1) + x_2 w_2) + ...: elementwise
    products and additions, whose bits no CPU, vector width or row count changes (an fp32 GEMM's order
    depends on all three). The CPU's GEMMs of inference (the output head, the linear layers, the MoE gate,
    the mHC projection, the grouped wo_a: host.fixed_order_linear) are this loop; host.fixed_order_matmul is
    it in C."""
    acc = x[:, :1] * wt[0]
    for k in range(1, x.size(1)):
        acc.add_(x[:, k:k + 1] * wt[k])
    if out is not None:
        return out.copy_(acc)
    return acc


def head_logits(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """The output head on the host: x [R, K] fp32, wt [K, V] fp32 (the head's weight transposed) -> [R, V]
    fp32, as fixed_order_matmul. host.head_logits is this loop in C."""
    return fixed_order_matmul(x, wt)


# ------------------------------------------------------------------------ scoring a block of logits
SCORE_LANES, SCORE_CHUNK, EXP_FLOOR = 16, 1024, -87.0  # host_kernels.c's constants


def exp_poly(d: torch.Tensor) -> torch.Tensor:
    """exp(d) for fp32 d <= 0 (and up to 88: sparse_attention_fixed_order's sink term) with fp32 multiplies and adds
    only (host_kernels.c's exp, the same bits on any CPU):
    2^n p(r), n = round(d log2 e), r = d - n ln2 (ln2 in two parts), p the degree-7 Taylor polynomial; 0 below
    EXP_FLOOR (-87, where 2^n would leave the normal range; such a term is under 2^-125 of the sum)."""
    t = d * 1.44269504088896341 + 12582912.0  # + 1.5 * 2^23 rounds n to nearest into the low bits
    n = t - 12582912.0
    r = (d - n * 0.693145751953125) - n * 1.428606765330187e-06
    p = r * 1.98412698e-04 + 1.38888889e-03
    for c in (8.33333333e-03, 4.16666667e-02, 1.66666667e-01, 0.5, 1.0, 1.0):
        p = p * r + c
    keep = d >= EXP_FLOOR
    scale = ((torch.where(keep, n, 0.0).to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(keep, p * scale, 0.0)


def _log_series(x: torch.Tensor) -> torch.Tensor:
    """ln x for fp64 x >= 1 (host_kernels.c's log_series): x = f 2^e, f in [sqrt(1/2), sqrt(2)), and
    ln f = 2 atanh(s), s = (f - 1) / (f + 1), by 14 terms of its series."""
    mant, e = torch.frexp(x)
    f, e = mant * 2.0, e.double() - 1.0
    high = f > 1.4142135623730951
    f, e = torch.where(high, f * 0.5, f), torch.where(high, e + 1.0, e)
    s = (f - 1.0) / (f + 1.0)
    s2, term, acc = s * s, s, torch.zeros_like(s)
    for k in range(14):
        acc = acc + term / float(2 * k + 1)
        term = term * s2
    return e * 0.6931471805599453 + 2.0 * acc


def score_logits(logits: torch.Tensor, targets: torch.Tensor):
    """(ln p(target) fp32 [R], log-sum-exp fp32 [R], argmax int64 [R]) of fp32 logits [R, V] on the CPU, in
    host_kernels.c's order (dsv41_score_logits): the maximum m at the row's first index of it (a NaN's, when there
    is one: then NaN, as torch's argmax and logsumexp give), e_j = exp_poly(l_j - m) summed in 16 fp32 lanes
    (element j into lane j mod 16) restarted every 1024 elements and carried in fp64, the lanes halved in a fixed
    tree, lse = m + ln(sum) in fp64 rounded to fp32."""
    R, V = logits.shape
    nan = logits.isnan()
    has_nan = nan.any(-1)
    m = logits.nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf).amax(-1)
    first = lambda hit: hit.int().argmax(-1)  # noqa: E731 - the first True (a row has one)
    at = torch.where(has_nan, first(nan), first(logits == m.unsqueeze(-1)))
    m = logits.gather(-1, at.unsqueeze(-1))  # [R, 1]
    chunks = -(-V // SCORE_CHUNK)
    d = F.pad(logits - m, (0, chunks * SCORE_CHUNK - V), value=-torch.inf)
    e = exp_poly(d).view(R, chunks, SCORE_CHUNK // SCORE_LANES, SCORE_LANES)
    lanes = e[:, :, 0]
    for i in range(1, SCORE_CHUNK // SCORE_LANES):
        lanes = lanes + e[:, :, i]
    total = torch.zeros(R, SCORE_LANES, dtype=torch.float64)
    for c in range(chunks):
        total = total + lanes[:, c].double()
    w = SCORE_LANES // 2
    while w >= 1:
        total = total[:, :w] + total[:, w:2 * w]
        w //= 2
    m = m.squeeze(-1)
    special = has_nan | m.isinf()
    lse = torch.where(special, m, (m.double() + _log_series(torch.where(special, 1.0, total[:, 0]))).float())
    return logits.gather(-1, targets.view(-1, 1)).squeeze(-1) - lse, lse, at.long()


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Input mixing: sum_j pre_j X_j. [B,T,n,d] x [B,T,n] -> [B,T,d] in x's dtype.

    The sum runs in fp32 in the fixed order j = 0, 1, ..., n-1 (not through a reduction kernel whose
    order may depend on the CPU's vector width); this is the order ATen's sum used on the golden's CPU,
    so the result is bit for bit the one `tests/test_fidelity.py` pins (docs/fidelity.md §7)."""
    return _collapse(x.float(), pre, x.dtype)


def _collapse(xf: torch.Tensor, pre: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """collapse of x already in fp32, returned in `dtype` (x's)."""
    # all n products in one multiply (the same products), then the n-1 additions in order, in place
    terms = (pre.unsqueeze(-1) * xf).unbind(-2)
    out = terms[0] + terms[1] if len(terms) > 1 else terms[0]
    for term in terms[2:]:
        out.add_(term)
    return out.to(dtype)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Residual update: X'_k = post_k y + sum_j comb_{jk} X_j (the residual is indexed by comb's first index).
    The sum over j runs in fp32 in the fixed order j = 0..n-1, as in `collapse`."""
    r = residual.float()
    if r.numel() <= _EXPAND_BATCHED_NUMEL:
        # few tokens (decode): all n x n products in one multiply ([.., j, k, d], the same products), then
        # the additions over j in order, in place; n times the residual's size in temporaries
        terms = (comb.unsqueeze(-1) * r.unsqueeze(-2)).unbind(-3)
        mixed = terms[0] + terms[1] if len(terms) > 1 else terms[0]
        for term in terms[2:]:
            mixed.add_(term)
    else:
        mixed = comb[..., 0, :, None] * r[..., 0, None, :]
        for j in range(1, r.size(-2)):
            mixed = mixed + comb[..., j, :, None] * r[..., j, None, :]
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2)
    out += mixed
    return out.to(y.dtype)


_EXPAND_BATCHED_NUMEL = 1 << 20  # residual elements up to which expand forms all products at once


def mhc_step(x: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             iters: int, hc_eps: float, norm_eps: float, y: torch.Tensor | None = None,
             post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
    """One single-pass mHC step around a sub-layer boundary.

    With y (the previous sub-layer's output [B,T,d]) and its post [B,T,n] / comb [B,T,n,n]: the residual
    update X' = post (x) y + comb^T X; without y, X' = X. Then, from X' alone: the next sub-layer's input
    collapse(X', pre_prev) [B,T,d] and its coefficients (pre, post, comb) = hc_coefficients(X', fn, ...).
    Returns (X' [B,T,n,d], collapsed, pre, post, comb), as Block.mix computes them."""
    x_new = x if y is None else expand(y, x, post, comb)
    xf = x_new.float()  # once for both readers of X'
    collapsed = _collapse(xf, pre_prev, x_new.dtype)
    pre_n, post_n, comb_n = _hc_coefficients(xf, fn, scale, base, iters, hc_eps, norm_eps)
    return x_new, collapsed, pre_n, post_n, comb_n


def mhc_step_fixed_order(x: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                         base: torch.Tensor, iters: int, hc_eps: float, norm_eps: float, y: torch.Tensor | None = None,
                         post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
    """mhc_step as the CPU's decode step computes it (host.mhc_step; model/kernels/mhc.py): the projection W_fn X
    summed in the fixed order (fixed_order_matmul: a token's coefficients do not depend on the tokens beside it)
    and the sigmoids by ATen's scalar formula (`row_invariant`). The oracle of the C step."""
    with row_invariant():
        x_new = x if y is None else expand(y, x, post, comb)
        xf = x_new.float()
        collapsed = _collapse(xf, pre_prev, x_new.dtype)
        project = lambda flat, w: fixed_order_matmul(flat.reshape(-1, flat.size(-1)), w.float().t()).view(  # noqa: E731
            *flat.shape[:-1], w.size(0))
        pre_n, post_n, comb_n = _hc_coefficients(xf, fn, scale, base, iters, hc_eps, norm_eps, project=project)
    return x_new, collapsed, pre_n, post_n, comb_n


# --------------------------------------------------------------------------------- KV packing
def pack_fp4_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed E2M1 [..., D/2] uint8, E4M3 scale bytes [..., D/16] uint8): the main KV format."""
    return formats.pack_fp4_e4m3(x, formats.FP4_E4M3_BLOCK)


def pack_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bytes [..., D] uint8, UE8M0 bytes [..., D/32] uint8): the window KV format."""
    return formats.pack_fp8_ue8m0(x, formats.FP8_BLOCK)


def pack_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed E2M1 [..., D/2] uint8, UE8M0 bytes [..., D/32] uint8): the indexer key format."""
    return formats.pack_mxfp4(x, formats.MXFP4_BLOCK)


def mxfp4_fake_quant(x: torch.Tensor, block: int = formats.MXFP4_BLOCK) -> torch.Tensor:
    """x rounded to MXFP4 (E2M1, one UE8M0 scale per block) and back, in x's dtype: the indexer's queries."""
    return formats.mxfp4_fake_quant(x, block)


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


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, block: int, fp4: bool) -> torch.Tensor:
    """A stored FP8 weight [N, K] (E4M3, one UE8M0 per block x block tile) or packed FP4 weight [N, K/2] (E2M1
    pairs, one UE8M0 per row and `block` columns) times its scales, as bf16 [N, K]: the weight operand of
    the GEMMs above, exact in bf16 (E4M3 / E2M1 times a power of two)."""
    if fp4:
        return formats.dequant_fp4_weight(weight, scale, block, torch.bfloat16)
    return formats.dequant_fp8_weight(weight, scale, block, torch.bfloat16)


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
