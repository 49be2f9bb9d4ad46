"""Model configuration and the layer plan.

`ModelArgs` uses the field names of the official inference config (`inference/config.json`, the flat
names of REF's `ModelArgs`), so a flat config loads as is. The released Hugging Face `config.json`
(root keys plus V4.1's `text_config` / `vision_config`) is translated by `ModelArgs.from_hf_config`.

`LayerPlan` is the single place where each layer's role is decided: its part (encoder, decoder,
dspark/mtp), compression ratio, CSA2 mode (swa / full / reindex / reuse), where its compressed KV and
its Top-K come from, whether it builds the candidate pool, carries an Engram module, or feeds DSpark.
Modules receive their `LayerSpec` and never re-derive any of it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Family = Literal["v4.1", "v4"]
Mode = Literal["swa", "full", "reindex", "reuse"]


@dataclass
class ModelArgs:
    """Field names follow REF's flat inference config. Defaults are V4.1-Flash."""

    family: Family = "v4.1"
    # runtime limits (size the caches), not model shape
    max_batch_size: int = 1
    max_seq_len: int = 4096
    # storage dtypes of the checkpoint: "fp8" = FP8 E4M3 linears with UE8M0 block scales
    dtype: Literal["bf16", "fp8"] = "fp8"
    expert_dtype: Literal["fp4", "fp8", "bf16"] | None = "fp4"
    # attn.wo_a: None = as `dtype` (FP8 in the official checkpoint); the runtime layout stores it bf16,
    # dequantized by the converter as REF's convert does (model/checkpoint/plan.py)
    wo_a_dtype: Literal["bf16", "fp8"] | None = None
    fp8_block_size: int = 32  # V4.1: 32x32 weight blocks and 32-wide activation groups; V4: 128
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    n_hash_layers: int = 0  # V4 only: the first layers route by a token-id table
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    # rope / YaRN
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    max_position_embeddings: int = 1048576
    # indexer and the hierarchical candidate pool
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # "bf16": index scores rounded as REF computes them (q.k, weights and sums in bf16), so Top-K picks
    # and breaks ties as the official model does; "fp32": exact scores (training always uses fp32)
    index_score_dtype: Literal["bf16", "fp32"] = "bf16"
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # vision
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: float | None = None
    image_token_id: int = 129264
    # DSpark drafter (V4.1); V4 uses n_mtp_layers MTP blocks instead
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    name: str = "custom"
    # training: FP8/FP4 weights (and the Engram tables) become dense fp32 masters with QAT onto their
    # storage grids; the state dict then has the official names minus the quantization scales
    trainable: bool = False

    def __post_init__(self):
        for key in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                    "engram_num_embeddings", "dspark_target_layer_ids"):
            setattr(self, key, tuple(int(v) for v in getattr(self, key)))
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Reject configs the code cannot run, with one clear sentence each."""
        n_total = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_total:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries; expected "
                             f"n_layers + n_mtp_layers = {n_total}")
        if self.head_dim % self.o_groups and self.n_heads % self.o_groups:
            raise ValueError("n_heads must be divisible by o_groups")
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by o_groups ({self.o_groups})")
        if self.rope_head_dim > self.head_dim or self.rope_head_dim % 2:
            raise ValueError("rope_head_dim must be even and at most head_dim")
        if self.family == "v4.1":
            for l in self.kv_source_layers + self.index_source_layers:
                if not (0 <= l < self.n_layers) or self.compress_ratios[l] == 0:
                    raise ValueError(f"source layer {l} must be a backbone layer with compress_ratio > 0")
            for l in range(self.n_layers):
                if self.compress_ratios[l] and not any(s <= l for s in self.kv_source_layers):
                    raise ValueError(f"layer {l} compresses but no kv source precedes it")
                if self.compress_ratios[l] and not any(s <= l for s in self.index_source_layers):
                    raise ValueError(f"layer {l} compresses but no index source precedes it")
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise ValueError("engram_num_embeddings needs one entry per engram layer")
            if self.n_mtp_layers and self.dspark_block_size:
                for l in self.dspark_target_layer_ids:
                    if not 0 <= l < self.n_layers:
                        raise ValueError(f"dspark target layer {l} is not a backbone layer")

    # ------------------------------------------------------------------ derived
    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def dspark_enabled(self) -> bool:
        return self.family == "v4.1" and self.n_mtp_layers > 0 and self.dspark_block_size > 0

    def moe_shape(self, layer_id: int) -> tuple[int, int]:
        """(routed experts, activated experts) of a layer: DSpark stages have their own."""
        if layer_id < self.n_layers or self.family != "v4.1":
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def plan(self) -> "LayerPlan":
        plan = getattr(self, "_plan", None)
        if plan is None:
            plan = LayerPlan.from_args(self)
            object.__setattr__(self, "_plan", plan)
        return plan

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """Flat config (ours or REF's inference/config.json). Unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "family" not in d:
            kw["family"] = "v4.1" if "kv_source_layers" in d else "v4"
        if kw["family"] == "v4":
            kw.setdefault("fp8_block_size", 128)
            _v4_defaults(kw)
        return cls(**kw)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """The released Hugging Face config.json (V4.1: root + text_config + vision_config; V4: flat)."""
        text = dict(cfg.get("text_config") or cfg)
        vision = cfg.get("vision_config") or {}
        quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
        is_v41 = "kv_source_layer_ids" in text or cfg.get("model_type") == "deepseek_v41"
        rope = text.get("rope_scaling") or {}
        get = text.get
        kw: dict = dict(
            family="v4.1" if is_v41 else "v4",
            vocab_size=get("vocab_size"), dim=get("hidden_size"), moe_inter_dim=get("moe_intermediate_size"),
            n_layers=get("num_hidden_layers"), n_heads=get("num_attention_heads"),
            n_mtp_layers=get("num_nextn_predict_layers", 0), n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts", 1), n_activated_experts=get("num_experts_per_tok"),
            n_hash_layers=get("num_hash_layers", 0), score_func=get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=get("norm_topk_prob", True), route_scale=get("routed_scaling_factor", 1.0),
            swiglu_limit=get("swiglu_limit", 0.0), q_lora_rank=get("q_lora_rank"), head_dim=get("head_dim"),
            rope_head_dim=get("qk_rope_head_dim"), norm_eps=get("rms_norm_eps"), o_groups=get("o_groups"),
            o_lora_rank=get("o_lora_rank"), window_size=get("sliding_window"),
            compress_ratios=get("compress_ratios"), compress_rope_theta=get("compress_rope_theta"),
            rope_theta=get("rope_theta"), original_seq_len=rope.get("original_max_position_embeddings", 0),
            rope_factor=rope.get("factor", 1.0), beta_fast=rope.get("beta_fast", 32),
            beta_slow=rope.get("beta_slow", 1), max_position_embeddings=get("max_position_embeddings"),
            index_n_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"), index_topk=get("index_topk"),
            hc_mult=get("hc_mult"), hc_sinkhorn_iters=get("hc_sinkhorn_iters"), hc_eps=get("hc_eps"),
            bos_token_id=get("bos_token_id", cfg.get("bos_token_id", 0)),
            eos_token_id=get("eos_token_id", cfg.get("eos_token_id", 1)),
            pad_token_id=get("pad_token_id", cfg.get("pad_token_id", 2)),
            gate_temp=get("gate_temp", 1.0),
        )
        block = quant.get("weight_block_size")
        if block:
            kw["fp8_block_size"] = int(block[0])
        if quant:
            kw["dtype"] = "fp8"
            kw["expert_dtype"] = quant.get("expert_dtype", cfg.get("expert_dtype", get("expert_dtype", "fp4")))
        else:
            kw["dtype"] = "bf16"
            kw["expert_dtype"] = get("expert_dtype", cfg.get("expert_dtype"))
        if is_v41:
            kw.update(
                kv_source_layers=get("kv_source_layer_ids"), index_source_layers=get("index_source_layer_ids"),
                candidate_source_layer=get("candidate_source_layer_id", -1),
                candidate_topk_blocks=get("candidate_topk_blocks", 0),
                candidate_block_size=get("candidate_block_size", 0),
                engram_layer_ids=get("engram_layer_ids", ()), engram_num_embeddings=get("engram_num_embeddings", ()),
                engram_max_ngram_size=get("engram_max_ngram_size", 1), engram_vocab_size=get("engram_vocab_size", 0),
                engram_n_heads=get("engram_n_heads", 0), engram_head_dim=get("engram_head_dim", 0),
                engram_pad_id=get("engram_pad_token_id", 2),
                engram_compressed_vocab_size=get("engram_compressed_vocab_size", 0),
                dspark_block_size=get("dspark_block_size", 0), dspark_noise_token_id=get("dspark_noise_token_id", 0),
                dspark_target_layer_ids=get("dspark_target_layer_ids", ()),
                dspark_markov_rank=get("dspark_markov_rank", 256),
                dspark_n_routed_experts=get("dspark_n_routed_experts", 0),
                dspark_n_activated_experts=get("dspark_num_experts_per_tok", 0),
                image_token_id=cfg.get("image_token_id", get("image_token_id", 129264)),
                vision_n_layers=vision.get("num_hidden_layers", 0), vision_dim=vision.get("hidden_size", 1024),
                vision_n_heads=vision.get("num_attention_heads", 16),
                vision_inter_dim=vision.get("intermediate_size", 2816), vision_patch_size=vision.get("patch_size", 14),
                vision_rope_theta=vision.get("rope_theta", 10000.0),
                vision_downsample_ratio=vision.get("downsample_ratio", 3),
                vision_max_n_token=vision.get("max_image_tokens", 1024),
                vision_min_pixels=vision.get("min_pixels", 295936), vision_max_wh_ratio=vision.get("max_wh_ratio"),
            )
        else:
            _v4_defaults(kw)
        missing = [k for k, v in kw.items() if v is None and k not in ("vision_max_wh_ratio", "expert_dtype")]
        if missing:
            raise ValueError(f"config.json lacks required keys for: {', '.join(sorted(missing))}")
        kw["name"] = cfg.get("_name_or_path") or cfg.get("model_type") or "checkpoint"
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """The released V4.1 config.json layout (root + text_config + vision_config)."""
        if self.family != "v4.1":
            raise ValueError("writing a V4 config.json is not supported")
        text = {
            "model_type": "deepseek_v41_text", "vocab_size": self.vocab_size, "hidden_size": self.dim,
            "moe_intermediate_size": self.moe_inter_dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": 1,
            "num_nextn_predict_layers": self.n_mtp_layers, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.n_activated_experts,
            "scoring_func": self.score_func, "topk_method": "noaux_tc", "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.route_scale, "swiglu_limit": self.swiglu_limit, "hidden_act": "silu",
            "q_lora_rank": self.q_lora_rank, "head_dim": self.head_dim, "qk_rope_head_dim": self.rope_head_dim,
            "rms_norm_eps": self.norm_eps, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size, "compress_ratios": list(self.compress_ratios),
            "compress_rope_theta": self.compress_rope_theta, "rope_theta": self.rope_theta,
            "rope_scaling": {"type": "yarn", "factor": self.rope_factor,
                             "original_max_position_embeddings": self.original_seq_len,
                             "beta_fast": self.beta_fast, "beta_slow": self.beta_slow},
            "max_position_embeddings": self.max_position_embeddings, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "kv_source_layer_ids": list(self.kv_source_layers),
            "index_source_layer_ids": list(self.index_source_layers),
            "candidate_source_layer_id": self.candidate_source_layer,
            "candidate_topk_blocks": self.candidate_topk_blocks, "candidate_block_size": self.candidate_block_size,
            "engram_layer_ids": list(self.engram_layer_ids),
            "engram_num_embeddings": list(self.engram_num_embeddings),
            "engram_max_ngram_size": self.engram_max_ngram_size, "engram_vocab_size": self.engram_vocab_size,
            "engram_n_heads": self.engram_n_heads, "engram_head_dim": self.engram_head_dim,
            "engram_pad_token_id": self.engram_pad_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            "dspark_block_size": self.dspark_block_size, "dspark_noise_token_id": self.dspark_noise_token_id,
            "dspark_target_layer_ids": list(self.dspark_target_layer_ids),
            "dspark_markov_rank": self.dspark_markov_rank, "dspark_n_routed_experts": self.dspark_n_routed_experts,
            "dspark_num_experts_per_tok": self.dspark_n_activated_experts, "gate_temp": self.gate_temp,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
        }
        vision = {
            "model_type": "deepseek_v41_vision", "num_hidden_layers": self.vision_n_layers,
            "hidden_size": self.vision_dim, "num_attention_heads": self.vision_n_heads,
            "intermediate_size": self.vision_inter_dim, "patch_size": self.vision_patch_size,
            "rope_theta": self.vision_rope_theta, "downsample_ratio": self.vision_downsample_ratio,
            "max_image_tokens": self.vision_max_n_token, "min_pixels": self.vision_min_pixels,
            "max_wh_ratio": self.vision_max_wh_ratio,
        }
        root = {
            "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": text, "vision_config": vision, "image_token_id": self.image_token_id,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "dtype": "bfloat16",
        }
        if self.dtype == "fp8":
            root["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                "weight_block_size": [self.fp8_block_size, self.fp8_block_size],
                "expert_dtype": self.expert_dtype,
            }
        return root


def _v4_defaults(kw: dict) -> None:
    """V4 has no CSA2 sharing, Engram, DSpark or vision: every compressing layer owns its KV."""
    ratios = kw.get("compress_ratios") or ()
    n_layers = kw.get("n_layers") or 0
    own = tuple(l for l in range(n_layers) if l < len(ratios) and ratios[l])
    kw.update(kv_source_layers=own,
              index_source_layers=tuple(l for l in own if ratios[l] == 4),
              candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=0,
              engram_layer_ids=(), engram_num_embeddings=(), engram_max_ngram_size=1, engram_vocab_size=0,
              engram_n_heads=0, engram_head_dim=0, engram_compressed_vocab_size=0,
              dspark_block_size=0, dspark_target_layer_ids=(), dspark_n_routed_experts=0,
              dspark_n_activated_experts=0, vision_n_layers=0)
    kw.setdefault("dspark_noise_token_id", 0)


# ---------------------------------------------------------------------------------- the layer plan
@dataclass(frozen=True)
class LayerSpec:
    """Everything that distinguishes one layer from another, decided once from the config."""

    id: int
    part: Literal["encoder", "decoder", "dspark", "mtp"]
    compress_ratio: int
    mode: Mode
    kv_source: int | None  # layer whose compressed KV (and indexer keys) this layer reads
    index_source: int | None  # layer whose Top-K this layer uses (itself for full/reindex)
    owns_kv: bool  # has attn.compressor.* and attn.indexer.{wk,k_norm}
    owns_index: bool  # has attn.indexer.{wq_b,weights_proj} and runs the indexer
    builds_candidates: bool  # scores the whole context and publishes the candidate-block pool
    uses_candidates: bool  # restricts its own indexer to that pool
    engram: int | None  # index into engram tables when an Engram module precedes this block
    dspark_tap: bool  # the residual entering this layer feeds the DSpark drafter
    n_routed_experts: int
    n_activated_experts: int

    def as_json(self) -> dict:
        return {"id": self.id, "part": self.part, "compress_ratio": self.compress_ratio, "mode": self.mode,
                "kv_source": self.kv_source, "index_source": self.index_source}


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]  # backbone layers 0..n_layers-1
    extra: tuple[LayerSpec, ...]  # DSpark stages (V4.1) or MTP blocks (V4), stored as mtp.{k}

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, i: int) -> LayerSpec:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def all(self) -> tuple[LayerSpec, ...]:
        return self.layers + self.extra

    @classmethod
    def from_args(cls, args: ModelArgs) -> "LayerPlan":
        n = args.n_layers
        kv_sources = set(args.kv_source_layers)
        index_sources = set(args.index_source_layers)
        engram = {l: i for i, l in enumerate(args.engram_layer_ids)}
        taps = set(args.dspark_target_layer_ids) if args.dspark_enabled else set()
        ced = args.family == "v4.1"
        layers = []
        for l in range(n):
            ratio = args.compress_ratios[l]
            if ratio == 0:
                mode, kv_src, idx_src = "swa", None, None
            else:
                # nearest source at or below this layer: the rule of spec §4.1
                kv_src = max(s for s in kv_sources if s <= l)
                idx_src = max((s for s in index_sources if s <= l), default=None)
                if args.family == "v4" and ratio != 4:
                    idx_src = None  # V4 HCA layers attend to every compressed entry, no indexer
                if l in kv_sources:
                    mode = "full"
                elif l in index_sources:
                    mode = "reindex"
                else:
                    mode = "reuse"
            builds = l == args.candidate_source_layer
            uses = (0 <= args.candidate_source_layer < l) and l in index_sources
            part = ("encoder" if l < n // 2 else "decoder") if ced else "decoder"
            routed, active = args.moe_shape(l)
            layers.append(LayerSpec(l, part, ratio, mode, kv_src, idx_src, l in kv_sources, l in index_sources,
                                    builds, uses, engram.get(l), l in taps, routed, active))
        extra = []
        for k in range(args.n_mtp_layers):
            l = n + k
            routed, active = args.moe_shape(l)
            extra.append(LayerSpec(l, "dspark" if args.dspark_enabled else "mtp", args.compress_ratios[l], "swa",
                                   None, None, False, False, False, False, None, False, routed, active))
        return cls(tuple(layers), tuple(extra))


# ---------------------------------------------------------------------------------- presets
def _v4_flash() -> ModelArgs:
    return ModelArgs.from_dict(dict(
        name="v4-flash", family="v4", vocab_size=129280, dim=4096, moe_inter_dim=2048, n_layers=43, n_mtp_layers=1,
        n_heads=64, n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, n_hash_layers=3,
        route_scale=1.5, swiglu_limit=10.0, q_lora_rank=1024, head_dim=512, rope_head_dim=64, norm_eps=1e-6,
        o_groups=8, o_lora_rank=1024, window_size=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
        index_n_heads=64, index_head_dim=128, index_topk=512, fp8_block_size=128))


def _v4_pro() -> ModelArgs:
    return ModelArgs.from_dict(dict(
        name="v4-pro", family="v4", vocab_size=129280, dim=7168, moe_inter_dim=3072, n_layers=61, n_mtp_layers=1,
        n_heads=128, n_routed_experts=384, n_shared_experts=1, n_activated_experts=6, n_hash_layers=3,
        route_scale=2.5, swiglu_limit=10.0, q_lora_rank=1536, head_dim=512, rope_head_dim=64, norm_eps=1e-6,
        o_groups=16, o_lora_rank=1024, window_size=128, compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
        index_n_heads=64, index_head_dim=128, index_topk=1024, fp8_block_size=128))


def _tiny() -> ModelArgs:
    """A test model where every V4.1 mode occurs and Top-K is smaller than the context:
    layers 0-1 SWA; encoder 2 (full, m=2), 3 (reuse); decoder 4 (full, m=1, candidate source),
    5 (reuse), 6 (reindex, pool-restricted), 7 (reuse of 6); 3 DSpark stages."""
    return ModelArgs(
        name="tiny", vocab_size=512, dspark_noise_token_id=511, dim=32, moe_inter_dim=32, n_layers=8, n_mtp_layers=3, n_heads=4,
        n_routed_experts=4, n_activated_experts=2, dspark_n_routed_experts=4, dspark_n_activated_experts=2,
        q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=8,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
        candidate_source_layer=4, candidate_topk_blocks=2, candidate_block_size=4, index_n_heads=2,
        index_head_dim=32, index_topk=4, engram_layer_ids=(1, 3), engram_vocab_size=97, engram_n_heads=2,
        engram_head_dim=32, engram_num_embeddings=(0, 0), dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=16,
        vision_n_layers=0, original_seq_len=64, max_seq_len=256, fp8_block_size=32)


PRESETS = {"v4.1-flash": lambda: ModelArgs(name="v4.1-flash"), "v4-flash": _v4_flash, "v4-pro": _v4_pro,
           "tiny": _tiny}


def preset(name: str) -> ModelArgs:
    """A named config; the Engram table sizes of test presets are derived from their primes."""
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; choose one of {', '.join(PRESETS)} or give a config.json path")
    args = PRESETS[name]()
    if args.engram_layer_ids and not any(args.engram_num_embeddings):
        from dsv41.model.engram import engram_table_rows  # the table sizes are the sums of the bucket primes

        args = args.replace(engram_num_embeddings=engram_table_rows(args))
    return args


def load_config(path: str | Path) -> ModelArgs:
    """A config.json path or a checkpoint directory: HF layout, or our flat runtime layout."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if "dim" in d and "hidden_size" not in d and "text_config" not in d:
        return ModelArgs.from_dict(d)
    return ModelArgs.from_hf_config(d)


def resolve_config(name_or_path: str) -> ModelArgs:
    """A preset name or a config.json / checkpoint directory path."""
    if name_or_path in PRESETS:
        return preset(name_or_path)
    if not Path(name_or_path).exists():
        raise ValueError(f"unknown config {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                         f"and no such file or directory")
    return load_config(name_or_path)
