"""Tests for model/formats.py.

The fake quantizers are checked against slow scalar references written here from the definitions
(nearest representable value, ties to even, scales from exact log2 arithmetic), not from the module's
code, so a wrong rounding rule, scale formula or amax floor fails.
"""

import math
import struct

import pytest
import torch
import torch.nn.functional as Fnn

from dsv41.model import formats as F

# --------------------------------------------------------------------------------------------------
# Scalar references
# --------------------------------------------------------------------------------------------------


def f32(v: float) -> float:
    """Round a Python float to the nearest fp32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _e4m3_positive_table() -> list[float]:
    """All finite non-negative E4M3 (fn) values by code 0..126 (code 127 is NaN)."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            values.append(mantissa * 2.0**-9)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


E4M3_TABLE = _e4m3_positive_table()
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def round_to_table(v: float, table: list[float]) -> float:
    """Nearest table value to v (saturating), ties to the even index; the sign is kept (also for 0)."""
    mag = min(abs(v), table[-1])
    best = min(range(len(table)), key=lambda i: (abs(table[i] - mag), i % 2))
    return math.copysign(table[best], v)


def scalar_pow2_scale(amax: float, fmt_max: float) -> float:
    """2^ceil(log2(r)) with r = fp32(amax * fp32(1/fmt_max)), via exact frexp."""
    r = f32(f32(amax) * f32(1.0 / fmt_max))
    mantissa, exponent = math.frexp(r)  # r = mantissa * 2^exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def slow_fake_quant(x: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    """Loop over blocks and elements; returns float32 values, cast to x.dtype like the model does."""
    flat = x.float().reshape(-1, x.size(-1)).tolist()
    out = []
    for row in flat:
        new_row = []
        for start in range(0, len(row), block):
            group = row[start : start + block]
            amax = max(abs(v) for v in group)
            if kind == "fp8":
                scale = scalar_pow2_scale(max(amax, f32(1e-4)), 448.0)
                new_row += [round_to_table(v / scale, E4M3_TABLE) * scale for v in group]
            elif kind == "mxfp4":
                scale = scalar_pow2_scale(max(amax, 6 * 2.0**-126), 6.0)
                new_row += [round_to_table(v / scale, E2M1_TABLE) * scale for v in group]
            elif kind == "fp4_e4m3":
                scale = round_to_table(f32(max(amax, 6 * 2.0**-9) / 6.0), E4M3_TABLE)
                new_row += [round_to_table(f32(v / scale), E2M1_TABLE) * scale for v in group]
        out.append(new_row)
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape).to(x.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern, so that -0.0 != 0.0 and NaN == NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{int(diff.sum())} differ, e.g. {a[diff][:5].tolist()} vs {b[diff][:5].tolist()}"


def sample_activations(rows: int, dim: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Values over many magnitudes, with exact zeros, negative zeros, outliers and grid-aligned entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    x = x * torch.where(torch.rand(rows, dim, generator=g) < 0.05, 40.0, 1.0)
    aligned = torch.randint(-96, 97, (rows, dim), generator=g).float() / 16
    x = torch.where(torch.rand(rows, dim, generator=g) < 0.3, aligned, x)
    x[torch.rand(rows, dim, generator=g) < 0.05] = 0.0
    x[torch.rand(rows, dim, generator=g) < 0.05] = -0.0
    x[0] = 0.0  # an all-zero row exercises the amax floors
    x[1] = x[1] * 2.0**-24  # so does a row of tiny values (amax < 1e-4 for FP8)
    return x.to(dtype)


# --------------------------------------------------------------------------------------------------
# Element formats
# --------------------------------------------------------------------------------------------------


def test_constants():
    assert F.FP8_E4M3_MAX == 448.0 and F.FP4_E2M1_MAX == 6.0
    assert F.E2M1_GRID == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert float(torch.finfo(torch.float8_e4m3fn).max) == F.FP8_E4M3_MAX


def test_e2m1_grid_values_are_fixed_points():
    grid = torch.tensor(F.E2M1_GRID)
    assert torch.equal(F.e2m1_round(grid), grid)
    assert torch.equal(F.e2m1_round(-grid[1:]), -grid[1:])
    assert F.e2m1_encode(grid).tolist() == list(range(8))
    assert F.e2m1_encode(-grid[1:]).tolist() == list(range(9, 16))


@pytest.mark.parametrize(
    "value, expected",
    [
        (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),  # ties
        (0.2500001, 0.5), (0.7499999, 0.5), (2.5000002, 3.0), (4.9999995, 4.0), (5.0000005, 6.0),
        (6.5, 6.0), (1e9, 6.0), (float("inf"), 6.0),  # saturation
        (-0.75, -1.0), (-2.5, -2.0), (-5.0, -4.0), (-7.0, -6.0),
    ],
)
def test_e2m1_round_to_nearest_even(value, expected):
    assert F.e2m1_round(torch.tensor([value])).item() == expected


def test_e2m1_sign_and_negative_zero():
    codes = F.e2m1_encode(torch.tensor([0.0, -0.0, -0.1, 0.1, -6.0]))
    assert codes.tolist() == [0, 8, 8, 0, 15]
    decoded = F.e2m1_decode(codes)
    assert decoded[1].item() == 0.0 and decoded[2].item() == 0.0  # code 8 decodes to (negative) zero
    assert torch.signbit(decoded[1])  # the sign of zero survives the round trip


def test_e2m1_encode_matches_scalar_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=g) * 3, torch.arange(-28, 29) / 4.0])
    expected = torch.tensor([round_to_table(v, E2M1_TABLE) for v in x.tolist()])
    assert_bitwise_equal(F.e2m1_round(x), expected)


