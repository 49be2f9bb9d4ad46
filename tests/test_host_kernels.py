"""The host kernels (model/kernels/host.py, host_kernels.c) against their torch references, bit for bit.

Each C function must give the bits of the torch code it replaces on the CPU the tests run on, at every ATen
CPU capability CI runs (.ci/run runs this file at the native ISA, AVX2 and the baseline): the C code does the
same IEEE operations in the same order, so any difference is a bug. Then the model: a prefill and decode steps
of the tiny model and a greedy generation of the bundled one, with the kernels and without, the same bits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from dsv41.model import formats, layers
from dsv41.model.kernels import host, reference
from test_host_overhead import assert_same, assert_same_values, edge_values

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc") or os.environ.get("CC")),
                                reason="no C compiler: the torch references run (tested everywhere else)")


@pytest.fixture(autouse=True)
def _loaded():
    assert host.available(), host.status()


# The largest logit difference between the fixed-order GEMMs and MKL's through the tiny model (measured 0 to
# 2.4e-6 on random weights: another summation order, whose last-bit differences the FP8 activation grid
# mostly absorbs), with room for a CPU whose MKL sums in yet another order
LOGIT_ATOL = 1e-4


def without_host(monkeypatch):
    monkeypatch.setattr(host, "library", lambda: None)


# ------------------------------------------------------------------------------------------- Sinkhorn


@pytest.mark.parametrize("n,iters,eps", [(4, 20, 1e-6), (4, 1, 1e-6), (3, 7, 1e-3), (2, 2, 0.0)])
def test_sinkhorn_normalize_bits(n, iters, eps):
    """n <= host.SINKHORN_MAX_N: the stream counts the host loop takes (ATen's sums of longer rows may split); n = 4
    also in vector lanes, one matrix a lane (16, 15 and 257 matrices: whole vectors and the ones left), in every ISA
    version the CPU runs."""
    g = torch.Generator().manual_seed(n * 100 + iters)
    for shape in [(16, 1, n, n), (3, 5, n, n), (257, n, n)]:
        logits = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
        comb = torch.exp(logits - logits.amax(-1, keepdim=True))  # as _sinkhorn_split hands it over
        comb.view(-1, n, n)[0] = 1.0
        comb.view(-1, n, n)[1, 0] = 1e-38  # a subnormal row sum after the division
        expected = reference._sinkhorn_normalize_(comb.clone(), iters, eps)
        got = host.sinkhorn_normalize_(comb.clone(), iters, eps)
        assert_same(got, expected)
        order = ["base", "avx2", "avx512"]
        for version in order[: order.index(host.head_isa()) + 1]:  # n = 4 in vector lanes: the same bits in each
            assert_same(host.sinkhorn_normalize_(comb.clone(), iters, eps, version), expected)


# ------------------------------------------------------------------------------------------- FP8 activations


def test_fp8_fake_quant_every_bf16_value():
    """All 65,536 bf16 bit patterns (NaN and inf included), as blocks of 32 in a shuffled order, and as the
    lone odd value in blocks of small ones (the amax floor) and of huge ones (saturation)."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    shuffled = every[torch.randperm(every.numel(), generator=g)].view(-1, 64)
    for x in (every.view(-1, 32), shuffled):
        assert_same(host.fp8_fake_quant_f32(x, 32),
                    formats.fp8_fake_quant_f32(x, 32))
    for fill in (1e-6, 3e38, 448.0):
        x = torch.full((every.numel(), 32), fill)
        x[:, 7] = every
        assert_same(host.fp8_fake_quant_f32(x, 32),
                    formats.fp8_fake_quant_f32(x, 32))


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_fake_quant_edges(block):
    for seed in range(4):
        x = edge_values((9, 512), seed)
        assert_same(host.fp8_fake_quant_f32(x, block),
                    formats.fp8_fake_quant_f32(x, block))


def test_linear_takes_the_host_path_with_the_same_bits(monkeypatch):
    """Linear's decode path: the C quantizer and the fixed-order product in one call (host.fp8_linear), the bits
    of their torch references composed; without the library, MKL's GEMM on the same grid (close, not the bits)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by the kernel tests: the Triton path's checks
    lin = layers.Linear(64, 96, torch.float8_e4m3fn, 32)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    q, s = lin.quantize(w)
    with torch.no_grad():
        lin.weight.copy_(q.view(lin.weight.dtype))
        lin.scale.copy_(s.view(lin.scale.dtype))
    x = edge_values((3, 5, 64), 4, nonfinite=False).bfloat16()
    calls = []
    real = host.fp8_linear
    monkeypatch.setattr(host, "fp8_linear", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        lin(x)  # fills the weight cache
        got = lin(x)
        wt = lin.dequantized_weight().t().contiguous()
        expected = reference.fixed_order_matmul(formats.fp8_fake_quant_f32(x, 32).view(-1, 64), wt)
    assert calls, "the host kernel was not used"
    # NaN (inf - inf in the sums) compared by place: torch's cast writes its payload one way on its vector path
    # and another on its scalar tail, the C cast one way
    assert_same_values(got, expected.view(3, 5, 96).bfloat16())
    without_host(monkeypatch)
    with torch.inference_mode():
        plain = lin(x).float()
    finite = plain.isfinite() & got.float().isfinite()  # the edge values overflow in either order
    assert finite.float().mean() > 0.5
    torch.testing.assert_close(plain[finite], got.float()[finite], rtol=8e-3, atol=1e-5)  # bf16 outputs


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R,K,N,Nb", [(1, 64, 96, 0), (5, 128, 24, 40), (3, 32, 7, 7)])
def test_fp8_linear_is_the_three_steps_in_one_call(in_dtype, out_dtype, R, K, N, Nb):
    """host.fp8_linear (a linear layer's host path, and linear_pair's w1 / w3 from one quantization): the bits
    of x.float() -> formats.fp8_fake_quant_f32 -> reference.fixed_order_matmul -> .to(dtype), on edge values
    with infinities and NaN (whose payload IEEE leaves open: compared by place)."""
    x = edge_values((R, K), R * K + N).to(in_dtype)
    g = torch.Generator().manual_seed(N)
    wt, wt_b = torch.randn(K, N, generator=g), torch.randn(K, Nb, generator=g) if Nb else None
    xq = formats.fp8_fake_quant_f32(x.float(), 32)
    got = host.fp8_linear(x, 32, wt, None, out_dtype, wt_b)
    expected = [reference.fixed_order_matmul(xq, w).to(out_dtype) for w in ([wt, wt_b] if Nb else [wt])]
    for a, b in zip(got if Nb else [got], expected):
        assert_same_values(a, b)
    assert_same_values(host.fp8_linear(x.view(R, 1, K), 32, wt, None, out_dtype, None).view(R, N), expected[0])
    for r in range(R):  # a row alone: the same bits
        assert_same_values(host.fp8_linear(x[r:r + 1], 32, wt, None, out_dtype), expected[0][r:r + 1])


@pytest.mark.parametrize("M,K,N", [(1, 64, 128), (3, 256, 24), (5, 64, 7), (9, 128, 300)])
def test_fixed_order_matmul_bits_on_strided_rows(M, K, N):
    """The GEMMs of inference (host.fixed_order_matmul): the reference's bits, on every ISA version through the
    head's entry points, with rows read from and written to a group's columns of wider tensors, and each
    row alone the same bits (what lets a decode step compute its rows in use only)."""
    x, wt = _head_inputs(M, K, N, M * K + N)
    expected = reference.fixed_order_matmul(x, wt)
    assert_same(host.fixed_order_matmul(x, wt), expected)
    wide = torch.randn(M, 3 * K)
    wide[:, K:2 * K] = x
    out = torch.full((M, 2 * N + 3), float("nan"))
    host.fixed_order_matmul(wide[:, K:2 * K], wt, out[:, N + 3:])
    assert_same(out[:, N + 3:], expected)
    assert out[:, :N + 3].isnan().all()  # nothing written outside the group's columns
    for r in range(M):
        assert_same(host.fixed_order_matmul(x[r:r + 1], wt), expected[r:r + 1])


def test_fixed_order_linear_and_its_groups_follow_the_gemm(monkeypatch):
    """fixed_order_linear and the grouped wo_a product against F.linear / einsum (close: another summation
    order), the transposed weight kept until the weight changes in place, and the graph-recording case left
    to F.linear."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 7, 96, generator=g), torch.randn(40, 96, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(host.fixed_order_linear(x, w), torch.nn.functional.linear(x, w))
        xg = x.view(2, 7, 2, 48)
        wg = torch.randn(2 * 16, 48, generator=g)
        torch.testing.assert_close(host.fixed_order_grouped_linear(xg, wg, 2),
                                   torch.einsum("btgd,grd->btgr", xg, wg.view(2, 16, 48)))
        # one group per rank (tensor parallelism splits wo_a's groups): still the grouped form
        torch.testing.assert_close(host.fixed_order_grouped_linear(x.view(2, 7, 1, 96), w, 1),
                                   torch.nn.functional.linear(x, w).view(2, 7, 1, 40))
        first = host.transposed(w)
        assert host.transposed(w) is first
        w.mul_(2)  # in place: the version moves, the kept copy is rebuilt
        assert torch.equal(host.transposed(w), first * 2)
    xr = x.clone().requires_grad_(True)
    seen = []
    monkeypatch.setattr(host, "fixed_order_matmul", lambda *a: seen.append(1))
    host.fixed_order_linear(xr, w).sum().backward()  # a graph to record: F.linear
    assert not seen and xr.grad is not None


def test_padded_linear_gives_a_row_its_bits_alone_at_any_row_count():
    """host.padded_linear, a decode step's fp32 GEMMs off the CPU (the router's scores, the compressor's projections,
    `fixed_rows`): a row's outputs at every row count up to the padding multiple are the bits it gets alone, where a
    BLAS sums one row (a GEMV) differently from several (cuBLAS; MKL here), and the values are F.linear's. On the
    CPU fixed_order_linear keeps its fixed order with `fixed_rows`."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 96, generator=g).bfloat16()  # a bf16 weight, widened as the router's is
    x = torch.randn(64, 96, generator=g)
    with torch.inference_mode():
        alone = torch.cat([host.padded_linear(x[i:i + 1], w, 64) for i in range(64)])
        for n in (2, 5, 16, 17, 33, 63, 64):
            assert torch.equal(host.padded_linear(x[:n], w, 64), alone[:n]), f"{n} rows"
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, w.float()))
        y = host.padded_linear(x[:5].view(5, 1, 96), w, 64)  # the compressor's [R, 1, d]
        assert y.shape == (5, 1, 40) and torch.equal(y[:, 0], alone[:5])
        assert host.padded_linear(x, w, 48).shape == (64, 40)  # past the multiple: two of it
        if host.available():
            assert torch.equal(host.fixed_order_linear(x[:3], w, fixed_rows=True), host.fixed_order_linear(x[:3], w))


def test_fixed_rows_pads_only_where_set_and_off_the_cpu(monkeypatch):
    """fixed_order_linear(fixed_rows=True) takes padded_linear only with host.FIXED_ROWS set and off the CPU (whose
    BLAS path pads the whole step instead, BatchCache.MIN_ROWS). Off the CPU here: the meta device (shapes only)."""
    monkeypatch.setattr(host, "fixed_order_applies", lambda x, w: False)
    x, w = torch.randn(3, 1, 16), torch.randn(8, 16)
    for rows in (None, 64):  # the CPU: F.linear, set or not
        monkeypatch.setattr(host, "FIXED_ROWS", rows)
        assert torch.equal(host.fixed_order_linear(x, w, fixed_rows=True), torch.nn.functional.linear(x, w))
    real, calls = host.padded_linear, []
    monkeypatch.setattr(host, "padded_linear", lambda x, w, rows: calls.append(rows) or real(x, w, rows))
    xm, wm = x.to("meta"), w.to("meta")
    for rows, fixed in ((None, True), (64, False), (64, True)):
        monkeypatch.setattr(host, "FIXED_ROWS", rows)
        assert host.fixed_order_linear(xm, wm, fixed_rows=fixed).shape == (3, 1, 8)
    assert calls == [64]


# ------------------------------------------------------------------------------------------- mHC mixes, RoPE


@pytest.mark.parametrize("B,T,d", [(16, 1, 64), (2, 3, 64), (1, 37, 64), (2, 3, 200), (1, 5, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_collapse_and_expand_bits(B, T, d, dtype):
    """The C loops run the channels in chunks of 64 (whole chunks, and a last one of 8 or 36 at d 200 and 100)."""
    g = torch.Generator().manual_seed(B * T)
    x = (torch.randn(B, T, 4, d, generator=g) * torch.exp(torch.randn(B, T, 4, 1, generator=g) * 3)).to(dtype)
    y = (torch.randn(B, T, d, generator=g) * 5).to(dtype)
    pre, post = torch.rand(B, T, 4, generator=g), torch.rand(B, T, 4, generator=g) * 2
    comb = torch.rand(B, T, 4, 4, generator=g)
    with torch.inference_mode():
        assert_same(host.collapse(x, pre), reference.collapse(x, pre))
        assert_same(host.expand(y, x, post, comb), reference.expand(y, x, post, comb))
        # the residual in another dtype than y (the output follows y)
        other = x.float() if dtype == torch.bfloat16 else x.bfloat16()
        assert_same(host.expand(y, other, post, comb), reference.expand(y, other, post, comb))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tail_bits(dtype):
    g = torch.Generator().manual_seed(0)
    table = layers.rope_frequencies(16, 128, 10000.0, 512, 1.0, 32, 1)
    for B, T in ((16, 1), (2, 5)):
        per_token = table[3:3 + T]
        per_row = table[torch.randint(0, 128, (B, T), generator=g)]
        for x in ((torch.randn(B, T, 4, 48, generator=g) * 5).to(dtype), (torch.randn(B, T, 80, generator=g) * 5).to(dtype)):
            for freqs in (per_token, per_row):
                for inverse in (False, True):
                    tail = x[..., -16:].contiguous()
                    expected = torch.cat([x[..., :-16], reference_rope(tail, freqs, inverse)], dim=-1)
                    assert_same(host.rope_tail(x, freqs, 16, inverse), expected)
                    with torch.inference_mode():  # the dispatch in layers.rope_tail
                        assert_same(layers.rope_tail(x, freqs, 16, inverse), expected)


def reference_rope(x, freqs, inverse):
    with torch.enable_grad():  # layers.apply_rope is the torch path whatever the mode
        return layers.apply_rope(x, freqs, inverse)


def test_dispatch_leaves_what_it_does_not_take_to_torch(monkeypatch):
    """Graphs (training), other dtypes, strided inputs and broadcast RoPE tables keep the torch code."""
    x = torch.randn(2, 3, 4, 64, requires_grad=True)
    assert not host.takes(x)  # grad mode on
    with torch.inference_mode():
        assert host.takes(torch.randn(2, 3))
        assert not host.takes(torch.randn(2, 3, dtype=torch.float16))
        assert not host.takes(torch.randn(3, 2).t())
        table = layers.rope_frequencies(16, 64, 10000.0, 512, 1.0, 32, 1)
        xr = torch.randn(4, 5, 48)
        assert not host.rope_fits(xr, table[:5].unsqueeze(0))  # [1, T, r/2] broadcast over B
        assert not host.rope_fits(xr, table[:5].conj())
        assert host.rope_fits(xr, table[:5])


# ------------------------------------------------------------------------------------------- the model


def test_decode_steps_are_the_same_bits_with_and_without(tiny_model, monkeypatch):
    """The tiny model (every layer mode): a prefill and decode steps of a continuous batch. With the library
    every GEMM is the fixed-order sum; without it, MKL's on padded rows (BatchCache.MIN_ROWS): the same
    numbers up to the summation order, so the logits are compared with a tolerance, not bit for bit."""
    from test_batch_engine import prompts, run_rows

    ids = prompts((1, 9, 17))
    with torch.inference_mode():
        with_c = run_rows(tiny_model, ids, 12)
        full_c = tiny_model(torch.tensor([ids[2]]), 0, tiny_model.new_cache(1))
    without_host(monkeypatch)
    with torch.inference_mode():
        without = run_rows(tiny_model, ids, 12)
        full = tiny_model(torch.tensor([ids[2]]), 0, tiny_model.new_cache(1))
    for a, b in zip(with_c, without):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(full_c, full, rtol=0, atol=LOGIT_ATOL)


def test_bundled_model_greedy_tokens_unchanged(monkeypatch):
    """The README's prompt in the chat encoding (thinking, effort 75): 48 greedy tokens, the same with and without
    the C library. Without it the GEMMs are MKL's, another summation order, so only decisions with a margin hold:
    the raw text "Add: 7 3 9 2 5" continues with random digits, whose 4th token the checkpoint after stage 32 picks
    by 0.044 of a logit ('1' over '7'), and there the two paths part."""
    from dsv41.model import encoding
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model
    from dsv41.model.engine import GenerationConfig, Generator

    model, _, tok = load_model(bundled_model_dir(), device="cpu")
    gen = Generator(model, tok)
    text = encoding.encode_messages([{"role": "user", "content": "Add: 7 3 9 2 5"}], mode="thinking", effort=75)
    prompt = tok.encode(text, allow_special=True)
    config = GenerationConfig(max_new_tokens=48, stop_ids=())
    with torch.inference_mode():
        with_c = gen.generate(prompt, config).output_ids
    without_host(monkeypatch)
    with torch.inference_mode():
        assert gen.generate(prompt, config).output_ids == with_c


# ------------------------------------------------------------------------------------------- build, fallback

STATUS = "from dsv41.model.kernels import host; print(host.status())"


def _status(env) -> str:
    r = subprocess.run([sys.executable, "-c", STATUS], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


@pytest.mark.process
def test_build_is_cached_and_the_fallbacks_say_why(tmp_path):
    cache = {"DSV41_CACHE_DIR": str(tmp_path)}
    assert _status(cache) == "loaded"
    (built,) = (tmp_path / "host-kernels").glob("*.so")
    stamp = built.stat().st_mtime_ns
    assert _status(cache) == "loaded" and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert not list((tmp_path / "host-kernels").glob("*.tmp*"))
    assert _status({**cache, "DSV41_HOST_KERNELS": "0"}).startswith("disabled")
    broken = _status({"DSV41_CACHE_DIR": str(tmp_path / "other"), "CC": str(tmp_path / "no-such-cc")})
    assert broken.startswith("build failed"), broken


# ------------------------------------------------------------------------------------------- the output head


def _head_inputs(R, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g) * torch.exp(torch.randn(R, K, generator=g))
    w = (torch.randn(V, K, generator=g) * 0.05).bfloat16()
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-40])
    w[:5, 0] = torch.tensor([-0.0, 0.0, 3e38, -3e38, 1e-39]).bfloat16()
    return x, w.float().t().contiguous()


@pytest.mark.parametrize("R,K,V", [(1, 64, 1000), (3, 16, 64), (4, 64, 129), (9, 72, 300), (17, 32, 7)])
def test_head_logits_bits(R, K, V):
    """Whole and partial 64-column blocks, row counts below, at and past the 4-row block, and -0.0, subnormal
    and overflowing products."""
    x, wt = _head_inputs(R, K, V, R * K + V)
    expected = reference.head_logits(x, wt)
    assert_same(host.head_logits(x, wt), expected)
    assert_same(host.head_logits(x, wt, threads=2), expected)  # its columns split between two threads
    for r in range(R):  # each row alone: the same bits (the step computes only its rows in use)
        assert_same(host.head_logits(x[r:r + 1].contiguous(), wt), expected[r:r + 1])


@pytest.mark.parametrize("R,K,V", [(1, 64, 1000), (2, 16, 64), (3, 64, 129), (5, 72, 300), (6, 64, 130), (7, 32, 7),
                                   (8, 64, 192), (11, 64, 200)])
def test_head_from_bf16_blocks_is_the_heads_bits(R, K, V):
    """The head for a few rows from the bf16 weight in column blocks (host.head_logits_bf16): the fp32 head's bits
    at every ISA version this CPU runs, whole and partial blocks, whole row tiles and the rows left after them;
    the kept blocks follow the weight's changes."""
    g = torch.Generator().manual_seed(R * K + V)
    x = torch.randn(R, K, generator=g) * torch.exp(torch.randn(R, K, generator=g))
    w = (torch.randn(V, K, generator=g) * 0.05).bfloat16()
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-40])
    w[:5, 0] = torch.tensor([-0.0, 0.0, 3e38, -3e38, 1e-39]).bfloat16()
    expected = reference.head_logits(x, w.float().t().contiguous())
    isa = host.head_isa()
    for version in [None, "base"] + (["avx2"] if isa in ("avx2", "avx512") else []) + (["avx512"] if isa == "avx512" else []):
        assert_same(host.head_logits_bf16(x, host.head_blocks(w), V, version), expected)
    assert_same(host.head_logits_bf16(x, host.head_blocks(w), V, threads=2), expected)  # blocks on two threads
    with torch.no_grad():
        w.mul_(2)  # the kept blocks are made again
    assert_same(host.head_logits_bf16(x, host.head_blocks(w), V), reference.head_logits(x, w.float().t().contiguous()))


