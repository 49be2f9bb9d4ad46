"""One KV-bytes table (issue #20 item 4): every cache codec knows its bytes per entry from its layout
(payload + scales), and the ledger (`dsv41 info`), the memory plan (`dsv41 info --mp`) and
`dsv41 quantize-kv` all agree with it and with the bytes a cache actually stores, for every format and
for two configs (tiny, V4.1-Flash)."""

from __future__ import annotations

import pytest
import torch

from dsv41.evals.bpb import Corpus, Document
from dsv41.evals.quantize_kv import evaluate
from dsv41.model import cache as C
from dsv41.model import formats as F
from dsv41.model.config import preset
from dsv41.model.ledger import kv_ledger

CODECS = [C.FP4_E4M3, C.FP8_UE8M0, C.BF16, C.MXFP4]
PACKED_NAME = {"fp4": "fp4_e4m3", "fp8": "fp8_ue8m0", "mxfp4": "mxfp4"}  # formats.packed_nbytes's names
CONFIGS = ["tiny", "v4.1-flash"]
CONTEXT, BATCH = 8, 2  # a multiple of every compress ratio of both configs


# ------------------------------------------------------------------------------------------- codecs
@pytest.mark.parametrize("dim", [32, 64, 128, 512])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_codec_layout_is_what_pack_stores(codec, dim):
    parts = codec.pack(torch.randn(BATCH, 3, dim, dtype=torch.bfloat16))
    assert [(p.shape[-1], p.dtype) for p in parts] == list(codec.layout(dim))
    assert all(tuple(p.shape[:2]) == (BATCH, 3) for p in parts)
    assert sum(p[0, 0].nbytes for p in parts) == codec.bytes_per_entry(dim)
    assert sum(p.nbytes for p in parts) == BATCH * 3 * codec.bytes_per_entry(dim)
    if codec.name in PACKED_NAME:
        assert F.packed_nbytes(PACKED_NAME[codec.name], dim) == codec.bytes_per_entry(dim)


def test_the_documented_entry_sizes():
    """docs/kv-cache.md's table, V4.1-Flash shapes, and V4's entry (ledger only)."""
    assert {f: C.kv_entry_bytes(preset("v4.1-flash"), f) for f in C.MAIN_FORMATS} == {
        "fp4": {"main": 288, "index_keys": 68, "window": 528},
        "fp8": {"main": 528, "index_keys": 68, "window": 528},
        "bf16": {"main": 1024, "index_keys": 68, "window": 528}}
    for name in ("v4-flash", "v4-pro"):
        args = preset(name)
        entry = C.v4_entry_codec(args.rope_head_dim).bytes_per_entry(args.head_dim)
        assert entry == 583
        led = kv_ledger(args)
        assert led["main_entry_bytes"] == led["window_entry_bytes"] == entry
        assert led["indexer_entry_bytes"] == C.INDEX_KEY_CODEC.bytes_per_entry(args.index_head_dim) == 68


def test_the_torch_free_table_is_the_codecs_table():
    """model/kv_layout.py (what `dsv41 info` reads without torch) is where the codecs' layouts come from:
    the same layouts and block sizes as the packers (checked against packed tensors above), the same table."""
    from dsv41.model import kv_layout as K
    from dsv41.model.checkpoint.safetensors import st_name

    assert (K.FP4_E4M3_BLOCK, K.FP8_BLOCK, K.MXFP4_BLOCK) == (F.FP4_E4M3_BLOCK, F.FP8_BLOCK, F.MXFP4_BLOCK)
    for codec in CODECS:
        for dim in (32, 64, 128, 512):
            assert [(n, st_name(t)) for n, t in codec.layout(dim)] == list(K.LAYOUTS[codec.name](dim))
            assert K.bytes_per_entry(codec.name, dim) == codec.bytes_per_entry(dim)
    assert tuple(C.MAIN_FORMATS) == K.MAIN_FORMATS
    assert (C.INDEX_KEY_CODEC.name, C.WINDOW_CODEC.name) == (K.INDEX_KEY_FORMAT, K.WINDOW_FORMAT)
    for config in CONFIGS + ["v4-flash"]:
        args = preset(config)
        for fmt in C.MAIN_FORMATS:
            assert K.kv_entry_bytes(args, fmt) == C.kv_entry_bytes(args, fmt)
        assert K.v4_entry_bytes(args.rope_head_dim, args.head_dim) == \
            C.v4_entry_codec(args.rope_head_dim).bytes_per_entry(args.head_dim)
    with pytest.raises(ValueError, match="main_format must be one of fp4, fp8, bf16"):
        C.kv_entry_bytes(preset("tiny"), "fp6")


