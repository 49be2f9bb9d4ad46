"""Fused quantize-and-pack of KV cache entries: one read of the values, one write of the packed bytes.

    pack_fp4_e4m3   main compressed KV: E2M1 pairs (element 2i in the low nibble) + one E4M3 scale per 16
    pack_fp8_ue8m0  window KV: E4M3 bytes + one UE8M0 scale per 32

Bit-exact with model/formats.py's packers (the same roundings: nearest-even, saturation, the scale rules and
amax floors), which the tests check byte for byte; the cache can use either.
"""

from __future__ import annotations

import torch

from dsv41.model import formats
from dsv41.model.kernels import opaque, reference, use_triton


@opaque
def _launch(kernel, x, parts, block, floor):
    import triton

    D = x.size(-1)
    if D % block or D & (D - 1):
        raise ValueError(f"packing kernel needs a power-of-two last dim that is a multiple of {block}, got {D}")
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.size(0)
    codes = torch.empty(M, parts[0], dtype=torch.uint8, device=x.device)
    scales = torch.empty(M, parts[1], dtype=torch.uint8, device=x.device)
    BM = max(1, min(32, 8192 // D))
    kernel[(triton.cdiv(M, BM),)](rows, codes, scales, M, rows.stride(0), D=D, BM=BM, AMAX_FLOOR=floor,
                                  num_warps=4)
    return codes.view(*x.shape[:-1], parts[0]), scales.view(*x.shape[:-1], parts[1])


def pack_fp4_e4m3(x: torch.Tensor, force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.pack_fp4_e4m3: x [..., D] -> (codes [..., D/2], E4M3 scale bytes [..., D/16])."""
    if not use_triton(x, force=force_triton):
        return reference.pack_fp4_e4m3(x)
    from dsv41.model.kernels._triton_quant import pack_fp4_e4m3_kernel

    D = x.size(-1)
    return _launch(pack_fp4_e4m3_kernel, x, (D // 2, D // 16), 16, formats.FP4_E4M3_AMAX_FLOOR)


def pack_fp8_ue8m0(x: torch.Tensor, force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.pack_fp8_ue8m0: x [..., D] -> (E4M3 bytes [..., D], UE8M0 bytes [..., D/32])."""
    if not use_triton(x, force=force_triton):
        return reference.pack_fp8_ue8m0(x)
    from dsv41.model.kernels._triton_quant import pack_fp8_ue8m0_kernel

    D = x.size(-1)
    return _launch(pack_fp8_ue8m0_kernel, x, (D, D // 32), 32, formats.FP8_AMAX_FLOOR)