def test_e2m1_decode_table():
    values = F.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert values.dtype == torch.float32


def test_pack_fp4_nibble_order_and_round_trip():
    codes = torch.tensor([[1, 2, 3, 4, 15, 8]], dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x43, 0x8F]]  # even index in the low nibble
    assert torch.equal(F.unpack_fp4(packed), codes)
    # the same bytes as read from safetensors "I8" or viewed as torch's packed fp4 dtype
    assert torch.equal(F.unpack_fp4(packed.view(torch.int8)), codes)
    assert torch.equal(F.unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), codes)
    every = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(F.unpack_fp4(F.pack_fp4(every)), every)


def test_to_e4m3_matches_scalar_reference_with_saturation():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(3000, generator=g) * torch.exp2(torch.randint(-12, 10, (3000,), generator=g).float()),
                   torch.tensor([448.0, 464.0, 1000.0, -1e6, 2.0**-10, 3 * 2.0**-11, -0.0])])
    expected = torch.tensor([round_to_table(v, E4M3_TABLE) for v in x.tolist()])
    assert_bitwise_equal(F.to_e4m3(x).float(), expected)


# --------------------------------------------------------------------------------------------------
# UE8M0
# --------------------------------------------------------------------------------------------------


def test_e8m0_decode_table():
    values = F.e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    for b in range(255):
        assert values[b].item() == 2.0 ** (b - 127), b
    assert math.isnan(values[255].item())
    # same as torch's own dtype, and raw int8 bytes are accepted too
    as_torch = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu).float()
    assert_bitwise_equal(values[:255], as_torch[:255])
    assert_bitwise_equal(F.e8m0_to_float(torch.tensor([127, -1], dtype=torch.int8))[:1], torch.tensor([1.0]))


def test_float_to_e8m0_inverse_and_validation():
    pow2 = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [float("nan")])
    assert F.float_to_e8m0(pow2).tolist() == list(range(256))
    for bad in (3.0, 0.0, -1.0, float("inf"), 2.0**-130):
        with pytest.raises(ValueError):
            F.float_to_e8m0(torch.tensor([bad]))


def test_ue8m0_scale_matches_exact_log2():
    g = torch.Generator().manual_seed(2)
    amax = torch.cat([
        torch.rand(500, generator=g) * torch.exp2(torch.randint(-30, 30, (500,), generator=g).float()),
        torch.tensor([448.0, 896.0, 447.0, 449.0, 6.0, 12.0, 5.9, 6.1, 1e-4]),
    ]).bfloat16().float()
    for fmt_max in (448.0, 6.0):
        got = F.ue8m0_scale(amax, fmt_max)
        expected = torch.tensor([scalar_pow2_scale(a, fmt_max) for a in amax.tolist()])
        assert_bitwise_equal(got, expected)
    assert F.ue8m0_scale(torch.tensor([448.0, 449.0]), 448.0).tolist() == [1.0, 2.0]