# ------------------------------------------------------------------------------------------- the table
def expected_bytes(args, fmt: str) -> dict[str, int]:
    """Bytes of a cache of BATCH sequences after CONTEXT tokens, from the codecs alone."""
    entries = sum(CONTEXT // args.compress_ratios[l] for l in args.kv_source_layers)
    main_codec, main_dim = C.MAIN_FORMATS[fmt], args.head_dim
    return {"main": BATCH * entries * main_codec.bytes_per_entry(main_dim),
            "index_keys": BATCH * entries * C.INDEX_KEY_CODEC.bytes_per_entry(args.index_head_dim),
            "window": BATCH * args.n_layers * args.window_size * C.WINDOW_CODEC.bytes_per_entry(args.head_dim)}


def filled_cache(args, fmt: str) -> C.KVCache:
    """A real cache of BATCH sequences after CONTEXT tokens: every kv source's entries and keys, every
    backbone layer's window, written as the forward writes them (random values of the true widths)."""
    g = torch.Generator().manual_seed(0)
    cache = C.KVCache(args, BATCH, main_format=fmt)
    for l in args.kv_source_layers:
        n = CONTEXT // args.compress_ratios[l]
        cache.write_index_keys(l, torch.randn(BATCH, n, args.index_head_dim, generator=g).bfloat16())
        cache.write_compressed(l, torch.randn(BATCH, n, args.head_dim, generator=g).bfloat16())
    for l in range(args.n_layers):
        cache.write_window(l, torch.randn(BATCH, CONTEXT, args.head_dim, generator=g).bfloat16(), 0)
    cache.pos = CONTEXT
    return cache


def tensor_bytes(cache: C.KVCache) -> dict[str, int]:
    """Bytes of the stored tensors, read off them here (not through `storage_bytes`)."""
    out = {"main": 0, "index_keys": 0, "window": 0}
    for l, lc in cache.layers.items():
        for part, store in (("main", lc.main), ("index_keys", lc.index_keys)):
            if store is not None:
                out[part] += sum(t[:, :lc.n_compressed].nbytes for t in store.parts)
        if lc.window is not None and l < cache.args.n_layers:
            out["window"] += sum(t.nbytes for t in lc.window.parts)
    return out


@pytest.mark.parametrize("fmt", list(C.MAIN_FORMATS))
@pytest.mark.parametrize("config", CONFIGS)
def test_ledger_memory_plan_and_stored_bytes_agree(config, fmt):
    from dsv41.model.parallel import memory_plan

    args = preset(config)
    table = C.kv_entry_bytes(args, fmt)
    want = expected_bytes(args, fmt)

    # what a real cache stores, entry by entry and in all
    cache = filled_cache(args, fmt)
    src = cache.layers[args.kv_source_layers[0]]
    assert sum(t[0, 0].nbytes for t in src.main.parts) == table["main"]
    assert sum(t[0, 0].nbytes for t in src.index_keys.parts) == table["index_keys"]
    assert sum(t[0, 0].nbytes for t in cache.layers[0].window.parts) == table["window"]
    stored = tensor_bytes(cache)
    assert stored == want
    assert {k: cache.storage_bytes()[k] for k in want} == want

    # the memory plan
    kv = {"main": want["main"], "index_keys": want["index_keys"], "window": want["window"],
          "total": sum(want.values())}
    assert C.kv_cache_bytes(args, CONTEXT, BATCH, fmt) == kv
    assert memory_plan(args, 1, CONTEXT, BATCH, main_format=fmt)["kv"] == kv

    # the ledger: per token and sequence; equal to the measured cache (CONTEXT is a multiple of every m)
    led = kv_ledger(args, fmt)
    assert (led["main_entry_bytes"], led["indexer_entry_bytes"], led["window_entry_bytes"]) == (
        table["main"], table["index_keys"], table["window"])
    per_token = CONTEXT * BATCH
    assert led["main_bytes_per_token"] == stored["main"] / per_token
    assert led["indexer_bytes_per_token"] == stored["index_keys"] / per_token
    assert led["global_bytes_per_token"] == cache.global_bytes_per_token() == (
        stored["main"] + stored["index_keys"]) / per_token
    assert led["swa_bytes_per_layer_window"] == stored["window"] / (BATCH * args.n_layers)
    if fmt == "fp4":
        assert kv_ledger(args) == led  # the official ledger (`dsv41 info`) is the fp4 one
        if config == "v4.1-flash":
            assert led["global_bytes_per_token"] == 890.0  # the report's anchor


# ------------------------------------------------------------------------------------------- quantize-kv
class ByteTokenizer:
    bos_id, pad_id = 0, 1

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        return [2 + b % (self.vocab - 2) for b in text.encode("utf-8")]


class CacheWriter(torch.nn.Module):
    """Stands in for V4.1-Flash in `quantize-kv` (the real one is 500 GB): writes what the forward
    writes into the cache (entries, keys and windows of the true widths) and returns random logits."""

    VOCAB = 64

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed = torch.nn.Embedding(4, 4)

    def forward(self, ids, cache, all_logits=True):
        B, T = ids.shape
        g = torch.Generator().manual_seed(T)
        for l in self.args.kv_source_layers:
            n = T // self.args.compress_ratios[l]
            cache.write_index_keys(l, torch.randn(B, n, self.args.index_head_dim, generator=g).bfloat16())
            cache.write_compressed(l, torch.randn(B, n, self.args.head_dim, generator=g).bfloat16())
        for l in range(self.args.n_layers):
            cache.write_window(l, torch.randn(B, T, self.args.head_dim, generator=g).bfloat16(), 0)
        cache.pos += T
        return torch.randn(B, T, self.VOCAB, generator=g)


@pytest.mark.parametrize("config", CONFIGS)
def test_quantize_kv_measures_the_table(config, tiny_model, monkeypatch):
    """`quantize-kv`'s measured bytes per token (its caches' real tensors, measured here too), its ledger
    column and the ledger agree with the codecs for every format. tiny: the real model's forward;
    V4.1-Flash: a stand-in that writes the true widths."""
    args = preset(config)
    model = tiny_model if config == "tiny" else CacheWriter(args)
    assert model.args.head_dim == args.head_dim and model.args.kv_source_layers == args.kv_source_layers

    caches = []

    class RecordingCache(C.KVCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            caches.append(self)

    monkeypatch.setattr(C, "KVCache", RecordingCache)
    text = "The cache stores main KV entries packed, two E2M1 codes per byte."[:4 * CONTEXT]
    corpus = Corpus("c", [Document("d0", text)])  # 4*CONTEXT tokens (one a byte): 4 full windows
    formats = list(C.MAIN_FORMATS)
    vocab = args.vocab_size if config == "tiny" else CacheWriter.VOCAB
    doc = evaluate(model, ByteTokenizer(vocab), [corpus], formats, max_ctx=CONTEXT, batch_size=BATCH)

    led = kv_ledger(args)
    assert doc["ledger"] == {"global_bytes_per_token_fp4": led["global_bytes_per_token"],
                             "swa_bytes_per_layer_window": led["swa_bytes_per_layer_window"]}
    by_format = {f: [c for c in caches if c.main_format == f] for f in formats}
    for row in doc["formats"]:
        f = row["format"]
        mine = by_format[f]  # one cache per batch (bf16: the reference run's)
        measured = [tensor_bytes(c) for c in mine]
        positions = sum(c.pos * c.batch_size for c in mine)
        assert all(c.pos == CONTEXT for c in mine)
        main = sum(m["main"] for m in measured)
        keys = sum(m["index_keys"] for m in measured)
        led_f = kv_ledger(args, f)
        assert row["bytes_per_token"] == (main + keys) / positions == row["ledger_bytes_per_token"] == \
            led_f["global_bytes_per_token"]
        assert row["main_bytes_per_token"] == main / positions == led_f["main_bytes_per_token"]
        assert row["indexer_bytes_per_token"] == keys / positions == led_f["indexer_bytes_per_token"]
        windows = sum(m["window"] for m in measured)
        assert row["window_bytes_per_layer"] == windows / (positions / CONTEXT * args.n_layers) == \
            led_f["swa_bytes_per_layer_window"] == args.window_size * C.kv_entry_bytes(args, f)["window"]
