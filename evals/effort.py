"""Generation for evaluation, and the effort sweep (report Figure 9).

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

Effort sweep
    V4.1 conditions on the effort b in 1..100 through the prompt's effort line (spec §7). For each
    effort the sweep encodes every item at that effort, generates greedily, scores the answers and
    reports accuracy with a 95% Wilson interval, mean reasoning tokens and mean output tokens (all
    generated tokens: reasoning, `</think>`, answer and EOS, i.e. what an API bills as output).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from dsv41.model.encoding import EFFORT_PRESETS, THINK_END, THINK_START

DEFAULT_EFFORTS = (1, 25, 50, 75, 100)
PREFILL_CHUNK = 2048


# ============================================================================ batched generation
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


# ============================================================================ statistics
def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (well behaved at 0 and 1, unlike p ± z·se)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values: Sequence[float], z: float = 1.959964) -> tuple[float, float]:
    """Normal-approximation 95% interval of a mean (for non-binary per-item scores)."""
    n = len(values)
    if n < 2:
        return (float("nan"), float("nan"))
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return (m - half, m + half)


@dataclass
class SweepPoint:
    effort: int
    accuracy: float
    ci95: tuple[float, float]
    mean_reasoning_tokens: float
    mean_output_tokens: float
    n: int
    budget_forced: int = 0  # items whose reasoning was cut by a thinking budget
    unfinished: int = 0  # items that ran out of tokens before answering
    seconds: float = 0.0


def point_from(effort: int, scores: Sequence[float], reasoning: Sequence[int], output: Sequence[int],
               **extra) -> SweepPoint:
    n = len(scores)
    binary = all(s in (0, 1, True, False) for s in scores)
    acc = sum(scores) / n if n else float("nan")
    ci = wilson_interval(int(sum(scores)), n) if binary else mean_interval(scores)
    return SweepPoint(effort, acc, ci, sum(reasoning) / max(1, len(reasoning)), sum(output) / max(1, len(output)),
                      n, **extra)


# ============================================================================ tasks for the sweep
class GenerationTask(Protocol):
    name: str
    max_new_tokens: int

    def items(self, limit: int | None) -> list[dict]: ...
    def prompt(self, item: dict, effort: int) -> str: ...
    def score(self, output: GenOutput, item: dict) -> float: ...


class TinyReasoning:
    """The bundled `tiny-reasoning` task (evals/tasks/tiny_reasoning): add a list of digits."""

    name = "tiny-reasoning"

    def __init__(self, max_new_tokens: int = 256, path: str | os.PathLike | None = None):
        from dsv41.evals.tasks import tiny_reasoning

        self.module, self.path, self.max_new_tokens = tiny_reasoning, path, max_new_tokens

    def items(self, limit):
        return self.module.load_items(self.path, limit)

    def prompt(self, item, effort):
        return self.module.prompt_text(item, effort)

    def score(self, output, item):
        # the task scores the completion after <think>: reasoning, </think>, answer
        completion = (output.reasoning or "") + (THINK_END + output.answer if output.answered else "")
        return float(self.module.score(completion, item))


def run_sweep(model, tokenizer, task: GenerationTask, efforts: Sequence[int] = DEFAULT_EFFORTS, *,
              limit: int | None = None, batch_size: int = 8, thinking_budget: int | None = None,
              progress=None) -> dict:
    """Accuracy and token use of `task` at each effort: the `dsv41 effort-sweep` JSON document.

    progress: an object with start(label, total) / advance(n) / stop(), or None."""
    items = task.items(limit)
    if not items:
        raise ValueError(f"task {task.name} has no items")
    points, samples = [], []
    for effort in efforts:
        requests = [GenRequest(tokenizer.encode(task.prompt(item, effort), allow_special=True),
                               max_new_tokens=task.max_new_tokens, thinking_budget=thinking_budget)
                    for item in items]
        if progress:
            progress.start(f"{task.name} · effort {effort}", len(requests))
        t0 = time.perf_counter()
        outputs = generate(model, tokenizer, requests, batch_size=batch_size,
                           on_done=(lambda i, o: progress.advance(1)) if progress else None)
        if progress:
            progress.stop()
        scores = [task.score(o, item) for o, item in zip(outputs, items)]
        points.append(point_from(effort, scores, [o.reasoning_tokens for o in outputs],
                                 [o.output_tokens for o in outputs],
                                 budget_forced=sum(o.budget_forced for o in outputs),
                                 unfinished=sum(not o.answered for o in outputs),
                                 seconds=round(time.perf_counter() - t0, 2)))
        for item, o, s in zip(items, outputs, scores):
            samples.append({"effort": effort, "id": item.get("id"), "score": s, "answer": o.answer,
                            "reasoning_tokens": o.reasoning_tokens, "output_tokens": o.output_tokens,
                            "finish_reason": o.finish_reason})
    return {"task": task.name, "points": [_point_json(p) for p in points], "samples": samples}


def _point_json(p: SweepPoint) -> dict:
    d = asdict(p)
    d["ci95"] = list(p.ci95)
    return d


def run_lm_eval_sweep(model, tokenizer, task: str, efforts: Sequence[int] = DEFAULT_EFFORTS, *,
                      limit: int | None = None, batch_size: int = 8, max_gen_toks: int | None = None,
                      thinking_budget: int | None = None, data_dir=None, include_path: list[str] | None = None,
                      progress=None) -> dict:
    """The effort sweep on an lm-eval generation task (thinking mode, the chat encoding at each
    effort). Accuracy is the task's first reported metric under its first filter, per document;
    token counts come from the adapter's generation log."""
    import tempfile

    from dsv41.evals.lm_eval_model import DSV41LM, make_task_manager, run_tasks

    points, samples, chosen = [], [], None
    with tempfile.TemporaryDirectory(prefix="dsv41-tasks-") as generated:
        tm = make_task_manager([task], generated, include_path)
        for effort in efforts:
            lm = DSV41LM(model=model, tokenizer=tokenizer, mode="thinking", effort=effort, batch_size=batch_size,
                         max_gen_toks=max_gen_toks, thinking_budget=thinking_budget, progress=progress)
            t0 = time.perf_counter()
            results = run_tasks(lm, [task], tm, limit=limit, data_dir=data_dir)
            if not lm.generation_log:
                raise ValueError(f"task {task} made no generation requests: the effort sweep needs a generate_until task")
            per_doc = _per_document_scores(results, chosen)
            chosen = per_doc["key"]
            log = lm.generation_log
            points.append(point_from(effort, per_doc["scores"], [g["reasoning_tokens"] for g in log],
                                     [g["output_tokens"] for g in log],
                                     budget_forced=sum(g["budget_forced"] for g in log),
                                     unfinished=sum(not g["answered"] for g in log),
                                     seconds=round(time.perf_counter() - t0, 2)))
            samples += [{"effort": effort, **g} for g in log]
    return {"task": task, "metric": chosen, "points": [_point_json(p) for p in points], "samples": samples}


