"""Engram: hashed n-gram memory added to the residual stream before layers 1 and 14 (spec §4.6).

Two halves:

**Host-side hashing (token ids only, no weights).**

1. Compressed token map. Every token id is decoded on its own and normalized
   NFKC -> NFD -> strip accents -> lowercase -> collapse `[ \\t\\r\\n]+` to one space -> strip, where a
   token that is exactly one space survives the strip (it is protected by a private-use sentinel).
   Its key is the normalized text; if normalization leaves nothing, the key is the raw decoded text;
   a token whose decoding contains U+FFFD (a partial UTF-8 byte sequence) is keyed by its raw vocab
   string. Keys get dense ids in first-seen order, so " The", "the" and "THE" share one id. With the
   DeepSeek vocabulary this gives 99,092 ids (`engram_compressed_vocab_size`). The normalizers come
   from the `tokenizers` package, as in the reference: its `Strip` removes Unicode White_Space only,
   whereas Python's `str.strip` would also remove U+001C..U+001F.
2. Bucket primes. With one `seen` set shared by all engram layers, for each layer (in order) and each
   n-gram size n = 2..N (N = `engram_max_ngram_size`), the search restarts at
   `engram_vocab_size - 1` and takes the next `engram_n_heads` primes that are not in `seen`. Each
   (n, head) owns the row range [offset, offset + prime) of its layer's table; offsets are the
   exclusive cumulative sum of the primes in (n, head) order, and the primes of a layer sum to its
   table size (`engram_num_embeddings`: 384,006,168 and 384,016,682 for V4.1-Flash).
3. Multipliers per layer L: numpy `default_rng(10007 * L)` draws N int64 values v_s in
   [0, floor((2^63 - 1) / compressed_vocab) // 2); m_s = 2 v_s + 1 (odd, and id * m_s cannot
   overflow int64).
4. Position t looks back over shifts s = 0..N-1: x_s is the compressed id of token t - s, replaced
   by the compressed pad id once the look-back passes the start of the sequence or reaches an image
   token; from there on every older slot is pad too (an n-gram never spans an image). With
   p_s = x_s * m_s, R_1 = p_0 and R_{s+1} = R_s XOR p_s, the (s+1)-gram row of head j is
   (R_{s+1} mod P_{s+1,j}) + offset_{s+1,j}. A token yields (N-1) * n_heads rows per layer, ordered
   [n=2 heads 0..H-1, n=3 heads ..., ...].

   `NgramHasher` computes this for a whole sequence or incrementally: it returns the last N-1
   compressed ids as `history` (image tokens and "before the start" stored as DEAD = -1), and
   hashing the next chunk with that history gives exactly what hashing everything at once gives.

**The module (`Engram`), per token and hc stream j, all in fp32:**

    e     = dequant(embed[rows])                        [n_cols, head_dim] -> flattened (bf16)
    kv    = wkv e                                       FP8 weight, FP8 activations -> bf16
    key_j = kv[j*d:(j+1)*d] (j < hc), value = kv[hc*d:]
    w     = q_weight * k_weight                         [hc, d]
    dot_j = sum_c(X_jc w_jc key_jc) * rsqrt(mean X_j^2 + eps) * rsqrt(mean key_j^2 + eps) * d^-1/2
    gate_j = sigmoid(copysign(sqrt(max(|dot_j|, 1e-6)), dot_j))     (0 where token_mask is False)
    X_j   <- X_j + gate_j * value

The FP8 activation quantization of `e` is lossless here: each 32-wide activation group is one
table block, i.e. E4M3 values times one power of two, which the power-of-two activation scale
reproduces exactly. Authority: the official V4.1 `engram.py` and the `Engram` /
`ParallelEngramEmbedding` classes of its `model.py` (S0); this is an independent implementation.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from dsv41.model.kernels import host, reference
from dsv41.model.kernels.reference import per_row

DEAD = -1  # compressed-id marker for "no token here": an image token, or before the sequence start
GATE_FLOOR = 1e-6  # |dot| is clamped to this before the signed square root
# Bump when the recipe of the compressed map changes, so stale disk caches are not reused.
TOKEN_MAP_RECIPE = "engram-token-map-v1"
_SPACE_SENTINEL = "\ue000"  # private-use character: keeps a lone-space token from stripping to ""
_TOKEN_MAP_CACHE: dict[str, tuple[torch.Tensor, int]] = {}


# ====================================================================================================
# 1. Compressed token map
# ====================================================================================================


def _engram_normalizer():
    """The normalization chain of step 1, as one `tokenizers` normalizer."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),  # a lone space must survive Strip
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def _backend_of(tokenizer):
    """The `tokenizers.Tokenizer` behind our `Tokenizer`, a Hugging Face fast tokenizer, or itself."""
    for attr in ("backend", "backend_tokenizer"):
        backend = getattr(tokenizer, attr, None)
        if backend is not None:
            return backend
    return tokenizer


