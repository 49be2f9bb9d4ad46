"""Ledgers computed from a config without allocating weights: parameters by component, parameters
activated per token in prefill and decode, the layer plan, and KV-cache bytes per token.

Counting rules (docs/architecture.md, "Ledgers"):
- A parameter is one logical weight element: an FP8 byte, half a packed-FP4 byte, a bf16/fp32 value.
  Quantization scales (UE8M0 / E4M3 block scales) are metadata and not counted.
- backbone = everything of the 40 text layers, embedding, final norm and head, including the Engram
  projections (`engram.wkv`, `q_weight`, `k_weight`); engram = the two n-gram tables; dspark =
  `mtp.*`; vision = `vision.*`, `aligner.*`, `image_*`.
- Activated per token counts the weights a token multiplies: dense parts in full, k of E routed
  experts, the Engram projection (table rows are looked up, not multiplied), the head; the input
  embedding is a lookup and is not counted.
- decode: all 40 layers. prefill (CED): encoder layers 0..L/2-1 in full, plus what layer L/2 (the
  decoder's kv source) needs to turn the encoder output into the decoder's global KV: its attention
  mHC coefficients, attn_norm, the compressor and the indexer key path; no head (prompt tokens emit
  no logits except the last, which is negligible).

Torch-free (`dsv41 info` imports no torch): the inventory is model/inventory.py's, computed from the config
(tests/test_info_startup.py checks it equals the meta-device model's), the KV bytes model/kv_layout.py's
(the layouts model/cache.py's codecs use).
"""

from __future__ import annotations

import math
from collections import Counter

from dsv41.model import kv_layout
from dsv41.model.config import ModelArgs
from dsv41.model.inventory import inventory_totals, release_dtype
from dsv41.model.inventory import parameter_inventory as plain_inventory

COMPONENTS = ("backbone", "engram", "dspark", "vision")
PACKED_DTYPES = ("I8", "U8")  # two weights per byte (packed E2M1)
SCALE_DTYPES = ("F8_E8M0", "F8_E4M3", "U8")  # block scales (metadata, not parameters)


def component_of(name: str) -> str:
    if ".engram.embed." in name:
        return "engram"
    if name.startswith("mtp."):
        return "dspark"
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision"
    return "backbone"


def parameter_inventory(args: ModelArgs, fast: bool = True):
    """The meta-device inventory, torch dtypes (`dsv41.model.checkpoint.names.parameter_inventory`; imports
    torch). The ledgers use model/inventory.py's, the same entries with safetensors dtype names."""
    from dsv41.model.checkpoint.names import parameter_inventory as meta_inventory

    return meta_inventory(args, fast)


def logical_numel(shape: tuple[int, ...], dtype: str) -> int:
    """Weights stored two per byte (packed E2M1, int8 storage) count twice. `dtype`: a safetensors name."""
    return math.prod(shape) * (2 if dtype in PACKED_DTYPES else 1)


def is_scale(name: str, dtype: str) -> bool:
    return name.endswith(".scale") and dtype in SCALE_DTYPES


def parameter_counts(args: ModelArgs, inventory=None) -> dict[str, int]:
    """Parameters per component. `inventory`: model/inventory.py's entries (safetensors dtype names)."""
    counts = Counter({c: 0 for c in COMPONENTS})
    for name, shape, dtype in inventory or plain_inventory(args):
        if is_scale(name, dtype):
            continue
        counts[component_of(name)] += logical_numel(shape, dtype)
    out = {c: counts[c] for c in COMPONENTS}
    out["total"] = sum(out.values())
    return out


