"""The packed KV cache: storage formats, bit-exact reads, measured bytes against the ledger, the
comparison formats, persistent export/import, rollback of packed rings."""

import pytest
import torch

from dsv41.model import formats
from dsv41.model.cache import BF16, FP4_E4M3, FP8_UE8M0, MAIN_FORMATS, MXFP4, KVCache
from dsv41.model.config import preset
from dsv41.model.ledger import kv_ledger


def hard_values(shape, seed=0) -> torch.Tensor:
    """bf16 values [..., D >= 32] with the blocks that make rounding subtle, one per row of the first
    rows: an FP4 block whose E4M3 scale is subnormal and rounds up (amax = 9 * 2^-9), an FP8 block whose
    max rounds up to 448 next to subnormal-range values, exact zeros and negative zeros, E2M1 ties and
    grid points; the rest random with row scales over many octaves (tiny and huge blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 3)
    flat = x.view(-1, shape[-1])
    flat[0, :16] = torch.linspace(-1, 1, 16) * 9 * 2.0**-9
    flat[1, :32] = torch.tensor([440.0, 2.0**-9, -3 * 2.0**-9, 5 * 2.0**-9] * 8)
    flat[2, :16] = 0.0
    flat[2, 16:32] = -0.0
    flat[3, :16] = torch.tensor([6.0, 0.5, 1.5, -0.5, -1.5, 3, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, 1e-4, -1e-4])
    return x.to(torch.bfloat16)


@pytest.fixture
def args():
    return preset("tiny")


# ------------------------------------------------------------------------------------- bit exactness
@pytest.mark.parametrize("fmt", list(MAIN_FORMATS))
def test_packed_reads_equal_fake_quantized_values_bit_for_bit(args, fmt):
    cache = KVCache(args, 2, main_format=fmt)
    main = hard_values((2, 6, args.head_dim), seed=1)
    keys = hard_values((2, 6, args.index_head_dim), seed=2)
    window = hard_values((2, 5, args.head_dim), seed=3)
    cache.write_index_keys(2, keys[:, :4])
    cache.write_compressed(2, main[:, :4])
    cache.write_index_keys(2, keys[:, 4:])  # a second append (the buffers grow)
    cache.write_compressed(2, main[:, 4:])
    cache.write_window(0, window, 0)
    want_main = {"fp4": formats.fp4_e4m3_fake_quant(main, 16), "fp8": formats.fp8_fake_quant(main, 32),
                 "bf16": main}[fmt]
    got = cache.compressed(2)
    assert got.dtype == torch.bfloat16
    # bit patterns, so that -0.0 and 0.0 count as different
    assert torch.equal(got.view(torch.int16), want_main.view(torch.int16))
    assert torch.equal(cache.index_keys_for(2).view(torch.int16), formats.mxfp4_fake_quant(keys, 32).view(torch.int16))
    assert torch.equal(cache.window_before(0, 5).view(torch.int16), formats.fp8_fake_quant(window, 32).view(torch.int16))
    assert torch.equal(cache.quantize_main(main), want_main)
    # what is stored: bytes, not floats (bf16 stores bf16)
    lc = cache.layer(2)
    stored = {p.dtype for p in lc.main.parts}
    assert stored == ({torch.bfloat16} if fmt == "bf16" else {torch.uint8})
    assert {p.dtype for p in lc.index_keys.parts} == {torch.uint8} and {p.dtype for p in cache.layer(0).window.parts} == {torch.uint8}


def test_rounding_twice_is_not_rounding_once():
    """Why the cache takes unrounded values: re-rounding fake-quantized values is not always exact. An
    FP4 block whose subnormal E4M3 scale rounded up (amax below 6 * 2^-6) gets a smaller scale the second
    time and its largest values saturate. Packing the unrounded values is exact for every codec."""
    x = hard_values((4, 64), seed=4).float()
    fp4 = lambda v: formats.fp4_e4m3_fake_quant(v, 16)
    assert not torch.equal(fp4(fp4(x[0])), fp4(x[0]))
    for codec in (MXFP4, FP4_E4M3, FP8_UE8M0, BF16):
        assert torch.equal(codec.unpack(codec.pack(x), torch.float32), codec.fake_quant(x))


def test_model_hands_the_cache_unrounded_values_and_reads_back_the_qat_values(tiny_model, tiny_args, monkeypatch):
    """The attention writes RoPE(latent) (not yet FP4) and reads FP4(RoPE(latent)): the entries the
    packed cache returns are exactly those the QAT forward computes."""
    written = {"main": [], "keys": [], "window": []}
    orig = (KVCache.write_compressed, KVCache.write_index_keys, KVCache.write_window)
    monkeypatch.setattr(KVCache, "write_compressed",
                        lambda self, l, x: (written["main"].append((l, x.clone())), orig[0](self, l, x))[1])
    monkeypatch.setattr(KVCache, "write_index_keys",
                        lambda self, l, x: (written["keys"].append((l, x.clone())), orig[1](self, l, x))[1])
    monkeypatch.setattr(KVCache, "write_window", lambda self, l, x, p, *packed: (
        written["window"].append((l, x.clone())), orig[2](self, l, x, p, *packed))[1])
    ids = torch.randint(0, tiny_args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = tiny_model.new_cache(1)
    with torch.inference_mode():
        tiny_model(ids, cache=cache)
    for src in tiny_args.kv_source_layers:
        main = torch.cat([x for l, x in written["main"] if l == src], dim=1)
        keys = torch.cat([x for l, x in written["keys"] if l == src], dim=1)
        assert not torch.equal(main, formats.fp4_e4m3_fake_quant(main, 16))  # unrounded
        assert torch.equal(cache.compressed(src), formats.fp4_e4m3_fake_quant(main, 16))
        assert not torch.equal(keys, formats.mxfp4_fake_quant(keys, 32))
        assert torch.equal(cache.index_keys_for(src), formats.mxfp4_fake_quant(keys, 32))
    l, window = written["window"][0]
    assert torch.equal(cache.window_before(l, 20), formats.fp8_fake_quant(window[:, -tiny_args.window_size:], 32))


def test_training_forward_keeps_gradients_and_equals_the_packed_forward(tiny_args):
    from dsv41.model.layers import rope_frequencies
    from dsv41.model.transformer import Transformer, init_random_

    rope_frequencies.cache_clear()  # tables built under inference_mode by earlier tests cannot take grads

    model = init_random_(Transformer(tiny_args), seed=1)
    ids = torch.randint(0, tiny_args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    train_cache, aux = model.new_cache(1), {}
    logits = model(ids, cache=train_cache, all_logits=True, aux=aux)  # grad mode: a differentiable store
    assert train_cache.layer(2).main.differentiable
    (logits.float().logsumexp(-1).mean() + sum(aux["indexer_kl"])).backward()
    assert model.layers[2].attn.compressor.wkv.weight.grad.abs().sum() > 0  # through the stored entries
    assert model.layers[2].attn.indexer.wk.weight.grad is not None
    packed_cache = model.new_cache(1)
    with torch.no_grad():
        packed = model(ids, cache=packed_cache, all_logits=True)
    assert not packed_cache.layer(2).main.differentiable
    assert torch.equal(logits.detach(), packed)


# ------------------------------------------------------------------------------------- measured bytes
@pytest.mark.parametrize("fmt,want", [("fp4", 890.0), ("fp8", 1490.0), ("bf16", 2730.0)])
def test_full_width_global_kv_bytes_per_token(fmt, want):
    """V4.1-Flash geometry (512-dim entries, 128-dim keys, sources 2/8/14 at m=2 and 20 at m=1), a small
    real allocation: 8 tokens' entries written into each kv source, bytes read off the tensors."""
    args = preset("v4.1-flash")
    cache = KVCache(args, 1, main_format=fmt)
    tokens = 8
    for l in args.kv_source_layers:
        n = tokens // args.compress_ratios[l]
        cache.write_index_keys(l, torch.randn(1, n, args.index_head_dim, dtype=torch.bfloat16))
        cache.write_compressed(l, torch.randn(1, n, args.head_dim, dtype=torch.bfloat16))
    cache.pos = tokens
    assert cache.global_bytes_per_token() == want
    if fmt == "fp4":
        assert want == kv_ledger(args)["global_bytes_per_token"]
    b = cache.storage_bytes()
    assert b["index_keys"] / tokens == 170.0 and b["main"] / tokens == want - 170.0
    # one layer's window ring: 128 slots of 528 bytes, as the ledger
    cache.write_window(0, torch.randn(1, 130, args.head_dim, dtype=torch.bfloat16), 0)
    assert cache.storage_bytes()["window"] == kv_ledger(args)["swa_bytes_per_layer_window"] == 128 * 528


