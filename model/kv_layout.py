"""What one KV-cache entry is stored as, as plain data (no torch): the layout of each storage format
(payload first, then scales, as (last dimension, safetensors dtype) per stored tensor), its bytes per
entry, and which format and width each part of a `KVCache` uses. The one table of KV bytes: model/cache.py's
codecs take their `layout` from here (and `kv_entry_bytes`, `kv_cache_bytes` from them), and the ledger
(`dsv41 info`) reads it without importing torch. tests/test_kv_bytes.py checks every layout against the
tensors the codecs' packers return.

    fp4    main KV (official): E2M1 codes two per byte + one E4M3 scale per 16          288 B at D = 512
    fp8    main KV (comparison), window ring: E4M3 + one UE8M0 scale per 32             528 B
    bf16   main KV (comparison): the post-RoPE latent in bf16                           1024 B
    mxfp4  index keys: E2M1 codes two per byte + one UE8M0 scale per 32                 68 B at D = 128
    v4     V4's entry (ledger only): D - rope FP8 dims, one UE8M0 per 64, rope dims bf16  583 B
"""

from __future__ import annotations

from typing import Callable

from dsv41.model.inventory import ITEMSIZE

# The block sizes of the KV formats: model/formats.py's FP4_E4M3_BLOCK, FP8_BLOCK and MXFP4_BLOCK, which its
# packers use (tests/test_kv_bytes.py checks that these agree with them and with the packed tensors).
FP4_E4M3_BLOCK = 16
FP8_BLOCK = 32
MXFP4_BLOCK = 32
V4_FP8_BLOCK = 64

Layout = tuple[tuple[int, str], ...]

LAYOUTS: dict[str, Callable[[int], Layout]] = {
    "fp4": lambda d: ((d // 2, "U8"), (d // FP4_E4M3_BLOCK, "U8")),  # E2M1 x2, E4M3 scales
    "fp8": lambda d: ((d, "U8"), (d // FP8_BLOCK, "U8")),  # E4M3, UE8M0 scales
    "bf16": lambda d: ((d, "BF16"),),
    "mxfp4": lambda d: ((d // 2, "U8"), (d // MXFP4_BLOCK, "U8")),  # E2M1 x2, UE8M0 scales
}

MAIN_FORMATS = ("fp4", "fp8", "bf16")  # main KV storage formats (`main_format`)
INDEX_KEY_FORMAT = "mxfp4"
WINDOW_FORMAT = "fp8"


def v4_entry_layout(rope_dim: int) -> Callable[[int], Layout]:
    """V4-Flash/Pro's KV entry, main and window alike: the D - rope_dim dims without RoPE in FP8 E4M3
    with one UE8M0 scale per 64, the rope_dim RoPE dims in bf16."""
    return lambda d: ((d - rope_dim, "U8"), ((d - rope_dim) // V4_FP8_BLOCK, "U8"), (rope_dim, "BF16"))


def layout_bytes(layout: Layout) -> int:
    """Bytes one stored entry takes: payload + scales."""
    return sum(n * ITEMSIZE[dtype] for n, dtype in layout)


def bytes_per_entry(fmt: str, dim: int) -> int:
    """Bytes of one entry of `dim` values in format `fmt` (a key of LAYOUTS)."""
    return layout_bytes(LAYOUTS[fmt](dim))


def v4_entry_bytes(rope_dim: int, dim: int) -> int:
    return layout_bytes(v4_entry_layout(rope_dim)(dim))


def kv_parts(args, main_format: str = "fp4") -> dict[str, tuple[str, int]]:
    """What a `KVCache` stores per entry, part by part: {"main", "index_keys", "window"} -> (format,
    values per entry). Main entries in `main_format` (head_dim values), index keys MXFP4
    (index_head_dim), window slots FP8 (head_dim)."""
    if main_format not in MAIN_FORMATS:
        raise ValueError(f"main_format must be one of {', '.join(MAIN_FORMATS)}, not {main_format!r}")
    return {"main": (main_format, args.head_dim),
            "index_keys": (INDEX_KEY_FORMAT, args.index_head_dim),
            "window": (WINDOW_FORMAT, args.head_dim)}


def kv_entry_bytes(args, main_format: str = "fp4") -> dict[str, int]:
    """The KV-bytes table: bytes per stored entry of each part of a `KVCache`; for V4.1-Flash and fp4,
    main 288, index_keys 68, window 528. (model/cache.py's `kv_entry_bytes` gives the same from its codecs.)"""
    return {part: bytes_per_entry(fmt, dim) for part, (fmt, dim) in kv_parts(args, main_format).items()}
