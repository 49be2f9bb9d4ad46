"""The CSA2 indexer (spec §4.4): which compressed entries each query attends to.

Keys (kv-source layers only) are projected from the compressor's pre-RoPE latent:
    k_g = MXFP4(RoPE(RMSNorm_k(W_k c_g), g m))                      [index_head_dim]
Queries (index-source layers) come from the layer's own q_lora latent q_r:
    q_t = MXFP4(RoPE(W_qb^I q_r, t))                                 [index_heads, index_head_dim]
    score_{t,g} = sum_h w_{t,h} ReLU(q_{t,h} . k_g),   w_t = W_w x_t / sqrt(index_head_dim * index_heads)
An entry is visible once the query has passed its group's last token: g < floor((t+1)/m).

Hierarchical pool: the candidate-source layer (decoder Full layer) scores the whole context and keeps
the best `candidate_topk_blocks` blocks of `candidate_block_size` entries; Reindex layers score only
inside that pool. Scores are computed in fp32 (REF keeps them in bf16, where near-ties may break
differently); Top-K ties go to `torch.topk` (in a continuous batch's decode step, to the lower index:
`top_indices`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import formats
from dsv41.model.config import LayerSpec, ModelArgs
from dsv41.model.kernels import indexer as kernels_indexer
from dsv41.model.kernels import quant as kernels_quant
from dsv41.model.kernels import host, use_triton
from dsv41.model.kernels.reference import weighted_relu_scores  # score = sum_h w_h ReLU(q_h . k)
from dsv41.model.layers import Linear, RMSNorm, qat, rope_tail, storage_dtype


def visible_counts(start_pos: int, seqlen: int, ratio: int, device) -> torch.Tensor:
    """Number of compressed entries each query position sees: floor((t+1)/m), [seqlen]."""
    return torch.div(torch.arange(start_pos + 1, start_pos + seqlen + 1, device=device), ratio,
                     rounding_mode="floor")


def top_indices(values: torch.Tensor, k: int, stable: bool = False) -> torch.Tensor:
    """Indices of the k largest values along the last dim (in no particular order). stable: equal values go
    to the lower index, so the choice does not depend on what follows in the row (a continuous batch pads
    each row to its fullest neighbour's width, and bf16 scores tie often); else torch.topk's choice."""
    if stable:
        return values.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return values.topk(k, dim=-1, sorted=False).indices


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int, stable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Level one of the two-level Top-K. scores [..., T, N] (invisible = -inf), visible [T].

    A block's score is its best entry; the block holding the newest visible entry is always kept
    (it is only partly filled, so an older full block could outscore it); blocks with no visible
    entry are never kept. Returns the pool twice: a bool mask over entries, shaped like scores, and
    the list of its entries [..., T, kept blocks * block_size] (-1 = none; the kernel's gather mode)."""
    n = scores.size(-1)
    padded = F.pad(scores, (0, -n % block_size), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    n_blocks = block_scores.size(-1)
    newest = torch.div(visible - 1, block_size, rounding_mode="floor").unsqueeze(-1)
    block_scores = block_scores.masked_fill(torch.arange(n_blocks, device=scores.device) == newest, torch.inf)
    top = top_indices(block_scores, min(topk_blocks, n_blocks), stable)
    kept = block_scores.gather(-1, top) > -torch.inf
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top, kept)
    entries = (top.unsqueeze(-1) * block_size + torch.arange(block_size, device=scores.device))
    entries = torch.where(kept.unsqueeze(-1) & (entries < n), entries, -1).flatten(-2)
    return keep.repeat_interleave(block_size, dim=-1)[..., :n], entries


class Indexer(nn.Module):
    """Owns the key path on kv-source layers and the query path on index-source layers."""

    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.ratio = spec.compress_ratio
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.rope_head_dim
        self.topk = args.index_topk
        self.score_dtype = args.index_score_dtype
        self.topk_blocks, self.block_size = args.candidate_topk_blocks, args.candidate_block_size
        if spec.owns_index:
            self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, storage_dtype(args.dtype),
                               args.fp8_block_size, trainable=args.trainable)
            self.weights_proj = Linear(args.dim, self.n_heads, torch.bfloat16)
            self.weight_scale = (self.head_dim * self.n_heads) ** -0.5
        if spec.owns_kv:
            self.wk = Linear(args.head_dim, self.head_dim, torch.bfloat16)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    def key_latent(self, latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Index keys of new compressed entries before MXFP4 rounding, RoPE(RMSNorm_k(W_k c_g)): what
        the KV cache packs as MXFP4. latent [B, G, head_dim] (pre-RoPE), freqs at g*m."""
        return rope_tail(self.k_norm(self.wk(latent)), freqs, self.rope_dim)

    def keys(self, latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Index keys of new compressed entries as the scores use them: MXFP4(key_latent)."""
        return qat(formats.mxfp4_fake_quant, self.key_latent(latent, freqs), 32)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, keys, freqs: torch.Tensor,
                start_pos: int, shared) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K compressed positions per query, ascending, -1 where fewer are visible: [B, T, K];
        and the scores they were chosen from, [B, T, N] (-inf where invisible or outside the pool).

        keys: the index keys of every compressed entry written so far, as values [B, N, index_head_dim]
        (training) or as the cache's packed MXFP4 bytes (codes, scales) (inference: the kernel decodes them)."""
        visible = visible_counts(start_pos, x.size(1), self.ratio, x.device)
        if self.spec.uses_candidates and isinstance(keys, tuple) and use_triton(keys[0]):
            # on the kernel, a Reindex layer scores its pool only. The references keep the masked full
            # scan below: Top-K over the whole row breaks ties between equal bf16 scores as REF does
            return self.pool_topk(x, qr, keys, freqs, visible.unsqueeze(-1), shared.candidate_entries)
        return self.select(x, qr, keys, freqs, visible, shared)

    def decode(self, x: torch.Tensor, qr: torch.Tensor, keys: tuple, freqs: torch.Tensor, visible: torch.Tensor,
               shared) -> torch.Tensor:
        """`forward` for one token per row of a continuous batch (model/batch_cache.py): row b sees its first
        visible[b] entries (visible [B, 1]; keys packed, [B, N, ...] with N the batch's largest count).
        Returns the Top-K [B, 1, index_topk], ascending, padded with -1 to the full width, so that the
        attention after it reads the same number of columns whatever the other rows hold."""
        if self.spec.uses_candidates and use_triton(keys[0]):
            top, _ = self.pool_topk(x, qr, keys, freqs, visible.unsqueeze(-1), shared.candidate_entries)
        else:
            top = self._host_select(x, qr, keys, freqs, visible, shared)
            if top is not None:
                return top
            top, _ = self.select(x, qr, keys, freqs, visible, shared, batch_invariant=True)
        return F.pad(top, (0, self.topk - top.size(-1)), value=-1)

    def _host_select(self, x: torch.Tensor, qr: torch.Tensor, keys: tuple, freqs: torch.Tensor, visible: torch.Tensor,
                     shared) -> torch.Tensor | None:
        """`select(..., batch_invariant=True)` padded to index_topk, its scores, masks and Top-K in one C call
        (host.indexer_decode), where the reference's scores take their exact path: bf16 scores, an index head dim
        of one MXFP4 block, at most host.INDEXER_MAX_HEADS heads, on the host; None elsewhere (and for a NaN score)."""
        pool = shared.candidates if self.spec.uses_candidates else None
        if not (self.score_dtype == "bf16" and self.head_dim == formats.MXFP4_BLOCK
                and self.n_heads <= host.INDEXER_MAX_HEADS and host.takes(x) and x.size(1) == 1
                and visible.dtype == torch.int64 and (pool is None or pool.dtype == torch.bool and pool.dim() == 3
                                                      and pool.shape[-1] == keys[0].size(1) and pool.stride(-1) == 1)):
            return None
        q, w = self.queries(x, qr, freqs)
        if not (host.takes(q) and w.dtype == torch.bfloat16 and w.is_contiguous()):
            return None
        out = host.indexer_decode(q, w, *keys, visible, pool, self.topk)
        if out is None:
            return None
        scores, top = out
        if self.spec.builds_candidates:
            shared.candidates, shared.candidate_entries = select_candidate_blocks(
                scores, visible, self.topk_blocks, self.block_size, stable=True)
        return top

    def select(self, x: torch.Tensor, qr: torch.Tensor, keys, freqs: torch.Tensor, visible: torch.Tensor, shared,
               batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked full scan: scores over every entry, -inf where invisible (visible: the entries each query
        sees, broadcastable to [B, T]) or outside the candidate pool; the pool built here on the candidate-source
        layer; the Top-K ascending, -1 where invisible. batch_invariant (the decode step): scores as keys @ q^T
        and ties to the lower index, so that a row's choice does not depend on the other rows' widths."""
        scores = self.head_scores(x, qr, keys, freqs, by_entry=batch_invariant)  # [B, T, N]
        n = scores.size(-1)
        scores = scores.masked_fill(torch.arange(n, device=x.device) >= visible.unsqueeze(-1), -torch.inf)
        if self.spec.builds_candidates:
            shared.candidates, shared.candidate_entries = select_candidate_blocks(
                scores, visible, self.topk_blocks, self.block_size, stable=batch_invariant)
        elif self.spec.uses_candidates:
            scores = scores.masked_fill(~shared.candidates, -torch.inf)
        idx = top_indices(scores.detach(), min(self.topk, n), batch_invariant).sort(dim=-1).values
        return torch.where(idx < visible.unsqueeze(-1), idx, -1), scores

    def pool_topk(self, x: torch.Tensor, qr: torch.Tensor, keys: tuple, freqs: torch.Tensor, visible: torch.Tensor,
                  pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A Reindex layer over packed keys: score only the candidate pool's entries (pool [B, T, C], -1 =
        none; visible: the entries each query sees, broadcastable to [B, T, 1]), so its work per query is the
        pool size whatever the context length. The same Top-K as the
        masked full scan (ascending ids, then -1s) up to ties, returned with the scores over the pool
        [B, T, C]. (Where the pool holds fewer than K visible entries the scan also keeps -inf picks below
        the visible count, i.e. entries outside the pool, as REF does; here those slots stay empty.)"""
        scores = self.head_scores(x, qr, keys, freqs, candidates=pool)
        scores = scores.masked_fill((pool < 0) | (pool >= visible), -torch.inf)
        top = scores.topk(min(self.topk, scores.size(-1)), dim=-1, sorted=False)
        last = torch.iinfo(torch.long).max  # sorts the empty picks after every id
        ids = torch.where(torch.isfinite(top.values), pool.gather(-1, top.indices), last).sort(dim=-1).values
        return torch.where(ids == last, -1, ids), scores

    def queries(self, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The index queries q_t = MXFP4(RoPE(W_qb^I q_r)) [B, T, H, Dk] and their head weights w_t [B, T, H], bf16 at
        REF's score precision (index_score_dtype "bf16", inference), else fp32."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = qat(kernels_quant.mxfp4_fake_quant, rope_tail(q, freqs, self.rope_dim), 32)  # formats' rounding
        bf16 = self.score_dtype == "bf16" and not torch.is_grad_enabled()  # REF's precision (inference only)
        return q, self.weights_proj(x).to(torch.bfloat16 if bf16 else torch.float32) * self.weight_scale

    def head_scores(self, x: torch.Tensor, qr: torch.Tensor, keys, freqs: torch.Tensor,
                    candidates: torch.Tensor | None = None, by_entry: bool = False) -> torch.Tensor:
        """sum_h w_h ReLU(q_h . k_g) over the index heads held here, [B, T, N] fp32, before any masking
        (packed keys with a candidate list [B, T, C]: over those entries only, [B, T, C]).
        Under tensor parallelism (model/parallel.py) each rank holds some heads and the partial sums
        are all-reduced before Top-K, so every rank selects the same entries."""
        q, w = self.queries(x, qr, freqs)
        bf16 = w.dtype == torch.bfloat16
        if isinstance(keys, tuple):  # packed bytes: model/kernels/indexer.py (Triton on CUDA)
            return kernels_indexer.indexer_scores(q, w, *keys, candidates=candidates, bf16_scores=bf16,
                                                  by_entry=by_entry)
        return weighted_relu_scores(q, keys, w, bf16)
