"""RoPE on the last rope_dim channels in one launch (model/layers.py rope_tail on CUDA).

    out[..., :D-r] = x[..., :D-r];  (out[2i], out[2i+1]) = (x[2i] + i x[2i+1]) * f_i   over the last r channels

In torch it is the split, the widening copy, the complex product, the cast and the concatenation: four to six
launches, three times in a layer's decode step (the query, the window row, the un-rotated output). The kernel
writes the whole row once. The complex product's rounding (fused multiply-adds or not) may differ from torch's
in the last bit of fp32 (tests/test_kernels_small.py).
"""

from __future__ import annotations

import torch

from dsv41.model.kernels import inference_kernel, interpreting, opaque, reference


def _fits(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int) -> bool:
    """x [B, T, D] or [B, T, H, D] (bf16/fp32, contiguous), complex64 freqs [T, r/2] or [B, T, r/2] contiguous."""
    if x.dim() not in (3, 4) or x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
        return False
    fshape = freqs.shape
    return (freqs.dtype == torch.complex64 and freqs.is_contiguous() and not freqs.is_conj()
            and rope_dim % 2 == 0 and 0 < rope_dim <= x.shape[-1] and fshape[-1] * 2 == rope_dim
            and fshape[-2] == x.shape[1] and (len(fshape) == 2 or len(fshape) == 3 and fshape[0] == x.shape[0]))


@opaque
def _launch(x, freqs, rope_dim, inverse):
    import triton

    from dsv41.model.kernels._triton_small import rope_tail_kernel

    B, T, D = x.shape[0], x.shape[1], x.shape[-1]
    H = x.shape[2] if x.dim() == 4 else 1
    out = torch.empty_like(x)
    f = torch.view_as_real(freqs)  # [.., r/2, 2] fp32: cos, sin
    BD = triton.next_power_of_2(D)
    BH = max(1, min(triton.next_power_of_2(H), 8192 // BD))
    rope_tail_kernel[(B * T, triton.cdiv(H, BH))](x, f, out, T, H, D, D - rope_dim, freqs.dim() == 3,
                                                  BH=BH, BD=BD, INVERSE=inverse, OUT_BF16=x.dtype == torch.bfloat16,
                                                  INTERPRET=interpreting(), num_warps=4)
    return out


def rope_tail(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False,
              force_triton: bool = False) -> torch.Tensor:
    """See reference.rope_tail. The kernel on CUDA (or forced under the interpreter) when no gradient is wanted and
    the shapes are the decode and prefill ones (`_fits`); otherwise the reference."""
    if not inference_kernel(x, force=force_triton) or not _fits(x, freqs, rope_dim):
        return reference.rope_tail(x, freqs, rope_dim, inverse)
    return _launch(x, freqs, rope_dim, inverse)
