"""Number formats of DeepSeek-V4.1-Flash (spec/architecture.md §2, §4.4, §6).

Five formats appear in the model:

* **FP8 E4M3** (``float8_e4m3fn``, max 448): weights of the dense linears, activations entering
  every quantized GEMM, and the sliding-window KV.
* **UE8M0** (``float8_e8m0fnu``): a bare power of two, byte ``b`` meaning ``2^(b-127)`` and 255 NaN.
  It is the block scale of FP8 weights (32x32 blocks), FP8 activations (1x32), FP4 weights (1x32) and
  the indexer's MXFP4.
* **E2M1** (FP4): sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
  Stored two per byte, the even index in the LOW nibble; code 8 is -0.
* **MXFP4** = E2M1 values with one UE8M0 scale per 32 (indexer keys and queries).
* **FP4 with E4M3 scales**: E2M1 values with one E4M3 scale per 16 and no global scale (the main
  compressed KV).

The model applies the activation formats as quantization-aware "fake quantization" (quantize, then
dequantize straight back), and the KV cache may store them packed. This module is written so that both
come out of one code path: ``unpack_*(pack_*(x))`` equals ``*_fake_quant(x)`` bit for bit.

Numerics follow the official V4.1 kernels as ported to torch in S0 (``kernel_cpu.py``), the authority
where the spec is silent:

* Power-of-two scales are ``2^ceil(log2(amax * fp32(1/fmt_max)))``, where the ceiling is taken from the
  IEEE-754 bits (exponent, plus one if any mantissa bit is set) of the fp32 product with the
  *reciprocal* as an fp32 constant. Multiplying by the rounded reciprocal is not the same as dividing
  by ``fmt_max``: ``amax = 448`` gives a ratio one ulp above 1 and hence a scale of 2, not 1.
* Everything is computed in fp32 from the input (the model feeds bf16), then the dequantized result is
  cast back to the input dtype. The dequantized values are exact in bf16 (at most 6 significant bits),
  so that cast never rounds.
* FP32 -> E4M3 is round-to-nearest-even with saturation at +-448; FP32 -> E2M1 is round-to-nearest-even
  with saturation at +-6. The sign of zero is kept (a small negative input becomes -0).

Everything is plain, vectorized PyTorch and runs on CPU and CUDA. Divisions are always tensor by tensor
on the input's device: CUDA turns a division by a Python scalar into a multiplication by its rounded
reciprocal, which would change the E4M3 rounding of ``amax / 6`` at ties.
"""

from __future__ import annotations

import struct

import torch

# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
# The eight E2M1 magnitudes, indexed by the 3-bit code (exponent bits, mantissa bit).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

E8M0_BIAS = 127
E8M0_NAN = 255

# Block sizes used by V4.1-Flash.
FP8_BLOCK = 32  # FP8 weights: 32x32 blocks; FP8 activations / window KV: 32 values per scale
FP4_WEIGHT_BLOCK = 32  # FP4 expert weights: one UE8M0 per 32 values along K
MXFP4_BLOCK = 32  # indexer keys and queries
FP4_E4M3_BLOCK = 16  # main compressed KV

# Lower bounds on a block's amax, so that an all-zero block still gets a finite, nonzero scale.
FP8_AMAX_FLOOR = 1e-4  # act_quant (compared in fp32)
MXFP4_AMAX_FLOOR = 6 * 2.0**-126  # scale >= 2^-126, the smallest normal fp32
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9  # scale >= 2^-9, the smallest E4M3 subnormal
# Weight quantization (checkpoint writing) only needs the scale to stay nonzero.
_WEIGHT_AMAX_FLOOR = torch.finfo(torch.float32).tiny

# Boundaries between consecutive E2M1 magnitudes (the midpoints of E2M1_GRID). A magnitude exactly
# on a boundary rounds to the neighbour with the even code: upward across 0.75, 1.75 and 3.5 (to
# 1, 2, 4 = codes 2, 4, 6), downward across 0.25, 1.25, 2.5 and 5 (to 0, 1, 2, 4).
_E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_GOES_UP = (False, True, False, True, False, True, False)
# The boundaries where a tie goes up, moved to the next fp32 below: "magnitude > that" is "magnitude >= b".
_E2M1_BELOW_BOUNDARIES = tuple(
    struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", b))[0] - 1))[0] if up else b
    for b, up in zip(_E2M1_BOUNDARIES, _E2M1_TIE_GOES_UP))


