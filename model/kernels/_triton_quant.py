"""Triton kernels of model/kernels/quant.py (imported only when they run)."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv41.model.kernels._triton_formats import (e2m1_to_f32_bits, e4m3_value_to_byte, f32_to_e2m1_code,
                                                 f32_to_e4m3_value, round_cast)


@triton.jit
def pack_fp4_e4m3_kernel(x_ptr, codes_ptr, scales_ptr, M, stride_x,
                         D: tl.constexpr, BM: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """Rows [BM, D] -> E2M1 pairs [BM, D/2] and E4M3 scales [BM, D/16] (formats.pack_fp4_e4m3, block 16).

    scale = e4m3(amax / 6) by true division and nearest-even rounding; codes = e2m1(x / scale), also a true
    division (the scale is not a power of two, so multiplying by a reciprocal would round differently)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, D)
    rmask = rows < M
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    groups = tl.reshape(x, (BM, D // 16, 16))
    amax = tl.maximum(tl.max(tl.abs(groups), axis=2), AMAX_FLOOR)
    scale = f32_to_e4m3_value(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
    y = tl.math.div_rn(groups, tl.broadcast_to(scale[:, :, None], (BM, D // 16, 16)))
    codes = tl.reshape(f32_to_e2m1_code(y), (BM, D // 2, 2))
    low, high = tl.split(codes)
    packed = (low | (high << 4)).to(tl.uint8)
    half = tl.arange(0, D // 2)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * (D // 2) + half[None, :], packed, mask=rmask[:, None])
    sixteenth = tl.arange(0, D // 16)
    tl.store(scales_ptr + rows[:, None].to(tl.int64) * (D // 16) + sixteenth[None, :],
             e4m3_value_to_byte(scale).to(tl.uint8), mask=rmask[:, None])


@triton.jit
def pack_fp8_ue8m0_kernel(x_ptr, codes_ptr, scales_ptr, M, stride_x,
                          D: tl.constexpr, BM: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """Rows [BM, D] -> E4M3 bytes [BM, D] and UE8M0 scales [BM, D/32] (formats.pack_fp8_ue8m0, block 32).

    scale = 2^ceil(log2(amax * fp32(1/448))) read off the fp32 bits; x / scale is exact (a power of two),
    then E4M3 nearest-even with saturation at 448."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, D)
    rmask = rows < M
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    groups = tl.reshape(x, (BM, D // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(groups), axis=2), AMAX_FLOOR)
    ratio_bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    scale_byte = ((ratio_bits >> 23) & 255) + ((ratio_bits & 0x7FFFFF) != 0).to(tl.int32)
    inverse = ((254 - scale_byte) << 23).to(tl.float32, bitcast=True)  # 2^-(byte-127)
    y = groups * inverse[:, :, None]
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    value = f32_to_e4m3_value(tl.abs(y))
    byte = tl.reshape(e4m3_value_to_byte(value) | (sign << 7), (BM, D)).to(tl.uint8)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], byte, mask=rmask[:, None])
    blocks = tl.arange(0, D // 32)
    tl.store(scales_ptr + rows[:, None].to(tl.int64) * (D // 32) + blocks[None, :], scale_byte.to(tl.uint8),
             mask=rmask[:, None])


@triton.jit
def mxfp4_kernel(x_ptr, out_ptr, codes_ptr, scales_ptr, M, stride_x,
                 D: tl.constexpr, BM: tl.constexpr, AMAX_FLOOR: tl.constexpr, FAKE: tl.constexpr,
                 OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows [BM, D] in MXFP4 (formats.pack_mxfp4 / mxfp4_fake_quant, block 32): scale = 2^ceil(log2(amax *
    fp32(1/6))) read off the fp32 bits, codes = e2m1(x / scale) (a true division). FAKE: the rounded values
    e2m1 * scale in the output dtype (-0 kept); else E2M1 pairs [BM, D/2] and UE8M0 bytes [BM, D/32]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, D)
    rmask = rows < M
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    groups = tl.reshape(x, (BM, D // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(groups), axis=2), AMAX_FLOOR)
    bits = ((amax * (1.0 / 6.0)).to(tl.int32, bitcast=True) & 0x7FFFFFFF) + 0x7FFFFF
    bits = bits & -0x800000
    scale = bits.to(tl.float32, bitcast=True)
    full = tl.broadcast_to(scale[:, :, None], (BM, D // 32, 32))
    codes = f32_to_e2m1_code(tl.math.div_rn(groups, full))
    if FAKE:
        y = tl.reshape(e2m1_to_f32_bits(codes) * full, (BM, D))
        if OUT_BF16:
            y = round_cast(y, tl.bfloat16, INTERPRET)
        tl.store(out_ptr + r64 * D + cols[None, :], y, mask=rmask[:, None])
    else:
        low, high = tl.split(tl.reshape(codes, (BM, D // 2, 2)))
        half = tl.arange(0, D // 2)
        tl.store(codes_ptr + r64 * (D // 2) + half[None, :], (low | (high << 4)).to(tl.uint8), mask=rmask[:, None])
        blocks = tl.arange(0, D // 32)
        tl.store(scales_ptr + r64 * (D // 32) + blocks[None, :], ((bits >> 23) & 255).to(tl.uint8),
                 mask=rmask[:, None])
