"""The KV cache (spec §4.4): what a sequence leaves behind for the tokens after it, stored packed.

Per layer: a ring of `window_size` window-KV slots (slot = position mod window). Per kv-source
layer: the shared compressed main KV, its indexer keys, and the compressor's pending partial group.
Model-wide: Engram's n-gram history. Every layer with m > 0 reads the compressed KV of its kv source;
nothing is duplicated across layers (that is CSA2's storage saving).

Storage formats (model/formats.py), bytes per entry for the V4.1-Flash shapes (D = 512, index 128), as
each codec's `bytes_per_entry` gives them (the one KV-bytes table: `kv_entry_bytes`, `kv_cache_bytes`):

    main KV      main_format="fp4" (official): E2M1 codes two per byte + one E4M3 scale per 16    288 B
                 main_format="fp8" (comparison): E4M3 + one UE8M0 scale per 32                   528 B
                 main_format="bf16" (comparison): the post-RoPE latent in bf16                   1024 B
    index keys   MXFP4: E2M1 codes two per byte + one UE8M0 scale per 32                          68 B
    window ring  FP8 E4M3 + one UE8M0 scale per 32                                               528 B

The write methods take the values *before* storage rounding (the post-RoPE latent, the index key,
the window KV) and pack them; the read methods (`compressed`, `index_keys_for`, `window_before`)
unpack to the dtype that was written, and their `*_bytes` forms hand over the stored bytes (an inference
forward's attention and indexer read those, decoding them in their kernels on CUDA). Because formats
guarantees unpack(pack(x)) == fake_quant(x) bit for bit, attention reading a packed entry sees exactly the
fake-quantized value the QAT forward computes. Packing the already fake-quantized values instead would
not always be exact, because rounding twice is not rounding once: an FP4 block whose subnormal E4M3 scale
rounded up (block amax below 6 * 2^-6) gets a smaller scale the second time and its largest values
saturate. So callers hand over the unrounded values.

Training: packed bytes carry no gradient. A write whose values require grad (grad mode on) goes to a
differentiable store of the fake-quantized values instead (straight-through, as `layers.qat`); reads
return the same numbers either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv41.model import formats, kv_layout
from dsv41.model.config import ModelArgs
from dsv41.model.kernels import quant as kernels_quant
from dsv41.model.layers import qat


# ------------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class Codec:
    """One storage format: `pack` x [..., D] -> byte tensors [..., *]; `unpack` them back to a dtype;
    `fake_quant` is what unpack(pack(x)) equals (bit for bit), in x's dtype.

    `layout(D)` is what one entry of D values is stored as: (last dimension, dtype) of each tensor
    `pack` returns, payload first, then scales (model/kv_layout.py's, with torch dtypes). `bytes_per_entry(D)`
    follows from it; it is the one table of KV bytes (`kv_entry_bytes`): the ledger (`dsv41 info`, through
    kv_layout, without torch), the memory plan and
    `dsv41 quantize-kv` ask it, and tests/test_kv_bytes.py checks it against the packed tensors."""

    name: str
    fake_quant: Callable[[torch.Tensor], torch.Tensor] | None
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None
    unpack: Callable[[tuple[torch.Tensor, ...], torch.dtype], torch.Tensor] | None
    layout: Callable[[int], tuple[tuple[int, torch.dtype], ...]]

    def bytes_per_entry(self, dim: int) -> int:
        """Bytes one stored entry of `dim` values takes: payload + scales."""
        return sum(n * dtype.itemsize for n, dtype in self.layout(dim))


def _bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


_TORCH_DTYPES = {"U8": torch.uint8, "BF16": torch.bfloat16}


def _layout(plain: Callable[[int], kv_layout.Layout]) -> Callable[[int], tuple[tuple[int, torch.dtype], ...]]:
    """A layout of model/kv_layout.py (the one table, torch-free) with torch dtypes."""
    return lambda d: tuple((n, _TORCH_DTYPES[dtype]) for n, dtype in plain(d))


# The packers and unpackers are model/kernels/quant.py's: one fused Triton pass on CUDA, one C call on the CPU, each
# bit-exact with model/formats.py's, which they call everywhere else.
FP4_E4M3 = Codec("fp4", lambda x: formats.fp4_e4m3_fake_quant(x, formats.FP4_E4M3_BLOCK),
                 kernels_quant.pack_fp4_e4m3,
                 lambda p, dtype: kernels_quant.unpack("fp4_e4m3", p[0], p[1], formats.FP4_E4M3_BLOCK, dtype),
                 _layout(kv_layout.LAYOUTS["fp4"]))  # E2M1 x2, E4M3 scales
FP8_UE8M0 = Codec("fp8", lambda x: formats.fp8_fake_quant(x, formats.FP8_BLOCK),
                  kernels_quant.pack_fp8_ue8m0,
                  lambda p, dtype: kernels_quant.unpack("fp8_ue8m0", p[0], p[1], formats.FP8_BLOCK, dtype),
                  _layout(kv_layout.LAYOUTS["fp8"]))  # E4M3, UE8M0 scales
BF16 = Codec("bf16", _bf16_round, lambda x: (x.to(torch.bfloat16),), lambda p, dtype: p[0].to(dtype),
             _layout(kv_layout.LAYOUTS["bf16"]))
MXFP4 = Codec("mxfp4", lambda x: formats.mxfp4_fake_quant(x, formats.MXFP4_BLOCK),
              kernels_quant.pack_mxfp4,
              lambda p, dtype: kernels_quant.unpack("mxfp4", p[0], p[1], formats.MXFP4_BLOCK, dtype),
              _layout(kv_layout.LAYOUTS["mxfp4"]))  # E2M1 x2, UE8M0 scales

CODECS: dict[str, Codec] = {c.name: c for c in (FP4_E4M3, FP8_UE8M0, BF16, MXFP4)}
MAIN_FORMATS: dict[str, Codec] = {f: CODECS[f] for f in kv_layout.MAIN_FORMATS}
INDEX_KEY_CODEC = CODECS[kv_layout.INDEX_KEY_FORMAT]
WINDOW_CODEC = CODECS[kv_layout.WINDOW_FORMAT]


def v4_entry_codec(rope_dim: int) -> Codec:
    """V4-Flash/Pro's KV entry, main and window alike (ledger only: the V4 forward is not implemented,
    so nothing packs it): the D - rope_dim dims without RoPE in FP8 E4M3 with one UE8M0 scale per 64,
    the rope_dim RoPE dims in bf16. 448 + 7 + 2 x 64 = 583 B at D = 512."""
    return Codec("v4", None, None, None, _layout(kv_layout.v4_entry_layout(rope_dim)))


def kv_codecs(args: ModelArgs, main_format: str = "fp4") -> dict[str, tuple[Codec, int]]:
    """What a `KVCache` stores per entry, part by part: {"main", "index_keys", "window"} -> (codec,
    values per entry). Main entries in `main_format` (head_dim values), index keys MXFP4
    (index_head_dim), window slots FP8 (head_dim): model/kv_layout.py's `kv_parts`."""
    return {part: (CODECS[fmt], dim) for part, (fmt, dim) in kv_layout.kv_parts(args, main_format).items()}