# --------------------------------------------------------------------------------------------------
# Fake quantization against the scalar references
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "fake_quant, block, kind",
    [(F.fp8_fake_quant, 32, "fp8"), (F.mxfp4_fake_quant, 32, "mxfp4"), (F.fp4_e4m3_fake_quant, 16, "fp4_e4m3")],
)
def test_fake_quant_matches_scalar_reference(fake_quant, block, kind, dtype):
    x = sample_activations(6, 128, seed=3, dtype=dtype)
    got = fake_quant(x, block)
    assert got.dtype == dtype and got.shape == x.shape
    assert_bitwise_equal(got, slow_fake_quant(x, block, kind))


def test_fake_quant_keeps_leading_dims_and_is_idempotent():
    x = sample_activations(6, 512, seed=4).view(2, 3, 512)
    for fq in (F.fp8_fake_quant, F.mxfp4_fake_quant):
        once = fq(x)
        assert once.shape == (2, 3, 512)
        assert_bitwise_equal(fq(once), once)  # power-of-two scales: quantized values are fixed points


def test_fp4_e4m3_scale_rounds_ties_to_even():
    # amax / 6 = 3.1875 / 6 = 0.53125 lies exactly between the E4M3 values 0.5 and 0.5625:
    # round-to-nearest-even picks 0.5 (even mantissa), so 3.1875 / 0.5 = 6.375 saturates to 6 -> 3.0.
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 3.1875
    packed, scales = F.pack_fp4_e4m3(x)
    assert scales.view(torch.float8_e4m3fn).float().item() == 0.5
    assert F.fp4_e4m3_fake_quant(x)[0, 0].item() == 3.0


def test_amax_floors():
    zeros = torch.zeros(1, 32)
    assert F.e8m0_to_float(F.pack_fp8_ue8m0(zeros)[1]).item() == 2.0**-22  # 2^ceil(log2(1e-4/448))
    assert F.e8m0_to_float(F.pack_mxfp4(zeros)[1]).item() == 2.0**-126
    assert F.pack_fp4_e4m3(zeros[:, :16])[1].view(torch.float8_e4m3fn).float().item() == 2.0**-9
    for fq in (F.fp8_fake_quant, F.mxfp4_fake_quant, F.fp4_e4m3_fake_quant):
        assert torch.equal(fq(zeros), zeros)


# --------------------------------------------------------------------------------------------------
# Packed storage
# --------------------------------------------------------------------------------------------------

