"""The one-launch RMSNorm, router and shared-expert SwiGLU (model/kernels/norm.py, routing.py) against their
references, and the model's wiring of them (the CPU keeps the references' bits; `MoE.load` counted on read; the
router's weight widened once).

CPU: the kernels through Triton's interpreter (skipped without Triton). GPU (@pytest.mark.gpu): compiled."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel is defined

from dsv41.model.kernels import host, reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def needs_triton():
    pytest.importorskip("triton")
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter tests need TRITON_INTERPRET=1 before Triton loads")


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in bf16 steps (same-sign finite values)."""
    ia, ib = a.bfloat16().view(torch.int16).int(), b.bfloat16().view(torch.int16).int()
    return int((ia - ib).abs().max())


# ------------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 512), (7, 96), (1, 1, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_kernel_matches_reference(shape, dtype):
    needs_triton()
    from dsv41.model.kernels import norm

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    w = (torch.rand(shape[-1], generator=g) + 0.5).bfloat16().to(DEV)
    ref = reference.rms_norm(x, w, 1e-20)
    got = norm.rms_norm(x, w, 1e-20, force_triton=True)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:  # the row sum's order differs: at most one bf16 step apart
        assert ulps_bf16(got.cpu(), ref.cpu()) <= 1
    else:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=0)


def test_rms_norm_kernel_strided_rows():
    needs_triton()
    from dsv41.model.kernels import norm

    x = torch.randn(6, 256, device=DEV)[:, :128]  # rows 256 apart
    w = torch.ones(128, dtype=torch.bfloat16, device=DEV)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6, force_triton=True), reference.rms_norm(x, w, 1e-6),
                               rtol=2e-6, atol=0)


def test_rms_norm_module_on_cpu_is_the_reference_bit_for_bit():
    from dsv41.model.layers import RMSNorm

    m = RMSNorm(48, 1e-20)
    with torch.no_grad():
        m.weight.copy_(torch.rand(48) + 0.5)
    x = torch.randn(4, 48).bfloat16()
    xf = x.float()
    want = torch.mul(m.weight, xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-20)).to(x.dtype)
    assert torch.equal(m(x), want)


def test_rms_norm_keeps_the_graph_for_training():
    needs_triton()
    from dsv41.model.kernels import norm

    x = torch.randn(3, 64, device=DEV, requires_grad=True)
    w = torch.ones(64, device=DEV, requires_grad=True)
    y = norm.rms_norm(x, w, 1e-6, force_triton=True)  # a gradient wanted: the reference, with its graph
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


# --------------------------------------------------------------------------------------------- RoPE
def rope_case(shape, rope_dim, per_row, seed, dtype):
    from dsv41.model.layers import rope_frequencies

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    B, T = shape[:2]
    table = rope_frequencies(rope_dim, 4096, 10000.0)
    pos = torch.randint(0, 4096, (B, T) if per_row else (T,), generator=g)
    return x.to(DEV), table[pos].contiguous().to(DEV)


