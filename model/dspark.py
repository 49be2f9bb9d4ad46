"""DSpark drafter (spec §4.8): semi-autoregressive drafting of `dspark_block_size` tokens at once.

Stored under `mtp.{k}`. Each stage is a window-only Block (same single-pass mHC wiring, a smaller
MoE) whose attention context is a ring of window KV built from the *target model's* hidden states:

    main_x_p = RMSNorm(main_proj(taps_p))      taps = residual entering each target layer (37, 38, 39),
                                               averaged over the 4 streams, concatenated
    ring_k[p mod 128] = FP8(RoPE(RMSNorm_kv(W_kv^k main_x_p), p))          per stage k

A draft block is [anchor, noise x (S-1)] at positions P+1..P+S, where the anchor is the last token the
target decided (position P+1, not yet in its cache). Every block position attends to the ring
(committed positions <= P) and to all S block positions (non-causal). After the last stage:

    U      = head(RMSNorm(sum_j pre_j X_j))                    base logits, [S, V]
    l_i    = U_i + markov_head.head(markov_head.embed(y_i))    y_0 = anchor, y_{i+1} ~ l_i
    c_i    = confidence_head.proj([x_i ; markov_embed(y_i)])   raw logit of "position i survives"

so position i drafts the token at P+2+i. REF returns c_i raw; sigmoid(c_i) is the acceptance
probability used by the verification-length choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import mhc
from dsv41.model.config import LayerSpec, ModelArgs
from dsv41.model.layers import Linear, RMSNorm, storage_dtype
from dsv41.model.block import Block


class MarkovHead(nn.Module):
    """A rank-r bigram correction: the drafted token's embedding adds to the next position's logits."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, dtype=torch.bfloat16)
        self.head = Linear(rank, vocab_size, torch.bfloat16)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(token_ids)
        return F.linear(e.float(), self.head.weight.float()), e


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = Linear(in_dim, 1, torch.bfloat16)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        h = torch.cat([hidden.float(), markov_embed.float()], dim=-1)
        return F.linear(h, self.proj.weight.float()).squeeze(-1)


class DSparkStage(Block):
    """A drafter stage: the backbone Block with the drafter's attention context, plus the stage's
    extra parts. Subclassing keeps the checkpoint names flat: mtp.{k}.attn..., mtp.0.main_proj..."""

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

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This stage's window KV of committed positions: main_x [B, T, dim] at positions [T] -> [B, T, D]."""
        return self.attn.window_kv(main_x, self.attn.freqs(positions, main_x.device))

    def draft(self, x: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor, context_kv: torch.Tensor,
              context_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mix(x, pre, lambda h: self.attn.block_attention(h, positions, context_kv, context_idx))


# ---------------------------------------------------------------------------------- functional API
def main_x(model, taps: torch.Tensor) -> torch.Tensor:
    """Taps of committed positions [B, T, n_targets*dim] -> the drafter's context input [B, T, dim]."""
    first = model.mtp[0]
    return first.main_norm(first.main_proj(taps))


def block_hidden(model, anchors: torch.Tensor, anchor_positions: torch.Tensor, contexts) -> torch.Tensor:
    """Run the stages on N draft blocks. anchors [N] token ids at anchor_positions [N] (= P+1);
    contexts: per stage (context_kv [N, R, D], context_idx [N, R]). Returns the collapsed hidden
    states x_p [N, S, dim] (before the output norm)."""
    args = model.args
    S = args.dspark_block_size
    ids = anchors.new_full((anchors.size(0), S), args.dspark_noise_token_id)
    ids[:, 0] = anchors
    positions = anchor_positions.view(-1, 1) + torch.arange(S, device=anchors.device)
    x = model.embed(ids).unsqueeze(2).repeat(1, 1, args.hc_mult, 1)
    pre = mhc.identity_pre(x)  # each drafter pass starts from a one-hot collapse, like the backbone
    for stage, (kv, idx) in zip(model.mtp, contexts):
        x, pre = stage.draft(x, pre, positions, kv, idx)
    return mhc.collapse(x, pre)


def base_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """U = head(RMSNorm(x_p)) [N, S, V] in fp32 (the target's head, shared)."""
    return model.head(model.mtp[-1].norm(hidden))


def markov_draft(model, U: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor, sample):
    """Autoregressive Markov pass over the block: y_0 = anchor, y_{i+1} = sample(U_i + M(y_i)).
    Returns (draft tokens [N, S], final logits [N, S, V], raw confidence [N, S])."""
    last = model.mtp[-1]
    S = U.size(1)
    tokens, logits, embeds = [], [], []
    y = anchors
    for i in range(S):
        bias, e = last.markov_head(y)
        l = U[:, i] + bias
        y = sample(l)
        tokens.append(y), logits.append(l), embeds.append(e)
    conf = last.confidence_head(hidden, torch.stack(embeds, dim=1))
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), conf


def teacher_forced_logits(model, U: torch.Tensor, hidden: torch.Tensor, prev_tokens: torch.Tensor):
    """Training form: prev_tokens [N, S] are y_0..y_{S-1} (anchor then the true next tokens).
    Returns (logits [N, S, V], raw confidence [N, S])."""
    last = model.mtp[-1]
    bias, e = last.markov_head(prev_tokens)
    return U + bias, last.confidence_head(hidden, e)
