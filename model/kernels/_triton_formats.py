"""Triton device functions that decode and encode the packed formats of model/formats.py.

Decoding builds powers of two from exponent bits (no exp2, whose fast path flushes or approximates), so every
decoded value is exact, as formats.unpack_* gives it. Imported only when a Triton kernel runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """2^e for integer e in the normal fp32 range [-126, 127], exact (built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f32(b):
    """E4M3 bytes (int32 holding 0..255) -> fp32: (1 + m/8) 2^(e-7), subnormals m 2^-9. (0x7F/0xFF, the
    NaN codes, never occur in the cache: the quantizers saturate at 448.)"""
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    normal = (8.0 + m) * pow2(tl.maximum(e, 1) - 10)
    mag = tl.where(e == 0, m * 0.001953125, normal)  # 2^-9
    return tl.where(sign == 1, -mag, mag)


@triton.jit
def e8m0_to_f32(b):
    """UE8M0 bytes (int32 1..254) -> 2^(b-127). Byte 0 (2^-127, an fp32 subnormal) reads as 0; the KV
    quantizers' amax floors keep every cache scale far above it."""
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32_every_byte(b):
    """UE8M0 bytes (int32 0..255) -> fp32 as formats.e8m0_to_float decodes all 256: 2^(b-127), byte 0 the
    fp32 subnormal 2^-127, byte 255 NaN. (e8m0_to_f32 reads 0 as 0 and 255 as inf, which the GEMM tiles can
    afford; a weight dequantized for another library's GEMM must equal the torch dequantization everywhere.)"""
    bits = tl.where(b == 0, 0x400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(c):
    """4-bit E2M1 codes (int32 0..15, bit 3 = sign) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (2.0 + m) * pow2(tl.maximum(e, 1) - 2))
    return tl.where(((c >> 3) & 1) == 1, -mag, mag)


@triton.jit
def e2m1_to_f32_bits(c):
    """4-bit E2M1 codes (int32 0..15, bit 3 = sign) -> fp32 from bits, exact, the sign bit copied, so code 8 is
    -0.0 as formats.e2m1_decode gives it (e2m1_to_f32's negation gives +0.0): e2m1_to_bf16's patterns, 16 bits up."""
    k = c & 7
    mag = tl.where(k >= 2, 0x3F000000 + k * 0x400000, k * 0x3F000000)
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(x):
    """Round fp32 to the nearest integer, ties to even, for |x| < 2^22: adding and removing 1.5 * 2^23
    leaves the integer part in the mantissa's last place, where fp32 addition rounds to nearest even."""
    magic = 12582912.0  # 1.5 * 2^23
    return (x + magic) - magic


@triton.jit
def f32_to_e4m3_value(v):
    """Round positive fp32 v to the E4M3 grid, nearest-even, saturating at 448 (what formats.to_e4m3 does
    for v > 0). Returns the rounded value as fp32."""
    v = tl.minimum(v, 448.0)
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    binade = tl.maximum(exponent, -6)  # E4M3 values are spaced 2^(binade-3) apart; 2^-9 when subnormal
    # scaling by powers of two is exact, so multiply (a division could take an approximate path)
    return tl.minimum(round_half_even(v * pow2(3 - binade)) * pow2(binade - 3), 448.0)


@triton.jit
def e4m3_value_to_byte(v):
    """A positive fp32 value on the E4M3 grid -> its byte (int32)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 255) - 127
    normal = ((exponent + 7) << 3) | ((bits >> 20) & 7)
    subnormal = round_half_even(v * 512.0).to(tl.int32)  # m 2^-9, m = 0..7 (8 is the first normal, byte 8)
    return tl.where(exponent < -6, subnormal, normal)


@triton.jit
def f32_to_e2m1_code(y):
    """fp32 -> 4-bit E2M1 code, nearest-even, saturating at 6; the sign bit is copied (-0 -> code 8).
    The code of |y| counts the grid midpoints below it, a midpoint it sits on counting only where
    rounding to even goes up (0.75, 1.75, 3.5), as formats.e2m1_encode does."""
    a = tl.abs(y)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def as_mma(x, INTERPRET: tl.constexpr):
    """An operand of tl.dot: bf16 on the GPU. The CPU interpreter's bf16 dot is wrong (Triton 3.6: it
    multiplies the raw bit patterns), so there the bf16-rounded value is kept in fp32, which computes the
    same products."""
    if INTERPRET:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def round_cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x -> dtype, rounding to nearest even. The CPU interpreter casts fp32 -> bf16 by truncation and
    flushes subnormals (Triton 3.6), so there the rounding is done on the bits (finite values) and the bf16 is
    their upper half, taken by a bitcast."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(dtype, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def e2m1_to_bf16(c):
    """4-bit E2M1 codes (int32 0..15, bit 3 = sign) -> bf16, exact, from bits (no fp32 on the way, to keep
    registers low where a whole tile is decoded): magnitude code k = 2..7 (1, 1.5, 2, 3, 4, 6) is bf16 bits
    0x3F00 + 0x40 k, k = 1 (0.5) is 0x3F00, k = 0 is 0; the sign goes to bit 15."""
    k = c & 7
    mag = tl.where(k >= 2, 0x3F00 + k * 0x40, k * 0x3F00)
    return (mag | ((c & 8) << 12)).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_to_bf16_by_e4m3(c):
    """4-bit E2M1 codes (int32 0..15, bit 3 = sign) -> bf16 of the value / 64, exact, through the hardware's E4M3
    conversion: the code's bits placed as an E4M3 byte's, s 0 0 e e m 0 0, read as E4M3 are the E2M1 value times
    2^-6, subnormals (code 1: 0.5) and the sign of -0 (code 8) included. The caller multiplies the other operand
    of its product by 64 (exact below 2^121 in magnitude, which queries and UE8M0 scales up to byte 248 are), so
    the products are those of e2m1_to_bf16's values."""
    byte = ((c & 8) << 4) | ((c & 7) << 2)
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def e2m1_decode_bf16(c, MODE: tl.constexpr):
    """The bf16 decodes of 4-bit E2M1 codes by kernels.decode_mode: 1 the value from bits (e2m1_to_bf16), 2 the value
    / 64 by the E4M3 conversion (e2m1_to_bf16_by_e4m3; the caller scales the other operand by 64)."""
    if MODE == 2:
        return e2m1_to_bf16_by_e4m3(c)
    else:
        return e2m1_to_bf16(c)


@triton.jit
def e4m3_to_bf16(b):
    """E4M3 bytes (uint8) -> bf16 by the hardware conversion (exact: every E4M3 value is a bf16 value).
    (0x7F/0xFF, the NaN codes, never occur in the cache.)"""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def e8m0_to_bf16(b):
    """UE8M0 bytes (uint8 1..254) -> 2^(b-127) as bf16 (exponent bits only; byte 0 reads as 0)."""
    return (b.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def mul_exact(v, s, INTERPRET: tl.constexpr):
    """v * s for bf16 v and s whose product is exactly a bf16 value: in bf16 on the GPU; in fp32 under the
    CPU interpreter, whose bf16 arithmetic is wrong (Triton 3.6 multiplies the raw bit patterns)."""
    if INTERPRET:
        return v.to(tl.float32) * s.to(tl.float32)
    else:
        return v * s