@pytest.mark.parametrize("shape,rope_dim", [((2, 3, 64), 16), ((1, 5, 4, 64), 16), ((3, 1, 8, 512), 64),
                                            ((2, 2, 96), 96)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tail_kernel_matches_reference(shape, rope_dim, per_row, dtype):
    needs_triton()
    from dsv41.model.kernels import rope

    x, freqs = rope_case(shape, rope_dim, per_row, sum(shape) + rope_dim, dtype)
    for inverse in (False, True):
        ref = reference.rope_tail(x, freqs, rope_dim, inverse)
        got = rope.rope_tail(x, freqs, rope_dim, inverse, force_triton=True)
        assert got.dtype == dtype and got.shape == x.shape
        D = shape[-1]
        assert torch.equal(got[..., :D - rope_dim], x[..., :D - rope_dim])  # the leading channels as they are
        if dtype == torch.bfloat16:  # a fused multiply-add may round the fp32 product's last bit apart
            assert ulps_bf16(got.cpu(), ref.cpu()) <= 1
        else:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_rope_tail_other_shapes_take_the_reference():
    """A strided x (or a table that does not match it) is left to the reference, whose bits it then has."""
    from dsv41.model.kernels import rope

    _, freqs = rope_case((2, 3, 64), 16, False, 0, torch.float32)
    strided = torch.randn(2, 3, 128)[..., ::2]
    assert not strided.is_contiguous()
    assert torch.equal(rope.rope_tail(strided, freqs.cpu(), 16, force_triton=True),
                       reference.rope_tail(strided, freqs.cpu(), 16))


# ------------------------------------------------------------------------------------------- router
def router_case(N, E, seed, device=DEV, wide=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(N, E, generator=g) * (12 if wide else 2)
    if wide:
        scores[0, :3] = torch.tensor([25.0, 21.0, -40.0])  # softplus's x-itself branch and its tiny tail
    bias = torch.randn(E, generator=g) * 0.1
    return scores.to(device), bias.to(device)


@pytest.mark.parametrize("N,E,k", [(1, 8, 2), (5, 8, 2), (3, 384, 6), (17, 256, 8), (2, 384, 1)])
@pytest.mark.parametrize("wide", [False, True])
def test_route_kernel_matches_reference(N, E, k, wide):
    needs_triton()
    from dsv41.model.kernels import routing

    scores, bias = router_case(N, E, N * E + k, wide=wide)
    for temp, norm, scale in ((1.0, True, 1.5), (2.0, False, 2.5)):
        w_ref, i_ref = reference.route(scores, bias, k, "sqrtsoftplus", temp, norm, scale)
        w, i = routing.route(scores, bias, k, "sqrtsoftplus", temp, norm, scale, force_triton=True)
        assert i.dtype == torch.int64 and torch.equal(i, i_ref)  # the same experts, in the same order
        torch.testing.assert_close(w, w_ref, rtol=4e-6, atol=1e-30)


def test_route_kernel_per_token_bias_and_ties():
    needs_triton()
    from dsv41.model.kernels import routing

    scores, bias = router_case(4, 64, 3)
    rows = torch.stack([bias, -bias, bias * 2, bias]).contiguous()  # a bias per token (image-span tokens)
    w_ref, i_ref = reference.route(scores, rows, 6)
    w, i = routing.route(scores, rows, 6, force_triton=True)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=4e-6, atol=0)
    tied = torch.zeros(2, 16, device=DEV)  # every score equal: the lowest indices, in order
    _, i = routing.route(tied, torch.zeros(16, device=DEV), 4, force_triton=True)
    assert i.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_route_other_score_functions_take_the_reference():
    from dsv41.model.kernels import routing

    scores, bias = router_case(3, 16, 1, device="cpu")
    for fn in ("sigmoid", "softmax"):
        w, i = routing.route(scores, bias, 2, fn)
        w_ref, i_ref = reference.route(scores, bias, 2, fn)
        assert torch.equal(w, w_ref) and torch.equal(i, i_ref)


# --------------------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("shape", [(1, 128), (3, 7, 96), (33, 2304)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_kernel_matches_reference(shape, dtype, limit):
    needs_triton()
    from dsv41.model.kernels import routing

    g = torch.Generator().manual_seed(shape[-1])
    gate = (torch.randn(*shape, generator=g) * 8).to(dtype).to(DEV)
    up = (torch.randn(*shape, generator=g) * 8).to(dtype).to(DEV)
    ref = reference.swiglu(gate, up, limit, dtype)
    got = routing.swiglu(gate, up, limit, dtype, force_triton=True)
    assert got.dtype == dtype and got.shape == gate.shape
    if dtype == torch.bfloat16:  # exp's last bits: at most one bf16 step apart
        assert ulps_bf16(got.cpu(), ref.cpu()) <= 1
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_shared_expert_on_cpu_keeps_its_bits():
    """Expert.forward without routing weights (the shared expert) goes through routing.swiglu: on the CPU the
    reference, whose arithmetic is _hidden's."""
    from dsv41.model.moe import Expert

    torch.manual_seed(0)
    e = Expert(64, 96, torch.bfloat16, 32, 10.0)
    with torch.no_grad():
        for lin in (e.w1, e.w2, e.w3):
            lin.weight.copy_(torch.randn_like(lin.weight, dtype=torch.float32) * 0.2)
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        got = e(x)
        gate, up = e.w1(x), e.w3(x)
        want = e.w2(e._hidden(gate.float(), up.float(), None).to(x.dtype))
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------- mHC expand
@pytest.mark.parametrize("lead,n,d", [((1, 1), 4, 64), ((3, 2), 4, 96), ((5,), 2, 2048), ((2, 1), 1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_expand_kernel_matches_reference(lead, n, d, dtype):
    needs_triton()
    from dsv41.model.kernels import mhc

    g = torch.Generator().manual_seed(n * d)
    y = torch.randn(*lead, d, generator=g).to(dtype).to(DEV)
    x = torch.randn(*lead, n, d, generator=g).to(dtype).to(DEV)
    post = torch.rand(*lead, n, generator=g).to(DEV) * 2
    comb = torch.rand(*lead, n, n, generator=g).to(DEV)
    ref = reference.expand(y, x, post, comb)
    got = mhc.expand(y, x, post, comb, force_triton=True)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:  # multiply-adds fused or not: at most one bf16 step apart
        assert ulps_bf16(got.cpu(), ref.cpu()) <= 1
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_decode_window_indices_kept_per_step_are_the_same():
    from dsv41.model import attention

    for start, n_prev, w in ((0, 0, 4), (10, 4, 4), (3, 3, 8), (200, 127, 128)):
        want = attention._window_indices(start, 1, n_prev, w, "cpu")
        assert torch.equal(attention._decode_window_indices(start, n_prev, w, torch.device("cpu")), want)
        assert torch.equal(attention.window_indices(start, 1, n_prev, w, "cpu"), want)
    assert not attention._decode_window_indices(5, 4, 4, torch.device("cpu")).is_inference()


# ------------------------------------------------------------------------------------------- MXFP4
@pytest.mark.parametrize("shape", [(1, 1, 4, 128), (3, 128), (2, 5, 64), (7, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_kernels_are_formats_bit_for_bit(shape, dtype):
    needs_triton()
    from dsv41.model import formats
    from dsv41.model.kernels import quant

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1]) ** torch.rand(shape[-1], generator=g)
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30])  # zeros and a value under the amax floor's scale
    x.view(-1)[3:6] = torch.tensor([0.75, 1.75, -3.5]) * 2.0 ** 3  # ties of the E2M1 grid
    x = x.to(dtype).to(DEV)
    codes, scales = quant.pack_mxfp4(x, force_triton=True)
    want_codes, want_scales = formats.pack_mxfp4(x, formats.MXFP4_BLOCK)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    fake = quant.mxfp4_fake_quant(x, 32, force_triton=True)
    want = formats.mxfp4_fake_quant(x, 32)
    assert fake.dtype == dtype and torch.equal(fake.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


# ------------------------------------------------------------------------------------ expert sort
@pytest.mark.parametrize("T,k,E,BM,unheld", [(1, 6, 384, 16, ()), (1, 2, 8, 16, ()), (9, 3, 6, 4, (3,)),
                                             (64, 6, 384, 16, (0, 5, 200)), (5, 8, 16, 32, (1, 2)),
                                             (85, 6, 64, 16, ())])
def test_sort_by_expert_kernel_is_the_torch_code(T, k, E, BM, unheld):
    needs_triton()
    from dsv41.model.kernels import experts as ek

    g = torch.Generator().manual_seed(T * 1000 + E)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    weights = torch.rand(T, k, generator=g).to(DEV)
    held = torch.ones(E, dtype=torch.bool)
    held[list(unheld)] = False
    held = held.to(DEV)
    got = ek.sort_by_expert(weights, indices, held, BM, force_triton=True)
    limit = ek.SORT_KERNEL_MAX
    ek.SORT_KERNEL_MAX = 0  # the torch code
    try:
        want = ek.sort_by_expert(weights, indices, held, BM)
    finally:
        ek.SORT_KERNEL_MAX = limit
    names = ("token", "route", "offsets", "tile expert", "tile row", "pos")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, a, b)


def test_sort_by_expert_kernel_only_where_it_applies(monkeypatch):
    """More assignments than SORT_KERNEL_MAX, or a CPU tensor not forced, take the torch code."""
    from dsv41.model.kernels import experts as ek

    def refuse(*a, **k):
        raise AssertionError("the sort kernel ran")

    monkeypatch.setattr(ek, "_sort_kernel", refuse)
    T, k, E = 86, 6, 64  # 516 assignments
    indices = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    held = torch.ones(E, dtype=torch.bool)
    ek.sort_by_expert(weights, indices, held, 16, force_triton=True)
    ek.sort_by_expert(weights[:2], indices[:2], held, 16)  # not forced, not CUDA


# --------------------------------------------------------------------------------- MoE.load, widened
def test_moe_load_counted_when_read(tiny_model):
    moe = next(b.ffn for b in tiny_model.layers if hasattr(b.ffn, "gate"))
    x = torch.randn(2, 3, moe.dim).bfloat16()
    with torch.no_grad():
        moe(x)
        weights, indices = moe.gate(x.reshape(-1, moe.dim))
    assert moe._load is None  # nothing counted yet
    assert torch.equal(moe.load, torch.bincount(indices.flatten(), minlength=moe.n_routed))
    moe.load = torch.tensor([1, 2])
    assert moe.load.tolist() == [1, 2]


def test_widened_weight_is_kept_and_follows_changes():
    w = torch.randn(8, 16).bfloat16()
    a = host.widened(w)
    assert a.dtype == torch.float32 and torch.equal(a, w.float()) and host.widened(w) is a
    with torch.no_grad():
        w.add_(1)
    assert torch.equal(host.widened(w), w.float())
    p = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    assert host.widened(p).requires_grad  # a gradient wanted: a fresh differentiable copy


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@torch.inference_mode()
def test_norm_router_and_rope_kernels_gpu():
    from dsv41.model.kernels import norm, rope, routing

    x = torch.randn(64, 4096, device="cuda").bfloat16()
    w = (torch.rand(4096, device="cuda") + 0.5).bfloat16()
    assert ulps_bf16(norm.rms_norm(x, w, 1e-20).cpu(), reference.rms_norm(x, w, 1e-20).cpu()) <= 1
    scores, bias = router_case(64, 384, 5, device="cuda", wide=True)
    wr, ir = reference.route(scores, bias, 6, "sqrtsoftplus", 1.0, True, 2.5)
    wk, ik = routing.route(scores, bias, 6, "sqrtsoftplus", 1.0, True, 2.5)
    assert torch.equal(ik, ir)
    torch.testing.assert_close(wk, wr, rtol=4e-6, atol=1e-30)
    x, freqs = rope_case((64, 1, 64, 512), 64, True, 3, torch.bfloat16)
    for inverse in (False, True):
        assert ulps_bf16(rope.rope_tail(x, freqs, 64, inverse).cpu(),
                         reference.rope_tail(x, freqs, 64, inverse).cpu()) <= 1
    g, u = torch.randn(2, 64, 2048, device="cuda").bfloat16().unbind(0)
    assert ulps_bf16(routing.swiglu(g, u, 10.0, torch.bfloat16).cpu(),
                     reference.swiglu(g, u, 10.0, torch.bfloat16).cpu()) <= 1


@pytest.mark.gpu
@torch.inference_mode()
def test_mhc_expand_kernel_gpu():
    """The block's last mHC update: the same bits as torch's (its products rounded before the sums, no fma)."""
    from dsv41.model.kernels import mhc

    y, xs = torch.randn(64, 4096, device="cuda").bfloat16(), torch.randn(64, 4, 4096, device="cuda").bfloat16()
    post, comb = torch.rand(64, 4, device="cuda"), torch.rand(64, 4, 4, device="cuda")
    assert torch.equal(mhc.expand(y, xs, post, comb, force_triton=True), reference.expand(y, xs, post, comb))


@pytest.mark.gpu
@torch.inference_mode()
def test_expert_sort_kernel_gpu():
    from dsv41.model.kernels import experts as ek

    for T in (1, 64):
        indices = torch.stack([torch.randperm(384)[:6] for _ in range(T)]).cuda()
        weights, held = torch.rand(T, 6, device="cuda"), torch.ones(384, dtype=torch.bool, device="cuda")
        held[[3, 100]] = False
        got = ek.sort_by_expert(weights, indices, held, 16, force_triton=True)
        limit, ek.SORT_KERNEL_MAX = ek.SORT_KERNEL_MAX, 0
        try:
            want = ek.sort_by_expert(weights, indices, held, 16)
        finally:
            ek.SORT_KERNEL_MAX = limit
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@torch.inference_mode()
def test_mxfp4_kernels_gpu():
    from dsv41.model import formats
    from dsv41.model.kernels import quant

    q = torch.randn(64, 1, 64, 128, device="cuda").bfloat16()
    assert torch.equal(quant.mxfp4_fake_quant(q, 32, force_triton=True).view(torch.int16),
                       formats.mxfp4_fake_quant(q, 32).view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(quant.pack_mxfp4(q, force_triton=True),
                                                 formats.pack_mxfp4(q, formats.MXFP4_BLOCK)))


def test_dequantized_weight_in_another_dtype_is_kept_and_follows_changes():
    """Linear.dequantized_weight(bf16) (the attention's wo_a einsum on CUDA) is the fp32 weight cast, made once
    and rebuilt when the stored weight changes; without a kept fp32 weight it keeps only the cast one."""
    from dsv41.model import formats
    from dsv41.model.layers import Linear

    lin = Linear(64, 32, torch.float8_e4m3fn, 32)
    q, s = formats.quant_fp8_weight(torch.randn(32, 64), 32)
    with torch.no_grad():
        lin.weight.copy_(q), lin.scale.copy_(s)
    a = lin.dequantized_weight(torch.bfloat16)
    assert lin._dequantized is None  # no fp32 copy kept for it
    assert a.dtype == torch.bfloat16 and torch.equal(a, lin.dequantized_weight().to(torch.bfloat16))
    assert lin.dequantized_weight(torch.bfloat16) is a
    q2, s2 = formats.quant_fp8_weight(torch.randn(32, 64), 32)
    with torch.no_grad():
        lin.weight.copy_(q2), lin.scale.copy_(s2)
    b = lin.dequantized_weight(torch.bfloat16)
    assert b is not a and torch.equal(b, formats.dequant_fp8_weight(q2, s2, 32).to(torch.bfloat16))


@pytest.mark.gpu
def test_head_on_cuda_reads_the_bf16_weight():
    """The head on CUDA: bf16 inputs through cuBLAS's bf16 GEMM with fp32 output, the fp32 GEMM's values on the
    widened operands up to the fp32 summation order, and no fp32 copy of the weight kept; fp32 inputs and
    inputs that need a gradient keep the fp32 GEMM."""
    from dsv41.model.transformer import Head

    head = Head(1000, 512).cuda()
    with torch.no_grad():
        head.weight.normal_(0, 0.05)
    x = torch.randn(3, 2, 512, device="cuda").bfloat16()
    with torch.inference_mode():
        got = head(x)
    want = torch.nn.functional.linear(x.float(), head.weight.float())
    assert got.dtype == torch.float32 and got.shape == (3, 2, 1000)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert head._fp32 is None
    with torch.inference_mode():
        head(x.float())
    assert head._fp32 is not None  # the fp32 path and its widened copy