def activated_counts(args: ModelArgs, inventory=None) -> dict[str, int]:
    """Parameters multiplied per token in decode and in (CED) prefill; see the module docstring."""
    per_layer: Counter = Counter()  # layer id -> activated params
    kv_path: Counter = Counter()  # layer id -> params of the global-KV path only
    other = 0
    for name, shape, dtype in inventory or plain_inventory(args):
        if is_scale(name, dtype) or component_of(name) != "backbone" or name.startswith("embed."):
            continue
        n = logical_numel(shape, dtype)
        if not name.startswith("layers."):
            other += n  # norm, head
            continue
        layer = int(name.split(".")[1])
        if ".ffn.experts." in name:
            routed, active = args.moe_shape(layer)
            n = n * active / routed
        per_layer[layer] += n
        if any(k in name for k in (".attn.compressor.", ".attn.indexer.wk.", ".attn.indexer.k_norm.",
                                   ".attn_norm.", ".hc_attn_")):
            kv_path[layer] += n
    decode = sum(per_layer.values()) + other
    if args.family == "v4.1":
        half = args.n_layers // 2
        prefill = sum(v for l, v in per_layer.items() if l < half) + kv_path[half]
    else:
        prefill = decode  # V4 has no CED: prefill runs every layer
    return {"prefill": int(round(prefill)), "decode": int(round(decode))}


def kv_ledger(args: ModelArgs, main_format: str = "fp4") -> dict[str, float]:
    """Bytes per token of the global KV (main + indexer keys), from the storage formats' sizes: the
    layouts of model/kv_layout.py (`kv_entry_bytes`; model/cache.py's codecs store exactly these).

    V4.1: main KV entries are E2M1 with one E4M3 scale per 16 (288 B for 512 dims; `main_format`
    "fp8" or "bf16" for the comparison formats), indexer keys MXFP4 (68 B for 128 dims), window KV
    FP8 with UE8M0 per 32 (528 B). Each kv source stores one entry per m tokens; nobody else stores
    any. V4: every compressing layer stores its own entries: 448 FP8 nope dims + 7 UE8M0 scales (one
    per 64) + 64 bf16 rope dims = 583 B, and its indexer keys (CSA layers) in MXFP4."""
    main = indexer = 0.0
    if args.family == "v4.1":
        table = kv_layout.kv_entry_bytes(args, main_format)
        entry, key = table["main"], table["index_keys"]
        for l in args.kv_source_layers:
            m = args.compress_ratios[l]
            main += entry / m
            indexer += key / m
        window_entry = table["window"]
    else:
        if main_format != "fp4":
            raise ValueError(f"V4's KV has one format (its official one), not main_format={main_format!r}")
        entry = kv_layout.v4_entry_bytes(args.rope_head_dim, args.head_dim)
        key = kv_layout.bytes_per_entry(kv_layout.INDEX_KEY_FORMAT, args.index_head_dim)
        for l in range(args.n_layers):
            m = args.compress_ratios[l]
            if m:
                main += entry / m
                if l in args.index_source_layers:
                    indexer += key / m
        window_entry = entry
    n_window_layers = args.n_layers  # every backbone layer keeps a window
    return {
        "global_bytes_per_token": main + indexer,
        "main_bytes_per_token": main,
        "indexer_bytes_per_token": indexer,
        "swa_bytes_per_layer_window": args.window_size * window_entry,
        "swa_bytes_per_token_all_layers": n_window_layers * window_entry,
        "main_entry_bytes": entry,
        "indexer_entry_bytes": key,
        "window_entry_bytes": window_entry,
        # persistent (SSD) prefix cache: global KV of every cached token; SWA KV, where it is kept at
        # all, is a snapshot of every layer's ring at a cached position (see persistent_ledger)
        "persistent_bytes_per_token_without_swa": main + indexer,
        "swa_snapshot_bytes": n_window_layers * args.window_size * window_entry,
    }


# The V4.1 report: global KV "about 1/4 of V4-Flash", persistent KV cache "1/8 of V4" (SWA KV leaves
# the persistent cache, which "almost halves its size", times the global KV's 1/4).
REPORT_GLOBAL_RATIO = 1 / 4
REPORT_PERSISTENT_RATIO = 1 / 8
TURN_TOKENS_EXAMPLES = (512, 2048, 8192, 32768)