def kv_entry_bytes(args: ModelArgs, main_format: str = "fp4") -> dict[str, int]:
    """The KV-bytes table: bytes per stored entry of each part of a `KVCache` (see `kv_codecs`); for
    V4.1-Flash and fp4, main 288, index_keys 68, window 528."""
    return {part: codec.bytes_per_entry(dim) for part, (codec, dim) in kv_codecs(args, main_format).items()}


def kv_cache_bytes(args: ModelArgs, context: int, batch: int = 1, main_format: str = "fp4") -> dict[str, int]:
    """What a `KVCache` stores for `batch` sequences after `context` tokens, from `kv_entry_bytes`:
    main entries (`main_format`; FP4 with E4M3 scales = 288 B at D = 512) and MXFP4 index keys (68 B)
    for every complete group of each kv-source layer, and one FP8 window ring of `window_size` slots
    (528 B each) per backbone layer, allocated whole. DSpark's rings (with --dspark), a compressor's
    pending partial group and the growable buffers' spare capacity (up to 2x of the main entries and
    keys) are not included. (`storage_bytes` measures the same from a cache's tensors.)"""
    entry = kv_entry_bytes(args, main_format)
    entries = sum(context // args.compress_ratios[l] for l in args.kv_source_layers)
    main = entries * entry["main"] * batch
    keys = entries * entry["index_keys"] * batch
    window = (args.window_size if context else 0) * args.n_layers * entry["window"] * batch
    return {"main": main, "index_keys": keys, "window": window, "total": main + keys + window}


def _differentiable(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


# ------------------------------------------------------------------------------------------- stores
class Rows:
    """Growable rows [B, capacity, ...] of one codec, appended at the end (capacity doubles when full).

    Packed: `parts` are the codec's byte tensors. Differentiable (the first write required grad): one
    tensor of fake-quantized values that keeps the autograd graph."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.parts: tuple[torch.Tensor, ...] | None = None
        self.dtype: torch.dtype | None = None  # what reads return: the dtype that was written
        self.differentiable = False

    def append(self, used: int, x: torch.Tensor) -> None:
        """Write x [B, n, D] (values before rounding) after the first `used` rows."""
        if self.parts is None:
            self.dtype, self.differentiable = x.dtype, _differentiable(x)
        elif _differentiable(x) and not self.differentiable:
            raise RuntimeError("this cache was filled without gradients; start a new cache for a training forward")
        new = (qat(self.codec.fake_quant, x),) if self.differentiable else self.codec.pack(x.detach())
        need = used + x.size(1)
        if self.parts is None or self.parts[0].size(1) < need:
            cap = max(need, 2 * (self.parts[0].size(1) if self.parts is not None else 0), 16)
            grown = []
            for i, n in enumerate(new):
                g = n.new_zeros(n.size(0), cap, *n.shape[2:])
                if self.parts is not None:
                    g[:, :used] = self.parts[i][:, :used]
                grown.append(g)
            self.parts = tuple(grown)
        for part, n in zip(self.parts, new):
            part[:, used:need] = n

    def stored(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """The stored tensors of rows start..stop-1 (views)."""
        return tuple(p[:, start:stop] for p in self.parts)

    def read(self, n: int) -> torch.Tensor:
        """Rows 0..n-1 as values [B, n, D] in the written dtype."""
        if self.differentiable:
            return self.parts[0][:, :n]
        return self.codec.unpack(self.stored(0, n), self.dtype)

    def nbytes(self, n: int) -> int:
        """Bytes of the first n rows, from the stored tensors."""
        return 0 if self.parts is None else sum(p[:, :n].nbytes for p in self.parts)

    def allocated_nbytes(self) -> int:
        return 0 if self.parts is None else sum(p.nbytes for p in self.parts)


class Ring:
    """The window ring [B, window, ...] of one codec; slot = position mod window."""

    def __init__(self, codec: Codec, window: int):
        self.codec, self.window = codec, window
        self.parts: tuple[torch.Tensor, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.differentiable = False

    def write(self, slots: torch.Tensor, x: torch.Tensor, packed: tuple[torch.Tensor, ...] | None = None) -> None:
        """x [B, n, D] at ring `slots` [n]; `packed`: codec.pack(x), when the caller has packed it already."""
        if self.parts is None:
            self.dtype, self.differentiable = x.dtype, _differentiable(x)
        elif _differentiable(x) and not self.differentiable:
            raise RuntimeError("this cache was filled without gradients; start a new cache for a training forward")
        if self.differentiable:
            new = (qat(self.codec.fake_quant, x),)
        else:
            new = packed if packed is not None else self.codec.pack(x.detach())
        if self.parts is None:
            self.parts = tuple(n.new_zeros(n.size(0), self.window, *n.shape[2:]) for n in new)
        for part, n in zip(self.parts, new):
            part[:, slots] = n

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        if self.differentiable:
            return self.parts[0][:, slots]
        return self.codec.unpack(self.stored(slots), self.dtype)

    def stored(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stored tensors of `slots`, in that order (a gather, so a copy)."""
        return tuple(p[:, slots] for p in self.parts)

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.clone() for p in self.parts)

    def restore(self, snapshot: tuple[torch.Tensor, ...], slots: torch.Tensor) -> None:
        for part, old in zip(self.parts, snapshot):
            part[:, slots] = old[:, slots]

    def nbytes(self) -> int:
        return 0 if self.parts is None else sum(p.nbytes for p in self.parts)


# ------------------------------------------------------------------------------------------- cache
class CompressorState:
    """The projections of a trailing incomplete group, kept until the group's last token arrives."""

    def __init__(self):
        self.kv: torch.Tensor | None = None
        self.score: torch.Tensor | None = None
        self.journal: list | None = None  # new projections since a cache checkpoint (for rollback)

    def take(self, kv: torch.Tensor, score: torch.Tensor, ratio: int):
        """Prepend the pending tokens to the new ones; return the complete groups, keep the rest."""
        if self.journal is not None:
            self.journal.append((kv, score))
        if self.kv is not None:
            kv, score = torch.cat([self.kv, kv], dim=1), torch.cat([self.score, score], dim=1)
        complete = kv.size(1) - kv.size(1) % ratio
        rest = kv.size(1) - complete
        self.kv, self.score = (kv[:, complete:], score[:, complete:]) if rest else (None, None)
        if complete == 0:
            return None, None
        return kv[:, :complete], score[:, :complete]

    @property
    def pending(self) -> int:
        return 0 if self.kv is None else self.kv.size(1)


@dataclass
class LayerCache:
    window: Ring | None = None
    main: Rows | None = None  # compressed main KV (kv-source layers)
    index_keys: Rows | None = None
    n_compressed: int = 0
    compressor_state: CompressorState = field(default_factory=CompressorState)


class KVCache:
    """Cache for a batch of sequences that advance together (same positions).

    main_format picks how compressed main KV entries are stored and hence what attention reads:
    "fp4" (official: E2M1 + E4M3 per 16), or for comparison "fp8" (E4M3 + UE8M0 per 32) and "bf16".
    Indexer keys are always MXFP4 and the window rings FP8, as in the official model.

    ref_index_quirk reproduces REF's decode behaviour where an indexer reads the most recently
    *published* index keys (layer 20's on steps where a ratio-2 group is still open) instead of its
    own kv source's keys; off by default (it is a bug), kept for parity studies."""

    def __init__(self, args: ModelArgs, batch_size: int, device: torch.device | str = "cpu",
                 ref_index_quirk: bool = False, main_format: str = "fp4"):
        if main_format not in MAIN_FORMATS:
            raise ValueError(f"main_format must be one of {', '.join(MAIN_FORMATS)}, not {main_format!r}")
        self.args, self.batch_size, self.device = args, batch_size, torch.device(device)
        self.main_format = main_format
        self.main_codec = MAIN_FORMATS[main_format]
        self.window_size = args.window_size
        self.layers: dict[int, LayerCache] = {}
        self.pos = 0  # tokens consumed so far
        self.ref_index_quirk = ref_index_quirk
        self._published_keys: int | None = None
        self._checkpoint: dict | None = None
        self.engram_history: torch.Tensor | None = None  # last (max_ngram-1) token ids per sequence
        self.window_floor: dict[int, int] = {}  # layer -> first position its window may see

    def layer(self, layer_id: int) -> LayerCache:
        if layer_id not in self.layers:
            self.layers[layer_id] = LayerCache()
        return self.layers[layer_id]

    def quantize_main(self, x: torch.Tensor) -> torch.Tensor:
        """The main-KV storage rounding as fake quantization: what `compressed` returns for an entry
        written as x (FP4 with E4M3 scales by default; FP8 or bf16 for the comparison formats)."""
        return qat(self.main_codec.fake_quant, x)

    # ------------------------------------------------------------------ window ring
    def _window_slots(self, layer_id: int, start_pos: int) -> torch.Tensor | None:
        """Ring slots of the positions max(0, start_pos-window)..start_pos-1, oldest first (None: none)."""
        ring = self.layer(layer_id).window
        # a window floor (SWA Bounded Replay) hides positions before a replay segment's start
        n_prev = min(start_pos - self.window_floor.get(layer_id, 0), self.window_size)
        if ring is None or n_prev <= 0:
            return None
        return torch.arange(start_pos - n_prev, start_pos, device=ring.parts[0].device) % self.window_size

    def window_before(self, layer_id: int, start_pos: int) -> torch.Tensor:
        """Window KV of the positions max(0, start_pos-window)..start_pos-1, oldest first."""
        slots = self._window_slots(layer_id, start_pos)
        if slots is None:
            shape = (self.batch_size, 0, self.args.head_dim)
            return torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        return self.layer(layer_id).window.read(slots)

    def window_bytes_before(self, layer_id: int, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`window_before` as the stored FP8 bytes: (E4M3 codes [B, n, D], UE8M0 scales [B, n, D/32])."""
        slots = self._window_slots(layer_id, start_pos)
        if slots is None:
            D = self.args.head_dim
            return (torch.zeros(self.batch_size, 0, D, dtype=torch.uint8, device=self.device),
                    torch.zeros(self.batch_size, 0, D // formats.FP8_BLOCK, dtype=torch.uint8, device=self.device))
        return self.layer(layer_id).window.stored(slots)

    def reads_packed(self, layer_id: int, x: torch.Tensor) -> bool:
        """Whether attention reads this layer's KV as the stored bytes (model/kernels/sparse_attention.py
        decodes them in the kernel on CUDA; its reference unpacks them to the same values): an inference
        forward (x wants no gradient, the stores hold bytes) with the official main format. A training
        forward, or a comparison main format (fp8, bf16), reads values."""
        ring = self.layer(layer_id).window
        return (self.main_codec is FP4_E4M3 and not _differentiable(x)
                and not (ring is not None and ring.differentiable))

    def set_window_floor(self, layer_id: int, position: int) -> None:
        """Truncated SWA (spec §4.5, Bounded Replay): from now on this layer's window never reaches
        before `position`, the start of a replay segment; older ring contents are ignored."""
        self.window_floor[layer_id] = position

    def write_window(self, layer_id: int, kv: torch.Tensor, start_pos: int,
                     packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """kv [B, T, D]: window KV of positions start_pos.. *before* FP8 rounding (the post-RoPE
        latent); the ring stores it as FP8 + UE8M0 and reads give fp8_fake_quant(kv). `packed`: the
        caller's WINDOW_CODEC.pack(kv), stored as is (not packed twice)."""
        lc = self.layer(layer_id)
        if lc.window is None:
            lc.window = Ring(WINDOW_CODEC, self.window_size)
        keep = min(kv.size(1), self.window_size)
        positions = torch.arange(start_pos + kv.size(1) - keep, start_pos + kv.size(1), device=kv.device)
        tail = None if packed is None else tuple(p[:, -keep:] for p in packed)
        lc.window.write(positions % self.window_size, kv[:, -keep:], tail)

    # ------------------------------------------------------------------ compressed KV
    def write_compressed(self, layer_id: int, entries: torch.Tensor) -> None:
        """entries [B, G, D]: new main-KV entries *before* storage rounding (RoPE(latent))."""
        lc = self.layer(layer_id)
        if lc.main is None:
            lc.main = Rows(self.main_codec)
        lc.main.append(lc.n_compressed, entries)
        lc.n_compressed += entries.size(1)

    def write_index_keys(self, layer_id: int, keys: torch.Tensor) -> None:
        """keys [B, G, index_head_dim] before MXFP4 rounding. Called before write_compressed for the
        same entries (they share n_compressed)."""
        lc = self.layer(layer_id)
        if lc.index_keys is None:
            lc.index_keys = Rows(INDEX_KEY_CODEC)
        lc.index_keys.append(lc.n_compressed, keys)
        self._published_keys = layer_id

    def compressed(self, source: int) -> torch.Tensor:
        """The main KV entries of kv source `source`, [B, n, D], as attention reads them."""
        lc = self.layer(source)
        if lc.main is None:
            return torch.zeros(self.batch_size, 0, self.args.head_dim, dtype=torch.bfloat16, device=self.device)
        return lc.main.read(lc.n_compressed)

    def main_bytes(self, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`compressed` as the stored FP4 bytes (E2M1 codes [B, n, D/2], E4M3 scales [B, n, D/16]), views.
        Only for a source that has written entries."""
        lc = self.layer(source)
        return lc.main.stored(0, lc.n_compressed)

    def _index_key_rows(self, source: int) -> tuple[Rows, int]:
        n = self.layer(source).n_compressed
        owner = self._published_keys if (self.ref_index_quirk and self._published_keys is not None) else source
        return self.layer(owner).index_keys, n

    def index_keys_for(self, source: int) -> torch.Tensor:
        rows, n = self._index_key_rows(source)
        return rows.read(n)

    def index_key_bytes(self, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`index_keys_for` as the stored MXFP4 bytes (codes [B, n, Dk/2], UE8M0 scales [B, n, Dk/32]), views."""
        rows, n = self._index_key_rows(source)
        return rows.stored(0, n)

    # ------------------------------------------------------------------ measured sizes
    def storage_bytes(self) -> dict[str, int]:
        """Bytes held, from the stored tensors (`nbytes` of the rows in use; rings whole): main KV,
        index keys, window rings of the backbone layers, DSpark's rings, and `allocated` (everything
        including the growable buffers' spare capacity)."""
        n_layers = self.args.n_layers
        out = {"main": 0, "index_keys": 0, "window": 0, "dspark_window": 0, "allocated": 0}
        for l, lc in self.layers.items():
            if lc.main is not None:
                out["main"] += lc.main.nbytes(lc.n_compressed)
                out["allocated"] += lc.main.allocated_nbytes()
            if lc.index_keys is not None:
                out["index_keys"] += lc.index_keys.nbytes(lc.n_compressed)
                out["allocated"] += lc.index_keys.allocated_nbytes()
            if lc.window is not None:
                out["window" if l < n_layers else "dspark_window"] += lc.window.nbytes()
                out["allocated"] += lc.window.nbytes()
        return out

    def global_bytes_per_token(self) -> float:
        """Global KV (main entries + index keys) per token and sequence, measured from the stored
        tensors. Equals the ledger's `global_bytes_per_token` once pos is a multiple of every ratio."""
        if self.pos == 0:
            return 0.0
        b = self.storage_bytes()
        return (b["main"] + b["index_keys"]) / (self.pos * self.batch_size)

    # ------------------------------------------------------------------ persistent global KV
    def export_global(self, upto: int | None = None) -> dict:
        """The packed global KV for a persistent prefix cache: per kv source, the stored main-KV and
        index-key tensors of the entries complete within the first `upto` tokens (default: all
        consumed), and their positions (entry g covers tokens g*m..g*m+m-1 and is rotated at g*m).

        Returns {"main_format", "dtype" (what reads return), "tokens": upto, "sources": {layer: {"ratio", "positions" [n],
        "main": (tensors [B, n, ...]), "index_keys": (codes, scales)}}}, tensors cloned. Window rings
        and the compressor's pending partial group are not part of it (bounded replay rebuilds them)."""
        upto = self.pos if upto is None else upto
        if not 0 <= upto <= self.pos:
            raise ValueError(f"upto={upto} is outside the {self.pos} consumed tokens")
        sources = {}
        for l in self.args.kv_source_layers:
            lc = self.layers.get(l)
            m = self.args.compress_ratios[l]
            n = min(upto // m, lc.n_compressed if lc is not None else 0)
            if lc is not None and (lc.main is not None and lc.main.differentiable):
                raise RuntimeError("a differentiable (training) cache holds no packed entries to export")
            empty = lc is None or lc.main is None
            sources[l] = {
                "ratio": m,
                "positions": torch.arange(n, device=self.device) * m,
                "main": () if empty else tuple(t.clone() for t in lc.main.stored(0, n)),
                "index_keys": () if empty else tuple(t.clone() for t in lc.index_keys.stored(0, n)),
            }
        dtype = next((lc.main.dtype for lc in self.layers.values() if lc.main is not None), torch.bfloat16)
        return {"main_format": self.main_format, "dtype": dtype, "tokens": upto, "sources": sources}

    def import_global(self, data: dict) -> None:
        """Load what `export_global` returned into this (empty) cache's compressed stores. Sets the
        entries and n_compressed only: `pos`, the window rings, the compressor's pending group and
        Engram's history are the caller's (who replays or recomputes the tokens after the entries)."""
        if data["main_format"] != self.main_format:
            raise ValueError(f"global KV stored as {data['main_format']}, this cache stores {self.main_format}")
        for l, src in data["sources"].items():
            l = int(l)
            if l not in self.args.kv_source_layers or src["ratio"] != self.args.compress_ratios[l]:
                raise ValueError(f"layer {l} with ratio {src['ratio']} is not a kv source of this model")
            lc = self.layer(l)
            if lc.n_compressed:
                raise ValueError(f"layer {l} already holds {lc.n_compressed} entries")
            if not src["main"]:
                continue
            n = src["main"][0].size(1)
            for rows_attr, codec, parts, dim in (("main", self.main_codec, src["main"], self.args.head_dim),
                                                 ("index_keys", INDEX_KEY_CODEC, src["index_keys"],
                                                  self.args.index_head_dim)):
                expect = self._packed_shapes(codec, dim, n)
                got = [tuple(p.shape) for p in parts]
                if got != expect:
                    raise ValueError(f"layer {l} {rows_attr}: tensors {got}, expected {expect}")
                rows = Rows(codec)
                rows.dtype = data.get("dtype", torch.bfloat16)
                rows.parts = tuple(p.to(self.device).clone() for p in parts)
                setattr(lc, rows_attr, rows)
            lc.n_compressed = n

    def _packed_shapes(self, codec: Codec, dim: int, n: int) -> list[tuple[int, ...]]:
        probe = codec.pack(torch.zeros(self.batch_size, n, dim))
        return [tuple(p.shape) for p in probe]

    # ------------------------------------------------------------------ speculative rollback
    def checkpoint(self) -> None:
        """Remember what the next forward may overwrite, so that `rollback` can drop a suffix of it
        (speculative decoding: verify drafts, keep the accepted prefix). Costs one copy of each
        (packed) window ring; compressed entries are only appended, so their counts suffice."""
        self._checkpoint = {
            "pos": self.pos,
            "rings": {l: lc.window.snapshot() for l, lc in self.layers.items() if lc.window is not None},
            "n_compressed": {l: lc.n_compressed for l, lc in self.layers.items()},
            "pending": {l: (lc.compressor_state.kv, lc.compressor_state.score) for l, lc in self.layers.items()},
            "engram_history": self.engram_history,
            "published": self._published_keys,
        }
        for lc in self.layers.values():
            lc.compressor_state.journal = []

    def rollback(self, new_pos: int, engram_history: torch.Tensor | None = None) -> None:
        """Keep positions < new_pos of those written since `checkpoint()`; forget the rest.
        engram_history: the Engram n-gram history as of new_pos (the caller knows the token ids)."""
        ck = self._checkpoint
        if ck is None:
            raise RuntimeError("rollback without a checkpoint")
        start = ck["pos"]
        if not start <= new_pos <= self.pos or self.pos - start > self.window_size:
            raise ValueError(f"cannot roll back to {new_pos}: checkpoint at {start}, cache at {self.pos}")
        dropped = torch.arange(new_pos, self.pos) % self.window_size
        for l, lc in self.layers.items():
            if l in ck["rings"] and len(dropped):
                lc.window.restore(ck["rings"][l], dropped.to(lc.window.parts[0].device))
            elif l not in ck["rings"] and lc.window is not None and new_pos == start:
                lc.window = None
            state = lc.compressor_state
            if state.journal is not None and (state.journal or l in ck["pending"]):
                # rebuild the pending partial group of the kept positions from the raw projections
                old_kv, old_score = ck["pending"].get(l, (None, None))
                kvs = ([old_kv] if old_kv is not None else []) + [kv for kv, _ in state.journal]
                scores = ([old_score] if old_score is not None else []) + [s for _, s in state.journal]
                ratio = self.args.compress_ratios[l]
                if kvs and ratio > 1:
                    first = start - (old_kv.size(1) if old_kv is not None else 0)  # position of kvs[0][:, 0]
                    kv_all, score_all = torch.cat(kvs, dim=1), torch.cat(scores, dim=1)
                    group_start = (new_pos // ratio) * ratio
                    keep = slice(group_start - first, new_pos - first)
                    pending = new_pos - group_start
                    state.kv = kv_all[:, keep] if pending else None
                    state.score = score_all[:, keep] if pending else None
            state.journal = None
            if l in ck["n_compressed"] and self.args.compress_ratios[l]:
                lc.n_compressed = min(lc.n_compressed, new_pos // self.args.compress_ratios[l])
        self.engram_history = engram_history if engram_history is not None else ck["engram_history"]
        self._published_keys = ck["published"]
        self.pos = new_pos
        self._checkpoint = None
