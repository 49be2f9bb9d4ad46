"""Sparse MQA with a per-head sink over [window rows ; compressed rows], dequantizing packed KV in the kernel.

    o_{t,h} = sum_j e^{l_j - M} kv_j / (sum_j e^{l_j - M} + e^{sink_h - M}),   l_j = scale q_{t,h} . kv_{idx_j}

over j in window_idx[t] (rows of the window store) and main_idx[t] (rows of the compressed store), -1 = empty
(model/attention.py: sparse_attention). Keys and values are the same latent row (one 512-wide head shared
by all query heads), so each row is read and dequantized once per block of heads and used for both
products.

Kernel layout. One program per (token, block of BH heads); it walks the window indices and then the
compressed indices in tiles of BK rows with the online softmax (running max m, running sum l, starting
from m = sink so an empty row ends as 0). The FP4 format packs element 2i in the low nibble and 2i+1 in
the high nibble of byte i, so the kernel keeps every D-vector as its even half and odd half
(q.kv = q_even.kv_even + q_odd.kv_odd) and never interleaves nibbles: a byte tile [BK, D/2] decodes straight
into the two halves, each with the E4M3 scale of byte i // 8. Row formats (constexpr per segment):
DENSE (bf16 rows), FP8 (E4M3 bytes + UE8M0 per 32), FP4 (E2M1 pairs + E4M3 per 16).

Numerics: the dequantized values are exact in bf16 (at most 5 significant bits), q enters the matrix
units as bf16 (the model's q is bf16), the logits and the accumulator are fp32, the probabilities enter
the second product as bf16 (as flash attention does); the output is rounded to q's dtype.
"""

from __future__ import annotations

import torch

from model.kernels import interpreting, reference, use_triton

DENSE, FP8, FP4, NONE = 0, 1, 2, 3


def sparse_attention_packed(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                            main_codes: torch.Tensor | None, main_scales: torch.Tensor | None,
                            sink: torch.Tensor, window_idx: torch.Tensor, main_idx: torch.Tensor | None,
                            scale: float, force_triton: bool = False) -> torch.Tensor:
    """See reference.sparse_attention_packed (same signature, same result within bf16 rounding)."""
    if not use_triton(q, window_codes, main_codes, force=force_triton):
        return reference.sparse_attention_packed(q, window_codes, window_scales, main_codes, main_scales, sink,
                                                 window_idx, main_idx, scale)
    segments = [(FP8, window_codes, window_scales, window_idx)]
    if main_codes is not None and main_idx is not None:
        segments.append((FP4, main_codes, main_scales, main_idx))
    return _launch(q, sink, scale, segments)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                     force_triton: bool = False) -> torch.Tensor:
    """model.attention.sparse_attention (unpacked bf16 rows kv [B,N,D]) through the same kernel."""
    if not use_triton(q, kv, force=force_triton) or kv.dtype != torch.bfloat16:
        from model.attention import sparse_attention as ref

        return ref(q, kv, sink, idx, scale)
    return _launch(q, sink, scale, [(DENSE, kv, None, idx)])


def supported(q: torch.Tensor, head_dim: int) -> bool:
    """Shapes the kernel handles: a power-of-two head dim of at least 32 (tl.dot needs 16 per half)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0 and q.size(-1) == head_dim


def _launch(q, sink, scale, segments):
    import triton

    B, T, H, D = q.shape
    if not supported(q, D):
        raise ValueError(f"sparse attention kernel needs a power-of-two head dim >= 32, got {D}")
    q = q.contiguous()
    o = torch.empty_like(q)
    sink = sink.float().contiguous()
    args = []
    fmts = []
    for fmt, codes, scales, idx in segments + [(NONE, None, None, None)] * (2 - len(segments)):
        fmts.append(fmt)
        if fmt == NONE:
            dummy = q  # never read (the segment's loop has no iterations)
            args += [dummy, dummy, 0, 0, 0, 0, torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device), 0, 0, 0]
            continue
        codes = codes.contiguous()
        scales = codes if scales is None else scales.contiguous()
        idx = idx.to(torch.int32).expand(B, T, -1).contiguous()
        args += [codes, scales, codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
                 idx, idx.stride(0), idx.stride(1), idx.size(2)]
    BH = min(max(16, triton.next_power_of_2(H)), 16 if D >= 256 else 64)
    BK = 32 if D >= 256 else 64
    grid = (B * T, triton.cdiv(H, BH))
    from model.kernels._triton_sparse_attention import kernel

    kernel[grid](q, o, sink, q.stride(0), q.stride(1), q.stride(2), T, H, float(scale), *args,
                 D2=D // 2, BH=BH, BK=BK, FMT_A=fmts[0], FMT_B=fmts[1],
                 INTERPRET=interpreting(), num_warps=4)
    return o