def _fingerprint_of(tokenizer) -> str:
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if isinstance(fingerprint, str) and fingerprint:
        return fingerprint
    return hashlib.sha256(_backend_of(tokenizer).to_str().encode()).hexdigest()


def _compute_token_map(backend) -> np.ndarray:
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    normalize = _engram_normalizer().normalize_str
    dense_id: dict[str, int] = {}
    token_map = np.empty(vocab_size, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)  # partial UTF-8: nothing to normalize
        else:
            key = normalize(text) or text  # normalized to nothing (e.g. a lone combining mark)
        token_map[token_id] = dense_id.setdefault(key, len(dense_id))
    return token_map


def default_cache_dir() -> Path:
    """~/.cache/dsv41, or $DSV41_CACHE_DIR."""
    return Path(os.environ.get("DSV41_CACHE_DIR") or Path.home() / ".cache" / "dsv41")


def _read_cached_map(path: Path) -> np.ndarray | None:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return arr if arr.ndim == 1 and arr.dtype == np.int64 else None


def _write_cached_map(path: Path, token_map: np.ndarray) -> None:
    """Atomic: written to a temporary file in the same directory, then renamed over the target."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, token_map, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only or full cache directory only costs the rebuild next time


def build_compressed_token_map(tokenizer, cache_dir: str | os.PathLike | None | bool = None) -> tuple[torch.Tensor, int]:
    """Compressed id of every token id: (int64 tensor [vocab_size], number of distinct ids).

    tokenizer: `dsv41.model.tokenizer.Tokenizer`, a Hugging Face fast tokenizer or a `tokenizers.Tokenizer`.
    Cached in memory by the tokenizer's fingerprint (the sha256 of its file), and on disk under
    `cache_dir` (default `default_cache_dir()`; False disables the disk cache). Returns a fresh
    tensor each call."""
    fingerprint = _fingerprint_of(tokenizer)
    cached = _TOKEN_MAP_CACHE.get(fingerprint)
    if cached is None:
        token_map = None
        path = None
        if cache_dir is not False:
            base = default_cache_dir() if cache_dir in (None, True) else Path(cache_dir)
            path = base / f"{TOKEN_MAP_RECIPE}-{fingerprint}.npy"
            token_map = _read_cached_map(path)
            vocab_size = _backend_of(tokenizer).get_vocab_size(with_added_tokens=True)
            if token_map is not None and token_map.shape[0] != vocab_size:
                token_map = None
        if token_map is None:
            token_map = _compute_token_map(_backend_of(tokenizer))
            if path is not None:
                _write_cached_map(path, token_map)
        # ids are dense and assigned in first-seen order, so the count is max + 1
        cached = (torch.from_numpy(token_map), int(token_map.max()) + 1)
        _TOKEN_MAP_CACHE[fingerprint] = cached
    return cached[0].clone(), cached[1]


# ====================================================================================================
# 2-3. Primes, offsets, multipliers
# ====================================================================================================


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; exact for every n < 3.3e24 (the first 12 prime bases)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(args) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket primes [engram layer][n-gram size n-2][head] (step 2)."""
    seen: set[int] = set()
    layers = []
    for _ in args.engram_layer_ids:
        per_size = []
        for _ in range(2, args.engram_max_ngram_size + 1):
            heads, candidate = [], args.engram_vocab_size - 1
            for _ in range(args.engram_n_heads):
                candidate += 1
                while candidate in seen or not is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
            per_size.append(tuple(heads))
        layers.append(tuple(per_size))
    return tuple(layers)


def engram_table_rows(args) -> tuple[int, ...]:
    """Rows of each engram layer's table = the sum of its primes (fills `engram_num_embeddings`)."""
    return tuple(sum(sum(heads) for heads in layer) for layer in engram_primes(args))


