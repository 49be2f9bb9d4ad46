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

    # ------------------------------------------------------------------ speculative rollback
    def checkpoint(self) -> None:
        """Remember what the next forward may overwrite, so that `rollback` can drop a suffix of it
        (speculative decoding: verify drafts, keep the accepted prefix). Costs one copy of each
        window ring; compressed entries are only appended, so their counts suffice."""
        self._checkpoint = {
            "pos": self.pos,
            "rings": {l: lc.window.clone() for l, lc in self.layers.items() if lc.window is not None},
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
        ck = getattr(self, "_checkpoint", None)
        if ck is None:
            raise RuntimeError("rollback without a checkpoint")
        start = ck["pos"]
        if not start <= new_pos <= self.pos or self.pos - start > self.window_size:
            raise ValueError(f"cannot roll back to {new_pos}: checkpoint at {start}, cache at {self.pos}")
        dropped = torch.arange(new_pos, self.pos) % self.window_size
        for l, lc in self.layers.items():
            if l in ck["rings"] and len(dropped):
                lc.window[:, dropped.to(lc.window.device)] = ck["rings"][l][:, dropped.to(lc.window.device)]
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

    def index_keys_for(self, source: int) -> torch.Tensor:
        n = self.layer(source).n_compressed
        owner = self._published_keys if (self.ref_index_quirk and self._published_keys is not None) else source
        return self.layer(owner).index_keys_buf[:, :n]