def test_head_takes_the_bf16_blocks_for_few_rows(tiny_model, monkeypatch):
    """Head.forward on the CPU at inference: up to host.head_bf16_max_rows() rows from the bf16 blocks, more rows from the
    fp32 kernel; the same logits either way."""
    head = tiny_model.head
    calls = []
    real = host.head_logits_bf16
    monkeypatch.setattr(host, "head_logits_bf16", lambda *a: calls.append(1) or real(*a))
    n = host.head_bf16_max_rows() + 1
    x = torch.randn(1, n, head.weight.size(1)).bfloat16()
    with torch.inference_mode():
        few = [head(x[:, i:i + 3]) for i in range(0, n, 3)]
        assert len(calls) == len(few)
        many = head(x)
        assert len(calls) == len(few)
    assert_same(torch.cat(few, dim=1), many)


def test_the_head_takes_a_helper_core_only_where_lent(tiny_model, monkeypatch):
    """host.helper_core(True) lends the head a second thread on the calling thread only (the scheduler's, for a
    decode step while its prefill thread idles), at one torch intra-op thread only and unless DSV41_HEAD_HELPER=0,
    and is undone on leaving; the logits are the same bits, at few rows (the bf16 blocks) and many (the fp32
    kernel); the C entry points are the two-thread ones inside it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with host.helper_core(True):
            assert host.head_threads() == 1  # torch's own workers hold the other core
        torch.set_num_threads(1)
        monkeypatch.setenv("DSV41_HEAD_HELPER", "0")
        with host.helper_core(True):
            assert host.head_threads() == 1
        monkeypatch.delenv("DSV41_HEAD_HELPER")
        _helper_core_calls(tiny_model, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _helper_core_calls(tiny_model, monkeypatch):
    head = tiny_model.head
    x = torch.randn(1, host.head_bf16_max_rows() + 3, head.weight.size(1)).bfloat16()
    called = []
    lib = host.library()
    for name in ("dsv41_head_bf16", "dsv41_head_bf16_two", "dsv41_fixed_order_matmul", "dsv41_head_logits_two"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _n=name, _f=real: called.append(_n) or _f(*a))
    with torch.inference_mode():
        alone = [head(x[:, :2]), head(x)]
        assert called == ["dsv41_head_bf16", "dsv41_fixed_order_matmul"] and host.head_threads() == 1
        called.clear()
        with host.helper_core(True):
            seen = []
            other = threading.Thread(target=lambda: seen.append(host.head_threads()))
            other.start()
            other.join()
            lent = [head(x[:, :2]), head(x)]
            with host.helper_core(False):
                assert host.head_threads() == 1
            assert host.head_threads() == 2 and seen == [1]
        assert host.head_threads() == 1
    assert called == ["dsv41_head_bf16_two", "dsv41_head_logits_two"]
    for a, b in zip(alone, lent):
        assert_same(a, b)


def test_head_logits_every_isa_version_gives_the_same_bits():
    """The library runs the AVX-512, AVX2 or baseline version of the head, the widest the CPU has; each one this
    CPU can run gives the reference's bits (the claim that lets a golden hold on every x86-64 CPU), at row
    counts below, at and past each version's row tile."""
    order = ["base", "avx2", "avx512"]
    runnable = order[: order.index(host.head_isa()) + 1]
    for R in (1, 2, 3, 4, 7, 9):
        # 517 columns: whole blocks and a short tail; 88 and 24: whole vectors past the blocks, then a tail
        for V in (517, 88, 24):
            x, wt = _head_inputs(R, 64, V, R)
            expected = reference.head_logits(x, wt)
            for version in runnable:
                assert_same(host.head_logits(x, wt, version), expected)
    print(f"head versions checked: {runnable}", file=sys.stderr)