def test_tiny_model_cache_bytes_equal_the_ledger(tiny_model, tiny_args):
    from dsv41.model.engine import cache_bytes_per_token

    cache = tiny_model.new_cache(2)
    with torch.inference_mode():
        tiny_model(torch.randint(0, tiny_args.vocab_size, (2, 32)), cache=cache)
    ledger = kv_ledger(tiny_args)
    assert cache.global_bytes_per_token() == cache_bytes_per_token(cache) == ledger["global_bytes_per_token"]
    b = cache.storage_bytes()
    assert b["window"] == 2 * tiny_args.n_layers * ledger["swa_bytes_per_layer_window"]
    assert b["allocated"] >= b["main"] + b["index_keys"] + b["window"]


# ------------------------------------------------------------------------------------- comparison formats
def test_comparison_formats_change_only_what_the_cache_returns(tiny_model, tiny_args, monkeypatch):
    ids = torch.randint(0, tiny_args.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    written, logits, caches = {}, {}, {}
    orig = KVCache.write_compressed

    def record(self, l, x):
        written.setdefault(self.main_format, []).append((l, x.clone()))
        orig(self, l, x)

    monkeypatch.setattr(KVCache, "write_compressed", record)
    with torch.inference_mode():
        for fmt in MAIN_FORMATS:
            caches[fmt] = tiny_model.new_cache(1, main_format=fmt)
            logits[fmt] = tiny_model(ids, cache=caches[fmt], all_logits=True)
    codec = {"fp4": FP4_E4M3, "fp8": FP8_UE8M0, "bf16": BF16}
    for fmt, cache in caches.items():
        raw = torch.cat([x for l, x in written[fmt] if l == 2], dim=1)
        assert torch.equal(cache.compressed(2), codec[fmt].fake_quant(raw))
    # layer 2 writes before anything reads the main KV: the same latents go into every format
    first = {fmt: written[fmt][0][1] for fmt in MAIN_FORMATS}
    assert torch.equal(first["fp4"], first["fp8"]) and torch.equal(first["fp4"], first["bf16"])
    # ... and the formats then differ in what attention sees
    assert not torch.equal(logits["fp4"], logits["bf16"]) and not torch.equal(logits["fp8"], logits["bf16"])
    assert torch.allclose(logits["fp4"], logits["bf16"], atol=0.5)
    with pytest.raises(ValueError, match="main_format"):
        KVCache(tiny_args, 1, main_format="int4")


# ------------------------------------------------------------------------------------- persistent global KV
def test_export_import_global_round_trip(tiny_model, tiny_args):
    cache = tiny_model.new_cache(1)
    with torch.inference_mode():
        tiny_model(torch.randint(0, tiny_args.vocab_size, (1, 21)), cache=cache)  # an open ratio-2 group
    data = cache.export_global()
    assert data["tokens"] == 21 and data["main_format"] == "fp4"
    assert torch.equal(data["sources"][2]["positions"], torch.arange(10) * 2)
    assert torch.equal(data["sources"][4]["positions"], torch.arange(21))
    assert all(t.dtype == torch.uint8 for s in data["sources"].values() for t in s["main"] + s["index_keys"])
    fresh = tiny_model.new_cache(1)
    fresh.import_global(data)
    for src in tiny_args.kv_source_layers:
        assert torch.equal(fresh.compressed(src), cache.compressed(src))
        assert torch.equal(fresh.index_keys_for(src), cache.index_keys_for(src))
    part = cache.export_global(upto=9)
    assert part["sources"][2]["main"][0].size(1) == 4 and part["sources"][4]["main"][0].size(1) == 9
    short = tiny_model.new_cache(1)
    short.import_global(part)
    assert torch.equal(short.compressed(2), cache.compressed(2)[:, :4])
    with pytest.raises(ValueError, match="fp4"):
        tiny_model.new_cache(1, main_format="fp8").import_global(data)
    with pytest.raises(ValueError, match="already holds"):
        fresh.import_global(data)
    bad = {**data, "sources": {2: {**data["sources"][2], "main": (data["sources"][2]["main"][0][..., :3],
                                                                   data["sources"][2]["main"][1])}}}
    with pytest.raises(ValueError, match="expected"):
        tiny_model.new_cache(1).import_global(bad)


# ------------------------------------------------------------------------------------- rollback
def test_rollback_restores_the_packed_window_ring(args):
    x = hard_values((1, 14, args.head_dim), seed=5)
    cache = KVCache(args, 1)
    cache.write_window(0, x[:, :10], 0)
    cache.pos = 10
    cache.checkpoint()
    cache.write_window(0, x[:, 10:14] * 3, 10)  # a rejected draft
    cache.pos = 14
    cache.rollback(11)
    ref = KVCache(args, 1)
    ref.write_window(0, x[:, :10], 0)
    ref.write_window(0, x[:, 10:11] * 3, 10)  # the accepted position
    assert torch.equal(cache.window_before(0, 11), ref.window_before(0, 11))
    assert cache.pos == 11
