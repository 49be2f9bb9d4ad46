"""The names of a checkpoint's tensors: the one table (`NAME_MAP`: legacy spellings and the split of each
tensor across model-parallel ranks), what each rank holds (`rank_part`, `rank_tensors`, `check_mp`), the
expected inventory of a model (`parameter_inventory`, `expected_tensors`, `inventory_totals`) and the
storage dtypes (the release's, the model's, the accepted ones)."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

import torch

from dsv41.model.checkpoint.safetensors import ST_DTYPES, CheckpointError, itemsize, st_name
from dsv41.model.config import ModelArgs
from dsv41.model import inventory
from dsv41.model.inventory import _RELEASE_DTYPES, inventory_totals, release_dtype  # noqa: F401


# ====================================================================================================
# Names: the one table (legacy spellings and model-parallel splits) and the expected inventory
# ====================================================================================================

REPLICATED, ROWS, COLS, ROWS_PADDED, EXPERTS = "replicated", "rows", "cols", "rows-padded", "experts"

# REF-style: a tensor's key is the name component before ".weight"/".scale"/".bias" (for bare
# parameters such as `attn_sink`, the last component); "parent.key" entries override "key".
# Splits follow REF's parallel modules (S0 model.py): ParallelEmbedding / ParallelHead and
# ColumnParallelLinear split dim 0 (ROWS), RowParallelLinear dim 1 (COLS), ParallelEngramEmbedding
# rows in ceil(rows / N) parts with the last zero-padded (ROWS_PADDED). Routed experts go whole to
# the rank owning their index range (EXPERTS, decided by the path, not the key); the vision tower,
# aligner and image_* embeddings, like every key not listed, are replicated. V4.1's shared experts
# are plain Linears in S0 (replicated), unlike V4's column/row-parallel MLP.
#   official key      legacy HF spellings             split across model-parallel ranks
NAME_MAP: dict[str, tuple[tuple[str, ...], str]] = {
    "embed":          (("embed_tokens",),              ROWS),         # vocabulary (also markov_head.embed)
    "head":           (("lm_head",),                   ROWS),         # vocabulary (also markov_head.head)
    "engram.embed":   ((),                             ROWS_PADDED),  # n-gram table rows
    "wq_a":           (("q_a_proj",),                  REPLICATED),
    "q_norm":         (("q_a_layernorm",),             REPLICATED),
    "wq_b":           (("q_b_proj",),                  ROWS),         # query heads (attn and indexer)
    "wkv":            (("kv_a_proj_with_mqa",),        REPLICATED),
    "kv_norm":        (("kv_a_layernorm",),            REPLICATED),
    "wo_a":           ((),                             ROWS),         # output groups
    "wo_b":           (("o_proj",),                    COLS),         # output groups
    "attn_sink":      ((),                             ROWS),         # heads
    "weights_proj":   ((),                             ROWS),         # index heads
    "attn_norm":      (("input_layernorm",),           REPLICATED),
    "ffn_norm":       (("post_attention_layernorm",),  REPLICATED),
    "w1":             (("gate_proj",),                 REPLICATED),
    "w2":             (("down_proj",),                 REPLICATED),
    "w3":             (("up_proj",),                   REPLICATED),
    # path components and suffixes that older HF exports spell differently
    "attn":           (("self_attn",),                 REPLICATED),
    "ffn":            (("mlp",),                       REPLICATED),
    "scale":          (("weight_scale_inv",),          REPLICATED),
    "bias":           (("e_score_correction_bias",),   REPLICATED),
}
_LEGACY = {old: new for new, (olds, _) in NAME_MAP.items() if "." not in new for old in olds}
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def split_of(name: str) -> str:
    """How tensor `name` (official spelling) is split across model-parallel ranks."""
    if _EXPERT.search(name):
        return EXPERTS
    parts = name.split(".")
    if parts[0] in ("vision", "aligner") or parts[0].startswith("image_"):
        return REPLICATED
    if len(parts) >= 2 and parts[-1] in ("weight", "scale", "bias"):
        key, parent = parts[-2], (parts[-3] if len(parts) >= 3 else "")
    else:
        key, parent = parts[-1], parts[-2] if len(parts) >= 2 else ""
    entry = NAME_MAP.get(f"{parent}.{key}") or NAME_MAP.get(key)
    return entry[1] if entry else REPLICATED


def official_name(stored: str, expected: Mapping[str, object]) -> str:
    """The official spelling of a stored name: itself when the model knows it, else the name with the
    legacy spellings of the table replaced (`model.` prefix, `self_attn`, `q_a_proj`, ...)."""
    if stored in expected:
        return stored
    parts = stored.removeprefix("model.").split(".")
    renamed = ".".join(_LEGACY.get(p, p) for p in parts)
    return renamed if renamed in expected else stored


def expected_tensors(args: ModelArgs) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor a checkpoint of `args` holds (in the storage
    dtypes args names: official = FP8 wo_a and FP4 experts; runtime = args with wo_a_dtype="bf16"), as
    the release stores them: the ViT norm weights BF16 (`release_dtype`), everything else in the
    model's dtype. For V4.1-Flash that is the release's 96,085 tensors and 510,286,023,000 bytes
    (`inventory_totals`)."""
    return dict(_inventory(json.dumps(args.to_dict(), sort_keys=True)))


