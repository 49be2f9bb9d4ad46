"""One layer of the V4.1 stack (spec §4.2, §4.3): attention and MoE, each between an mHC collapse and
expansion, in the single-pass form.

    X, h, pre_a, post_a, comb_a = mhc_step(X, pre)                 h = RMSNorm(sum_j pre_j X_j) (the previous pre)
    y = Attention(h)
    X, h, pre_f, post_f, comb_f = mhc_step(X, pre_a, y, post_a, comb_a)    X = post_a (x) y + comb_a^T X
    z = MoE(h)
    X = post_f (x) z + comb_f^T X;  the block hands pre_f to the next

model/transformer.py stacks these blocks into the model; model/dspark.py's drafter stages are blocks too,
which is why the block is its own module (the drafter and the model both build on it, neither on the other).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv41.model import mhc
from dsv41.model.attention import Attention
from dsv41.model.cache import KVCache
from dsv41.model.config import LayerSpec, ModelArgs
from dsv41.model.kernels import mhc as kernels_mhc
from dsv41.model.layers import RMSNorm
from dsv41.model.moe import MoE


@dataclass
class SharedState:
    """What attention layers hand down the stack within one forward (REF's SharedAttentionRuntime,
    made explicit and per call): the latest published Top-K and the decoder's candidate pool."""

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None  # the pool as a mask over entries [B, T, N]
    candidate_entries: torch.Tensor | None = None  # and as entry ids [B, T, C] (-1 = none)
    aux: dict | None = None  # training only: auxiliary losses collected on the way (indexer KL)
    image_window: torch.Tensor | None = None  # extra window columns of image spans [B, T, S] (vision.py)
    precompressed: frozenset = frozenset()  # kv sources whose entries for these tokens already exist


class Block(nn.Module):
    """Attention and MoE sub-layers, each between an mHC collapse and expansion.

    Single-pass mHC: each sub-layer collapses its input with the `pre` computed by the sub-layer
    before it, while post/comb come from its own input. The block returns its FFN `pre` for the next."""

    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.norm_eps, self.hc_eps, self.hc_iters = args.norm_eps, args.hc_eps, args.hc_sinkhorn_iters
        self.attn = Attention(args, spec)
        self.ffn = MoE(args, spec)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.engram = None
        if spec.engram is not None:
            from dsv41.model.engram import Engram

            self.engram = Engram(args, spec.id)
        n_mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.zeros(n_mix, width)))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros(n_mix)))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.zeros(3)))

    def mhc_step(self, x: torch.Tensor, pre_prev: torch.Tensor, sub: str, y: torch.Tensor | None = None,
                 post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
        """One read of the residual streams at a sub-layer boundary (kernels/mhc.py: a single Triton pass on
        CUDA, model/mhc.py's functions elsewhere): X' = post (x) y + comb^T X (when the previous sub-layer's
        output y is given), this sub-layer's input RMSNorm(collapse(X', pre_prev)), and its coefficients from X'.
        (The norm rides along so that the CPU decode step's one C call for the step takes it too.)"""
        norm = getattr(self, f"{sub}_norm")
        return kernels_mhc.mhc_step(x, pre_prev, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                    getattr(self, f"hc_{sub}_base"), self.hc_iters, self.hc_eps, self.norm_eps,
                                    y, post, comb, norm=(norm.weight, norm.eps))

    def forward(self, x: torch.Tensor, pre: torch.Tensor, start_pos: int, cache: KVCache, shared: SharedState,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mix(x, pre, lambda h: self.attn(h, start_pos, cache, shared), image_mask)

    def decode(self, x: torch.Tensor, pre: torch.Tensor, cache, shared: SharedState):
        """One token per row of a continuous batch (model/batch_cache.py): attention in its per-row form,
        the MoE in its batch-invariant form (MoE.every_row: a row's sums do not depend on the other rows)."""
        return self.mix(x, pre, lambda h: self.attn.decode(h, cache, shared),
                        ffn=lambda h: self.ffn.every_row(h, cache.active))

    def mix(self, x: torch.Tensor, pre: torch.Tensor, attend, image_mask: torch.Tensor | None = None, ffn=None):
        """The single-pass mHC wiring around an attention call `attend(normed input) -> output` (and the
        MoE, or `ffn(normed input)` in its place).

        The attention's input uses the previous sub-layer's `pre`; its own coefficients come from the same
        read. The FFN's step folds the attention's residual update into that read. The FFN's own update
        stays a separate pass: Engram and the DSpark taps read the residual between blocks."""
        x, h, pre_a, post_a, comb_a = self.mhc_step(x, pre, "attn")  # h = attn_norm(collapse(X, pre))
        y = attend(h)
        x, h, pre_f, post_f, comb_f = self.mhc_step(x, pre_a, "ffn", y, post_a, comb_a)  # h = ffn_norm(...)
        z = self.ffn(h, image_mask) if ffn is None else ffn(h)
        return kernels_mhc.expand(z, x, post_f, comb_f), pre_f