PACKERS = [
    (F.pack_fp8_ue8m0, F.unpack_fp8_ue8m0, F.fp8_fake_quant, 512, 528),
    (F.pack_mxfp4, F.unpack_mxfp4, F.mxfp4_fake_quant, 128, 68),
    (F.pack_fp4_e4m3, F.unpack_fp4_e4m3, F.fp4_e4m3_fake_quant, 512, 288),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pack, unpack, fake_quant, dim, nbytes", PACKERS)
def test_unpack_of_pack_equals_fake_quant_bitwise(pack, unpack, fake_quant, dim, nbytes, dtype):
    x = sample_activations(12, dim, seed=5, dtype=dtype).view(3, 4, dim)
    payload, scales = pack(x)
    assert payload.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert_bitwise_equal(unpack(payload, scales, dtype=dtype), fake_quant(x))
    # the fp32 unpack is exact: the bf16 fake-quant loses nothing in its final cast
    assert_bitwise_equal(unpack(payload, scales).to(dtype), fake_quant(x))


@pytest.mark.parametrize("pack, unpack, fake_quant, dim, nbytes", PACKERS)
def test_packed_byte_counts(pack, unpack, fake_quant, dim, nbytes):
    payload, scales = pack(torch.randn(dim))
    assert payload.numel() * payload.element_size() + scales.numel() * scales.element_size() == nbytes
    fmt = {F.pack_fp8_ue8m0: "fp8_ue8m0", F.pack_mxfp4: "mxfp4", F.pack_fp4_e4m3: "fp4_e4m3"}[pack]
    assert F.packed_nbytes(fmt, dim) == nbytes


def test_pack_rejects_partial_blocks():
    with pytest.raises(ValueError):
        F.pack_fp8_ue8m0(torch.randn(2, 40))


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(45, 70), (64, 96), (1, 33)])
def test_fp8_weight_round_trip_on_partial_blocks(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0] * 100 + shape[1])) * 0.05
    w[0, 0] = 2.0  # one large value in the first tile only
    q, scale = F.quant_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (math.ceil(shape[0] / 32), math.ceil(shape[1] / 32))
    deq = F.dequant_fp8_weight(q, scale)
    # per tile the error is at most half an E4M3 step at the tile's scale
    s = F.e8m0_to_float(scale)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = (slice(32 * r, 32 * r + 32), slice(32 * c, 32 * c + 32))
            tile_max = w[tile].abs().max().item()
            assert s[r, c].item() == scalar_pow2_scale(tile_max, 448.0)
            assert (deq[tile] - w[tile]).abs().max().item() <= 2.0**-4 * tile_max
    # quantizing the dequantized weight gives back the same values (the same bytes, except in a tile whose
    # maximum rounded down to 224 x its scale: there the second scale is half the first and every code one
    # exponent step up, CI's baseline-ISA draw once had such a tile), and raw bytes dequantize the same
    q2, scale2 = F.quant_fp8_weight(deq)
    assert torch.equal(F.dequant_fp8_weight(q2, scale2), deq)
    halved = deq.new_zeros(scale.shape, dtype=torch.bool)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = (slice(32 * r, 32 * r + 32), slice(32 * c, 32 * c + 32))
            halved[r, c] = deq[tile].abs().max().item() <= 224.0 * s[r, c].item()
    assert torch.equal(F.e8m0_to_float(scale2), torch.where(halved, s / 2, s))
    assert torch.equal(F.dequant_fp8_weight(q.view(torch.uint8), scale.view(torch.uint8)), deq)


def test_fp8_weight_requantizes_a_tile_whose_maximum_rounded_down_to_224_steps():
    """The case the round trip above allows for, made on purpose: a tile maximum of 225 x 2^-8 rounds to 224
    x 2^-8, so quantizing the dequantized weight again takes the scale 2^-9 and the same values."""
    w = torch.full((32, 32), 0.1 * 2.0**-8)
    w[0, 0] = 225 * 2.0**-8
    q, scale = F.quant_fp8_weight(w)
    deq = F.dequant_fp8_weight(q, scale)
    assert F.e8m0_to_float(scale).item() == 2.0**-8 and deq[0, 0].item() == 224 * 2.0**-8
    q2, scale2 = F.quant_fp8_weight(deq)
    assert F.e8m0_to_float(scale2).item() == 2.0**-9 and torch.equal(F.dequant_fp8_weight(q2, scale2), deq)


def test_dequant_fp8_weight_by_hand():
    w = torch.tensor([[1.5, -2.0] * 20] * 33).to(torch.float8_e4m3fn)  # [33, 40]: 2x2 tiles, partial
    scale_bytes = torch.tensor([[127, 130], [120, 0]], dtype=torch.uint8)
    deq = F.dequant_fp8_weight(w, scale_bytes)
    assert deq[0, 0].item() == 1.5 and deq[0, 33].item() == -2.0 * 8  # column 33 is odd -> -2
    assert deq[32, 0].item() == 1.5 * 2.0**-7 and deq[32, 39].item() == -2.0 * 2.0**-127
    with pytest.raises(ValueError):
        F.dequant_fp8_weight(w, scale_bytes[:1])


def test_fp4_weight_round_trip():
    w = torch.randn(8, 96)
    packed, scale = F.quant_fp4_weight(w)
    assert packed.shape == (8, 48) and packed.dtype == torch.uint8
    assert scale.shape == (8, 3) and scale.dtype == torch.float8_e8m0fnu
    deq = F.dequant_fp4_weight(packed.view(torch.int8), scale)  # "I8" bytes as in the checkpoint
    assert_bitwise_equal(deq, slow_fake_quant(w, 32, "mxfp4"))