@lru_cache(maxsize=16)
def _inventory(args_json: str) -> tuple:
    args = ModelArgs.from_dict(json.loads(args_json))
    return tuple((name, (tuple(shape), release_dtype(name, st_name(dtype))))
                 for name, shape, dtype in parameter_inventory(args))


# Tensors the release stores in another dtype than the model holds (`release_dtype`, its table and the
# shard-header tally `inventory_totals` live in the torch-free model/inventory.py, which `dsv41 info` reads).
# The ViT RMSNorm weights are fp32 Parameters in S0's vision.py (`torch.ones(dim, dtype=torch.float32)`),
# but the release's shard headers store its 65 norm vectors of 1024 (32 blocks x norm1/norm2 + the
# final norm) as BF16 (BF16 520, F32 387 tensors; 133,120 bytes below an all-F32 inventory). S0 loads
# that (load_state_dict copies with conversion), and so do we: the inventory (`expected_tensors`) and
# `save_official` use BF16 for exactly these tensors, F32 is accepted too (checkpoints written before,
# e.g. the bundled dsv41-tiny), `convert` keeps either as stored (so the round trip is byte for byte),
# and both are widened losslessly to F32 when loaded into the model. Every other tensor must have the
# model's dtype.


def model_dtype(name: str, dtype: str) -> str:
    """The dtype the model holds tensor `name` in, when a checkpoint (or the inventory) stores it as
    `dtype` in one of its `accepted_dtypes`."""
    for pattern, held, stored in _RELEASE_DTYPES:
        if dtype in (held, stored) and pattern.fullmatch(name):
            return held
    return dtype


def accepted_dtypes(name: str, dtype: str) -> tuple[str, ...]:
    """The safetensors dtypes a checkpoint may store tensor `name` in, when the inventory says `dtype`
    (the release's dtype first; for the ViT norm weights: BF16, then the model's F32)."""
    for pattern, held, stored in _RELEASE_DTYPES:
        if dtype in (held, stored) and pattern.fullmatch(name):
            return (stored, held)
    return (dtype,)


def to_model_dtypes(state: dict[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], str]]
                    ) -> dict[str, torch.Tensor]:
    """`state` with every tensor stored in an accepted other dtype (BF16 ViT norm weights) widened to
    the model's dtype, losslessly (BF16 -> F32 is exact); everything else untouched (still mapped)."""
    for name, t in state.items():
        if name in expected:
            want = ST_DTYPES[model_dtype(name, expected[name][1])]
            if t.dtype != want and st_name(t.dtype) in accepted_dtypes(name, expected[name][1]):
                state[name] = t.to(want)
    return state


def runtime_args(args: ModelArgs, expert_dtype: str) -> ModelArgs:
    """The ModelArgs of a runtime-layout checkpoint converted from an official one of `args`."""
    return args.replace(wo_a_dtype="bf16", expert_dtype=expert_dtype)


def _weight_name(scale_name: str) -> str:
    return scale_name[: -len("scale")] + "weight"


def _expert_owner(name: str, args: ModelArgs, mp: int) -> int:
    """Rank holding routed expert `name`: experts [r E/N, (r+1) E/N) live on rank r."""
    expert = int(_EXPERT.search(name).group(1))
    head, layer = name.split(".")[:2]
    routed, _ = args.moe_shape(int(layer) + (args.n_layers if head == "mtp" else 0))
    if routed % mp:
        raise CheckpointError(f"cannot split the {routed} routed experts of {head}.{layer} across {mp} ranks")
    return expert // (routed // mp)


@dataclass(frozen=True)
class Part:
    """The part of a full tensor that one rank holds: indices [start, stop) along `dim` (None: all of
    it), followed by `pad` zero rows (the last Engram-table parts)."""

    dim: int | None
    start: int = 0
    stop: int = 0
    pad: int = 0