def engram_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """Odd int64 multipliers [n_layers, max_ngram_size] (step 3)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram_size, dtype=np.int64)
        rows.append(draws * 2 + 1)
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, max_ngram_size, dtype=torch.int64)


# ====================================================================================================
# 4. Hashing token ids into table rows
# ====================================================================================================


class NgramHasher(nn.Module):
    """Token ids -> engram table rows for every engram layer (step 4).

    Buffers (non-persistent, they move with `.to(device)`): `token_map` [vocab], `multipliers`
    [n_layers, N], `primes` [n_layers, N-1, H], `offsets` [n_layers, (N-1)*H]. `pad_id` is the
    compressed id of `engram_pad_id`.

    forward(token_ids [B, T], image_mask [B, T] or None, history [B, N-1] or None)
        -> rows [B, T, n_layers, (N-1)*H] (int64), new history [B, N-1].
    `history` is what the previous call returned (None = start of the sequences); rows for
    layer `engram_layer_ids[i]` are `rows[:, :, i]`.
    """

    def __init__(self, args, token_map: torch.Tensor, n_compressed: int | None = None):
        super().__init__()
        token_map = torch.as_tensor(token_map, dtype=torch.int64)
        n_compressed = int(token_map.max()) + 1 if n_compressed is None else int(n_compressed)
        expected = getattr(args, "engram_compressed_vocab_size", 0)
        if n_compressed != expected:
            # every multiplier depends on this number: a different vocabulary rehashes the whole table
            raise ValueError(f"the compressed token map has {n_compressed} ids but the config says "
                             f"engram_compressed_vocab_size = {expected}; wrong tokenizer?")
        self.layer_ids = tuple(args.engram_layer_ids)
        self.max_ngram_size = args.engram_max_ngram_size
        self.n_heads = args.engram_n_heads
        if self.max_ngram_size < 2:
            raise ValueError("engram_max_ngram_size must be at least 2")
        primes = engram_primes(args)
        rows = tuple(sum(sum(h) for h in layer) for layer in primes)
        if rows != tuple(args.engram_num_embeddings):
            raise ValueError(f"engram_num_embeddings {tuple(args.engram_num_embeddings)} does not match the bucket "
                             f"primes, whose sums are {rows}")
        flat = torch.tensor([[p for heads in layer for p in heads] for layer in primes], dtype=torch.int64)
        offsets = torch.cumsum(flat, dim=1) - flat  # exclusive cumulative sum in (n, head) order
        self.pad_id = int(token_map[args.engram_pad_id])
        self.register_buffer("token_map", token_map, persistent=False)
        self.register_buffer("multipliers", engram_multipliers(self.layer_ids, self.max_ngram_size, n_compressed),
                             persistent=False)
        self.register_buffer("primes", flat.view(len(self.layer_ids), self.max_ngram_size - 1, self.n_heads),
                             persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    @classmethod
    def from_tokenizer(cls, args, tokenizer, cache_dir=None) -> "NgramHasher":
        token_map, n_compressed = build_compressed_token_map(tokenizer, cache_dir)
        return cls(args, token_map, n_compressed)

    @property
    def n_cols(self) -> int:
        """Rows looked up per token and layer: (N-1) n-gram sizes x H heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    def layer_index(self, layer_id: int) -> int:
        return self.layer_ids.index(layer_id)

    def new_history(self, batch: int, device=None) -> torch.Tensor:
        """History of sequences that have not started: every slot DEAD."""
        return torch.full((batch, self.max_ngram_size - 1), DEAD, dtype=torch.int64,
                          device=device if device is not None else self.token_map.device)

    def compress(self, token_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids [B, T]; DEAD where image_mask is True."""
        compressed = self.token_map[token_ids]
        if image_mask is not None:
            compressed = compressed.masked_fill(image_mask.bool(), DEAD)
        return compressed

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, image_mask: torch.Tensor | None = None,
                history: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seqlen = token_ids.shape
        n_back = self.max_ngram_size - 1
        if history is None:
            history = self.new_history(batch, token_ids.device)
        # the look-back window of position t is stream[:, t + n_back - s] for s = 0..n_back
        stream = torch.cat([history.to(token_ids.device), self.compress(token_ids, image_mask)], dim=1)
        blocked = torch.zeros(batch, seqlen, dtype=torch.bool, device=token_ids.device)
        lookback = []
        for shift in range(self.max_ngram_size):
            source = stream[:, n_back - shift: n_back - shift + seqlen]
            blocked = blocked | (source == DEAD)  # once blocked, every older slot stays pad
            lookback.append(torch.where(blocked, self.pad_id, source))
        ids = torch.stack(lookback, dim=-1)  # [B, T, N]: shift 0 = the token itself
        products = ids.unsqueeze(2) * self.multipliers  # [B, T, n_layers, N]
        rolling = products[..., 0]
        rows = []
        for shift in range(1, self.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., shift])  # hash of the (shift+1)-gram
            rows.append(rolling.unsqueeze(-1) % self.primes[:, shift - 1])  # [B, T, n_layers, H]
        rows = torch.cat(rows, dim=-1) + self.offsets
        return rows, stream[:, -n_back:].clone()


# ====================================================================================================
# The module
# ====================================================================================================


class EngramEmbedding(nn.Module):
    """The FP8 n-gram table: `weight` float8_e4m3fn [rows, head_dim] and `scale` float8_e8m0fnu
    [rows, head_dim/block], one power of two per `block` values of a row. Rows are dequantized on
    lookup, to bf16 (exact: E4M3 times a power of two).

    The V4.1 tables hold ~384M rows (98 GB each); build the module on the meta device and load or
    memory-map the checkpoint tensors into it. Lookups only touch the rows they read."""

    def __init__(self, num_rows: int, head_dim: int, block: int = 32, trainable: bool = False):
        super().__init__()
        if head_dim % block:
            raise ValueError(f"engram_head_dim {head_dim} is not a multiple of the scale block {block}")
        self.num_rows, self.head_dim, self.block = num_rows, head_dim, block
        self.trainable = trainable
        if trainable:  # a dense fp32 master, rounded to the stored FP8 rows in the forward (QAT)
            self.weight = nn.Parameter(torch.zeros(num_rows, head_dim, dtype=torch.float32))
            self.register_parameter("scale", None)
            return
        # empty, not zeros: zero-filling would touch every page of a 98 GB table
        self.weight = nn.Parameter(torch.empty(num_rows, head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(num_rows, head_dim // block, dtype=torch.float8_e8m0fnu),
                                  requires_grad=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if self.trainable:
            from dsv41.model.formats import fp8_fake_quant
            from dsv41.model.layers import qat

            return qat(fp8_fake_quant, self.weight[rows], self.block).to(torch.bfloat16)
        values = self.weight[rows].float().unflatten(-1, (-1, self.block))  # [..., head_dim/block, block]
        scales = self.scale[rows].float().unsqueeze(-1)
        return (values * scales).flatten(-2).to(torch.bfloat16)


def _fp8_linear_module(in_features: int, out_features: int, block: int, trainable: bool = False) -> nn.Module:
    from dsv41.model.layers import Linear

    return Linear(in_features, out_features, dtype=torch.float8_e4m3fn, block=block, trainable=trainable)


class Engram(nn.Module):
    """Gated n-gram memory for one layer: X [B, T, hc, dim] -> X + gate * value (see module docstring).

    Parameters, with the checkpoint's names under `layers.{l}.engram.`: `embed.weight`,
    `embed.scale`, `wkv.weight` (E4M3 [dim*(hc+1), n_cols*head_dim]), `wkv.scale` (UE8M0 32x32
    blocks), `q_weight`, `k_weight` (bf16 [hc, dim])."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.table_index = tuple(args.engram_layer_ids).index(layer_id)
        self.dim, self.hc_mult, self.eps = args.dim, args.hc_mult, args.norm_eps
        self.n_cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
        block = getattr(args, "fp8_block_size", 32)
        trainable = getattr(args, "trainable", False)
        self.embed = EngramEmbedding(args.engram_num_embeddings[self.table_index], args.engram_head_dim, block,
                                     trainable)
        self.wkv = _fp8_linear_module(self.n_cols * args.engram_head_dim, args.dim * (args.hc_mult + 1), block,
                                      trainable)
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim, dtype=torch.bfloat16))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim, dtype=torch.bfloat16))

    def _host_gate(self, x: torch.Tensor, kv: torch.Tensor) -> bool:
        """Whether host.engram_mix takes the gate: the decode step's scalar sigmoid (reference.scalar_loop_applies),
        contiguous bf16/fp32 CPU operands, rows long enough for the C statistic."""
        return (reference.scalar_loop_applies(self.hc_mult) and self.dim >= host.SUM_LANES
                and host.takes(x, kv, self.q_weight, self.k_weight) and kv.shape[-1] == (self.hc_mult + 1) * self.dim)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hc, dim]; rows: [B, T, n_cols] (this layer's slice of `NgramHasher` output);
        token_mask: [B, T], False = gate shut (image tokens), those positions pass through unchanged."""
        memory = self.embed(rows).flatten(-2)  # [B, T, n_cols * head_dim], bf16
        kv = self.wkv(memory)  # bf16, as REF's FP8 GEMM writes it
        if token_mask is None and self._host_gate(x, kv):
            # the decode step: the lines below in two C calls around torch's sqrt, the same bits
            return host.engram_mix(x, kv, self.q_weight, self.k_weight, self.eps, GATE_FLOOR)
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.dim))  # one key per hc stream
        value = value.float()  # one value shared by the streams
        weight = self.q_weight.float() * self.k_weight.float()  # the checkpoint only ever uses the product
        h = x.float()
        # normalized per (token, stream) over dim, not across streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.dim ** -0.5  # [B, T, hc]
        gate = per_row(torch.sigmoid, torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))  # signed sqrt
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.bool().unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)
