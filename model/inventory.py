"""The tensor inventory of a model, from its config alone, as plain data (no torch): (name, shape,
safetensors dtype) of every tensor of the official checkpoint layout, in the order the meta-device model's
`state_dict()` lists them, and the byte counts that follow from it. What `dsv41 info` needs, without
importing torch (which alone takes longer than the whole command may).

- `parameter_inventory(args)`: V4.1 from the modules' shapes (transformer.py, block.py, attention.py,
  indexer.py, moe.py, engram.py, dspark.py, vision.py; layers.py's `Linear` in each storage dtype); V4 from
  spec §3 and §6 (ledgers only). It is `dsv41.model.checkpoint.names.parameter_inventory` (a model built
  on the meta device) with safetensors dtype names in place of torch dtypes: tests/test_info_startup.py
  checks names, shapes, dtypes and order for the bundled, tiny, V4.1-Flash and V4 configs.
- `ITEMSIZE`: bytes per element of each safetensors dtype (tests check it against torch's sizes).
- `release_dtype`, `inventory_totals`: the release's storage dtypes and the tally of a shard header, as
  `dsv41.model.checkpoint.names` computes them (tests check the two agree).
"""

from __future__ import annotations

import math
import re
from typing import Iterable

from dsv41.model.config import LayerSpec, ModelArgs

BF16, F32, I8, I64, F8_E4M3, F8_E8M0 = "BF16", "F32", "I8", "I64", "F8_E4M3", "F8_E8M0"
FP4 = "fp4"  # packed E2M1 weights: I8 bytes holding two values each, one F8_E8M0 scale per 32 inputs

# bytes per element of every safetensors dtype (`dsv41.model.checkpoint.safetensors.ST_DTYPES`)
ITEMSIZE: dict[str, int] = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4,
                            "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}

Entry = tuple[str, tuple[int, ...], str]  # (name, shape, safetensors dtype)


def storage_dtype(kind: str | None) -> str:
    """A config string ("fp8", "fp4", "bf16", "fp32", None) -> what `Linear` stores (layers.storage_dtype)."""
    if kind == FP4:
        return kind
    return {"fp8": F8_E4M3, "bf16": BF16, None: BF16, "fp32": F32}[kind]


def parameter_inventory(args: ModelArgs) -> list[Entry]:
    """(name, shape, safetensors dtype) of every tensor in the official checkpoint layout of `args`."""
    if args.family == "v4":
        return _v4_inventory(args)
    if args.family != "v4.1":
        raise ValueError("the forward pass implements DeepSeek-V4.1; V4 configs are supported by the "
                         "ledgers (dsv41 info) only")
    return _V41(args).entries()


