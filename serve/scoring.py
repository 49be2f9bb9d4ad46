"""Per-token log-probabilities of a token sequence: what /v1/completions returns for `echo` + `logprobs`.

The same forward as the lm-eval adapter's scoring (evals/bpb.py `_score_batch`, one row): the whole
sequence through a fresh KV cache in chunks, the head applied in fixed blocks of positions
(`bpb.score_positions`), ln p(target) = logit(target) - logsumexp(logits). The most likely tokens come from
the same logits, so a token that is the argmax has exactly the top log-probability (lm-eval's `is_greedy`
compares the two for equality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.evals.bpb import score_positions

LOGITS_BYTES = 2**28  # sizes the chunks: as many positions as fit this many fp32 logits (none is built)


@dataclass
class TokenScores:
    """For positions 1..n-1 of the sequence: ln p(ids[j] | ids[:j]) and the `top` most likely (id, ln p)."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@torch.inference_mode()
def score_tokens(model, ids: list[int], top: int = 1, max_logits_bytes: int = LOGITS_BYTES) -> TokenScores:
    if len(ids) < 2:
        return TokenScores([], [])
    device = model.embed.weight.device
    vocab = model.args.vocab_size
    inputs = torch.tensor([ids[:-1]], device=device)
    targets = torch.tensor(ids[1:], device=device)
    cache = model.new_cache(1)
    chunk = max(1, max_logits_bytes // (4 * vocab))
    logprobs: list[float] = []
    best: list[list[tuple[int, float]]] = []
    for s in range(0, inputs.size(1), chunk):
        hidden = model(inputs[:, s:s + chunk], start_pos=s, cache=cache, all_logits=True, head=False)[0]
        tgt = targets[s:s + chunk]
        picked, _, top_k = score_positions(model, hidden, tgt, check_greedy=False, top=top)
        logprobs += picked.tolist()
        if top_k is not None:
            best += [list(zip(i, v)) for i, v in zip(top_k[1].tolist(), top_k[0].tolist())]
        else:
            best += [[] for _ in range(tgt.numel())]
    return TokenScores(logprobs, best)