def rank_part(name: str, shape: tuple[int, ...], tensors: Mapping[str, tuple[tuple[int, ...], str]],
              args: ModelArgs, mp: int, rank: int) -> Part | None:
    """Which part of tensor `name` (full shape `shape`) rank `rank` of `mp` holds; None: none of it.

    A block scale follows its weight: the rank gets the scale rows (columns) of the blocks its weight
    rows (columns) fall in. That needs each rank's weight part to be whole blocks, or to lie inside one
    block (then neighbouring ranks hold a copy of the same scale row)."""
    rule = split_of(name)
    if rule == EXPERTS:
        return Part(None) if _expert_owner(name, args, mp) == rank else None
    if rule == REPLICATED or mp == 1:
        return Part(None)
    dim = 1 if rule == COLS else 0
    is_scale = name.endswith(".scale") and _weight_name(name) in tensors
    if is_scale:
        weight_shape = tensors[_weight_name(name)][0]
        wpart = rank_part(_weight_name(name), weight_shape, tensors, args, mp, rank)
        if wpart.dim is None:
            return Part(None)
        block = 1 if shape[dim] == weight_shape[dim] else args.fp8_block_size
        size = wpart.stop - wpart.start
        if block > 1 and size % block and block % size:
            raise CheckpointError(f"cannot split {_weight_name(name)} {list(weight_shape)} across {mp} ranks: "
                                  f"parts of {size} do not align with its {block}-wide scale blocks")
        start = wpart.start // block
        stop = -(-wpart.stop // block) if wpart.stop > wpart.start else start
        pad = -(-(wpart.stop + wpart.pad) // block) - stop if wpart.pad else 0
        return Part(dim, start, stop, pad)
    if len(shape) <= dim:
        raise CheckpointError(f"cannot split {name} {list(shape)} along dim {dim}")
    size = shape[dim]
    if rule == ROWS_PADDED:
        part = -(-size // mp)
        start = min(rank * part, size)
        stop = min(start + part, size)
        return Part(dim, start, stop, part - (stop - start))
    if size % mp:
        raise CheckpointError(f"cannot split {name} {list(shape)} into {mp} equal parts along dim {dim}")
    part = size // mp
    return Part(dim, rank * part, (rank + 1) * part)


def check_mp(args: ModelArgs, mp: int) -> None:
    """REF's parallel modules need whole heads, output groups, index heads, vocabulary rows and
    experts on every rank."""
    counts = {"n_heads": args.n_heads, "o_groups": args.o_groups, "index_n_heads": args.index_n_heads,
              "vocab_size": args.vocab_size, "n_routed_experts": args.n_routed_experts}
    if args.dspark_enabled:
        counts["dspark_n_routed_experts"] = args.dspark_n_routed_experts
    for key, value in counts.items():
        if value % mp:
            raise CheckpointError(f"--mp {mp} does not divide {key} = {value}; choose an mp that divides "
                                  f"{', '.join(f'{k} {v}' for k, v in counts.items())}")


def part_shape(shape: tuple[int, ...], part: Part) -> tuple[int, ...]:
    if part.dim is None:
        return tuple(shape)
    out = list(shape)
    out[part.dim] = part.stop - part.start + part.pad
    return tuple(out)


def rank_tensors(full: Mapping[str, tuple[tuple[int, ...], str]], args: ModelArgs, mp: int,
                 rank: int) -> dict[str, tuple[tuple[int, ...], str, Part]]:
    """name -> (shape, dtype, part) of what rank `rank` holds of the full (runtime-dtype) tensors."""
    out = {}
    for name, (shape, dtype) in full.items():
        part = rank_part(name, shape, full, args, mp, rank)
        if part is not None:
            out[name] = (part_shape(shape, part), dtype, part)
    return out


def _file_order(names: Iterable[str], dtypes: Mapping[str, str]) -> list[str]:
    """Wider dtypes first (keeps every tensor aligned to its element size), then model order."""
    names = list(names)
    rank = {n: i for i, n in enumerate(names)}
    return sorted(names, key=lambda n: (-itemsize(dtypes[n]), rank[n]))


# ---------------------------------------------------------------------------------- the inventory of a model
class _SkipInitOnMeta(torch.overrides.TorchFunctionMode):
    """Leaves out `torch.nn.init` fills of meta tensors, which hold no values. On the meta device
    `nn.Embedding`'s `normal_` runs a Python reference kernel whose decorator imports torch._dynamo (about a
    second of start-up for `dsv41 info` and every model load); skipping the fill changes no value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device():
    """`with meta_device(): model = Transformer(args)`: the model on the meta device (shapes and dtypes,
    no storage), built without running weight initializers."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield


def parameter_inventory(args: ModelArgs, fast: bool = True) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor in the official checkpoint layout, built on the meta device.

    Building 15,000 expert modules takes seconds, so by default the model is built with one routed
    expert per layer and the expert entries are replicated by name (tests check that this equals
    the full construction)."""
    if args.family == "v4":
        return _v4_inventory(args)
    from dsv41.model.transformer import Transformer

    small = args.replace(n_routed_experts=1, n_activated_experts=1, dspark_n_routed_experts=1,
                         dspark_n_activated_experts=1) if fast else args
    with meta_device():
        model = Transformer(small)
    out = []
    for name, p in model.state_dict().items():
        shape = tuple(p.shape)
        if fast and ".ffn." in name:
            layer = _layer_id(name, args)
            routed, _ = args.moe_shape(layer)
            if ".experts.0." in name:
                out.extend((name.replace(".experts.0.", f".experts.{e}."), shape, p.dtype) for e in range(routed))
                continue
            if ".ffn.gate." in name:
                shape = (routed,) + shape[1:]
        out.append((name, shape, p.dtype))
    return out


def _layer_id(name: str, args: ModelArgs) -> int:
    head, idx = name.split(".")[:2]
    return int(idx) + (args.n_layers if head == "mtp" else 0)


def _v4_inventory(args: ModelArgs) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Tensor shapes of a V4 (Flash/Pro) checkpoint (ledgers only: the V4 forward pass is not implemented):
    model/inventory.py's torch-free list, in torch dtypes."""
    return [(name, shape, ST_DTYPES[dtype]) for name, shape, dtype in inventory._v4_inventory(args)]


