"""Where the server's memory goes: GET /debug/memory (only with DSV41_SERVE_DEBUG_MEMORY=1: tracemalloc slows
every allocation) and glibc's trim, which the engine thread runs (serve/worker.py).

What the load test found (benchmarks/results/cpu-serve/NOTES.md): Python's heap stays flat (tracemalloc ~9
MiB, the gc's object count flat); the growth is native memory in use (glibc's blocks, `mallinfo2`), and the
engine alone in one process (no HTTP, no serve/) grows the same way. It follows the decode step's shapes:
the eager CPU step computes over the longest row's entries and the rows in use, which change every step,
and the native libraries under torch keep per-shape state (oneDNN's primitive cache is part of it); with
the batch cache's static shapes the same run stays flat. The memory the arenas hold free on top of that is
what `malloc_trim(0)` gives back to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time

_libc = None


def libc():
    """glibc, or None (another C library: nothing to trim, nothing to report)."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim  # noqa: B018 - glibc only
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_trim() -> bool:
    lib = libc()
    return bool(lib and lib.malloc_trim(0))


def mallinfo() -> dict | None:
    """glibc's counters over every arena, in MiB: the blocks in use (in the arenas and mmapped), and the free
    memory the arenas hold (what malloc_trim can give back)."""
    lib = libc()
    if lib is None or not hasattr(lib, "mallinfo2"):
        return None
    lib.mallinfo2.restype = _Mallinfo2
    m = lib.mallinfo2()
    mib = 2**20
    return {"malloc_in_use_mib": round((m.uordblks + m.hblkhd) / mib, 1),
            "malloc_free_mib": round(m.fordblks / mib, 1)}


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class MemoryProbe:
    """GET /debug/memory: RSS, glibc's arenas, Python's objects (gc) and, with tracemalloc started at server
    start, the allocation sites that grew most since the previous call. `?trim=1` trims first and says what it
    gave back."""

    def __init__(self):
        import tracemalloc

        tracemalloc.start()
        self.previous = tracemalloc.take_snapshot()
        self.started = time.monotonic()

    def report(self, trim: bool = False, top: int = 12) -> dict:
        import tracemalloc

        out = {"seconds": round(time.monotonic() - self.started, 1), "rss_mib": rss_mib(), "malloc": mallinfo()}
        if trim:
            malloc_trim()
            out["after_trim"] = {"rss_mib": rss_mib(), "malloc": mallinfo()}
        out["gc"] = {"objects": len(gc.get_objects()), "counts": gc.get_count()}
        current, peak = tracemalloc.get_traced_memory()
        out["python_traced_mib"] = {"current": current / 2**20, "peak": peak / 2**20}
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        out["grew_since_last_call"] = [
            {"where": str(s.traceback[0]), "kib": round(s.size_diff / 1024, 1), "count": s.count_diff}
            for s in snapshot.compare_to(self.previous, "lineno")[:top]]
        self.previous = snapshot
        return out