class _V41:
    """The V4.1 model's parameters, module by module in registration order (a module's own parameters
    first, then its submodules, as `state_dict()` walks them). Routed experts are listed as the
    meta-device inventory lists them: each tensor of expert 0 followed by the same tensor of the others."""

    def __init__(self, args: ModelArgs):
        self.args = args
        self.out: list[Entry] = []

    def add(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self.out.append((name, tuple(int(s) for s in shape), dtype))

    def linear(self, p: str, in_features: int, out_features: int, dtype: str = BF16, trainable: bool = False):
        """layers.Linear: FP8 (block scales), packed FP4 (one scale per 32 inputs), or dense; a trainable
        FP8/FP4 layer holds a dense fp32 master and no scale."""
        block = self.args.fp8_block_size
        kind = "fp4" if dtype == FP4 else ("fp8" if dtype == F8_E4M3 else "dense")
        if trainable and kind != "dense":
            self.add(f"{p}.weight", (out_features, in_features), F32)
        elif kind == "fp4":
            self.add(f"{p}.weight", (out_features, in_features // 2), I8)
            self.add(f"{p}.scale", (out_features, in_features // 32), F8_E8M0)
        elif kind == "fp8":
            self.add(f"{p}.weight", (out_features, in_features), F8_E4M3)
            self.add(f"{p}.scale", (math.ceil(out_features / block), math.ceil(in_features / block)), F8_E8M0)
        else:
            self.add(f"{p}.weight", (out_features, in_features), dtype)

    def norm(self, p: str, dim: int, dtype: str = BF16):
        self.add(f"{p}.weight", (dim,), dtype)

    def nn_linear(self, p: str, in_features: int, out_features: int, bias: bool = True):
        """torch.nn.Linear in bf16 (the vision tower and aligner)."""
        self.add(f"{p}.weight", (out_features, in_features), BF16)
        if bias:
            self.add(f"{p}.bias", (out_features,), BF16)

    # ------------------------------------------------------------------ the model (transformer.Transformer)
    def entries(self) -> list[Entry]:
        a = self.args
        if a.vision_enabled:
            for n in ("image_start", "image_end", "image_newline"):
                self.add(n, (a.dim,), BF16)
        self.add("embed.weight", (a.vocab_size, a.dim), BF16)
        for spec in a.plan.layers:
            self.block(f"layers.{spec.id}", spec)
        self.norm("norm", a.dim)
        self.add("head.weight", (a.vocab_size, a.dim), BF16)
        if a.dspark_enabled:
            for k, spec in enumerate(a.plan.extra):
                self.dspark_stage(f"mtp.{k}", spec, k)
        if a.vision_enabled:
            self.vision()
        return self.out

    # ------------------------------------------------------------------ block.Block
    def block(self, p: str, spec: LayerSpec):
        a = self.args
        n_mix, width = (2 + a.hc_mult) * a.hc_mult, a.hc_mult * a.dim
        for sub in ("attn", "ffn"):
            self.add(f"{p}.hc_{sub}_fn", (n_mix, width), F32)
            self.add(f"{p}.hc_{sub}_base", (n_mix,), F32)
            self.add(f"{p}.hc_{sub}_scale", (3,), F32)
        self.attention(f"{p}.attn", spec)
        self.moe(f"{p}.ffn", spec)
        self.norm(f"{p}.attn_norm", a.dim)
        self.norm(f"{p}.ffn_norm", a.dim)
        if spec.engram is not None:
            self.engram(f"{p}.engram", spec.id)

    # ------------------------------------------------------------------ attention.Attention, Compressor, Indexer
    def attention(self, p: str, spec: LayerSpec):
        a = self.args
        dense, tr = storage_dtype(a.dtype), a.trainable
        self.add(f"{p}.attn_sink", (a.n_heads,), F32)
        self.linear(f"{p}.wq_a", a.dim, a.q_lora_rank, dense, tr)
        self.norm(f"{p}.q_norm", a.q_lora_rank)
        self.linear(f"{p}.wq_b", a.q_lora_rank, a.n_heads * a.head_dim, dense, tr)
        self.linear(f"{p}.wkv", a.dim, a.head_dim, dense, tr)
        self.norm(f"{p}.kv_norm", a.head_dim)
        self.linear(f"{p}.wo_a", a.n_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank,
                    storage_dtype(a.wo_a_dtype or a.dtype), tr)
        self.linear(f"{p}.wo_b", a.o_groups * a.o_lora_rank, a.dim, dense, tr)
        if spec.owns_kv:
            self.linear(f"{p}.compressor.wkv", a.dim, a.head_dim)
            if spec.compress_ratio > 1:
                self.linear(f"{p}.compressor.wgate", a.dim, a.head_dim)
            self.norm(f"{p}.compressor.norm", a.head_dim)
        if spec.owns_kv or spec.owns_index:
            if spec.owns_index:
                self.linear(f"{p}.indexer.wq_b", a.q_lora_rank, a.index_n_heads * a.index_head_dim,
                            storage_dtype(a.dtype), tr)
                self.linear(f"{p}.indexer.weights_proj", a.dim, a.index_n_heads)
            if spec.owns_kv:
                self.linear(f"{p}.indexer.wk", a.head_dim, a.index_head_dim)
                self.norm(f"{p}.indexer.k_norm", a.index_head_dim)

    # ------------------------------------------------------------------ moe.MoE, Gate, Expert
    def moe(self, p: str, spec: LayerSpec):
        a = self.args
        routed = spec.n_routed_experts
        expert_dtype = FP4 if a.expert_dtype == "fp4" else storage_dtype(a.expert_dtype or a.dtype)
        self.add(f"{p}.gate.weight", (routed, a.dim), BF16)
        self.add(f"{p}.gate.bias", (routed,), F32)
        if a.vision_enabled:
            self.add(f"{p}.gate.bias_vl", (routed,), F32)
        start = len(self.out)
        self.expert(f"{p}.experts.0", expert_dtype)
        one = self.out[start:]
        del self.out[start:]
        for name, shape, dtype in one:  # as names.parameter_inventory replicates expert 0 by name
            self.out.extend((name.replace(".experts.0.", f".experts.{e}."), shape, dtype) for e in range(routed))
        if a.n_shared_experts != 1:
            raise ValueError("exactly one shared expert is supported (as in every V4/V4.1 config)")
        self.expert(f"{p}.shared_experts", storage_dtype(a.dtype))

    def expert(self, p: str, dtype: str):
        a = self.args
        self.linear(f"{p}.w1", a.dim, a.moe_inter_dim, dtype, a.trainable)
        self.linear(f"{p}.w2", a.moe_inter_dim, a.dim, dtype, a.trainable)
        self.linear(f"{p}.w3", a.dim, a.moe_inter_dim, dtype, a.trainable)

    # ------------------------------------------------------------------ engram.Engram, EngramEmbedding
    def engram(self, p: str, layer_id: int):
        a = self.args
        block, tr = a.fp8_block_size, a.trainable
        self.add(f"{p}.q_weight", (a.hc_mult, a.dim), BF16)
        self.add(f"{p}.k_weight", (a.hc_mult, a.dim), BF16)
        rows = a.engram_num_embeddings[tuple(a.engram_layer_ids).index(layer_id)]
        if a.engram_head_dim % block:
            raise ValueError(f"engram_head_dim {a.engram_head_dim} is not a multiple of the scale block {block}")
        if tr:
            self.add(f"{p}.embed.weight", (rows, a.engram_head_dim), F32)
        else:
            self.add(f"{p}.embed.weight", (rows, a.engram_head_dim), F8_E4M3)
            self.add(f"{p}.embed.scale", (rows, a.engram_head_dim // block), F8_E8M0)
        n_cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
        self.linear(f"{p}.wkv", n_cols * a.engram_head_dim, a.dim * (a.hc_mult + 1), F8_E4M3, tr)

    # ------------------------------------------------------------------ dspark.DSparkStage
    def dspark_stage(self, p: str, spec: LayerSpec, stage: int):
        a = self.args
        self.block(p, spec)
        if stage == 0:
            self.linear(f"{p}.main_proj", a.dim * len(a.dspark_target_layer_ids), a.dim, storage_dtype(a.dtype),
                        a.trainable)
            self.norm(f"{p}.main_norm", a.dim)
        if stage == a.n_mtp_layers - 1:
            self.norm(f"{p}.norm", a.dim)
            self.add(f"{p}.markov_head.embed.weight", (a.vocab_size, a.dspark_markov_rank), BF16)
            self.linear(f"{p}.markov_head.head", a.dspark_markov_rank, a.vocab_size)
            self.linear(f"{p}.confidence_head.proj", a.dim + a.dspark_markov_rank, 1)

    # ------------------------------------------------------------------ vision.VisionTransformer, Aligner
    def vision(self):
        a = self.args
        v = a.vision_dim
        self.nn_linear("vision.patch_embed.proj", 3 * a.vision_patch_size ** 2, v)
        for i in range(a.vision_n_layers):
            p = f"vision.blocks.{i}"
            self.norm(f"{p}.norm1", v, F32)
            self.nn_linear(f"{p}.attn.wqkv", v, 3 * v)
            self.nn_linear(f"{p}.attn.wo", v, v)
            self.norm(f"{p}.norm2", v, F32)
            self.nn_linear(f"{p}.mlp.w1", v, 2 * a.vision_inter_dim, bias=False)
            self.nn_linear(f"{p}.mlp.w2", a.vision_inter_dim, v, bias=False)
        self.norm("vision.norm", v, F32)
        self.nn_linear("aligner.w1", v * a.vision_downsample_ratio ** 2, a.dim)
        self.nn_linear("aligner.w2", a.dim, a.dim)


def _v4_inventory(args: ModelArgs) -> list[Entry]:
    """Tensor shapes of a V4 (Flash/Pro) checkpoint, from spec §3 and §6 (ledgers only: the V4 forward
    pass is not implemented). Names follow the official checkpoint."""
    d, b = args.dim, args.fp8_block_size
    f8, e8, bf, f32, i8 = F8_E4M3, F8_E8M0, BF16, F32, I8
    out: list = []

    def linear(name, o, i, dtype=f8):
        out.append((f"{name}.weight", (o, i), dtype))
        if dtype == f8:
            out.append((f"{name}.scale", (math.ceil(o / b), math.ceil(i / b)), e8))

    def block(p, layer, ratio, mtp=False):
        n_mix = (2 + args.hc_mult) * args.hc_mult
        for sub in ("attn", "ffn"):
            out.extend([(f"{p}.hc_{sub}_fn", (n_mix, args.hc_mult * d), f32), (f"{p}.hc_{sub}_base", (n_mix,), f32),
                        (f"{p}.hc_{sub}_scale", (3,), f32)])
        out.extend([(f"{p}.attn_norm.weight", (d,), bf), (f"{p}.ffn_norm.weight", (d,), bf),
                    (f"{p}.attn.attn_sink", (args.n_heads,), f32), (f"{p}.attn.q_norm.weight", (args.q_lora_rank,), bf),
                    (f"{p}.attn.kv_norm.weight", (args.head_dim,), bf)])
        linear(f"{p}.attn.wq_a", args.q_lora_rank, d)
        linear(f"{p}.attn.wq_b", args.n_heads * args.head_dim, args.q_lora_rank)
        linear(f"{p}.attn.wkv", args.head_dim, d)
        linear(f"{p}.attn.wo_a", args.o_groups * args.o_lora_rank, args.n_heads * args.head_dim // args.o_groups)
        linear(f"{p}.attn.wo_b", d, args.o_groups * args.o_lora_rank)
        if ratio:
            overlap = 2 if ratio == 4 else 1
            width = overlap * args.head_dim
            out.extend([(f"{p}.attn.compressor.wkv.weight", (width, d), bf),
                        (f"{p}.attn.compressor.wgate.weight", (width, d), bf),
                        (f"{p}.attn.compressor.ape", (ratio, width), f32),
                        (f"{p}.attn.compressor.norm.weight", (args.head_dim,), bf)])
            if ratio == 4:
                iw = 2 * args.index_head_dim
                linear(f"{p}.attn.indexer.wq_b", args.index_n_heads * args.index_head_dim, args.q_lora_rank)
                out.extend([(f"{p}.attn.indexer.weights_proj.weight", (args.index_n_heads, d), bf),
                            (f"{p}.attn.indexer.compressor.wkv.weight", (iw, d), bf),
                            (f"{p}.attn.indexer.compressor.wgate.weight", (iw, d), bf),
                            (f"{p}.attn.indexer.compressor.ape", (ratio, iw), f32),
                            (f"{p}.attn.indexer.compressor.norm.weight", (args.index_head_dim,), bf)])
        out.append((f"{p}.ffn.gate.weight", (args.n_routed_experts, d), bf))
        if layer < args.n_hash_layers and not mtp:
            out.append((f"{p}.ffn.gate.tid2eid", (args.vocab_size, args.n_activated_experts), I64))
        else:
            out.append((f"{p}.ffn.gate.bias", (args.n_routed_experts,), f32))
        inter = args.moe_inter_dim
        for e in range(args.n_routed_experts):
            for w, (o, i) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
                out.append((f"{p}.ffn.experts.{e}.{w}.weight", (o, i // 2), i8))
                out.append((f"{p}.ffn.experts.{e}.{w}.scale", (o, i // 32), e8))
        for w, (o, i) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            linear(f"{p}.ffn.shared_experts.{w}", o, i)

    out.extend([("embed.weight", (args.vocab_size, d), bf), ("head.weight", (args.vocab_size, d), bf),
                ("norm.weight", (d,), bf), ("hc_head_fn", (args.hc_mult, args.hc_mult * d), f32),
                ("hc_head_base", (args.hc_mult,), f32), ("hc_head_scale", (1,), f32)])
    for l in range(args.n_layers):
        block(f"layers.{l}", l, args.compress_ratios[l])
    for k in range(args.n_mtp_layers):
        p = f"mtp.{k}"
        block(p, args.n_layers + k, 0, mtp=True)
        linear(f"{p}.e_proj", d, d)
        linear(f"{p}.h_proj", d, d)
        out.extend([(f"{p}.enorm.weight", (d,), bf), (f"{p}.hnorm.weight", (d,), bf), (f"{p}.norm.weight", (d,), bf),
                    (f"{p}.hc_head_fn", (args.hc_mult, args.hc_mult * d), f32),
                    (f"{p}.hc_head_base", (args.hc_mult,), f32), (f"{p}.hc_head_scale", (1,), f32)])
    return out


# ---------------------------------------------------------------------------------- storage dtypes and totals
# names.py's `_RELEASE_DTYPES`: the release stores the ViT RMSNorm weights (fp32 in the model) as BF16
_RELEASE_DTYPES: tuple[tuple[re.Pattern, str, str], ...] = (
    (re.compile(r"vision\.(?:blocks\.\d+\.norm[12]|norm)\.weight"), "F32", "BF16"),
)


def release_dtype(name: str, dtype: str) -> str:
    """The safetensors dtype the release stores tensor `name` in, when the model holds it as `dtype`."""
    for pattern, model_dtype, stored in _RELEASE_DTYPES:
        if dtype == model_dtype and pattern.fullmatch(name):
            return stored
    return dtype


def inventory_totals(tensors: Iterable[Entry]) -> dict:
    """Tensor and byte counts of (name, shape, safetensors dtype) entries, in total and per dtype (the
    numbers a shard-header tally of a checkpoint gives)."""
    by_dtype: dict[str, dict[str, int]] = {}
    for _, shape, dtype in tensors:
        row = by_dtype.setdefault(dtype, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += math.prod(shape) * ITEMSIZE[dtype]
    return {"tensors": sum(r["tensors"] for r in by_dtype.values()),
            "bytes": sum(r["bytes"] for r in by_dtype.values()),
            "by_dtype": dict(sorted(by_dtype.items()))}