# Small constant tensors, built once per device and then reused (read-only). Building one per call cost
# several operator calls and, on CUDA, a blocking host-to-device copy in every quantization: the training
# step of the tiny recipe quantizes hundreds of times (docs/performance.md, "Training step").
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(values: float | tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # repr: keeps 0.0 and -0.0 apart. A tensor's .device is already a torch.device: constructing another
    # would be an operator call per lookup.
    key = (repr(values), dtype, device if isinstance(device, torch.device) else torch.device(device))
    t = _CONSTANTS.get(key)
    if t is None:
        # an ordinary tensor even when the first caller runs under inference_mode (an inference tensor
        # could not be used later in a forward that records gradients)
        with torch.inference_mode(False), torch.no_grad():
            t = torch.tensor(values, dtype=dtype, device=device)
        _CONSTANTS[key] = t
    return t


def _grid_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values by 4-bit code: codes 8..15 are the negatives of 0..7 (code 8 is -0.0)."""
    return _constant(E2M1_GRID + tuple(-v for v in E2M1_GRID), torch.float32, device)


def _fp32_const(value: float, device: torch.device) -> torch.Tensor:
    return _constant(float(value), torch.float32, device)


def _split_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., N] -> [..., N // block, block]; N must be a multiple of block."""
    # unflatten checks the size itself: reading it first would be one more operator call per quantization
    try:
        return x.unflatten(-1, (-1, block))
    except RuntimeError:
        n = x.size(-1)
        if n % block != 0:
            raise ValueError(f"last dimension {n} is not a multiple of the block size {block}") from None
        return x.unflatten(-1, (n // block, block))  # N == 0: -1 cannot be inferred


# --------------------------------------------------------------------------------------------------
# Raw-byte views: safetensors hands out I8 / U8 / F8_* tensors; accept all of them.
# --------------------------------------------------------------------------------------------------

_ONE_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _ONE_BYTE_DTYPES:
        raise TypeError(f"expected a one-byte tensor (uint8/int8/float8/float4_x2), got {t.dtype}")
    return t.view(torch.uint8)


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """E4M3 values given as float8_e4m3fn or as their raw bytes (uint8/int8)."""
    if t.dtype == torch.float8_e4m3fn:
        return t
    if t.dtype in (torch.uint8, torch.int8):
        return t.view(torch.float8_e4m3fn)
    raise TypeError(f"expected float8_e4m3fn or raw uint8/int8 bytes, got {t.dtype}")


def _e8m0_scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A UE8M0 scale as fp32, given as float8_e8m0fnu, raw bytes, or already-decoded floats."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8, torch.int8):
        return e8m0_to_float(scale)
    if scale.is_floating_point():
        return scale.float()
    raise TypeError(f"unsupported scale dtype {scale.dtype}")


# --------------------------------------------------------------------------------------------------
# UE8M0
# --------------------------------------------------------------------------------------------------


def ue8m0_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """The power-of-two block scale 2^ceil(log2(amax / fmt_max)), as the kernels compute it.

    ratio = amax * fp32(1 / fmt_max) in fp32; its ceiling power of two is read off the bits: the biased
    exponent, plus one when any mantissa bit is set. Returns fp32. (A subnormal ratio yields 2^-126.)
    """
    # A Python float operand is cast to fp32 by the kernel (CPU and CUDA alike), the same value as the
    # fp32 constant tensor; a multiplication (unlike a division) is not rewritten on CUDA.
    bits = (amax.float() * (1.0 / fmt_max)).view(torch.int32)
    return _ceil_pow2_bits(bits.bitwise_and_(0x7FFFFFFF)).view(torch.float32)


def _ceil_pow2_bits(bits: torch.Tensor) -> torch.Tensor:
    """In place on the int32 bits of a sign-cleared fp32 ratio: the bits of its ceiling power of two,
    (exponent + any mantissa bit set) << 23, read off the bits with two operators instead of six.

    Adding 0x7FFFFF carries into the exponent exactly when a mantissa bit is set, and the mask keeps the
    exponent field and bit 31. For a NaN ratio the exponent 0xFF plus one wraps into bit 31 in both forms
    (the integer add wraps on every backend), giving the bits of -0.0 as (0x100 << 23) did; a subnormal
    ratio gives 2^-126, zero gives +0."""
    return bits.add_(0x7FFFFF).bitwise_and_(-0x800000)  # -0x800000 == int32 0xFF800000


def e8m0_to_float(e8m0: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8, int8 or float8_e8m0fnu) -> fp32: 2^(byte - 127); 255 is NaN; 0 is 2^-127."""
    b = _as_bytes(e8m0)
    # one gather from the 256 decoded values (built once per device) instead of a shift and two selects
    return _e8m0_table(b.device)[b.int()]


def _e8m0_table(device: torch.device) -> torch.Tensor:
    """fp32 values of the 256 UE8M0 bytes: b << 23 for 1..254, the subnormal 2^-127 for 0, NaN
    (0x7FC00000) for 255."""
    t = _CONSTANTS.get(("e8m0", device))
    if t is None:
        bits = [0x00400000] + [b << 23 for b in range(1, 255)] + [0x7FC00000]
        with torch.inference_mode(False), torch.no_grad():
            t = torch.tensor(bits, dtype=torch.int32, device=device).view(torch.float32)
        _CONSTANTS[("e8m0", device)] = t
    return t


def float_to_e8m0(pow2: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Powers of two (2^-127 .. 2^127) -> UE8M0 bytes (uint8). NaN -> 255.

    With check=True, anything else (not a power of two, <= 0, out of range, inf) raises ValueError;
    with check=False (hot paths whose scales are powers of two by construction) no sync is done and
    inf also maps to 255.
    """
    bits = pow2.float().view(torch.int32)
    if check:
        biased_exponent = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        is_nan = (biased_exponent == 0xFF) & (mantissa != 0)
        is_min = (biased_exponent == 0) & (mantissa == 0x400000)  # 2^-127 is an fp32 subnormal
        normal_pow2 = (bits > 0) & (biased_exponent > 0) & (biased_exponent < 0xFF) & (mantissa == 0)
        bad = ~(normal_pow2 | is_min | is_nan)
        if bool(bad.any()):
            raise ValueError(f"not a power of two in [2^-127, 2^127]: {pow2.float()[bad][:4].tolist()}")
    # The byte is the biased exponent field for every input: 2^-127 (exponent field 0) gives 0, NaN and
    # inf (field 0xFF) give 255. The uint8 cast keeps the low byte of the arithmetic shift, which is that
    # field whatever the sign.
    return (bits >> 23).to(torch.uint8)


# --------------------------------------------------------------------------------------------------
# E4M3 and E2M1 element formats
# --------------------------------------------------------------------------------------------------


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448 (the CUDA satfinite cast)."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Floats -> 4-bit E2M1 codes (uint8, bit 3 = sign), round-to-nearest-even, saturating at +-6.

    The code of a magnitude is the number of grid boundaries below it, counting a boundary it sits
    exactly on only where rounding to even goes up. The sign bit is copied, so -0.0 and small negatives
    that round to zero get code 8.
    """
    xf = x.float()
    # "above b, or on b where ties go up" is "above the fp32 just below b" for those b: one comparison
    # (NaN compares false with every boundary either way and keeps code 0)
    boundaries = _constant(_E2M1_BELOW_BOUNDARIES, torch.float32, xf.device)
    code = (xf.abs().unsqueeze(-1) > boundaries).sum(dim=-1, dtype=torch.uint8)
    return code | (torch.signbit(xf).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (low 4 bits of any integer tensor) -> fp32. Code 8 decodes to -0.0 (== 0)."""
    return _grid_table(codes.device)[(codes.to(torch.int64) & 0xF)]


def _decode_fp4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """e2m1_decode(unpack_fp4(packed)) with one gather: a table of the two values of each of the 256 bytes
    (low nibble first), built once per device."""
    b = _as_bytes(packed)
    device = b.device
    t = _CONSTANTS.get(("e2m1 pairs", device))
    if t is None:
        grid = E2M1_GRID + tuple(-v for v in E2M1_GRID)
        pairs = [(grid[v & 0xF], grid[v >> 4]) for v in range(256)]
        with torch.inference_mode(False), torch.no_grad():
            t = torch.tensor(pairs, dtype=torch.float32, device=device)
        _CONSTANTS[("e2m1 pairs", device)] = t
    # an embedding lookup (rows of the [256, 2] table): 3.6x faster on the CPU than advanced indexing
    return torch.nn.functional.embedding(b.long(), t).flatten(-2)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round onto the E2M1 grid (nearest, ties to even, saturating at +-6); returns fp32."""
    return e2m1_decode(e2m1_encode(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., K] -> bytes [..., K // 2] (uint8): element 2i in the low nibble, 2i+1 high."""
    if codes.size(-1) % 2 != 0:
        raise ValueError("pack_fp4 needs an even number of codes along the last dimension")
    c = codes.to(torch.uint8) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes [..., K // 2] (uint8, int8 or float4_e2m1fn_x2) -> 4-bit codes [..., K] (uint8)."""
    b = _as_bytes(packed)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------------
# Block quantizers shared by the fake-quant and the pack paths
# --------------------------------------------------------------------------------------------------


def _quantize_fp8_ue8m0(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (E4M3 values [..., G, block], fp32 power-of-two scales [..., G])."""
    values, scale, _ = _fp8_ue8m0_blocks(x.float(), block)
    return values, scale.squeeze(-1)


_FP8_RATIO = 1.0 / FP8_E4M3_MAX  # cast to fp32 by the multiplication, as ue8m0_scale's constant


def _fp8_ue8m0_blocks(xf: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 x -> (E4M3 values [..., G, block], fp32 scales [..., G, 1], their int32 bits [..., G, 1]).

    `_quantize_fp8_ue8m0`'s numbers with the fewest operators: every quantized GEMM's activation passes
    here, so a decode step runs it over a hundred times. The max of |x| is one reduction (the inf-norm:
    max |x|, NaN propagating, as abs().amax()); the scale's arithmetic is ue8m0_scale's, in place on
    temporaries (the amax is >= the floor or NaN, never negative, so the sign needs no clearing); the
    clamp before the cast is to_e4m3's."""
    groups = _split_blocks(xf, block)
    amax = torch.linalg.vector_norm(groups, float("inf"), dim=-1, keepdim=True)
    if torch.is_grad_enabled():  # out of place: a graph through x may need these values in a backward
        bits = (amax.clamp_min(FP8_AMAX_FLOOR) * _FP8_RATIO).view(torch.int32)
        bits = bits.add(0x7FFFFF).bitwise_and_(-0x800000)
        scale = bits.view(torch.float32)
        return to_e4m3(groups / scale), scale, bits
    bits = _ceil_pow2_bits(amax.clamp_min_(FP8_AMAX_FLOOR).mul_(_FP8_RATIO).view(torch.int32))
    scale = bits.view(torch.float32)
    q = (groups / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale, bits


def fp8_fake_quant_f32(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp8_fake_quant(x, block) in fp32, without the cast back to x's dtype.

    For a bf16 or fp32 x, fp8_fake_quant(x).float() equals this bit for bit: E4M3 values times a power of
    two of at least 2^-22 (the amax floor) have at most 4 significant bits and a normal exponent, so the
    bf16 round trip is exact (an overflow is inf either way); only a NaN's payload would be canonicalized
    there, and a GEMM fed from here rounds its output, which canonicalizes NaN anyway (Linear.forward)."""
    values, scale, _ = _fp8_ue8m0_blocks(x.float(), block)
    return (values.float() * scale).flatten(-2)


def _quantize_mxfp4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (E2M1 codes [..., G, block], fp32 power-of-two scales [..., G]).

    scale = 2^ceil(log2(amax/6)) guarantees |x / scale| <= 6, and the encoder saturates anyway.
    """
    groups = _split_blocks(x.float(), block)
    amax = groups.abs().amax(dim=-1).clamp_min(MXFP4_AMAX_FLOOR)
    scale = ue8m0_scale(amax, FP4_E2M1_MAX)
    return e2m1_encode(groups / scale.unsqueeze(-1)), scale


def _quantize_fp4_e4m3(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (E2M1 codes [..., G, block], E4M3 scales [..., G]).

    scale = e4m3(amax / 6) (true division, then RNE); it may round below amax/6, in which case the
    largest elements saturate at 6.
    """
    groups = _split_blocks(x.float(), block)
    amax = groups.abs().amax(dim=-1).clamp_min(FP4_E4M3_AMAX_FLOOR)
    scale = to_e4m3(amax / _fp32_const(FP4_E2M1_MAX, x.device))
    return e2m1_encode(groups / scale.float().unsqueeze(-1)), scale


# --------------------------------------------------------------------------------------------------
# Fake quantization (QAT in the forward)
# --------------------------------------------------------------------------------------------------


def fp8_fake_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """E4M3 with one UE8M0 scale per `block` values along the last dim (amax floor 1e-4), and back.

    The window KV applies it over all 512 dims, RoPE tail included. Returns x's dtype.
    """
    return fp8_fake_quant_f32(x, block).to(x.dtype)


def mxfp4_fake_quant(x: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """MXFP4 (E2M1, UE8M0 = 2^ceil(log2(amax/6)) per `block`, amax floor 6*2^-126), and back.

    Used on the indexer keys and queries. Returns x's dtype.
    """
    codes, scale = _quantize_mxfp4(x, block)
    return (e2m1_decode(codes) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_e4m3_fake_quant(x: torch.Tensor, block: int = FP4_E4M3_BLOCK) -> torch.Tensor:
    """E2M1 with one E4M3 scale e4m3(amax/6) per `block` (amax floor 6*2^-9, no global scale), and back.

    Used on the main compressed KV. Returns x's dtype.
    """
    codes, scale = _quantize_fp4_e4m3(x, block)
    return (e2m1_decode(codes) * scale.float().unsqueeze(-1)).flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Packed storage (KV cache). unpack_*(pack_*(x)) == *_fake_quant(x), bit for bit.
# --------------------------------------------------------------------------------------------------


def pack_fp8_ue8m0(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (E4M3 bytes [..., N] uint8, UE8M0 bytes [..., N // block] uint8).

    A 512-dim window KV entry takes 512 + 16 = 528 bytes.
    """
    values, _, bits = _fp8_ue8m0_blocks(x.float(), block)
    # the UE8M0 byte is the scale's exponent field (float_to_e8m0), read off the bits at hand
    return values.flatten(-2).view(torch.uint8), (bits >> 23).to(torch.uint8).squeeze(-1)


def unpack_fp8_ue8m0(
    codes: torch.Tensor, scales: torch.Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(E4M3 bytes [..., N], UE8M0 bytes [..., N // block]) -> values [..., N] in `dtype`."""
    values = _split_blocks(_as_e4m3(codes).float(), block)
    return _to(values.mul_(e8m0_to_float(scales).unsqueeze(-1)).flatten(-2), dtype)


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (fp32) in `dtype`: skips the call when nothing changes (`.to` returns x itself then)."""
    return x if dtype == torch.float32 else x.to(dtype)


def pack_mxfp4(x: torch.Tensor, block: int = MXFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (packed E2M1 [..., N // 2] uint8, UE8M0 bytes [..., N // block] uint8).

    A 128-dim indexer key takes 64 + 4 = 68 bytes.
    """
    codes, scale = _quantize_mxfp4(x, block)
    return pack_fp4(codes.flatten(-2)), float_to_e8m0(scale, check=False)


def unpack_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, block: int = MXFP4_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(packed E2M1 [..., N // 2], UE8M0 bytes [..., N // block]) -> values [..., N] in `dtype`."""
    values = _split_blocks(_decode_fp4_pairs(packed), block)
    return _to(values.mul_(e8m0_to_float(scales).unsqueeze(-1)).flatten(-2), dtype)


def pack_fp4_e4m3(x: torch.Tensor, block: int = FP4_E4M3_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (packed E2M1 [..., N // 2] uint8, E4M3 scale bytes [..., N // block] uint8).

    A 512-dim main compressed KV entry takes 256 + 32 = 288 bytes.
    """
    codes, scale = _quantize_fp4_e4m3(x, block)
    return pack_fp4(codes.flatten(-2)), scale.view(torch.uint8)


def unpack_fp4_e4m3(
    packed: torch.Tensor, scales: torch.Tensor, block: int = FP4_E4M3_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(packed E2M1 [..., N // 2], E4M3 scale bytes [..., N // block]) -> values [..., N] in `dtype`."""
    values = _split_blocks(_decode_fp4_pairs(packed), block)
    return _to(values.mul_(_as_e4m3(scales).float().unsqueeze(-1)).flatten(-2), dtype)


def packed_nbytes(fmt: str, dim: int) -> int:
    """Bytes one packed vector of `dim` values takes: 'fp8_ue8m0' (block 32), 'mxfp4' (block 32) or
    'fp4_e4m3' (block 16). E.g. fp8_ue8m0 512 -> 528, mxfp4 128 -> 68, fp4_e4m3 512 -> 288."""
    if fmt == "fp8_ue8m0":
        return dim + dim // FP8_BLOCK
    if fmt == "mxfp4":
        return dim // 2 + dim // MXFP4_BLOCK
    if fmt == "fp4_e4m3":
        return dim // 2 + dim // FP4_E4M3_BLOCK
    raise ValueError(f"unknown packed format {fmt!r}")


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


def _expand_block_scale(scale: torch.Tensor, out_features: int, in_features: int, block: int) -> torch.Tensor:
    """[ceil(out/block), ceil(in/block)] -> [out, in]: each scale repeated over its block, edges cropped."""
    return scale.repeat_interleave(block, dim=0)[:out_features].repeat_interleave(block, dim=1)[:, :in_features]


def dequant_fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """FP8 E4M3 weight [out, in] with UE8M0 scales [ceil(out/block), ceil(in/block)] -> `dtype` [out, in].

    Shapes need not be multiples of the block: the last row/column blocks are partial.
    """
    w = _as_e4m3(weight).float()
    out_features, in_features = w.shape
    s = _e8m0_scale_to_float(scale)
    expected = (-(-out_features // block), -(-in_features // block))
    if tuple(s.shape) != expected:
        raise ValueError(f"scale shape {tuple(s.shape)} does not match weight {tuple(w.shape)}: expected {expected}")
    return (w * _expand_block_scale(s, out_features, in_features, block)).to(dtype)


def quant_fp8_weight(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/block), ceil(in/block)]).

    Each block x block tile gets the scale 2^ceil(log2(amax/448)) (the same rounding as act_quant), so
    nothing saturates; an all-zero tile gets 2^-126. Partial edge tiles are handled by zero padding.
    """
    w = weight.float()
    out_features, in_features = w.shape
    pad_rows, pad_cols = -out_features % block, -in_features % block
    padded = torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))
    tiles = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, block, C, block]
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(_WEIGHT_AMAX_FLOOR)  # [R, C]
    scale = ue8m0_scale(amax, FP8_E4M3_MAX)
    q = to_e4m3(w / _expand_block_scale(scale, out_features, in_features, block))
    return q, float_to_e8m0(scale).view(torch.float8_e8m0fnu)


def fp8_weight_fake_quant(weight: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """``dequant_fp8_weight(*quant_fp8_weight(w))`` for weights [..., out, in], fp32, without the byte encoding.

    Quantization-aware training rounds every FP8 master onto its grid in every forward. The stored
    checkpoint's round trip through UE8M0 bytes is exact for the power-of-two scales that finite weights
    get, so the tile scale can multiply straight back: the same values with a third of the operators and
    without `float_to_e8m0`'s validity check (a host sync). Leading dims hold independent weights (the
    routed experts, stacked). tests/test_train_ops.py compares it with the round trip.
    """
    w = weight.float()
    out_features, in_features = w.shape[-2:]
    pad_rows, pad_cols = -out_features % block, -in_features % block
    if pad_rows or pad_cols:
        w = torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))
    tiles = w.unflatten(-2, (-1, block)).unflatten(-1, (-1, block))  # [..., R, block, C, block]
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(_WEIGHT_AMAX_FLOOR)
    scale = ue8m0_scale(amax, FP8_E4M3_MAX)
    values = to_e4m3(tiles / scale).float() * scale
    return values.flatten(-2).flatten(-3, -2)[..., :out_features, :in_features]


def dequant_fp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_WEIGHT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed E2M1 weight [out, in // 2] (int8 "I8", uint8 or float4_e2m1fn_x2) with one UE8M0 per
    `block` values along `in` ([out, in // block]) -> `dtype` [out, in]."""
    values = e2m1_decode(unpack_fp4(packed))
    out_features, in_features = values.shape
    s = _e8m0_scale_to_float(scale)
    if tuple(s.shape) != (out_features, in_features // block) or in_features % block:
        raise ValueError(f"scale shape {tuple(s.shape)} does not match an FP4 weight [{out_features}, {in_features}]")
    return (values * s.repeat_interleave(block, dim=1)).to(dtype)


def quant_fp4_weight(weight: torch.Tensor, block: int = FP4_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [out, in] -> (packed E2M1 uint8 [out, in // 2], float8_e8m0fnu [out, in // block]).

    MXFP4 per row: scale 2^ceil(log2(amax/6)) per `block` along `in`, E2M1 round-to-nearest-even.
    For a safetensors "I8" tensor write ``packed.view(torch.int8)``.
    """
    codes, scale = _quantize_mxfp4(weight, block)
    return pack_fp4(codes.flatten(-2)), float_to_e8m0(scale).view(torch.float8_e8m0fnu)


# E2M1 magnitudes reach 6, and 6 * 2^6 = 384 <= 448 < 6 * 2^7: within one FP8 tile the FP4 scales can be
# shifted by up to 6 bits into the E4M3 values.
_FP4_TO_FP8_MAX_OFFSET = 2.0**6


def fp4_weight_to_fp8(
    packed: torch.Tensor,
    scale: torch.Tensor,
    block: int = FP8_BLOCK,
    fp4_block: int = FP4_WEIGHT_BLOCK,
    check_lossless: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 expert weight -> FP8 weight with block x block UE8M0 tiles, as the official convert's
    ``--expert-dtype fp8`` does (spec §6).

    Per tile, the new scale is max(FP4 scales in the tile) / 2^6 and each E2M1 value is multiplied by
    its own group's offset = fp4_scale / tile_scale (a power of two <= 2^6) and stored as E4M3; so
    value * fp4_scale == e4m3 * tile_scale. This is exact whenever every group's scale in a tile is at
    least 2^-14 of the tile's largest (offset >= 2^-8 keeps 0.5 * offset on the E4M3 subnormal grid);
    check_lossless=True verifies the round trip and raises ValueError otherwise. -0 becomes +0, as in the
    official table. Returns (float8_e4m3fn [out, in], float8_e8m0fnu [out // block, in // block]).
    """
    values = e2m1_decode(unpack_fp4(packed)) + 0.0  # -0.0 + 0.0 == +0.0
    out_features, in_features = values.shape
    if out_features % block or in_features % block or block % fp4_block:
        raise ValueError(f"[{out_features}, {in_features}] is not tiled by {block}x{block} / groups of {fp4_block}")
    group_scale = _e8m0_scale_to_float(scale)  # [out, in // fp4_block]
    groups_per_tile_row = block // fp4_block
    tiles = group_scale.view(out_features // block, block, in_features // block, groups_per_tile_row)
    tile_scale = tiles.amax(dim=(1, 3)) / _fp32_const(_FP4_TO_FP8_MAX_OFFSET, values.device)  # [R, C]
    tile_scale_per_group = tile_scale.repeat_interleave(block, dim=0).repeat_interleave(groups_per_tile_row, dim=1)
    offset = (group_scale / tile_scale_per_group).repeat_interleave(fp4_block, dim=1)  # [out, in]
    weight_fp8 = to_e4m3(values * offset)
    scale_fp8 = float_to_e8m0(tile_scale).view(torch.float8_e8m0fnu)
    if check_lossless:
        original = values * group_scale.repeat_interleave(fp4_block, dim=1)
        converted = dequant_fp8_weight(weight_fp8, scale_fp8, block)
        lost = original != converted
        if bool(lost.any()):
            raise ValueError(f"FP4 -> FP8 conversion is not exact for {int(lost.sum())} values")
    return weight_fp8, scale_fp8


# --------------------------------------------------------------------------------------------------
# Quantized GEMM reference paths (act_quant + fp8_gemm / fp4_gemm numerics)
# --------------------------------------------------------------------------------------------------


def act_quant(
    x: torch.Tensor, block: int = FP8_BLOCK, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 activation quantization with UE8M0 scales (the V4.1 `scale_fmt="ue8m0"` path).

    Returns (float8_e4m3fn [..., K], scales [..., K // block] in `scale_dtype`: fp32 or float8_e8m0fnu).
    """
    values, scale = _quantize_fp8_ue8m0(x, block)
    return values.flatten(-2), scale.to(scale_dtype)


def _block_scaled_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, block: int
) -> torch.Tensor:
    """sum over K blocks k of (A_k @ B_k^T) * a_scale[:, k] * b_scale[:, k], in fp32.

    a [M, K] and b [N, K] hold the unscaled FP8/FP4 values, a_scale [M, K // block], b_scale
    [N, K // block]. Each block's product is computed on its own and the scaled partials are added in K
    order, as the kernels accumulate: the order of fp32 additions decides the last bits.
    """
    m, k = a.shape
    acc = torch.zeros(m, b.size(0), dtype=torch.float32, device=a.device)
    for kb in range(k // block):
        cols = slice(kb * block, (kb + 1) * block)
        acc += (a[:, cols] @ b[:, cols].T) * a_scale[:, kb : kb + 1] * b_scale[:, kb]
    return acc


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: int = FP8_BLOCK,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x @ W^T with FP8 activations (act_quant, 1 x block) and an FP8 weight (block x block tiles).

    weight: [N, K] float8_e4m3fn or raw bytes; weight_scale: [ceil(N/block), K // block] UE8M0
    (float8_e8m0fnu, raw bytes, or decoded floats). Returns [..., N] in out_dtype (default x.dtype).
    """
    k = x.size(-1)
    q, a_scale = act_quant(x, block)
    w = _as_e4m3(weight).float()
    n = w.size(0)
    w_scale = _e8m0_scale_to_float(weight_scale)
    if w.size(1) != k or tuple(w_scale.shape) != (-(-n // block), k // block):
        raise ValueError(f"weight {tuple(w.shape)} / scale {tuple(w_scale.shape)} do not fit K={k}, block={block}")
    w_scale_per_row = w_scale.repeat_interleave(block, dim=0)[:n]
    y = _block_scaled_matmul(q.reshape(-1, k).float(), a_scale.reshape(-1, k // block), w, w_scale_per_row, block)
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


def fp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    block: int = FP4_WEIGHT_BLOCK,
    act_block: int = FP8_BLOCK,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x @ W^T with FP8 activations (act_quant, 1 x act_block) and an FP4 weight.

    weight_packed: [N, K // 2] packed E2M1 (int8/uint8/float4_e2m1fn_x2); weight_scale: [N, K // block]
    UE8M0. The product runs block by block along K, the activation scale of a weight block being that of
    the activation block containing it. Returns [..., N] in out_dtype (default x.dtype).
    """
    k = x.size(-1)
    if act_block % block:
        raise ValueError("the activation block must be a multiple of the FP4 weight block")
    q, a_scale = act_quant(x, act_block)
    a_scale_per_block = a_scale.reshape(-1, k // act_block).repeat_interleave(act_block // block, dim=1)
    w = e2m1_decode(unpack_fp4(weight_packed))
    n = w.size(0)
    w_scale = _e8m0_scale_to_float(weight_scale)
    if w.size(1) != k or tuple(w_scale.shape) != (n, k // block):
        raise ValueError(f"FP4 weight [{n}, {w.size(1)}] / scale {tuple(w_scale.shape)} do not fit K={k}")
    y = _block_scaled_matmul(q.reshape(-1, k).float(), a_scale_per_block, w, w_scale, block)
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)
