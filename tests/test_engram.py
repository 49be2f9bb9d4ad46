"""Engram: compressed token map, bucket primes, n-gram hashing (full / chunked / images), the module."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from dsv41.model import engram as E
from dsv41.model.formats import quant_fp8_weight
from dsv41.model.tokenizer import bundled_tokenizer_path, load_tokenizer

# The released V4.1-Flash Engram settings (spec §5)
REAL = SimpleNamespace(engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
                       engram_max_ngram_size=4, engram_vocab_size=16000000, engram_n_heads=8,
                       engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=99092,
                       dim=5120, hc_mult=4, norm_eps=1e-20)


def tiny_args(**overrides):
    args = SimpleNamespace(engram_layer_ids=(1, 3), engram_max_ngram_size=3, engram_n_heads=2,
                           engram_vocab_size=101, engram_head_dim=32, engram_pad_id=2,
                           engram_compressed_vocab_size=40, dim=32, hc_mult=4, norm_eps=1e-20)
    args.engram_num_embeddings = (420, 508)  # primes (101,103,107,109) and (113,127,131,137), see below
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def trial_division_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


@pytest.fixture(scope="module")
def real_map():
    return E.build_compressed_token_map(load_tokenizer(), cache_dir=False)


# ------------------------------------------------------------------------- compressed token map
def test_real_map_has_99092_ids(real_map):
    token_map, n = real_map
    assert n == 99092
    assert token_map.shape == (129280,) and token_map.dtype == torch.int64
    # dense ids in first-seen order: each new id appears right after the previous maximum
    firsts = torch.unique(token_map, return_inverse=False)
    assert torch.equal(firsts, torch.arange(n))
    first_pos = np.array([np.argmax(token_map.numpy() == i) for i in (0, 1, 2, 10, 1000, n - 1)])
    assert np.all(np.diff(first_pos) > 0)


def test_real_map_merges_case_and_space_variants(real_map):
    token_map, _ = real_map
    tok = load_tokenizer()
    the = {tok.token_to_id(t) for t in ("Ġthe", "ĠThe", "ĠTHE", "the", "The")}
    assert None not in the and len({int(token_map[i]) for i in the}) == 1
    assert token_map[tok.token_to_id("Ġcat")] != token_map[tok.token_to_id("Ġthe")]


def test_v41_renames_do_not_change_the_map(real_map):
    token_map, n = real_map
    v4 = load_tokenizer(bundled_tokenizer_path(), v41_names=False)
    v4_map, v4_n = E.build_compressed_token_map(v4, cache_dir=False)
    assert v4_n == n and torch.equal(v4_map, token_map)


def _toy_tokenizer(tokens):
    # WordLevel without a decoder: decoding one id gives back its token string verbatim
    return BackendTokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))


def test_normalization_rules_on_a_toy_vocabulary():
    tokens = ["A", "a", " a", "Á",  # NFKC/NFD + strip accents + lowercase + strip -> "a"
              " ", "  ", "\t\n",  # whitespace runs collapse to one space, which is protected from Strip
              "\x0b",  # Strip removes it -> empty -> keyed by the raw text
              "\u0301",  # a lone combining accent: removed -> empty -> raw text
              "\x1cA",  # U+001C is not Unicode White_Space: kept (str.strip would remove it and merge with "a")
              "ﬁ", "FI",  # NFKC expands the ligature
              "x\ufffd", "X\ufffd",  # partial UTF-8: keyed by the raw vocab string, not lowercased
              "b ", "B"]
    token_map, n = E.build_compressed_token_map(_toy_tokenizer(tokens), cache_dir=False)
    assert token_map.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 5, 6, 7, 8, 8]
    assert n == 9


def test_disk_cache_is_written_atomically_and_reused(tmp_path, monkeypatch):
    backend = _toy_tokenizer(["q", "Q", "r", "R "])
    E._TOKEN_MAP_CACHE.clear()
    first, n = E.build_compressed_token_map(backend, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"  # no temporary file left behind
    assert np.load(files[0]).tolist() == first.tolist() == [0, 0, 1, 1] and n == 2

    def no_rebuild(_):
        raise AssertionError("should have been read from the disk cache")

    E._TOKEN_MAP_CACHE.clear()
    monkeypatch.setattr(E, "_compute_token_map", no_rebuild)
    again, n2 = E.build_compressed_token_map(backend, cache_dir=tmp_path)
    assert torch.equal(again, first) and n2 == 2
    again[0] = 99  # callers get their own copy
    assert E.build_compressed_token_map(backend, cache_dir=tmp_path)[0][0] == 0

    monkeypatch.undo()
    files[0].write_bytes(b"not a numpy file")  # a corrupt cache is rebuilt
    E._TOKEN_MAP_CACHE.clear()
    rebuilt, _ = E.build_compressed_token_map(backend, cache_dir=tmp_path)
    assert rebuilt.tolist() == [0, 0, 1, 1]
    E._TOKEN_MAP_CACHE.clear()


# ------------------------------------------------------------------------- primes and multipliers
def test_real_prime_sums_equal_the_table_sizes():
    primes = E.engram_primes(REAL)
    assert [sum(sum(h) for h in layer) for layer in primes] == [384006168, 384016682]
    assert E.engram_table_rows(REAL) == (384006168, 384016682)
    flat = [p for layer in primes for heads in layer for p in heads]
    assert len(flat) == 48 == len(set(flat))  # never reused, across layers too
    assert all(trial_division_is_prime(p) and p > 15999999 for p in flat)
    first = 16000000
    while not trial_division_is_prime(first):
        first += 1
    assert primes[0][0][0] == first  # every (layer, n) restarts the search at engram_vocab_size - 1
    assert primes[0][1][0] > primes[0][0][-1] and primes[1][0][0] > primes[0][2][-1]


def test_tiny_primes_by_hand():
    assert E.engram_primes(tiny_args()) == (((101, 103), (107, 109)), ((113, 127), (131, 137)))


def test_is_prime_matches_trial_division():
    assert [n for n in range(2000) if E.is_prime(n)] == [n for n in range(2000) if trial_division_is_prime(n)]
    assert E.is_prime(2**61 - 1) and not E.is_prime((2**31 - 1) * (2**61 - 1))


def test_multipliers():
    mult = E.engram_multipliers((1, 14), 4, 99092)
    # values produced by the official engram.py for the released config (run outside this repository)
    assert mult.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                             [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    assert bool((mult % 2 == 1).all())
    assert int(mult.max()) * 99092 < 2**63  # id * multiplier cannot overflow


# ------------------------------------------------------------------------- hashing
def reference_rows(args, token_map, ids, image_mask=None):
    """The hash of spec §4.6 step 4, one position at a time in Python integers."""
    primes = E.engram_primes(args)
    mult = E.engram_multipliers(args.engram_layer_ids, args.engram_max_ngram_size,
                                int(token_map.max()) + 1).tolist()
    pad = int(token_map[args.engram_pad_id])
    B, T = ids.shape
    n_max, H = args.engram_max_ngram_size, args.engram_n_heads
    out = torch.zeros(B, T, len(args.engram_layer_ids), (n_max - 1) * H, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            window, stopped = [], False
            for s in range(n_max):
                stopped = stopped or t - s < 0 or (image_mask is not None and bool(image_mask[b, t - s]))
                window.append(pad if stopped else int(token_map[ids[b, t - s]]))
            for li in range(len(args.engram_layer_ids)):
                offset, col = 0, 0
                hash_value = window[0] * mult[li][0]
                for n in range(2, n_max + 1):
                    hash_value ^= window[n - 1] * mult[li][n - 1]
                    for j in range(H):
                        p = primes[li][n - 2][j]
                        out[b, t, li, col] = hash_value % p + offset
                        offset += p
                        col += 1
    return out


def toy_map(vocab=60, n_compressed=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.cat([torch.arange(n_compressed), torch.randint(0, n_compressed, (vocab - n_compressed,), generator=g)])
    return m[torch.randperm(vocab, generator=g)]


def test_real_rows_match_the_official_code(real_map):
    hasher = E.NgramHasher(REAL, *real_map)
    tok = load_tokenizer()
    ids = torch.tensor([[0] + tok.encode("Hello world, the THE The cat")])
    assert ids.tolist() == [[0, 19923, 2058, 14, 270, 6367, 455, 7539]]
    rows, history = hasher(ids)
    assert rows.shape == (1, 8, 2, 24)
    # produced by the official engram.py (NgramHashState) on the same input, run outside this repository
    assert rows[0, 0, 0].tolist() == [5702652, 24393184, 39183301, 61503783, 78984481, 90144770, 103724983,
                                      121476532, 131476717, 152385926, 164143652, 191599181, 198145581,
                                      217419202, 238329687, 247482304, 257520185, 283540304, 288689443,
                                      315264704, 322314652, 348890037, 367865216, 380066193]
    assert rows[0, 5, 1].tolist() == [10782026, 29648357, 42693002, 51392664, 71743974, 83262216, 106538192,
                                      118195818, 134476970, 157040625, 171807413, 184938117, 198899689,
                                      210005398, 228546323, 245402534, 267564688, 277512936, 294400923,
                                      308566071, 328862371, 351654575, 356520857, 380922217]
    assert torch.equal(rows, reference_rows(REAL, real_map[0], ids))
    assert history.tolist() == [[237, 237, 6264]]  # " the", " THE", " The" share one compressed id
    assert bool((rows < torch.tensor(REAL.engram_num_embeddings).view(1, 1, 2, 1)).all())


@pytest.mark.parametrize("n_max, heads", [(3, 2), (4, 3), (2, 1)])
def test_rows_match_the_python_reference(n_max, heads):
    args = tiny_args(engram_max_ngram_size=n_max, engram_n_heads=heads)
    args.engram_num_embeddings = E.engram_table_rows(args)
    token_map = toy_map()
    hasher = E.NgramHasher(args, token_map)
    ids = torch.randint(0, 60, (2, 17), generator=torch.Generator().manual_seed(1))
    image = torch.zeros(2, 17, dtype=torch.bool)
    image[0, 4:7] = True
    image[1, 0] = True
    for mask in (None, image):
        rows, _ = hasher(ids, mask)
        assert torch.equal(rows, reference_rows(args, token_map, ids, mask))


def test_chunked_and_token_by_token_equal_full_sequence():
    args = tiny_args(engram_max_ngram_size=4, engram_n_heads=3)
    args.engram_num_embeddings = E.engram_table_rows(args)
    hasher = E.NgramHasher(args, toy_map())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 60, (3, 40), generator=g)
    image = torch.zeros(3, 40, dtype=torch.bool)
    image[0, 10:14] = True
    image[2, 20:21] = True
    full, full_history = hasher(ids, image)

    for sizes in ([1] * 40, [5, 1, 2, 13, 19], [2, 38]):
        history, pieces, start = None, [], 0
        for size in sizes:
            rows, history = hasher(ids[:, start:start + size], image[:, start:start + size], history)
            pieces.append(rows)
            start += size
        assert torch.equal(torch.cat(pieces, dim=1), full)
        assert torch.equal(history, full_history)


def test_image_tokens_are_dead():
    args = tiny_args()
    hasher = E.NgramHasher(args, toy_map())
    ids = torch.randint(3, 60, (1, 20), generator=torch.Generator().manual_seed(3))
    image = torch.zeros(1, 20, dtype=torch.bool)
    image[0, 5:9] = True
    rows, _ = hasher(ids, image)
    # before the image: untouched
    assert torch.equal(rows[:, :5], hasher(ids[:, :5])[0])
    # after it: the look-back stops at the image, as if the sequence started there
    assert torch.equal(rows[:, 9:], hasher(ids[:, 9:])[0])
    # inside it: every slot is pad, i.e. the rows of a lone pad token at the sequence start
    pad_rows = hasher(torch.tensor([[args.engram_pad_id]]))[0]
    assert torch.equal(rows[:, 5:9], pad_rows.expand(1, 4, -1, -1))
    # and without the mask the image positions would be hashed normally (the mask matters)
    assert not torch.equal(hasher(ids)[0][:, 9:], rows[:, 9:])


def test_hasher_rejects_a_wrong_vocabulary_or_table_size():
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        E.NgramHasher(tiny_args(engram_compressed_vocab_size=41), toy_map())
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        E.NgramHasher(tiny_args(engram_num_embeddings=(420, 509)), toy_map())


# ------------------------------------------------------------------------- the module
def make_tiny_engram(seed=0):
    args = tiny_args()
    g = torch.Generator().manual_seed(seed)
    module = E.Engram(args, layer_id=3)
    rows_n, hd = module.embed.num_rows, args.engram_head_dim
    module.embed.weight.data = (torch.randn(rows_n, hd, generator=g) * 40).to(torch.float8_e4m3fn)
    module.embed.scale.data = torch.randint(118, 126, (rows_n, hd // 32), generator=g).to(torch.uint8).view(
        torch.float8_e8m0fnu)
    w = torch.randn(args.dim * (args.hc_mult + 1), module.n_cols * hd, generator=g) * 0.05
    module.wkv.weight.data, module.wkv.scale.data = quant_fp8_weight(w, 32)
    module.q_weight.data = (1 + 0.5 * torch.randn(args.hc_mult, args.dim, generator=g)).bfloat16()
    module.k_weight.data = (1 + 0.5 * torch.randn(args.hc_mult, args.dim, generator=g)).bfloat16()
    return args, module


def test_parameter_names_shapes_dtypes():
    args, module = make_tiny_engram()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    assert shapes == {
        "embed.weight": ((508, 32), torch.float8_e4m3fn),
        "embed.scale": ((508, 1), torch.float8_e8m0fnu),
        "wkv.weight": ((160, 128), torch.float8_e4m3fn),
        "wkv.scale": ((5, 4), torch.float8_e8m0fnu),
        "q_weight": ((4, 32), torch.bfloat16),
        "k_weight": ((4, 32), torch.bfloat16),
    }
    with torch.device("meta"):  # the released shapes, without allocating 98 GB
        real = E.Engram(REAL, layer_id=14)
    assert {k: tuple(v.shape) for k, v in real.state_dict().items()} == {
        "embed.weight": (384016682, 256), "embed.scale": (384016682, 8),
        "wkv.weight": (25600, 6144), "wkv.scale": (800, 192),
        "q_weight": (4, 5120), "k_weight": (4, 5120)}


def reference_engram(module, args, x, rows, token_mask):
    """Straight from the equations, in float64 (REF rounds the wkv output to bf16, so we do too)."""
    d, hc = args.dim, args.hc_mult
    table = module.embed.weight.float().double()
    scale = module.embed.scale.view(torch.uint8).double().sub(127).exp2()
    table = table * scale.repeat_interleave(32, dim=1)
    w = module.wkv.weight.float().double()
    w_scale = module.wkv.scale.view(torch.uint8).double().sub(127).exp2()
    w = w * w_scale.repeat_interleave(32, dim=0).repeat_interleave(32, dim=1)
    memory = table[rows].flatten(-2)  # [B, T, n_cols * head_dim]
    kv = (memory @ w.T).to(torch.bfloat16).double()
    key, value = kv[..., :hc * d].unflatten(-1, (hc, d)), kv[..., hc * d:]
    omega = module.q_weight.detach().double() * module.k_weight.detach().double()
    h = x.double()
    out = h.clone()
    B, T = x.shape[:2]
    for b in range(B):
        for t in range(T):
            for j in range(hc):
                hj, kj = h[b, t, j], key[b, t, j]
                dot = (hj * omega[j] * kj).sum() / math.sqrt(d)
                dot = dot / math.sqrt(hj.square().mean() + args.norm_eps) / math.sqrt(kj.square().mean() + args.norm_eps)
                signed_sqrt = math.copysign(math.sqrt(max(abs(float(dot)), 1e-6)), float(dot))
                gate = 1 / (1 + math.exp(-signed_sqrt)) if bool(token_mask[b, t]) else 0.0
                out[b, t, j] = hj + gate * value[b, t]
    return out


def test_forward_matches_the_equations():
    args, module = make_tiny_engram()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 4, 32, generator=g)
    rows = torch.randint(0, 508, (2, 6, 4), generator=g)
    token_mask = torch.ones(2, 6, dtype=torch.bool)
    token_mask[1, 2] = False
    with torch.no_grad():
        out = module(x, rows, token_mask)
    expected = reference_engram(module, args, x, rows, token_mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3)
    # the memory term is not negligible: without it the check above would fail
    assert (expected - x.double()).abs().max() > 0.1


def test_gate_closed_where_token_mask_is_false():
    args, module = make_tiny_engram(seed=1)
    x = torch.randn(2, 5, 4, 32).bfloat16()
    rows = torch.randint(0, 508, (2, 5, 4))
    token_mask = torch.tensor([[True, False, True, True, False], [False, False, True, True, True]])
    with torch.no_grad():
        out = module(x, rows, token_mask)
        unmasked = module(x, rows, None)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[~token_mask], x[~token_mask])  # passed through bit for bit
    assert torch.equal(out[token_mask], unmasked[token_mask])
    assert not torch.equal(unmasked[~token_mask], x[~token_mask])


def test_hasher_feeds_the_module():
    args, module = make_tiny_engram(seed=2)
    hasher = E.NgramHasher(args, toy_map())
    ids = torch.randint(0, 60, (1, 9))
    rows, _ = hasher(ids)
    layer_rows = rows[:, :, hasher.layer_index(module.layer_id)]
    assert layer_rows.shape == (1, 9, module.n_cols)
    assert int(layer_rows.max()) < module.embed.num_rows
    with torch.no_grad():
        out = module(torch.randn(1, 9, 4, 32), layer_rows)
    assert torch.isfinite(out).all()