def test_head_dispatch_and_the_rows_a_decode_step_computes(tiny_model, monkeypatch):
    """On the CPU the head is the fixed-order sum (the C kernel, or its torch reference without the library:
    the same bits), with gradients or without; the gradients are those of the GEMM. A decode step of 2 rows in
    use computes those 2 rows (every GEMM is the fixed-order sum); without the library the step pads to
    BatchCache.MIN_ROWS rows for MKL's GEMMs."""
    from dsv41.model.batch_cache import BatchCache
    from dsv41.model.transformer import Head

    head = tiny_model.head
    h = torch.randn(3, 5, head.weight.size(1)).bfloat16()
    with torch.inference_mode():
        fast = head(h)
        assert head.row_independent(h) and fast.shape == (3, 5, head.weight.size(0))
        with monkeypatch.context() as m:
            without_host(m)
            assert_same(head(h), fast)
    trained = Head(10, 8)
    with torch.no_grad():
        trained.weight.normal_()
    x = torch.randn(2, 3, 8, requires_grad=True)
    y = trained(x)
    with torch.no_grad():
        assert_same(y.detach(), trained(x))  # the same forward bits with a gradient wanted
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    w2 = trained.weight.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, w2.float()).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(trained.weight.grad.float(), w2.grad.float(), rtol=2e-2, atol=1e-3)
    seen = []
    real, real_bf16 = host.head_logits, host.head_logits_bf16
    monkeypatch.setattr(host, "head_logits", lambda x, wt: seen.append(x.size(0)) or real(x, wt))
    monkeypatch.setattr(host, "head_logits_bf16", lambda x, b, V: seen.append(x.size(0)) or real_bf16(x, b, V))
    with torch.inference_mode():
        cache = BatchCache(tiny_model.args, 4, 64)
        for b, n in enumerate((3, 5)):
            cache.load(b, _prefilled(tiny_model, n))
        seen.clear()  # the prefills' heads
        logits = tiny_model.decode(torch.tensor([5, 6]), cache)
    assert logits.shape[0] == 2 and seen == [2] and cache.rows == 2  # fixed-order GEMMs: no padding rows
    without_host(monkeypatch)
    assert BatchCache(tiny_model.args, 4, 64).min_rows == BatchCache.MIN_ROWS  # MKL's GEMMs: padded


def _prefilled(model, n):
    kv = model.new_cache(1)
    model(torch.arange(3, 3 + n).view(1, -1), 0, kv)
    return kv


