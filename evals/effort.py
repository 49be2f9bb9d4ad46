"""The effort sweep (report Figure 9).

Generation
    Batched generation (`generate`, `GenRequest`, `GenOutput`) lives in evals/batch_generate.py: one
    prefill and one single-token forward per step for a batch, stop strings looked for in the answer
    only, an optional thinking budget. It is imported here, where the sweep uses it, under its names.

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
from typing import Protocol, Sequence

from dsv41.evals.batch_generate import GenOutput, GenRequest, cut_at_stop, generate  # noqa: F401
from dsv41.model.encoding import EFFORT_PRESETS, THINK_END

DEFAULT_EFFORTS = (1, 25, 50, 75, 100)


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
