"""Batched generation for evaluation (lm-eval's generate_until, the effort sweep).

Batched generation
    `generate` hands every request to the engine's scheduler (model/engine.py, `Generator.generate_many`):
    continuous batching over per-row positions, so prompts of any length decode together, a finished
    row is refilled at once, and each result is reported as it finishes (`on_done`). A request's tokens
    do not depend on what else is in the batch (docs/generation.md, batch invariance).

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
    engine_seconds: float = 0.0  # the request's share of its engine's time (GenerationResult.engine_seconds)

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)


class _Row:
    """What a request's tokens mean for evaluation: where the answer starts, the reasoning tokens, and
    whether a stop string ended the answer (the engine's `on_token` hook)."""

    def __init__(self, req: GenRequest, thinking: bool, tok, think_end: int | None, eos: int):
        self.req, self.thinking, self.tok, self.think_end, self.eos = req, thinking, tok, think_end, eos
        self.out: list[int] = []
        self.answer_from = 0 if not thinking else None  # index in `out` where the answer starts
        self.reasoning_tokens = 0
        self.max_stop = max((len(s) for s in req.until), default=0)

    def on_token(self, token: int) -> str | None:
        """Record a committed token (the engine applied the thinking budget already); "stop_string" when
        the answer now holds a stop string."""
        if self.answer_from is None:  # still reasoning
            if token == self.think_end:
                self.answer_from = len(self.out) + 1
            else:
                self.reasoning_tokens += 1
        self.out.append(token)
        if token != self.eos and self.answer_from is not None and self.max_stop and len(self.out) > self.answer_from:
            # the stop strings can only end in the text of the last few tokens
            tail = self.tok.decode(self.out[max(self.answer_from, len(self.out) - self.max_stop - 4):])
            if any(s and s in tail for s in self.req.until):
                return "stop_string"
        return None

    def result(self, finish: str, forced: bool, engine_seconds: float = 0.0) -> GenOutput:
        tok, eos = self.tok, self.eos
        reasoning = None
        if self.thinking:
            end = self.answer_from - 1 if self.answer_from is not None else len(self.out)
            reasoning = tok.decode([t for t in self.out[:end] if t != eos])
        if self.answer_from is None:  # never left the reasoning: no answer
            answer = ""
        else:
            answer = tok.decode([t for t in self.out[self.answer_from:] if t != eos])
            answer = cut_at_stop(answer, self.req.until)
        finish = {"stop": "eos"}.get(finish, finish)
        return GenOutput(answer, reasoning, list(self.out), self.reasoning_tokens, finish, forced,
                         answered=self.answer_from is not None, engine_seconds=engine_seconds)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """The text before the earliest stop string (lm-eval's truncation rule)."""
    cut = len(text)
    for s in until:
        if s:
            k = text.find(s)
            if k >= 0:
                cut = min(cut, k)
    return text[:cut]


def engine_request(r: GenRequest, tokenizer):
    """(the evaluation row, the engine's Request) of one GenRequest."""
    from dsv41.model.engine import GenerationConfig, Request, SamplingConfig

    eos = tokenizer.eos_id
    think_start, think_end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
    thinking = think_start is not None and r.prompt_ids[-1] == think_start
    row = _Row(r, thinking, tokenizer, think_end, eos)
    config = GenerationConfig(max_new_tokens=r.max_new_tokens, sampling=SamplingConfig(r.temperature, r.top_p, r.seed),
                              stop_ids=(eos,), thinking_budget=r.thinking_budget if thinking else None,
                              think_end_id=think_end)
    return row, Request(list(r.prompt_ids), config, on_token=row.on_token)


def generate(model, tokenizer, requests: Sequence[GenRequest], *, batch_size: int = 8,
             on_done: Callable[[int, GenOutput], None] | None = None, generator=None, pool=None) -> list[GenOutput]:
    """Generate for every request, up to `batch_size` at once; results in request order. on_done(i,
    output) as each finishes. `generator`: a model.engine.Generator to reuse (else one is made). `pool`: an
    evals.engine_pool.EnginePool to spread the requests over (its batch size then applies to each engine)."""
    from dsv41.model.engine import Generator

    for r in requests:
        if not r.prompt_ids:
            raise ValueError("empty prompt")
        if len(r.prompt_ids) + r.max_new_tokens > model.args.max_seq_len:
            raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceed "
                             f"the model's max_seq_len ({model.args.max_seq_len})")
    if pool is not None:
        return pool.generate(requests, tokenizer, on_done=on_done)
    rows, engine_requests = [], []
    for r in requests:
        row, request = engine_request(r, tokenizer)
        rows.append(row)
        engine_requests.append(request)
    results: list[GenOutput | None] = [None] * len(requests)

    def done(i, result):
        results[i] = rows[i].result(result.finish_reason, result.budget_forced, result.engine_seconds)
        if on_done:
            on_done(i, results[i])

    generator = generator or Generator(model, tokenizer)
    generator.generate_many(engine_requests, max_batch_size=batch_size, on_done=done)
    return results  # type: ignore[return-value]