# ------------------------------------------------------------------------------ scoring a block of logits
def _score_inputs(R: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 6
    targets = torch.randint(0, V, (R,), generator=g)
    if V >= 8:
        logits[0, 3] = logits[0, 6] = logits[0].max() + 1  # a tie for the maximum: its first index
        logits[-1, :4] = torch.tensor([-100.0, -87.5, -0.0, 88.0])  # terms flushed to 0, -0.0, a large logit
    return logits, targets


@pytest.mark.parametrize("R,V", [(1, 1), (2, 15), (3, 16), (4, 17), (2, 1024), (3, 1040), (5, 2049), (1, 129280)])
def test_score_logits_bits(R, V):
    """Rows shorter than, equal to and past one group of 16 lanes and one 1024-element chunk, V4.1's vocabulary:
    the reference's bits for the log-probabilities, the log-sum-exp and the argmax; within 1e-5 of torch's
    logsumexp, and torch's argmax (ties go to the first index), on every ISA version this CPU runs."""
    logits, targets = _score_inputs(R, V, R * V)
    expected = reference.score_logits(logits, targets)
    order = ["base", "avx2", "avx512"]
    for version in [None, *order[: order.index(host.head_isa()) + 1]]:
        for got, want in zip(host.score_logits(logits, targets, version), expected):
            assert_same(got, want)
    lp, lse, argmax = expected
    assert torch.allclose(lse, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-5)
    assert torch.equal(argmax, logits.argmax(-1))
    assert torch.equal(lp, logits.gather(-1, targets[:, None])[:, 0] - lse)
    rows = torch.tensor([0, R - 1])  # strided rows: a block's first rows of a wider buffer
    wide = torch.cat([logits, logits], 1)[rows, :V]
    assert_same(host.score_logits(wide, targets[rows])[1], lse[rows])


def test_score_logits_nan_and_infinite_rows():
    """A NaN is the maximum at its first index and makes the row's scores NaN; a +inf maximum gives an infinite
    log-sum-exp; a row of -inf has a -inf log-sum-exp (torch's argmax and logsumexp agree on each)."""
    logits = torch.randn(4, 40)
    logits[1, 7] = logits[1, 30] = torch.nan
    logits[2, 3] = torch.inf
    logits[3] = -torch.inf
    targets = torch.tensor([0, 1, 2, 3])
    expected = reference.score_logits(logits, targets)
    for got, want in zip(host.score_logits(logits, targets), expected):
        assert_same(got, want)
    lp, lse, argmax = expected
    assert torch.equal(argmax, logits.argmax(-1))
    assert torch.allclose(lse[[0, 2, 3]], torch.logsumexp(logits, -1)[[0, 2, 3]], atol=1e-5)
    assert lse[1].isnan() and lp[1].isnan() and lse[2] == torch.inf and lse[3] == -torch.inf


def test_exp_poly_accuracy():
    """The fixed exp: within 2e-7 relative of exp where it counts (-87 <= d <= 0), exactly 1 at 0, 0 below."""
    d = torch.linspace(-87, 0, 400_001)
    got = reference.exp_poly(d).double()
    want = torch.exp(d.double())
    assert float(((got - want) / want).abs().max()) < 2e-7
    assert reference.exp_poly(torch.tensor([0.0, -0.0]))[0] == 1.0
    assert torch.equal(reference.exp_poly(torch.tensor([-87.01, -1e4, -torch.inf])), torch.zeros(3))


def test_score_positions_takes_the_scoring_pass_with_or_without_the_library(tiny_model, monkeypatch):
    """bpb.score_positions on the CPU: the C pass and, without the library, its torch reference give the same
    log-probabilities and greedy flags."""
    from dsv41.evals import bpb

    model = tiny_model
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(bpb.HEAD_ROWS + 5, model.args.dim, generator=g)
    targets = torch.randint(0, model.args.vocab_size, (hidden.size(0),), generator=g)
    with torch.inference_mode():
        lp, hit, _ = bpb.score_positions(model, hidden, targets)
        without_host(monkeypatch)
        lp_ref, hit_ref, _ = bpb.score_positions(model, hidden, targets)
    assert_same(lp, lp_ref)
    assert torch.equal(hit, hit_ref)


@pytest.mark.parametrize("R,V", [(1, 1), (3, 15), (2, 16), (4, 33), (16, 1031), (2, 129280)])
def test_argmax_rows_is_torchs(R, V):
    """Greedy decoding's argmax (engine.greedy_ids on the CPU): torch's answer on random rows, ties (the first
    index), NaN (the first NaN), infinities and rows of -inf; strided rows."""
    from dsv41.model.engine import greedy_ids

    g = torch.Generator().manual_seed(R * V)
    logits = torch.randn(R, V, generator=g)
    if V >= 8:
        logits[0, 2] = logits[0, 5] = logits[0].max() + 1
        logits[-1, 1], logits[-1, 6] = torch.nan, torch.nan
    if R >= 3:
        logits[1, V // 2] = torch.inf
        logits[2] = -torch.inf
    assert torch.equal(host.argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(greedy_ids(logits), logits.argmax(-1))
    wide = torch.cat([logits, logits], 1)[:, :V]
    assert torch.equal(host.argmax_rows(wide), logits.argmax(-1))
    # the count of rows with a NaN or an inf, from the same pass (engine.checked_greedy_ids): the rows above, and
    # each kind alone at the last position (the vector loop's tail) and at the first
    ids, bad = host.argmax_rows(logits, count_nonfinite=True)
    assert torch.equal(ids, logits.argmax(-1)) and bad == int((~torch.isfinite(logits)).any(-1).sum())
    for value in (float("nan"), float("inf"), float("-inf"), 3e38):
        for at in (0, V - 1):
            one = torch.randn(R, V, generator=g)
            one[R // 2, at] = value
            ids, bad = host.argmax_rows(one, count_nonfinite=True)
            assert torch.equal(ids, one.argmax(-1)) and bad == (0 if value == 3e38 else 1), (value, at)


@pytest.mark.parametrize("n_tok", [1, 5, 33])
def test_routed_moe_host_path_is_the_loops_bits(tiny_model, monkeypatch, n_tok):
    """MoE.routed's host path (every expert's rows in one grouped C call per product, the SwiGLU on all rows at
    once, each token's outputs added in ascending expert order) against the per-expert loop it replaces: the same
    bits, at one token, a few and more tokens than experts; an expert not held here (expert parallelism) sends
    the layer back to the loop."""
    from dsv41.model import moe as moe_module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by the kernel tests: the Triton path's checks
    layers_moe = [b.ffn for b in tiny_model.layers if isinstance(b.ffn, moe_module.MoE)]
    assert layers_moe
    calls = []
    real = host.fp8_linear_grouped
    monkeypatch.setattr(host, "fp8_linear_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(n_tok)
    for moe in layers_moe:
        x = (torch.randn(n_tok, moe.dim, generator=g) * 2).bfloat16()
        with torch.inference_mode():
            weights, indices = moe.gate(x)
            with monkeypatch.context() as m:
                m.setattr(moe_module.MoE, "_host_experts", lambda self, x, i: None)
                loop = moe.routed(x, weights, indices)  # (also fills the weight caches)
            fused = moe.routed(x, weights, indices)
        assert_same(fused, loop)
    assert len(calls) == 2 * len(layers_moe), "the host path did not run"
    moe, last = layers_moe[0], str(len(layers_moe[0].experts) - 1)
    held, moe.experts._modules[last] = moe.experts._modules[last], None
    try:
        x = torch.randn(n_tok, moe.dim, generator=g).bfloat16()
        with torch.inference_mode():
            assert moe._host_experts(x, torch.zeros(n_tok, 2, dtype=torch.long)) is None
    finally:
        moe.experts._modules[last] = held


@pytest.mark.parametrize("n_tok,in_use", [(1, 1), (5, 5), (33, 33), (8, 5)])
def test_moe_every_row_in_two_calls_is_the_paths_bits(tiny_model, monkeypatch, n_tok, in_use):
    """MoE.every_row's host path in two C calls around torch's silu (host.moe_up, host.moe_down) against the path it
    replaces (`_routed_host` for the rows in use, the shared expert on every row, their sum): the same bits, at one
    token, a few, more tokens than experts, and with padding rows (rows_in_use < R); it runs only once the layers'
    weight caches are filled (the first call takes the loop, which fills them)."""
    from dsv41.model import moe as moe_module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layers_moe = [b.ffn for b in tiny_model.layers if isinstance(b.ffn, moe_module.MoE)]
    ran = []
    real = moe_module.MoE._every_row_host
    monkeypatch.setattr(moe_module.MoE, "_every_row_host",
                        lambda self, *a: (lambda y: ran.append(y is not None) or y)(real(self, *a)))
    g = torch.Generator().manual_seed(n_tok)
    for moe in layers_moe:
        x = (torch.randn(n_tok, 1, moe.dim, generator=g) * 2).bfloat16()
        with torch.inference_mode():
            moe.every_row(x, in_use)  # fills the caches
            two_calls = moe.every_row(x, in_use)
            with monkeypatch.context() as m:
                m.setattr(moe_module.MoE, "_every_row_host", lambda self, *a: None)
                before = moe.every_row(x, in_use)
        assert_same(two_calls, before)
    assert ran and ran[-1], "the two-call path did not run"


def test_moe_calls_refuse_an_expert_they_cannot_read():
    """host.moe_up / moe_down check every assignment before reading: an expert index outside 0..E-1, or one chosen
    whose weights were not passed, raises (no read out of bounds)."""
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(64, 32)
    ptrs = [w.data_ptr(), None, w.data_ptr()]
    for bad in ([[0, 3], [2, 0]], [[0, 1], [2, 0]], [[-1, 0], [2, 0]]):
        with pytest.raises(IndexError, match="expert index"):
            host.moe_up(x, torch.tensor(bad), 32, ptrs, ptrs, w.data_ptr(), w.data_ptr(), 32, 10.0)
    indices = torch.tensor([[0, 2], [2, 0]])
    gate, up, order = host.moe_up(x, indices, 32, ptrs, ptrs, w.data_ptr(), w.data_ptr(), 32, 10.0)
    w2 = torch.randn(32, 64)
    with pytest.raises(IndexError, match="expert index"):
        host.moe_down(gate, up, torch.rand(2, 2), indices, order, 32, [w2.data_ptr(), None, None], w2.data_ptr(), 64,
                      torch.bfloat16)


# ------------------------------------------------------------------------------------------- the KV cache's formats

PACKERS = [("fp8_ue8m0", formats.FP8_BLOCK), ("mxfp4", formats.MXFP4_BLOCK), ("fp4_e4m3", formats.FP4_E4M3_BLOCK)]


def _every_bf16(block: int) -> torch.Tensor:
    """All 65,536 bf16 bit patterns as fp32 rows of `block`, shuffled, so every value meets others in its block."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(block))].view(-1, block)


@pytest.mark.parametrize("fmt,block", PACKERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packers_are_formats_bytes(fmt, block, dtype):
    """host.pack_<fmt> against formats.pack_<fmt>, byte for byte: every bf16 value, the edge values (NaN, inf,
    subnormals, the E2M1 ties and the amax floors), bf16 and fp32 inputs, one row and several dims."""
    for x in (_every_bf16(block * 2), edge_values((7, 3, 128), 5), edge_values((1, 1, 512), 6)):
        x = x.to(dtype)
        assert_same(getattr(host, "pack_" + fmt)(x, block), getattr(formats, "pack_" + fmt)(x, block))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_fake_quant_is_formats(dtype):
    """The indexer queries' rounding: formats.mxfp4_fake_quant's values in x's dtype (a NaN's payload aside: only
    0 x inf makes one, an inf input's block, and torch writes its bf16 payload one way on its vector path and
    another on its scalar tail)."""
    for x in (_every_bf16(64), edge_values((5, 4, 128), 7)):
        x = x.to(dtype)
        assert_same_values(host.mxfp4_fake_quant(x, 32), formats.mxfp4_fake_quant(x, 32))


@pytest.mark.parametrize("fmt,block", PACKERS)
def test_unpackers_are_formats_values(fmt, block):
    """Every code byte against every scale byte (NaN codes and scales included), and the packers' own output."""
    width = block if fmt == "fp8_ue8m0" else block // 2
    codes = torch.arange(256, dtype=torch.uint8).repeat(256 * width // 256 + 1)[:256 * width].view(256, width)
    codes = codes[torch.randperm(256, generator=torch.Generator().manual_seed(3))].contiguous()
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1)
    expected = getattr(formats, "unpack_" + fmt)(codes, scales, block, torch.float32)
    assert_same_values(host.unpack(fmt, codes, scales, block), expected)
    packed = getattr(formats, "pack_" + fmt)(edge_values((3, 2, 256), 8, nonfinite=False), block)
    for dtype in (torch.float32, torch.bfloat16):
        assert_same(host.unpack(fmt, *packed, block, dtype), getattr(formats, "unpack_" + fmt)(*packed, block, dtype))
    with pytest.raises(ValueError, match="do not match"):
        host.unpack(fmt, codes, scales[:, :0], block)


def test_cache_codecs_and_the_attention_take_the_host_formats(monkeypatch):
    """The cache's codecs and the references' unpackers reach the C calls on the CPU at inference (and keep
    formats' code without the library or with a graph; strided bytes are copied first)."""
    from dsv41.model import cache
    from dsv41.model.kernels import quant

    calls = []
    for name in ("pack_fp8_ue8m0", "pack_mxfp4", "pack_fp4_e4m3", "unpack"):
        real = getattr(host, name)
        monkeypatch.setattr(host, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = torch.randn(2, 3, 512).bfloat16()
    with torch.inference_mode():
        for codec in (cache.WINDOW_CODEC, cache.INDEX_KEY_CODEC, cache.FP4_E4M3):
            packed = codec.pack(x[..., :128].contiguous() if codec is cache.INDEX_KEY_CODEC else x)
            codec.unpack(packed, torch.float32)
    assert sorted(set(calls)) == ["pack_fp4_e4m3", "pack_fp8_ue8m0", "pack_mxfp4", "unpack"]
    calls.clear()
    codes = torch.randint(0, 255, (4, 64), dtype=torch.uint8)
    scales = torch.randint(100, 140, (4, 2), dtype=torch.uint8)
    assert not host.takes_codes(codes.t())  # strided bytes: copied, then the C call (the same values)
    strided = codes.t().contiguous().t()
    assert_same(quant.unpack("fp8_ue8m0", strided, scales, 32), formats.unpack_fp8_ue8m0(strided, scales, 32))
    assert calls == ["unpack"]
    assert host.takes(x) is False  # grad mode on outside inference: the packers keep formats' code


# ------------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_atens_order_at_every_length(dtype):
    """host.rms_norm and host.rms_rstd against the torch code, bit for bit, at every row length from 8 to 300 and
    at V4.1's widths: the C sum follows ATen's order (8-lane vectors, four accumulators, the lanes last), so a
    length where the order differed would show here, at each CPU capability CI runs this file at."""
    g = torch.Generator().manual_seed(9)
    for n in [*range(host.SUM_LANES, 300), 512, 1024, 1031, 4096, 7168, 28672]:
        x = (torch.randn(3, n, generator=g) * torch.exp(torch.randn(3, 1, generator=g) * 3)).to(dtype)
        for wdtype in (torch.bfloat16, torch.float32):
            w = torch.randn(n, generator=g).to(wdtype)
            assert_same(host.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        assert_same(host.rms_rstd(x, 1e-20), torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-20))
    edges = edge_values((4, 64), 10)
    assert_same_values(host.rms_norm(edges, torch.ones(64), 1e-20), reference.rms_norm(edges, torch.ones(64), 1e-20))


def test_rms_norm_dispatch(monkeypatch):
    """kernels.norm.rms_norm takes the C call on the CPU at inference for rows of at least SUM_LANES values (shorter
    rows, whose ATen order depends on the rows beside them, and graphs keep the torch code)."""
    from dsv41.model.kernels import norm

    calls = []
    real = host.rms_norm
    monkeypatch.setattr(host, "rms_norm", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        norm.rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6)
        assert calls == [1]
        norm.rms_norm(torch.randn(9, 7), torch.ones(7), 1e-6)
        assert calls == [1]
    norm.rms_norm(torch.randn(2, 64, requires_grad=True), torch.ones(64), 1e-6)
    assert calls == [1]


# ------------------------------------------------------------------------------------------- sparse attention


def _sparse_attention_by_einsum(q, kv, sink, idx, scale):
    """reference.sparse_attention as it was written before its products became direct batched GEMMs: the oracle."""
    B, T, H, D = q.shape
    qf, kvf = q.float(), kv.float()
    batch = torch.arange(B).view(-1, 1, 1)
    acc = q.new_zeros(B, T, H, D, dtype=torch.float32)
    denom = q.new_zeros(B, T, H, dtype=torch.float32)
    run_max = torch.full((B, T, H), -1e30, dtype=torch.float32)
    for start in range(0, idx.size(-1), reference.SPARSE_BLOCK):
        block = idx[..., start:start + reference.SPARSE_BLOCK].long()
        valid = block >= 0
        keys = kvf[batch, block.clamp_min(0)] * valid.unsqueeze(-1)
        logits = torch.where(valid.unsqueeze(2), torch.einsum("bthd,btkd->bthk", qf, keys), -torch.inf) * scale
        new_max = torch.maximum(run_max, logits.amax(dim=-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(logits - new_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bthk,btkd->bthd", p.to(torch.bfloat16).float(), keys)
        run_max = new_max
    denom = denom + torch.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(q.dtype)


@pytest.mark.parametrize("B,T,H,D,N,K", [(1, 1, 4, 64, 96, 96), (3, 1, 4, 64, 80, 96), (2, 37, 4, 64, 100, 70),
                                         (1, 200, 4, 64, 300, 128), (4, 3, 8, 128, 50, 33), (2, 1, 4, 64, 10, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_attention_products_are_einsums_bits(B, T, H, D, N, K, dtype):
    """The reference's two products as batched GEMMs on the operands einsum lays out, and its rows gathered as
    embedding rows: einsum's bits (decode and prefill shapes, empty indices and a row with none)."""
    g = torch.Generator().manual_seed(B * 1000 + T)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    kv = torch.randn(B, N, D, generator=g).to(dtype)
    sink = torch.randn(H, generator=g)
    idx = torch.randint(-1, N, (B, T, K), generator=g)
    idx[0, 0, :3] = -1
    if B > 1:
        idx[1, 0] = -1
    assert_same(reference.sparse_attention(q, kv, sink, idx, 0.125), _sparse_attention_by_einsum(q, kv, sink, idx, 0.125))


# ------------------------------------------------------------------------------------------- scalar sigmoid, softplus


def test_scalar_sigmoid_and_softplus_are_atens_scalar_loop(monkeypatch):
    """host.scalar_sigmoid / scalar_softplus against what reference.per_row makes ATen compute inside the decode
    step (its scalar formula on every element): a million values over every fp32 exponent, both signs, and the
    edges, bit for bit; per_row takes them where its scalar path runs and nowhere else; route and the mHC step
    pass them on the CPU."""
    from dsv41.model.kernels import mhc, routing

    spread = torch.arange(-2**31, 2**31, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    spread = spread[torch.isfinite(spread)]
    edges = torch.tensor([0.0, -0.0, 20.0, 20.000002, 19.999998, -88.7, 88.7, 1e-40, float("inf"), float("-inf")])
    t = torch.cat([spread, edges])
    t = t[:t.numel() // 7 * 7].contiguous().view(-1, 7)  # rows that are not whole vector chunks
    with reference.row_invariant():
        for fn, scalar in ((torch.sigmoid, host.scalar_sigmoid), (torch.nn.functional.softplus, host.scalar_softplus)):
            assert_same(reference.per_row(fn, t, scalar), reference.per_row(fn, t))
            assert_same(scalar(t), reference.per_row(fn, t))
    wide = torch.randn(3, reference.VECTOR_CHUNK)  # whole vector chunks: the vector code, not the scalar hook
    assert reference.per_row(torch.sigmoid, wide, lambda _: 1 / 0) is not None
    assert host.scalar_sigmoid(torch.randn(4, 3).t()) is None  # strided: torch's own
    seen = []
    for name in ("scalar_sigmoid", "scalar_softplus"):
        real = getattr(host, name)
        monkeypatch.setattr(host, name, lambda x, _real=real, _name=name: seen.append(_name) or _real(x))
    # parameters: made outside inference. 8 streams: the step's pieces (with 4, V4.1's, the decode step's mHC is
    # one C call, host.mhc_step, whose sigmoid is this formula inside: test_mhc_step_in_one_call_bits)
    weights = (torch.randn(80, 512) * 0.05, torch.ones(3), torch.zeros(80))
    with torch.inference_mode(), reference.row_invariant():
        routing.route(torch.randn(2, 8), torch.zeros(8), 2)
        mhc.mhc_step(torch.randn(1, 1, 8, 64).bfloat16(), torch.rand(1, 1, 8), *weights, 20, 1e-6, 1e-6)
    assert sorted(set(seen)) == ["scalar_sigmoid", "scalar_softplus"]


# ------------------------------------------------------------------------------------------- attention inputs


def _unfused_inputs(attn):
    return lambda x, freqs: (*attn.query(x, freqs), attn.window_latent(x, freqs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R,per_row", [(1, True), (3, True), (2, False)])
def test_attention_inputs_in_one_call_bits(tiny_model, monkeypatch, dtype, R, per_row):
    """host.attention_inputs (Attention.decode_inputs on the CPU) against Attention.query and window_latent, each
    of whose pieces takes its own host call: qr, the rotated queries and the window latent, bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = host.attention_inputs
    monkeypatch.setattr(host, "attention_inputs", lambda *a: calls.append(1) or real(*a))
    attn = tiny_model.layers[2].attn
    g = torch.Generator().manual_seed(R)
    x = (torch.randn(R, 1, tiny_model.args.dim, generator=g) * 3).to(dtype)
    positions = torch.tensor([5, 70, 300])[:R].unsqueeze(1) if per_row else slice(40, 41)
    with torch.inference_mode():
        freqs = attn.freqs(positions, x.device, stop=301) if per_row else attn.freqs(positions, x.device)
        want = _unfused_inputs(attn)(x, freqs)
        want = _unfused_inputs(attn)(x, freqs)  # the weight caches filled by the first call
        got = attn.decode_inputs(x, freqs)
    assert calls, "the fused call was not taken"
    assert_same(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R,per_row", [(1, True), (3, True), (2, False)])
def test_attention_output_in_one_call_bits(tiny_model, monkeypatch, dtype, R, per_row):
    """host.attention_output (Attention.decode_output on the CPU) against Attention.output, whose inverse RoPE,
    grouped wo_a and wo_b each take their own host call: bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = host.attention_output
    monkeypatch.setattr(host, "attention_output", lambda *a: calls.append(1) or real(*a))
    attn = tiny_model.layers[5].attn
    g = torch.Generator().manual_seed(10 + R)
    o = (torch.randn(R, 1, attn.n_heads, attn.head_dim, generator=g) * 2).to(dtype)
    positions = torch.tensor([5, 70, 300])[:R].unsqueeze(1) if per_row else slice(40, 41)
    with torch.inference_mode():
        freqs = attn.freqs(positions, o.device, stop=301) if per_row else attn.freqs(positions, o.device)
        attn.output(o, freqs)  # the weight caches filled
        want = attn.output(o, freqs)
        got = attn.decode_output(o, freqs)
    assert calls, "the fused call was not taken"
    assert_same(got, want)


def test_decode_steps_with_fused_attention_inputs_are_the_same_bits(tiny_model, monkeypatch):
    """The tiny model's decode steps (every layer mode, rows at different positions): the same logits, bit for bit,
    with the attention's inputs and output and the indexer's choice each in one call and Engram's gate in two, and in
    their separate calls."""
    from test_batch_engine import prompts, run_rows

    from dsv41.model.attention import Attention
    from dsv41.model.engram import Engram
    from dsv41.model.indexer import Indexer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ids = prompts((1, 9, 17))
    calls = []
    for name in ("attention_inputs", "attention_output", "engram_mix", "indexer_decode"):
        monkeypatch.setattr(host, name, lambda *a, _real=getattr(host, name), _name=name: calls.append(_name)
                            or _real(*a))
    with torch.inference_mode():
        fused = run_rows(tiny_model, ids, 8)
    assert set(calls) == {"attention_inputs", "attention_output", "engram_mix", "indexer_decode"}
    monkeypatch.setattr(Attention, "decode_inputs", lambda self, x, freqs: _unfused_inputs(self)(x, freqs))
    monkeypatch.setattr(Attention, "decode_output", Attention.output)
    monkeypatch.setattr(Engram, "_host_gate", lambda *a: False)
    monkeypatch.setattr(Indexer, "_host_select", lambda *a: None)
    with torch.inference_mode():
        apart = run_rows(tiny_model, ids, 8)
    assert_same(fused, apart)


# ------------------------------------------------------------------------------------------- the indexer's choice


@pytest.mark.parametrize("B,H,N,topk,with_pool", [(1, 4, 70, 32, False), (3, 4, 130, 32, True), (2, 2, 20, 32, False),
                                                  (2, 4, 64, 8, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_decode_in_one_call_bits(B, H, N, topk, with_pool, dtype):
    """host.indexer_decode against Indexer.select's decode lines (reference.indexer_scores' exact path, the masks,
    the stable Top-K, the ascending ids, -1 past the visible ones, the pad), over keys read in place from a row-range
    view: the scores and the ids bit for bit, with tied scores (repeated keys) and rows that see few entries."""
    from dsv41.model.indexer import top_indices

    g = torch.Generator().manual_seed(B * 100 + N)
    q = formats.mxfp4_fake_quant(torch.randn(B, 1, H, 32, generator=g) * 2, 32).to(dtype)
    w = (torch.randn(B, 1, H, generator=g) * 0.3).bfloat16()
    keys = torch.randn(B, 2 * N, 32, generator=g)
    keys[:, 5], keys[:, 9] = keys[:, 3], keys[:, 3]  # equal scores: the lower id first
    codes, scales = (t[:, :N] for t in formats.pack_mxfp4(keys, 32))
    visible = torch.tensor([N, N // 2, 3])[:B].view(B, 1)
    pool = torch.rand(B, 1, N, generator=g) > 0.3 if with_pool else None
    with torch.inference_mode():
        got = host.indexer_decode(q, w, codes, scales, visible, pool, topk)
        scores = reference.indexer_scores(q, w, codes, scales, bf16_scores=True, by_entry=True)
        scores = scores.masked_fill(torch.arange(N) >= visible.unsqueeze(-1), -torch.inf)
        if pool is not None:
            scores = scores.masked_fill(~pool, -torch.inf)
        idx = top_indices(scores, min(topk, N), stable=True).sort(dim=-1).values
        top = torch.nn.functional.pad(torch.where(idx < visible.unsqueeze(-1), idx, -1), (0, topk - idx.size(-1)),
                                      value=-1)
    assert got is not None
    assert_same(got[0], scores)
    assert_same(got[1], top)
    nan = w.clone()
    nan[0, 0, 0] = float("nan")
    assert host.indexer_decode(q, nan, codes, scales, visible, pool, topk) is None  # torch's sort puts NaN first


# ------------------------------------------------------------------------------------------- Engram's gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R", [1, 3])
def test_engram_gate_in_two_calls_bits(tiny_model, monkeypatch, dtype, R):
    """host.engram_mix (Engram.forward's gate in the decode step) against the torch lines it replaces: bit for bit,
    with a stream of zeros among the rows (its dot product clamped to the floor before the signed square root)."""
    from dsv41.model.engram import Engram

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engram = tiny_model.layers[1].engram
    hc, dim = engram.hc_mult, engram.dim
    g = torch.Generator().manual_seed(R)
    x = (torch.randn(R, 1, hc, dim, generator=g) * 2).to(dtype)
    x[0, 0, 1] = 0
    rows = torch.randint(0, engram.embed.weight.size(0), (R, 1, engram.n_cols), generator=g)
    calls = []
    real = host.engram_mix
    monkeypatch.setattr(host, "engram_mix", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode(), reference.row_invariant():
        got = engram(x, rows)
        assert calls, "the C calls were not taken"
        monkeypatch.setattr(Engram, "_host_gate", lambda *a: False)
        want = engram(x, rows)
    assert_same(got, want)
    assert not torch.equal(got, x)


# ------------------------------------------------------------------------------------------- the MoE router


def _gate_case(N, E, dtype, bias_rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, 64, generator=g) * 2).to(dtype)
    w = torch.randn(E, 64, generator=g) * 0.3
    bias = torch.randn(N, E, generator=g) * 0.1 if bias_rows else torch.randn(E, generator=g) * 0.1
    return x, w, bias


@pytest.mark.parametrize("E,k", [(8, 1), (8, 2), (7, 3), (16, 4), (33, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temp,norm,bias_rows", [(1.0, True, False), (0.7, True, True), (1.3, False, False)])
def test_gate_route_is_the_references_bits(E, k, dtype, temp, norm, bias_rows):
    """host.gate_route (the GEMM and softplus, torch's sqrt, the Top-k and weights) against reference.gate_route
    inside the decode step's row_invariant(): the weights and the indices in their order, bit for bit."""
    x, w, bias = _gate_case(9, E, dtype, bias_rows, E * 100 + k)
    with torch.inference_mode(), reference.row_invariant():
        out = host.gate_route(x, w, bias, k, temp, norm, 1.5)
        assert out is not None
        assert_same(out, reference.gate_route(x, w, bias, k, temp, norm, 1.5))


def test_gate_route_leaves_ties_and_nans_to_torch(monkeypatch):
    """A row whose k largest biased scores hold a tie, or with a NaN, is torch.topk's to order: the C call declines
    and routing.gate_route answers with the reference; ties below the k-th and elsewhere in other rows do not
    matter to it."""
    from dsv41.model.kernels import routing

    w = torch.randn(8, 64) * 0.3
    with torch.inference_mode(), reference.row_invariant():
        tied = torch.zeros(3, 64)  # every score the same
        assert host.gate_route(tied, w, torch.zeros(8), 2) is None
        nan = torch.randn(3, 64)
        nan[2, 5] = float("nan")
        assert host.gate_route(nan, w, torch.zeros(8), 2) is None
        # the k-th largest tied with a lower one: declined; a tie below the k-th: answered
        x = torch.randn(1, 64)
        scores = reference.fixed_order_matmul(x, w.t().contiguous())
        s = reference.per_row(torch.nn.functional.softplus, scores).sqrt()[0]
        order = s.argsort(descending=True)
        at_k = torch.zeros(8)
        at_k[order[2]] = s[order[1]] - s[order[2]]  # the 3rd largest raised to the 2nd's biased score
        assert host.gate_route(x, w, at_k, 2) is None
        below = torch.zeros(8)
        below[order[3]] = s[order[2]] - s[order[3]]  # the 4th raised to the 3rd: top 2 unchanged
        if s[order[3]] + below[order[3]] == s[order[2]]:
            assert_same(host.gate_route(x, w, below, 2), reference.gate_route(x, w, below, 2))
        for xs, bias in ((tied, torch.zeros(8)), (nan, torch.zeros(8)), (x, at_k)):
            assert_same(routing.gate_route(xs, w, bias, 2), reference.gate_route(xs, w, bias, 2))


def test_gate_route_dispatch(monkeypatch):
    """routing.gate_route takes the C calls only inside the decode step's row_invariant() with rows that are not
    whole vector chunks (where the reference's softplus is ATen's scalar formula), the sqrt-softplus score, k <= 4;
    everywhere else the GEMM and route of before, with the same numbers."""
    from dsv41.model.kernels import routing

    calls = []
    real = host.gate_route
    monkeypatch.setattr(host, "gate_route", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, bias = _gate_case(4, 8, torch.bfloat16, False, 7)
    with torch.inference_mode():
        want = routing.route(host.fixed_order_linear(x, w), bias, 2)
        assert_same(routing.gate_route(x, w, bias, 2), want)  # outside row_invariant(): the vector softplus
        assert not calls
        with reference.row_invariant():
            assert_same(routing.gate_route(x, w, bias, 2), reference.gate_route(x, w, bias, 2))
            assert len(calls) == 1
            wide = torch.randn(32, 64) * 0.3  # a whole vector chunk of experts: the vector code, not the scalar loop
            routing.gate_route(x, wide, torch.zeros(32), 2)
            routing.gate_route(x, w, bias, 5)  # k above GATE_MAX_TOPK
            routing.gate_route(x, w, bias, 2, "sigmoid")
            assert len(calls) == 1


# ------------------------------------------------------------------------------------------- fixed-order attention


def _packed_attention_case(B, T, H, D, W, N, Kw, Km, dtype, seed):
    """Random packed operands: FP8 window rows [B, W, D], FP4 main rows in a store of 2 N rows per sequence read
    through a row-range view (the cache's layout: a sequence's rows are not next to the next sequence's), indices
    with -1 holes, a row with none."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    window = formats.pack_fp8_ue8m0(torch.randn(B, W, D, generator=g) * 3, formats.FP8_BLOCK)
    store = formats.pack_fp4_e4m3(torch.randn(B, 2 * N, D, generator=g), formats.FP4_E4M3_BLOCK)
    main = tuple(t[:, :N] for t in store) if Km else (None, None)
    w_idx = torch.randint(-1, W, (B, T, Kw), generator=g)
    m_idx = torch.randint(-1, N, (B, T, Km), generator=g) if Km else None
    w_idx[0, 0] = -1
    if m_idx is not None:
        m_idx[0, 0] = -1
    return q, window, main, torch.randn(H, generator=g), w_idx, m_idx


@pytest.mark.parametrize("B,T,H,D,W,N,Kw,Km", [(1, 1, 4, 64, 64, 40, 64, 32), (3, 1, 4, 64, 64, 90, 64, 32),
                                                (2, 37, 4, 64, 64, 100, 80, 70), (2, 5, 8, 128, 16, 300, 16, 200),
                                                (1, 3, 4, 64, 64, 10, 64, 0), (2, 1, 2, 32, 8, 5, 3, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("values", [False, True])
def test_sparse_attention_fixed_order_bits(B, T, H, D, W, N, Kw, Km, dtype, values):
    """host.sparse_attention_packed is reference.sparse_attention_packed with attend=sparse_attention_fixed_order,
    bit for bit (decode and prefill shapes, several blocks of 64, no main store, -1 holes, an empty row, the
    window's fp32 values given or decoded from its bytes, a strided main store); and within rounding of REF's
    order (reference.sparse_attention: MKL's GEMMs and torch's exp)."""
    q, (wc, ws), (mc, ms), sink, w_idx, m_idx = _packed_attention_case(B, T, H, D, W, N, Kw, Km, dtype, B * 100 + T)
    wv = formats.unpack_fp8_ue8m0(wc, ws, formats.FP8_BLOCK, torch.float32) if values else None
    got = host.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125, wv)
    want = reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125, wv,
                                             attend=reference.sparse_attention_fixed_order)
    assert_same(got, want)
    order = ["base", "avx2", "avx512"]
    for version in order[: order.index(host.head_isa()) + 1]:  # every ISA version this CPU runs: the same bits
        assert_same(host.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125, wv, version), want)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))  # the row with no index: 0, as REF's
    ref = reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125, wv)
    # a probability one ulp apart can round to a neighbouring bf16 value before P.V, whatever the output's dtype
    assert float((got.float() - ref.float()).abs().max()) <= 2 ** -7 * max(1.0, float(ref.float().abs().max()))


@pytest.mark.parametrize("start_pos,n_prev,T,window,Km", [(0, 0, 37, 64, 0), (100, 63, 20, 64, 24), (7, 7, 90, 80, 70),
                                                      (300, 79, 5, 80, 8)])
@pytest.mark.parametrize("values", [False, True])
def test_sparse_attention_prefill_window_in_place(start_pos, n_prev, T, window, Km, values):
    """A prefill's causal window (attention.window_indices: a run of consecutive rows, -1 before position 0) is read
    in place from the sequence's window transposed once, not gathered token by token: the same bits as the
    reference and as gathering (a window block of shuffled indices), in every ISA version; one and two window
    blocks, with and without a main store."""
    from dsv41.model.attention import window_indices
    B, H, D, N = 2, 4, 64, 50
    W = n_prev + T
    q, (wc, ws), (mc, ms), sink, _, m_idx = _packed_attention_case(B, T, H, D, W, N, 1, Km, torch.float32, T + Km)
    w_idx = window_indices(start_pos, T, n_prev, window, "cpu").expand(B, T, -1).contiguous()
    shuffled = w_idx[..., torch.randperm(w_idx.size(-1), generator=torch.Generator().manual_seed(0))]
    wv = formats.unpack_fp8_ue8m0(wc, ws, formats.FP8_BLOCK, torch.float32) if values else None
    order = ["base", "avx2", "avx512"]
    for idx in (w_idx, shuffled):
        want = reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, idx, m_idx, 0.125, wv,
                                                 attend=reference.sparse_attention_fixed_order)
        for version in order[: order.index(host.head_isa()) + 1]:
            assert_same(host.sparse_attention_packed(q, wc, ws, mc, ms, sink, idx, m_idx, 0.125, wv, version), want)


def test_sparse_attention_fixed_order_edges():
    """Blocks whose indices are all -1 after a valid one (rescale exactly 1), logits large enough that the sink's
    term is clamped (e^88: the output is 0 within fp32, as exp's inf makes it), and a NaN query row (NaN out)."""
    q, (wc, ws), (mc, ms), sink, w_idx, m_idx = _packed_attention_case(2, 2, 4, 64, 64, 40, 64, 80, torch.float32, 7)
    m_idx[1, 1] = -1  # a whole second block of holes
    q[1, 0, 2] = float("nan")
    big = torch.full_like(sink, 200.0)
    for s in (sink, big):
        got = host.sparse_attention_packed(q, wc, ws, mc, ms, s, w_idx, m_idx, 0.125)
        want = reference.sparse_attention_packed(q, wc, ws, mc, ms, s, w_idx, m_idx, 0.125,
                                                 attend=reference.sparse_attention_fixed_order)
        assert_same(got, want)
        assert torch.isnan(got[1, 0, 2]).all() and not torch.isnan(got[1, 0, 3]).any()


def test_sparse_attention_dispatch(monkeypatch):
    """kernels.sparse_attention_packed takes the C call on the CPU at inference in the "fast" mode only: the
    "exact" mode, a gradient and the Triton interpreter keep REF's order (reference.sparse_attention)."""
    from dsv41.model.kernels import sparse_attention as kernels_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by the kernel tests: it keeps the reference
    calls = []
    real = host.sparse_attention_packed
    monkeypatch.setattr(host, "sparse_attention_packed", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, (wc, ws), (mc, ms), sink, w_idx, m_idx = _packed_attention_case(1, 1, 4, 64, 64, 40, 64, 32, torch.bfloat16, 3)
    with torch.inference_mode():
        fast = kernels_attention.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125)
    assert calls == [1]
    layers.set_gemm_mode("exact")
    try:
        with torch.inference_mode():
            exact = kernels_attention.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125)
    finally:
        layers.set_gemm_mode("fast")
    assert calls == [1]
    assert_same(exact, reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125))
    kernels_attention.sparse_attention_packed(q.requires_grad_(), wc, ws, mc, ms, sink, w_idx, m_idx, 0.125)
    assert calls == [1]
    assert_same(fast, real(q.detach(), wc, ws, mc, ms, sink, w_idx, m_idx, 0.125))


def test_exp_poly_up_to_the_sink_clamp():
    """exp_poly past 0, where the attention's sink term takes it (up to reference.SINK_EXP_MAX): within 4e-7
    relative of exp, and finite at the clamp."""
    d = torch.linspace(0, reference.SINK_EXP_MAX, 200_001)
    got = reference.exp_poly(d).double()
    assert float(((got - torch.exp(d.double())) / torch.exp(d.double())).abs().max()) < 4e-7
    assert torch.isfinite(reference.exp_poly(torch.tensor([reference.SINK_EXP_MAX]))).all()


# ------------------------------------------------------------------------------------------- the mHC step, whole


@pytest.mark.parametrize("R,n,d,with_y", [(1, 4, 64, True), (5, 4, 64, False), (7, 4, 32, True), (3, 2, 16, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_step_in_one_call_bits(R, n, d, with_y, dtype):
    """host.mhc_step is reference.mhc_step_fixed_order bit for bit, and within 1e-6 of REF's mhc_step (MKL's
    projection, the vector sigmoid) in the coefficients and one bf16 step in the streams."""
    g = torch.Generator().manual_seed(R * 10 + n)
    x = torch.randn(R, 1, n, d, generator=g).to(dtype)
    fn = torch.randn((n + 2) * n, n * d, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((n + 2) * n, generator=g) * 0.3
    pre_prev = torch.rand(R, 1, n, generator=g)
    y, post, comb = ((torch.randn(R, 1, d, generator=g).to(dtype), torch.rand(R, 1, n, generator=g) * 2,
                      torch.rand(R, 1, n, n, generator=g)) if with_y else (None, None, None))
    scale_mix, base_f = reference._mix_affine(scale, base, n)
    with torch.inference_mode():
        got = host.mhc_step(x, pre_prev, host.transposed(fn), scale_mix, base_f, 20, 1e-6, 1e-20, y, post, comb)
        want = reference.mhc_step_fixed_order(x, pre_prev, fn, scale, base, 20, 1e-6, 1e-20, y, post, comb)
        ref = reference.mhc_step(x, pre_prev, fn, scale, base, 20, 1e-6, 1e-20, y, post, comb)
    for a, b, c in zip(got, want, ref):
        assert_same(a, b)
        assert float((a.float() - c.float()).abs().max()) <= (1e-6 if a.dtype == torch.float32 and a.dim() < 4
                                                              else 2 ** -7 * float(c.float().abs().max()))
    assert got[0] is x if y is None else got[0] is not x


def test_mhc_step_dispatch(monkeypatch):
    """kernels.mhc.mhc_step takes host.mhc_step in the decode step (`row_invariant`, where the sigmoids are ATen's
    scalar formula) on the CPU at inference, in either GEMM mode: the bits of the step's pieces (the projection's
    fixed order is the host's in both modes). Outside it (a prefill) the pieces run, torch's vector sigmoid."""
    from dsv41.model.kernels import mhc

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by the kernel tests: the Triton path's checks
    calls = []
    real = host.mhc_step
    monkeypatch.setattr(host, "mhc_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    weights = (torch.randn(24, 256) * 0.05, torch.ones(3), torch.zeros(24))
    x, pre = torch.randn(2, 1, 4, 64).bfloat16(), torch.rand(2, 1, 4)
    with torch.inference_mode(), reference.row_invariant():
        one_call = mhc.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6)
        assert calls == [1]
        monkeypatch.setattr(mhc, "_one_call", lambda *a: False)
        pieces = mhc._host_step(x, pre, *weights, 20, 1e-6, 1e-6, None, None, None)
        monkeypatch.undo()
    for a, b, c in zip(one_call, reference.mhc_step_fixed_order(x, pre, *weights, 20, 1e-6, 1e-6), pieces):
        assert_same(a, b)
        assert_same(a, c)
    monkeypatch.setattr(host, "mhc_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        mhc.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6)
    assert calls == [1]


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_step_with_the_sublayers_norm_bits(monkeypatch, norm_dtype, dtype):
    """mhc_step's `norm`: the collapsed input through the sub-layer's RMSNorm in the host's one call (its C call in
    place) and on every other path (the pieces, the reference) the bits of rms_norm after the step; the other
    outputs unchanged."""
    from dsv41.model.kernels import mhc
    from dsv41.model.kernels import norm as kernels_norm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(3)
    weights = (torch.randn(24, 256, generator=g) * 0.05, torch.ones(3), torch.zeros(24))
    x, pre = torch.randn(3, 1, 4, 64, generator=g).to(dtype), torch.rand(3, 1, 4, generator=g)
    y, post, comb = torch.randn(3, 1, 64, generator=g).to(dtype), torch.rand(3, 1, 4) * 2, torch.rand(3, 1, 4, 4)
    norm = ((torch.rand(64, generator=g) + 0.5).to(norm_dtype), 1e-6)
    calls = []
    real = host.mhc_step
    monkeypatch.setattr(host, "mhc_step", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    with torch.inference_mode(), reference.row_invariant():
        plain = mhc.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6, y, post, comb)
        normed = mhc.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6, y, post, comb, norm=norm)
        assert calls == [None, norm]  # the norm went into the one call
        monkeypatch.setattr(mhc, "_one_call", lambda *a: False)
        pieces = mhc.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6, y, post, comb, norm=norm)
        monkeypatch.undo()
    with torch.inference_mode():
        want = kernels_norm.rms_norm(plain[1], *norm)
        torch_ref = reference.rms_norm(plain[1], *norm)
        outside = mhc._normed(reference.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6, y, post, comb), norm)
    assert_same(want, torch_ref)
    for got in (normed, pieces):
        assert_same(got[1], want)
        for a, b in zip(got[2:] + (got[0],), plain[2:] + (plain[0],)):
            assert_same(a, b)
    assert_same(outside[1], reference.rms_norm(reference.mhc_step(x, pre, *weights, 20, 1e-6, 1e-6, y, post,
                                                                  comb)[1], *norm))


# ------------------------------------------------------------------------------------------- the batch cache's writes


def test_put_rows_is_the_indexed_put():
    """host.put_rows(dst, slots, src) is dst[arange(R), slots] = src[:, 0] for the batch cache's stores (uint8
    bytes, fp32 values, a trailing dim or none), leaves the rows past R alone, refuses what it does not take (a
    strided store, another dtype, a gradient) without writing, and raises on a slot outside the ring."""
    g = torch.Generator().manual_seed(5)
    for dst, src in ((torch.randint(0, 255, (6, 4, 32), dtype=torch.uint8, generator=g),
                      torch.randint(0, 255, (3, 1, 32), dtype=torch.uint8, generator=g)),
                     (torch.randn(6, 5, 8, generator=g), torch.randn(3, 1, 8, generator=g)),
                     (torch.randn(5, 9, generator=g), torch.randn(3, 1, generator=g))):
        slots = torch.tensor([2, 0, dst.size(1) - 1])
        want = dst.clone()
        want[torch.arange(3), slots] = src[:, 0]
        with torch.inference_mode():
            assert host.put_rows(dst, slots, src)
        assert_same(dst, want)
    with torch.inference_mode():
        assert not host.put_rows(dst.t().contiguous().t(), slots, src)
        assert not host.put_rows(dst, slots, src.double())
        with pytest.raises(IndexError, match="outside"):
            host.put_rows(dst, torch.tensor([0, 1, dst.size(1)]), src)
    before = dst.clone()
    assert not host.put_rows(dst, slots, src)  # grad mode on: torch's put records it
    assert_same(dst, before)