def persistent_ledger(args: ModelArgs, turn_tokens: float, with_swa: bool) -> float:
    """Persistent prefix-cache bytes per cached token.

    without SWA (V4.1: SWA KV lives in a short-lived DRAM pool, a miss is rebuilt by bounded replay):
    the global KV only. With SWA (V4): plus two snapshots of every layer's window ring (at the end of
    the prompt and at the end of the output) per turn of `turn_tokens` tokens, so the SWA share depends
    on the workload's turn length."""
    kv = kv_ledger(args)
    swa = 2 * kv["swa_snapshot_bytes"] / turn_tokens if with_swa else 0.0
    return kv["global_bytes_per_token"] + swa


def kv_comparison(args: ModelArgs, baseline: ModelArgs) -> dict:
    """This model's KV ledger against a baseline's (V4.1-Flash against V4-Flash in the report).

    global: bytes per token of global KV, and their ratio (report: 1/4).
    persistent: this model's persistent cache without SWA against the baseline's with SWA. The baseline's
    SWA share depends on the turn length; the report says SWA KV was "nearly half" of V4's persistent
    cache, which holds at `turn_tokens_swa_half` (where the two SWA snapshots per turn equal the
    turn's global KV); the ratio there is set beside the report's 1/8, and at a few other turn lengths."""
    mine, base = kv_ledger(args), kv_ledger(baseline)
    half = 2 * base["swa_snapshot_bytes"] / base["global_bytes_per_token"]
    ratios = {str(t): persistent_ledger(args, t, False) / persistent_ledger(baseline, t, True)
              for t in TURN_TOKENS_EXAMPLES}
    return {
        "baseline": baseline.name,
        "global_bytes_per_token": {"this": mine["global_bytes_per_token"], "baseline": base["global_bytes_per_token"],
                                   "ratio": mine["global_bytes_per_token"] / base["global_bytes_per_token"],
                                   "report_ratio": REPORT_GLOBAL_RATIO},
        "persistent": {
            "swa_snapshot_bytes": {"this": mine["swa_snapshot_bytes"], "baseline": base["swa_snapshot_bytes"]},
            "turn_tokens_swa_half": half,
            "this_without_swa_bytes_per_token": persistent_ledger(args, half, False),
            "this_with_swa_bytes_per_token": persistent_ledger(args, half, True),
            "baseline_with_swa_bytes_per_token": persistent_ledger(baseline, half, True),
            "baseline_without_swa_bytes_per_token": persistent_ledger(baseline, half, False),
            "ratio": persistent_ledger(args, half, False) / persistent_ledger(baseline, half, True),
            "ratio_by_turn_tokens": ratios,
            "report_ratio": REPORT_PERSISTENT_RATIO,
        },
    }


def checkpoint_ledger(args: ModelArgs, inventory=None) -> dict:
    """Tensors and bytes of the official-layout checkpoint of `args`, in the release's storage dtypes
    (`dsv41.model.checkpoint.expected_tensors`: the ViT norm weights BF16): in total and per safetensors
    dtype, as a tally of the shard headers gives them. V4.1-Flash: 96,085 tensors, 510,286,023,000
    bytes (BF16 520, F32 387, F8_E4M3 357, F8_E8M0 47,589, I8 47,232)."""
    entries = [(name, shape, release_dtype(name, dtype)) for name, shape, dtype in inventory or plain_inventory(args)]
    return {"layout": "official", **inventory_totals(entries)}


def info(args: ModelArgs, path: str | None = None) -> dict:
    """The document `dsv41 info --json` prints (spec/cli.md). Imports no torch."""
    inventory = plain_inventory(args)
    doc = {
        "model": args.name,
        "path": path,
        "family": args.family,
        "params": parameter_counts(args, inventory),
        "activated": activated_counts(args, inventory),
        "layers": [s.as_json() for s in args.plan.all],
        "kv": kv_ledger(args),
        "checkpoint": checkpoint_ledger(args, inventory),
    }
    if args.family == "v4.1":  # the report's comparison: V4.1's KV ledger against V4-Flash's
        from dsv41.model.config import preset

        doc["kv_vs_v4_flash"] = kv_comparison(args, preset("v4-flash"))
    return doc