def _random_fp4_weight(out_features, in_features, scale_spread, seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120 - scale_spread, 121, (out_features, in_features // 32), generator=g).to(torch.uint8)
    return packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("block, spread", [(32, 6), (32, 14), (128, 14)])
def test_fp4_weight_to_fp8_is_lossless(block, spread):
    packed, scale = _random_fp4_weight(256, 512, spread, seed=block + spread)
    w8, s8 = F.fp4_weight_to_fp8(packed, scale, block=block, check_lossless=True)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (256, 512)
    assert s8.dtype == torch.float8_e8m0fnu and s8.shape == (256 // block, 512 // block)
    assert torch.equal(F.dequant_fp8_weight(w8, s8, block), F.dequant_fp4_weight(packed, scale))
    # the largest group of each tile sits 6 bits above the tile scale: E2M1 6 -> E4M3 384
    assert w8.float().abs().max().item() == 384.0
    assert not torch.signbit(w8.float()[w8.float() == 0]).any()  # -0 (code 8) comes out as +0


def test_fp4_weight_to_fp8_detects_loss_beyond_2_to_14():
    packed, scale = _random_fp4_weight(64, 256, 24, seed=7)
    with pytest.raises(ValueError):
        F.fp4_weight_to_fp8(packed, scale, check_lossless=True)


# --------------------------------------------------------------------------------------------------
# Quantized GEMMs
# --------------------------------------------------------------------------------------------------


def test_act_quant_scales_and_values():
    x = sample_activations(4, 64, seed=8)
    q, s = F.act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (4, 2)
    assert_bitwise_equal((q.float().view(4, 2, 32) * s.unsqueeze(-1)).view(4, 64).bfloat16(), F.fp8_fake_quant(x))
    q8, s8 = F.act_quant(x, scale_dtype=torch.float8_e8m0fnu)
    assert s8.dtype == torch.float8_e8m0fnu and torch.equal(s8.float(), s)


def test_fp8_linear_matches_linear_on_dequantized_operands():
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 5, 256, generator=g) * 2).bfloat16()
    w = torch.randn(70, 256, generator=g) * 0.03  # 70 rows: a partial 32-row block
    w8, ws = F.quant_fp8_weight(w)
    y = F.fp8_linear(x, w8, ws)
    assert y.shape == (2, 5, 70) and y.dtype == torch.bfloat16
    w_deq = F.dequant_fp8_weight(w8, ws)
    # same operands, plain fp32 GEMM: only the fp32 summation order differs
    ref = Fnn.linear(F.fp8_fake_quant(x).float(), w_deq)
    torch.testing.assert_close(F.fp8_linear(x, w8, ws, out_dtype=torch.float32), ref, rtol=1e-5, atol=1e-5)
    # against the unquantized activation: within the FP8 activation error
    exact = Fnn.linear(x.float(), w_deq)
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.04  # measured 0.026 here: E4M3 rounding of the activations
    # raw bytes as read from safetensors give the same result
    assert torch.equal(F.fp8_linear(x, w8.view(torch.uint8), ws.view(torch.uint8)), y)


def test_fp4_linear_matches_linear_on_dequantized_operands():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(7, 128, generator=g).bfloat16()
    w = torch.randn(48, 128, generator=g) * 0.03
    packed, scale = F.quant_fp4_weight(w)
    w_deq = F.dequant_fp4_weight(packed, scale)
    ref = Fnn.linear(F.fp8_fake_quant(x).float(), w_deq)
    y = F.fp4_linear(x, packed.view(torch.int8), scale, out_dtype=torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert F.fp4_linear(x, packed, scale).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bitwise():
    x = sample_activations(64, 512, seed=11)
    for fq in (F.fp8_fake_quant, F.mxfp4_fake_quant, F.fp4_e4m3_fake_quant):
        assert_bitwise_equal(fq(x.cuda()).cpu(), fq(x))
    for pack in (F.pack_fp8_ue8m0, F.pack_mxfp4, F.pack_fp4_e4m3):
        for got, want in zip(pack(x.cuda()), pack(x)):
            assert torch.equal(got.cpu(), want)
    w = torch.randn(96, 512) * 0.02
    w8, ws = F.quant_fp8_weight(w)
    y_cpu = F.fp8_linear(x, w8, ws, out_dtype=torch.float32)
    y_gpu = F.fp8_linear(x.cuda(), w8.cuda(), ws.cuda(), out_dtype=torch.float32).cpu()
    torch.testing.assert_close(y_gpu, y_cpu, rtol=1e-5, atol=1e-5)
