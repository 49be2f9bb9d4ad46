"""DSpark drafter stages (spec §4.8), stored under `mtp.{k}` in the checkpoint.

Each stage is a window-only Block (ratio 0, own 128-slot ring fed by the target model's taps) with a
smaller MoE (128 experts, top-3). Stage 0 also owns `main_proj`/`main_norm`, which turn the taps of
the target layers into the `main_x` that fills the drafter's window KV; the last stage owns the
output norm, the Markov head (a rank-256 bigram correction of the draft logits) and the confidence
head (predicts whether each draft position survives verification).

This module holds the parameters with their official names and shapes; the drafting forward and
verification belong to the inference engine.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import LayerSpec, ModelArgs
from model.layers import Linear, RMSNorm, storage_dtype
from model.transformer import Block


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, dtype=torch.bfloat16)
        self.head = Linear(rank, vocab_size, torch.bfloat16)


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = Linear(in_dim, 1, torch.bfloat16)


class DSparkStage(Block):
    """A drafter stage: the backbone Block (window-only attention, DSpark-sized MoE) plus the
    stage's extra parts. Subclassing keeps the checkpoint names flat: mtp.{k}.attn..., mtp.0.main_proj..."""

    def __init__(self, args: ModelArgs, spec: LayerSpec, stage: int):
        super().__init__(args, spec)
        self.stage = stage
        if stage == 0:
            self.main_proj = Linear(args.dim * len(args.dspark_target_layer_ids), args.dim,
                                    storage_dtype(args.dtype), args.fp8_block_size, trainable=args.trainable)
            self.main_norm = RMSNorm(args.dim, args.norm_eps)
        if stage == args.n_mtp_layers - 1:
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(args.dim + args.dspark_markov_rank)
