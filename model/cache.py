"""The KV cache (spec §4.4): what a sequence leaves behind for the tokens after it.

Per layer: a ring of `window_size` window-KV slots (slot = position mod window). Per kv-source
layer: the shared compressed main KV, its indexer keys, and the compressor's pending partial group.
Model-wide: Engram's n-gram history. Every layer with m > 0 reads the compressed KV of its kv source;
nothing is duplicated across layers (that is CSA2's storage saving).

This module keeps the values as the forward pass produces them (already fake-quantized to their
storage grids, held in bf16/fp32 tensors). Packed storage lives behind the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.config import ModelArgs


class CompressorState:
    """The projections of a trailing incomplete group, kept until the group's last token arrives."""

    def __init__(self):
        self.kv: torch.Tensor | None = None
        self.score: torch.Tensor | None = None

    def take(self, kv: torch.Tensor, score: torch.Tensor, ratio: int):
        """Prepend the pending tokens to the new ones; return the complete groups, keep the rest."""
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


def _append(buf: torch.Tensor | None, used: int, new: torch.Tensor) -> torch.Tensor:
    """Write `new` after the first `used` rows of a growable buffer (capacity doubles when full)."""
    need = used + new.size(1)
    if buf is None or buf.size(1) < need:
        cap = max(need, 2 * (buf.size(1) if buf is not None else 0), 16)
        grown = new.new_zeros(new.size(0), cap, *new.shape[2:])
        if buf is not None:
            grown[:, :used] = buf[:, :used]
        buf = grown
    buf[:, used:need] = new
    return buf


@dataclass
class LayerCache:
    window: torch.Tensor | None = None  # [B, window, D] ring
    compressed_buf: torch.Tensor | None = None  # [B, capacity, D]
    index_keys_buf: torch.Tensor | None = None  # [B, capacity, index_head_dim]
    n_compressed: int = 0
    compressor_state: CompressorState = field(default_factory=CompressorState)


class KVCache:
    """Cache for a batch of sequences that advance together (same positions).

    ref_index_quirk reproduces REF's decode behaviour where an indexer reads the most recently
    *published* index keys (layer 20's on steps where a ratio-2 group is still open) instead of its
    own kv source's keys; off by default (it is a bug), kept for parity studies."""

    def __init__(self, args: ModelArgs, batch_size: int, device: torch.device | str = "cpu",
                 ref_index_quirk: bool = False):
        self.args, self.batch_size, self.device = args, batch_size, torch.device(device)
        self.window_size = args.window_size
        self.layers: dict[int, LayerCache] = {}
        self.pos = 0  # tokens consumed so far
        self.ref_index_quirk = ref_index_quirk
        self._published_keys: int | None = None
        self.engram_history: torch.Tensor | None = None  # last (max_ngram-1) token ids per sequence

    def layer(self, layer_id: int) -> LayerCache:
        if layer_id not in self.layers:
            self.layers[layer_id] = LayerCache()
        return self.layers[layer_id]

    # ------------------------------------------------------------------ window ring
    def window_before(self, layer_id: int, start_pos: int) -> torch.Tensor:
        """Window KV of the positions max(0, start_pos-window)..start_pos-1, oldest first."""
        ring = self.layer(layer_id).window
        n_prev = min(start_pos, self.window_size)
        if ring is None or n_prev == 0:
            shape = (self.batch_size, 0, self.args.head_dim)
            return torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        slots = torch.arange(start_pos - n_prev, start_pos, device=ring.device) % self.window_size
        return ring[:, slots]

    def write_window(self, layer_id: int, kv: torch.Tensor, start_pos: int) -> None:
        lc = self.layer(layer_id)
        if lc.window is None:
            lc.window = kv.new_zeros(kv.size(0), self.window_size, kv.size(-1))
        keep = min(kv.size(1), self.window_size)
        positions = torch.arange(start_pos + kv.size(1) - keep, start_pos + kv.size(1), device=kv.device)
        lc.window[:, positions % self.window_size] = kv[:, -keep:]

    # ------------------------------------------------------------------ compressed KV
    def write_compressed(self, layer_id: int, entries: torch.Tensor) -> None:
        lc = self.layer(layer_id)
        lc.compressed_buf = _append(lc.compressed_buf, lc.n_compressed, entries)
        lc.n_compressed += entries.size(1)

    def write_index_keys(self, layer_id: int, keys: torch.Tensor) -> None:
        """Called before write_compressed for the same entries (they share n_compressed)."""
        lc = self.layer(layer_id)
        lc.index_keys_buf = _append(lc.index_keys_buf, lc.n_compressed, keys)
        self._published_keys = layer_id

    def compressed(self, source: int) -> torch.Tensor:
        lc = self.layer(source)
        if lc.compressed_buf is None:
            return torch.zeros(self.batch_size, 0, self.args.head_dim, dtype=torch.bfloat16, device=self.device)
        return lc.compressed_buf[:, :lc.n_compressed]

    def index_keys_for(self, source: int) -> torch.Tensor:
        n = self.layer(source).n_compressed
        owner = self._published_keys if (self.ref_index_quirk and self._published_keys is not None) else source
        return self.layer(owner).index_keys_buf[:, :n]
