"""The KV cache of a continuous batch: many sequences, each in its own row at its own position.

`KVCache` (model/cache.py) holds sequences that advance together, one position for all rows: it is what a
prefill fills, and the full-sequence forward's oracle. A `BatchCache` holds up to `n_rows` sequences in
fixed-shape tensors, each row with its own length, and is what the engine's decode step reads and writes
(model/engine.py): rows enter between steps (`load`: a prefilled `KVCache` of one sequence), leave
(`free`), and the last row moves into a freed one (`move`), so the rows in use are always 0..B-1 and a
step works on views of the first B rows, never on a gather.

Per row, the same state as a `KVCache` of one sequence, in the same packed formats:

    every layer      window ring [R, W, ...] (FP8 + UE8M0), slot of position p = p mod W;
                     window floor [R] (SWA Bounded Replay: the first position the window may see)
    kv sources       main entries [R, cap, ...] (FP4 + E4M3) and index keys [R, cap, ...] (MXFP4),
                     n_compressed [R]; the compressor's open group: projections and scores [R, m, D]
                     (fp32), slot of position p = p mod m
    model-wide       positions [R] (tokens consumed); Engram's history [R, N-1]

Every decode step writes every row the same way, so the step has no data-dependent shapes (a CUDA graph
can replay it): the window row at p mod W, the open group's projection at p mod m, and a compressed entry
at index n_compressed, which only counts (n_compressed + 1) when the row's group completes at this token;
an incomplete group's pooled value lands in the next free entry, unseen, and is overwritten when the
group completes. The row widths attention and Top-K see are fixed per model (W window slots, index_topk
main entries), so a row's reductions do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from dsv41.model.cache import FP4_E4M3, INDEX_KEY_CODEC, WINDOW_CODEC, KVCache
from dsv41.model.config import ModelArgs
from dsv41.model.kernels import host


class RowsFull(ValueError):
    """A sequence needs more positions than a row holds (`max_len`)."""


class BatchCache:
    def __init__(self, args: ModelArgs, n_rows: int, max_len: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # padding rows serve MKL's GEMMs on a CPU without the host library (below); with it, and on CUDA, a
        # step computes the rows in use only
        self.min_rows = self.MIN_ROWS if self.device.type == "cpu" and not host.available() else 1
        n_rows = max(n_rows, self.min_rows)
        self.args, self.n_rows, self.max_len = args, n_rows, max_len
        self.window_size = W = args.window_size
        self.positions = torch.zeros(n_rows, dtype=torch.long, device=self.device)
        # what every layer of one step derives from the positions alone (window slots and indices, RoPE rows),
        # computed by the first layer that asks: a dozen launches a layer on CUDA (`step_memo`)
        self._memo: dict = {}
        self.live = torch.zeros(n_rows, dtype=torch.bool, device=self.device)  # rows holding a sequence
        self.lengths = [0] * n_rows  # the positions, on the host (the scheduler's bookkeeping)
        S, D = n_rows, args.head_dim
        self.window_codes = {l: torch.zeros(S, W, D, dtype=torch.uint8, device=self.device)
                             for l in range(args.n_layers)}
        self.window_scales = {l: torch.zeros(S, W, D // 32, dtype=torch.uint8, device=self.device)
                              for l in range(args.n_layers)}
        # On the CPU the window rows also as the fp32 values they decode to, kept as they are written: the
        # reference attention would otherwise decode every row's whole window at every step of every layer
        # (a tenth of a 32-row step). The same values as decoding them there (the decode is elementwise).
        # Kernels decode the packed bytes in registers, so CUDA keeps only those.
        self.window_values = ({l: torch.zeros(S, W, D, dtype=torch.float32) for l in range(args.n_layers)}
                              if self.device.type == "cpu" else None)
        self.window_floor = torch.zeros(args.n_layers, S, dtype=torch.long, device=self.device)
        self.floored = [False] * args.n_layers  # does any row of this layer have a window floor
        self.ratio = {l: args.compress_ratios[l] for l in args.kv_source_layers}
        self.n_compressed = {l: torch.zeros(S, dtype=torch.long, device=self.device) for l in self.ratio}
        self.main: dict[int, tuple[torch.Tensor, ...]] = {}
        self.index_keys: dict[int, tuple[torch.Tensor, ...]] = {}
        self.capacity = 0
        self._grow(16)
        self.pending_kv = {l: torch.zeros(S, m, D, dtype=torch.float32, device=self.device)
                           for l, m in self.ratio.items() if m > 1}
        self.pending_score = {l: torch.zeros_like(t) for l, t in self.pending_kv.items()}
        self.engram_history: torch.Tensor | None = None  # [R, N-1], made on the first load that has one
        self.dtype = torch.bfloat16  # what the written values were (reads of a KVCache return it)
        self.active = self.rows = self.longest = 0  # this step: rows in use, rows computed, longest row (prepare_step)
        self._row_ids: dict[int, torch.Tensor] = {}
        # static: every step reads the whole entry capacity and a RoPE table of a power-of-two length, so
        # that its shapes stay fixed between capacity doublings (a CUDA graph replays it: model/engine.py).
        # The same numbers as reading only the entries in use (the rest are masked; tests/test_batch_engine.py)
        self.static = False

    # ------------------------------------------------------------------ storage
    def _grow(self, need: int) -> None:
        """Room for `need` compressed entries per row (plus the scratch entry an open group writes to)."""
        cap = self.capacity
        if need + 1 <= cap:
            return
        cap = max(need + 1, 2 * cap, 16)
        for l in self.ratio:
            for store, codec, dim in ((self.main, FP4_E4M3, self.args.head_dim),
                                      (self.index_keys, INDEX_KEY_CODEC, self.args.index_head_dim)):
                old = store.get(l)
                new = tuple(torch.zeros(self.n_rows, cap, n, dtype=dt, device=self.device)
                            for n, dt in codec.layout(dim))
                if old is not None:
                    for o, n in zip(old, new):
                        n[:, :o.size(1)] = o
                store[l] = new
        self.capacity = cap

    def reserve(self, length: int) -> None:
        """Room for rows of `length` positions now, so that the entry stores are not reallocated (and a
        static step's shapes do not change) while they grow to it."""
        self._grow(self.entries_needed(length))

    def entries_needed(self, length: int) -> int:
        """Compressed entries a row of `length` positions holds at most (the finest ratio's)."""
        return max((length // m for m in self.ratio.values()), default=0)

    # ------------------------------------------------------------------ rows in and out
    def load(self, row: int, kv: KVCache, src: int = 0) -> None:
        """Put sequence `src` of `kv` (a prefilled KVCache, official FP4 main format) in `row`. A KVCache of several
        sequences is a batched prefill's (model/engine.py, Scheduler): its sequences share one length."""
        if not 0 <= src < kv.batch_size or kv.main_format != "fp4":
            raise ValueError("a BatchCache row takes one sequence of a KVCache with FP4 main KV")
        if kv.pos > self.max_len:
            raise RowsFull(f"the sequence holds {kv.pos} positions; a row holds {self.max_len}")
        self._grow(self.entries_needed(kv.pos))
        for l in range(self.args.n_layers):
            lc = kv.layers.get(l)
            ring = lc.window if lc is not None else None
            if ring is not None:
                if ring.differentiable:
                    raise ValueError("a training (differentiable) cache cannot join a batch")
                self.window_codes[l][row] = ring.parts[0][src]
                self.window_scales[l][row] = ring.parts[1][src]
                if self.window_values is not None:
                    self.window_values[l][row] = _decoded(ring.parts[0][src], ring.parts[1][src])
                self.dtype = ring.dtype
            floor = kv.window_floor.get(l, 0)
            self.window_floor[l, row] = floor
            self.floored[l] = self.floored[l] or floor > 0
        for l, m in self.ratio.items():
            lc = kv.layers.get(l)
            n = lc.n_compressed if lc is not None else 0
            if n != kv.pos // m:
                raise ValueError(f"layer {l} holds {n} entries after {kv.pos} positions (ratio {m})")
            self.n_compressed[l][row] = n
            if n:
                for stores, parts in ((self.main[l], lc.main.parts), (self.index_keys[l], lc.index_keys.parts)):
                    for d, s in zip(stores, parts):
                        d[row, :n] = s[src, :n]
            if m > 1:
                state = lc.compressor_state if lc is not None else None
                r = state.pending if state is not None else 0
                if r != kv.pos % m:
                    raise ValueError(f"layer {l}: {r} pending projections after {kv.pos} positions (ratio {m})")
                if r:
                    self.pending_kv[l][row, :r] = state.kv[src]
                    self.pending_score[l][row, :r] = state.score[src]
        if kv.engram_history is not None:
            if self.engram_history is None:
                self.engram_history = torch.zeros(self.n_rows, kv.engram_history.size(1), dtype=torch.long,
                                                  device=self.device)
            self.engram_history[row] = kv.engram_history[src]
        self.positions[row] = kv.pos
        self.lengths[row] = kv.pos
        self.live[row] = True

    def unload(self, row: int) -> KVCache:
        """Row `row`'s sequence as a KVCache of one sequence (the inverse of `load`; tensors copied): what a
        prefix cache stores after a reply, so that the next turn of a conversation continues over it."""
        from dsv41.model.cache import Ring, Rows

        kv = KVCache(self.args, 1, self.device)
        length = self.lengths[row]
        kv.pos = length
        for l in range(self.args.n_layers):
            lc = kv.layer(l)
            if length:
                lc.window = Ring(WINDOW_CODEC, self.window_size)
                lc.window.dtype = self.dtype
                lc.window.parts = (self.window_codes[l][row:row + 1].clone(), self.window_scales[l][row:row + 1].clone())
            if self.floored[l] and int(self.window_floor[l, row]):
                kv.window_floor[l] = int(self.window_floor[l, row])
        for l, m in self.ratio.items():
            lc, n = kv.layer(l), length // m
            lc.n_compressed = n
            if n:
                for attr, codec, store in (("main", FP4_E4M3, self.main[l]),
                                           ("index_keys", INDEX_KEY_CODEC, self.index_keys[l])):
                    rows = Rows(codec)
                    rows.dtype = self.dtype
                    rows.parts = tuple(t[row:row + 1, :n].clone() for t in store)
                    setattr(lc, attr, rows)
                kv._published_keys = l
            r = length % m
            if m > 1 and r:
                lc.compressor_state.kv = self.pending_kv[l][row:row + 1, :r].clone()
                lc.compressor_state.score = self.pending_score[l][row:row + 1, :r].clone()
        if self.engram_history is not None:
            kv.engram_history = self.engram_history[row:row + 1].clone()
        return kv

    def move(self, src: int, dst: int) -> None:
        """Copy row `src` into row `dst` (the scheduler keeps the rows in use contiguous)."""
        if src == dst:
            return
        for l in range(self.args.n_layers):
            self.window_codes[l][dst] = self.window_codes[l][src]
            self.window_scales[l][dst] = self.window_scales[l][src]
            if self.window_values is not None:
                self.window_values[l][dst] = self.window_values[l][src]
        self.window_floor[:, dst] = self.window_floor[:, src]
        n_max = self.entries_needed(self.lengths[src])
        for l in self.ratio:
            self.n_compressed[l][dst] = self.n_compressed[l][src]
            for store in (self.main[l], self.index_keys[l]):
                for t in store:
                    t[dst, :n_max + 1] = t[src, :n_max + 1]
            if l in self.pending_kv:
                self.pending_kv[l][dst] = self.pending_kv[l][src]
                self.pending_score[l][dst] = self.pending_score[l][src]
        if self.engram_history is not None:
            self.engram_history[dst] = self.engram_history[src]
        self.positions[dst] = self.positions[src]
        self.lengths[dst] = self.lengths[src]
        self.live[dst] = self.live[src]

    def free(self, row: int) -> None:
        """Forget row `row`'s sequence (its tensors are overwritten by the next load). A free row computed as
        padding (prepare_step) stays at position 0 with no entries: its writes land in its own first slots."""
        self.lengths[row] = 0
        self.positions[row] = 0
        self.live[row] = False
        self.window_floor[:, row] = 0
        for n in self.n_compressed.values():
            n[row] = 0

    # ------------------------------------------------------------------ one decode step
    # A step computes `rows` >= `active` rows: the rows in use, 0..B-1. On the CPU every GEMM of inference sums
    # each output in a fixed order (host.fixed_order_linear, the head's order), so a row's numbers do not
    # depend on the rows beside it and the step computes the rows in use only. Without the C library the
    # GEMMs are MKL's, whose fp32 GEMM sums a row differently when the matrix has few rows (one row is a
    # GEMV) and from about 9 rows on the same whatever the row count: there the step pads to MIN_ROWS rows
    # with free ones. (On CUDA the GEMM kernels pick tiles and K splits by row count: no padding there, and
    # no such guarantee.)
    MIN_ROWS = 16
    MIN_ENTRIES = 16  # the indexer scores at least this many entries (the same reason, for its GEMM's width)

    def prepare_step(self, active: int) -> int:
        """Before a step over the rows in use 0..active-1: room for the entries it may write; returns the
        number of rows the step computes."""
        if any(self.lengths[b] + 1 > self.max_len for b in range(active)):
            raise RowsFull(f"a row would pass {self.max_len} positions")
        self._grow(max(self.entries_needed(max(self.lengths[:active]) + 1), self.MIN_ENTRIES))
        rows = max(active, min(self.min_rows, self.n_rows))
        if self.static:  # a few row counts only: each is one CUDA graph
            rows = min(1 << (rows - 1).bit_length(), self.n_rows)
        self.active, self.rows = active, rows
        self.longest = max(self.lengths[:active])  # the padding rows sit at position 0
        if rows not in self._row_ids:  # kept per row count: a captured step reads the same tensor every replay
            self._row_ids[rows] = torch.arange(rows, device=self.device)
        self.row_ids = self._row_ids[rows]
        return self.rows

    def rope_stop(self) -> int:
        """One past the largest position the step rotates at (static: a power of two, at least 64)."""
        stop = self.longest + 1
        return max(1 << (stop - 1).bit_length(), 64) if self.static else stop

    def static_key(self) -> tuple:
        """What a captured step depends on besides the tensors' contents: rows, entry capacity (the stores'
        shapes and addresses), the RoPE table, which layers have window floors."""
        return self.rows, self.capacity, self.rope_stop(), tuple(self.floored)

    def begin_step(self) -> None:
        """A decode step starts (Transformer.decode_rows): the positions it reads are those of this step."""
        self._memo.clear()

    def step_memo(self, key, make):
        """make(), computed once per step for `key`: a value of the step's positions that several layers use
        (cleared by begin_step and advance_positions; inside a captured step the first layer's launches
        compute it at every replay, and the later layers read it)."""
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = make()
        return value

    def window_index(self, layer_id: int) -> torch.Tensor:
        """Ring slots of each row's window after this step's row is written, as REF's decode lays them out
        (model.py get_window_topk_idxs): the positions max(0, floor, p-W+1)..p oldest first, then -1 up to
        the full width W. [R, 1, W]"""
        if self.floored[layer_id]:
            return self._window_index(layer_id)
        return self.step_memo("window_index", lambda: self._window_index(layer_id))

    def _window_index(self, layer_id: int) -> torch.Tensor:
        p = self.positions[:self.rows].unsqueeze(1)
        first = (p - self.window_size + 1).clamp_min(0)
        if self.floored[layer_id]:  # SWA Bounded Replay: nothing before the row's replay segment
            first = torch.maximum(first, self.window_floor[layer_id, :self.rows].unsqueeze(1))
        position = first + torch.arange(self.window_size, device=self.device)
        return torch.where(position <= p, position % self.window_size, -1).unsqueeze(1)

    def write_window(self, layer_id: int, packed: tuple[torch.Tensor, torch.Tensor]) -> None:
        """This step's window row of each row (packed FP8 [R, 1, D] and scales) at slot p mod W."""
        rows = self.row_ids
        slots = self.step_memo("window_slots", lambda: self.positions[:self.rows] % self.window_size)
        codes, scales = packed
        if host.put_rows(self.window_codes[layer_id], slots, codes):  # the CPU: each row's bytes by address
            host.put_rows(self.window_scales[layer_id], slots, scales)
            if self.window_values is not None:
                host.put_rows(self.window_values[layer_id], slots, _decoded(codes, scales))
            return
        self.window_codes[layer_id][rows, slots] = codes[:, 0]
        self.window_scales[layer_id][rows, slots] = scales[:, 0]
        if self.window_values is not None:
            self.window_values[layer_id][rows, slots] = _decoded(codes[:, 0], scales[:, 0])

    def window_rows(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window_codes[layer_id][:self.rows], self.window_scales[layer_id][:self.rows]

    def window_decoded(self, layer_id: int) -> torch.Tensor | None:
        """The window rows as fp32 values [R, W, D] (CPU; None on CUDA): window_rows decoded."""
        return self.window_values[layer_id][:self.rows] if self.window_values is not None else None

    def open_group(self, layer_id: int, kv: torch.Tensor, score: torch.Tensor):
        """Add this step's projections (kv, score [R, 1, D] fp32) to each row's open group; return the
        group's projections and scores [R, m, D] (slots after p mod m hold the previous group's: a row's
        pooled value is only used when its group completes at this token)."""
        rows = self.row_ids
        slot = self.positions[:self.rows] % self.ratio[layer_id]
        if not (host.put_rows(self.pending_kv[layer_id], slot, kv)
                and host.put_rows(self.pending_score[layer_id], slot, score)):
            self.pending_kv[layer_id][rows, slot] = kv[:, 0]
            self.pending_score[layer_id][rows, slot] = score[:, 0]
        return self.pending_kv[layer_id][:self.rows], self.pending_score[layer_id][:self.rows]

    def entry_positions(self, layer_id: int) -> torch.Tensor:
        """Where each row's next compressed entry is rotated: its group's first token, n_compressed * m."""
        return self.n_compressed[layer_id][:self.rows] * self.ratio[layer_id]

    def append_entry(self, layer_id: int, main: tuple[torch.Tensor, ...], keys: tuple[torch.Tensor, ...]) -> None:
        """Write each row's entry (packed main [R, 1, ...], packed index key) at index n_compressed; count it
        for the rows in use whose group completes at this token (position p with (p + 1) mod m == 0)."""
        rows = self.row_ids
        n = self.n_compressed[layer_id]
        at = n[:self.rows]
        for store, new in ((self.main[layer_id], main), (self.index_keys[layer_id], keys)):
            for t, v in zip(store, new):
                if not host.put_rows(t, at, v):
                    t[rows, at] = v[:, 0]
        R = self.rows
        n[:R] += ((self.positions[:R] + 1) % self.ratio[layer_id] == 0) & self.live[:R]

    def visible(self, layer_id: int) -> torch.Tensor:
        """Entries each row sees after this step's entry was counted, [R, 1]."""
        return self.n_compressed[layer_id][:self.rows].view(-1, 1)

    def entries(self, layer_id: int) -> int:
        """Entries the step reads: the most any row in use holds after this step (from the host positions),
        or the whole capacity when static (the rest are masked)."""
        if self.static:
            return self.capacity - 1
        return (self.longest + 1) // self.ratio[layer_id]

    def main_rows(self, layer_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t[:self.rows, :n] for t in self.main[layer_id])

    def index_key_rows(self, layer_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The index keys of the first max(n, MIN_ENTRIES) entries of each row (the rest score -inf)."""
        return tuple(t[:self.rows, :max(n, self.MIN_ENTRIES)] for t in self.index_keys[layer_id])

    def advance_positions(self) -> None:
        """The step's last write (on the device, inside a captured step): every live row moved one position."""
        self.positions[:self.rows] += self.live[:self.rows]
        self._memo.clear()

    def advance(self) -> None:
        """After a step, on the host: every row in use consumed one token."""
        for b in range(self.active):
            self.lengths[b] += 1

    # ------------------------------------------------------------------ measured sizes
    def row_bytes(self, row: int) -> dict[str, int]:
        """Bytes row `row` holds in use (window rings whole; entries up to its n_compressed)."""
        ring = sum(self.window_codes[l][row].nbytes + self.window_scales[l][row].nbytes
                   for l in range(self.args.n_layers))
        length = self.lengths[row]
        main = keys = 0
        for l, m in self.ratio.items():
            n = length // m
            main += sum(t[row, :n].nbytes for t in self.main[l])
            keys += sum(t[row, :n].nbytes for t in self.index_keys[l])
        return {"main": main, "index_keys": keys, "window": ring}


def _decoded(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Window bytes (FP8 E4M3 + UE8M0 per 32) -> their fp32 values."""
    return WINDOW_CODEC.unpack((codes, scales), torch.float32)
