"""Batched generation for evaluation (lm-eval's generate_until, the effort sweep).

Batched generation
    `generate` decodes many prompts at once over the model's KV cache: one prefill, then one
    single-token forward per step for the whole batch (no recompute of the prefix). The model's
    cache advances all rows of a batch together (same positions), so prompts are batched with
    others of the same token length; a prompt with no partner runs alone.

Reasoning and stop strings
    A prompt that ends with `<think>` (the V4.1 thinking-mode generation header) starts in the
    reasoning phase. Stop strings (lm-eval's `until`) are looked for only in the answer, the text
    after `</think>`: a "Question:" the model writes while reasoning does not end the generation
    (toolkit-anchors §2.1: HFLM gets this wrong). The answer returned is the text after
    `</think>`, cut at the first stop string; reasoning is kept apart. A completion that never
    closed its reasoning has no answer (""). An optional thinking budget forces `</think>` after
    that many reasoning tokens, as the engine's effort budget does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from dsv41.model.encoding import THINK_END, THINK_START

PREFILL_CHUNK = 2048


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 256
    until: tuple[str, ...] = ()  # stop strings, looked for in the answer only
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    thinking_budget: int | None = None  # force </think> after this many reasoning tokens


@dataclass
class GenOutput:
    answer: str  # text after </think> (or all text without reasoning), cut at the first stop string
    reasoning: str | None  # text before </think>; None when the prompt did not open reasoning
    output_ids: list[int]  # every generated token, </think> and EOS included
    reasoning_tokens: int
    finish_reason: str  # "eos" | "stop_string" | "length"
    budget_forced: bool = False
    answered: bool = True  # False: the reasoning never closed, so there is no answer part

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)


class _Row:
    """Decoding state of one sequence."""

    def __init__(self, req: GenRequest, thinking: bool, generator):
        self.req, self.thinking, self.gen = req, thinking, generator
        self.out: list[int] = []
        self.answer_from = 0 if not thinking else None  # index in `out` where the answer starts
        self.reasoning_tokens = 0
        self.done, self.finish, self.forced = False, "length", False
        self.max_stop = max((len(s) for s in req.until), default=0)

    def accept(self, token: int, tok, think_end: int | None, eos: int) -> int:
        """Apply the thinking budget to a drawn token, record it, decide whether the row is done."""
        if self.answer_from is None:  # still reasoning
            if token == think_end:
                self.answer_from = len(self.out) + 1
            elif self.req.thinking_budget is not None and self.reasoning_tokens >= self.req.thinking_budget:
                token, self.forced = think_end, True
                self.answer_from = len(self.out) + 1
            else:
                self.reasoning_tokens += 1
        self.out.append(token)
        if token == eos:
            self.done, self.finish = True, "eos"
        elif self.answer_from is not None and self.max_stop and len(self.out) > self.answer_from:
            # the stop strings can only end in the text of the last few tokens
            tail = tok.decode(self.out[max(self.answer_from, len(self.out) - self.max_stop - 4):])
            if any(s and s in tail for s in self.req.until):
                self.done, self.finish = True, "stop_string"
        if not self.done and len(self.out) >= self.req.max_new_tokens:
            self.done = True
        return token

    def result(self, tok, eos: int) -> GenOutput:
        reasoning = None
        if self.thinking:
            end = self.answer_from - 1 if self.answer_from is not None else len(self.out)
            reasoning = tok.decode([t for t in self.out[:end] if t != eos])
        if self.answer_from is None:  # never left the reasoning: no answer
            answer = ""
        else:
            answer = tok.decode([t for t in self.out[self.answer_from:] if t != eos])
            answer = cut_at_stop(answer, self.req.until)
        return GenOutput(answer, reasoning, list(self.out), self.reasoning_tokens, self.finish, self.forced,
                         answered=self.answer_from is not None)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """The text before the earliest stop string (lm-eval's truncation rule)."""
    cut = len(text)
    for s in until:
        if s:
            k = text.find(s)
            if k >= 0:
                cut = min(cut, k)
    return text[:cut]


def generate(model, tokenizer, requests: Sequence[GenRequest], *, batch_size: int = 8,
             on_done: Callable[[int, GenOutput], None] | None = None) -> list[GenOutput]:
    """Generate for every request; results in request order. on_done(i, output) as each finishes."""
    import torch

    from dsv41.model.engine import SamplingConfig, token_distribution

    device = model.embed.weight.device
    eos = tokenizer.eos_id
    think_start, think_end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
    for r in requests:
        if not r.prompt_ids:
            raise ValueError("empty prompt")
        if len(r.prompt_ids) + r.max_new_tokens > model.args.max_seq_len:
            raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceed "
                             f"the model's max_seq_len ({model.args.max_seq_len})")
    # same prompt length and sampling settings batch together; longest prompts first
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((len(r.prompt_ids), r.temperature, r.top_p), []).append(i)
    keys = sorted(groups, key=lambda k: (-k[0], k[1:]))
    batches = [groups[k][s:s + batch_size] for k in keys for s in range(0, len(groups[k]), batch_size)]
    results: list[GenOutput | None] = [None] * len(requests)
    with torch.inference_mode():
        for batch in batches:
            rows = []
            for i in batch:
                req = requests[i]
                gen = torch.Generator(device="cpu")
                gen.manual_seed(req.seed)
                thinking = think_start is not None and req.prompt_ids[-1] == think_start
                rows.append(_Row(req, thinking, gen))
            sampling = SamplingConfig(requests[batch[0]].temperature, requests[batch[0]].top_p)
            ids = torch.tensor([requests[i].prompt_ids for i in batch], device=device)
            cache = model.new_cache(len(batch))
            for s in range(0, ids.size(1), PREFILL_CHUNK):
                logits = model(ids[:, s:s + PREFILL_CHUNK], start_pos=s, cache=cache)
            while True:
                if sampling.temperature <= 0:
                    drawn = logits.argmax(-1).tolist()
                else:
                    probs = token_distribution(logits, sampling).float().cpu()
                    drawn = [int(torch.multinomial(probs[r], 1, generator=row.gen)) for r, row in enumerate(rows)]
                feed = []
                for row, token in zip(rows, drawn):
                    if row.done:
                        feed.append(tokenizer.pad_id)
                        continue
                    feed.append(row.accept(int(token), tokenizer, think_end, eos))
                for i, row in zip(batch, rows):
                    if row.done and results[i] is None:
                        results[i] = row.result(tokenizer, eos)
                        if on_done:
                            on_done(i, results[i])
                if all(row.done for row in rows):
                    break
                logits = model(torch.tensor(feed, device=device).view(-1, 1), start_pos=cache.pos, cache=cache)
    return results  # type: ignore[return-value]