def _per_document_scores(results: dict, key: str | None) -> dict:
    """Per-document values of one metric (e.g. "exact_match,flexible-extract") over every leaf task."""
    per_task = results.get("samples") or {}
    if key is None:  # the first metric,filter pair of the first leaf task with samples
        for task, rows in per_task.items():
            for k in (results["results"].get(task) or {}):
                if "," in k and "_stderr" not in k:
                    key = k
                    break
            if key:
                break
    if key is None:
        raise ValueError("the task reported no metric")
    metric, _, filt = key.partition(",")
    scores = [float(s[metric]) for rows in per_task.values() for s in rows
              if s.get("filter", "none") == filt and metric in s]
    if not scores:
        raise ValueError(f"no per-document values of {key} in the samples")
    return {"key": key, "scores": scores}


# ============================================================================ outputs
CSV_COLUMNS = ("effort", "accuracy", "ci95_low", "ci95_high", "mean_reasoning_tokens", "mean_output_tokens", "n")


def sweep_csv(doc: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for p in doc["points"]:
        w.writerow([p["effort"], f"{p['accuracy']:.6f}", f"{p['ci95'][0]:.6f}", f"{p['ci95'][1]:.6f}",
                    f"{p['mean_reasoning_tokens']:.3f}", f"{p['mean_output_tokens']:.3f}", p["n"]])
    return buf.getvalue()


def write_sweep(doc: dict, out_dir: Path, plot: bool = True) -> list[Path]:
    """sweep.json (points and per-item samples), sweep.csv and sweep.png under out_dir."""
    from dsv41.evals.reports import write_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "sweep.json", out_dir / "sweep.csv"]
    write_atomic(paths[0], json.dumps(doc, indent=2) + "\n")
    write_atomic(paths[1], sweep_csv(doc))
    if plot:
        from dsv41.evals.plots import plot_sweep

        png = out_dir / "sweep.png"
        plot_sweep(doc, png)
        paths.append(png)
    return paths


PRESET_OF = {v: k for k, v in EFFORT_PRESETS.items()}  # 50 -> "low", 75 -> "high", 100 -> "max"
