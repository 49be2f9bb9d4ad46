"""Fused quantize-and-pack of KV cache entries: one read of the values, one write of the packed bytes.

    pack_fp4_e4m3   main compressed KV: E2M1 pairs (element 2i in the low nibble) + one E4M3 scale per 16
    pack_fp8_ue8m0  window KV: E4M3 bytes + one UE8M0 scale per 32
    pack_mxfp4      indexer keys: E2M1 pairs + one UE8M0 scale per 32; mxfp4_fake_quant the same rounding
                    returned as values (the indexer's queries; in torch, about fifteen launches each)
    unpack          any of the three back to values

On the CPU (inference, contiguous bf16/fp32 values or bytes) each is one C call of model/kernels/host.py with the
same bytes and values: a decode step packs and unpacks in every layer, a dozen torch operators or more each time.

Bit-exact with model/formats.py's packers (the same roundings: nearest-even, saturation, the scale rules and
amax floors), which the tests check byte for byte; the cache can use either.
"""

from __future__ import annotations

import torch

from dsv41.model import formats
from dsv41.model.kernels import host, inference_kernel, interpreting, opaque, reference, use_triton


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
        return host.pack_fp4_e4m3(x) if host.takes(x) else reference.pack_fp4_e4m3(x)
    from dsv41.model.kernels._triton_quant import pack_fp4_e4m3_kernel

    D = x.size(-1)
    return _launch(pack_fp4_e4m3_kernel, x, (D // 2, D // 16), 16, formats.FP4_E4M3_AMAX_FLOOR)


def pack_fp8_ue8m0(x: torch.Tensor, force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.pack_fp8_ue8m0: x [..., D] -> (E4M3 bytes [..., D], UE8M0 bytes [..., D/32])."""
    if not use_triton(x, force=force_triton):
        return host.pack_fp8_ue8m0(x) if host.takes(x) else reference.pack_fp8_ue8m0(x)
    from dsv41.model.kernels._triton_quant import pack_fp8_ue8m0_kernel

    D = x.size(-1)
    return _launch(pack_fp8_ue8m0_kernel, x, (D, D // 32), 32, formats.FP8_AMAX_FLOOR)


def _mxfp4_applies(x: torch.Tensor, block: int, force: bool) -> bool:
    """The kernel's shapes (whole power-of-two rows of 32-value blocks, bf16 or fp32) at inference."""
    D = x.size(-1)
    return (inference_kernel(x, force=force) and block == formats.MXFP4_BLOCK and D % block == 0
            and D & (D - 1) == 0 and x.dtype in (torch.bfloat16, torch.float32))


@opaque
def _launch_mxfp4(x: torch.Tensor, fake: bool):
    import triton

    from dsv41.model.kernels._triton_quant import mxfp4_kernel

    D = x.size(-1)
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.size(0)
    dev = x.device
    out = torch.empty(M, D, dtype=x.dtype, device=dev) if fake else rows
    codes = rows if fake else torch.empty(M, D // 2, dtype=torch.uint8, device=dev)
    scales = rows if fake else torch.empty(M, D // 32, dtype=torch.uint8, device=dev)
    BM = max(1, min(32, 4096 // D))
    mxfp4_kernel[(triton.cdiv(M, BM),)](rows, out, codes, scales, M, rows.stride(0), D=D, BM=BM,
                                        AMAX_FLOOR=formats.MXFP4_AMAX_FLOOR, FAKE=fake,
                                        OUT_BF16=x.dtype == torch.bfloat16, INTERPRET=interpreting(), num_warps=4)
    if fake:
        return out.view(x.shape)
    return codes.view(*x.shape[:-1], D // 2), scales.view(*x.shape[:-1], D // 32)


def pack_mxfp4(x: torch.Tensor, force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.pack_mxfp4: x [..., D] -> (E2M1 pairs [..., D/2], UE8M0 bytes [..., D/32]), byte for byte."""
    if not _mxfp4_applies(x, formats.MXFP4_BLOCK, force_triton):
        return host.pack_mxfp4(x) if host.takes(x) else reference.pack_mxfp4(x)
    return _launch_mxfp4(x, False)


def mxfp4_fake_quant(x: torch.Tensor, block: int = formats.MXFP4_BLOCK, force_triton: bool = False) -> torch.Tensor:
    """See reference.mxfp4_fake_quant: x rounded to MXFP4 and back, in x's dtype, bit for bit."""
    if not _mxfp4_applies(x, block, force_triton):
        return host.mxfp4_fake_quant(x, block) if host.takes(x) else reference.mxfp4_fake_quant(x, block)
    return _launch_mxfp4(x, True)


def unpack(fmt: str, codes: torch.Tensor, scales: torch.Tensor, block: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """formats.unpack_<fmt>(codes, scales, block, dtype), fmt "fp8_ue8m0", "fp4_e4m3" or "mxfp4": one C call on the
    CPU (host.unpack, the same values), formats' torch code elsewhere (the CUDA kernels decode the bytes
    themselves; what is left there is not on a decode step's path)."""
    if codes.device.type == "cpu":
        # strided bytes (a continuous batch's index keys: each row's first n entries of its store) are copied first:
        # a copy of the bytes costs one operator where formats' decode takes a dozen; the same values
        contiguous = codes.contiguous(), scales.contiguous()
        if host.takes_codes(*contiguous):
            return host.unpack(fmt, *contiguous, block, dtype)
    return getattr(formats, "unpack_" + fmt)(codes, scales, block, dtype)
