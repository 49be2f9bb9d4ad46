"""A persistent prefix cache (spec §4.5, report "store" and "move" ledgers).

What persists is the global KV only: each kv source's compressed main KV and indexer keys, in their
packed storage formats (890 bytes per token for V4.1-Flash). SWA state (the window rings, Engram's
n-gram history, the compressor's pending group) stays in memory for a time-to-live; it is 128 x 528 B
per layer, and V4.1 stops persisting it (SWA Bounded Replay).

A lookup finds the longest stored prefix of the prompt:
- hit with live SWA state: the cache is restored exactly and only the suffix is prefilled (exact);
- hit without it (expired, or another process): the global KV is loaded and the last `window_size`
  cached tokens are replayed through every layer with truncated SWA to rebuild the windows (SWA
  Bounded Replay; an approximation the model was post-trained to tolerate), then the suffix;
- miss: a normal prefill.
Prefixes are stored at token counts that are multiples of every compression ratio, so no group is
left half-compressed in a persisted entry.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def prefix_key(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class Hit:
    tokens: int  # how many prompt tokens the cache covers
    cache: object | None  # a live KVCache (SWA state within its TTL), exact
    global_kv: dict | None  # persisted global KV only (bounded replay needed)


class PrefixCache:
    def __init__(self, directory: str | os.PathLike, swa_ttl_s: float = 600.0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.swa_ttl_s = swa_ttl_s
        self._live: dict[str, tuple[float, object]] = {}  # key -> (expiry, KVCache copy)
        self.stats = {"hits_live": 0, "hits_replay": 0, "misses": 0, "stored": 0}

    # ------------------------------------------------------------------ index
    def _index(self) -> dict[str, int]:
        f = self.dir / "index.json"
        try:
            return {k: int(v) for k, v in json.loads(f.read_text()).items()}
        except (OSError, ValueError):
            return {}

    def _write_atomic(self, path: Path, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix="tmp-", suffix=".part")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # ------------------------------------------------------------------ store / lookup
    def aligned(self, n: int, args) -> int:
        step = math.lcm(*[m for m in args.compress_ratios[: args.n_layers] if m] or [1])
        return n - n % step

    def store(self, ids: list[int], cache) -> int:
        """Persist the global KV of the first `aligned(len(ids))` tokens; keep the full cache (SWA
        included) in memory for the TTL. Returns the number of tokens stored."""
        n = self.aligned(min(len(ids), cache.pos), cache.args)
        if n == 0:
            return 0
        key = prefix_key(ids[:n])
        data = cache.export_global(upto=n)
        self._write_atomic(self.dir / f"{key}.pt", lambda tmp: torch.save(data, tmp))
        index = self._index()
        index[key] = n
        self._write_atomic(self.dir / "index.json", lambda tmp: Path(tmp).write_text(json.dumps(index)))
        if n == cache.pos:
            snapshot = copy.deepcopy(cache)
            snapshot._checkpoint = None
            self._live[key] = (time.monotonic() + self.swa_ttl_s, snapshot)
        self.stats["stored"] += 1
        return n

    def lookup(self, ids: list[int], device) -> Hit | None:
        """The longest stored prefix of ids that leaves at least one token to prefill."""
        now = time.monotonic()
        self._live = {k: v for k, v in self._live.items() if v[0] > now}
        index = self._index()
        for n in sorted(set(index.values()), reverse=True):
            if n >= len(ids):
                continue
            key = prefix_key(ids[:n])
            if key not in index:
                continue
            if key in self._live:
                self.stats["hits_live"] += 1
                cache = copy.deepcopy(self._live[key][1])
                return Hit(n, cache, None)
            try:
                data = torch.load(self.dir / f"{key}.pt", map_location=device, weights_only=True)
            except Exception:  # noqa: BLE001 - a damaged entry (truncated, garbage) is a miss, never an error
                continue
            self.stats["hits_replay"] += 1
            return Hit(n, None, data)
        self.stats["misses"] += 1
        return None
