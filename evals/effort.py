"""The effort sweep (report Figure 9).

Generation
    Batched generation (`generate`, `GenRequest`, `GenOutput`) lives in evals/batch_generate.py, over the
    engine's scheduler (continuous batching; stop strings looked for in the answer only, an optional
    thinking budget). It is imported here, where the sweep uses it, under its names.

Effort sweep
    V4.1 conditions on the effort b in 1..100 through the prompt's effort line (spec §7). For each
    effort the sweep encodes every item at that effort, generates greedily, scores the answers and
    reports accuracy with a 95% Wilson interval, mean reasoning tokens and mean output tokens (all
    generated tokens: reasoning, `</think>`, answer and EOS, i.e. what an API bills as output).

Interrupt and resume
    With a `SweepStore` the sweep appends each finished unit to `partial.jsonl` in the output folder as
    it completes (one flushed JSON line per unit, after a first line holding the settings'
    fingerprint): for the bundled task a unit is one finished item of one effort (its score and token
    counts), written as the engine finishes it, for an lm-eval task one effort. A rerun with the same
    settings reuses the stored units and generates only the rest. A row's tokens do not depend on what
    else the engine runs beside it (batch invariance, docs/generation.md), so a resumed sweep gives the
    same numbers as an uninterrupted one (only the `seconds` timings differ). Units written by earlier
    versions (several items each) are read the same way.
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
              progress=None, store: "SweepStore | None" = None, items: list[dict] | None = None,
              pool=None) -> dict:
    """Accuracy and token use of `task` at each effort: the `dsv41 effort-sweep` JSON document.

    progress: an object with start(label, total) / advance(n) / stop(), or None.
    store: a `SweepStore` (opened with `SweepStore.open`): finished batches are appended to it as they
    complete and batches it already holds are not generated again.
    items: the task's items when the caller has loaded them (else `task.items(limit)`).
    pool: an evals.engine_pool.EnginePool to spread each effort's requests over (the same results)."""
    items = task.items(limit) if items is None else items
    if not items:
        raise ValueError(f"task {task.name} has no items")
    all_requests = {effort: [GenRequest(tokenizer.encode(task.prompt(item, effort), allow_special=True),
                                        max_new_tokens=task.max_new_tokens, thinking_budget=thinking_budget)
                             for item in items] for effort in efforts}
    limit_len = model.args.max_seq_len
    for requests in all_requests.values():  # before any generation: a too-long prompt fails at once
        longest = max(len(r.prompt_ids) for r in requests)
        if longest + task.max_new_tokens > limit_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({task.max_new_tokens}) exceed "
                             f"the model's max_seq_len ({limit_len})")
    # Every effort's requests in one engine run, the highest effort (the longest reasoning) first: the long
    # requests start early and decode beside the short ones, where effort after effort each ended on its few
    # longest requests decoding alone. A request's tokens do not depend on what decodes beside it.
    rows: dict[int, dict[int, dict]] = {effort: {} for effort in efforts}
    seconds = dict.fromkeys(efforts, 0.0)
    for effort in efforts:
        for record in (store.batches(effort).values() if store else ()):  # finished before an interrupt
            rows[effort].update(zip(record["batch"], record["rows"]))
            seconds[effort] += record["seconds"]
    todo = [(effort, i) for effort in sorted(efforts, reverse=True) for i in range(len(items))
            if i not in rows[effort]]
    if progress:
        label = f"effort {efforts[0]}" if len(efforts) == 1 else f"{len(efforts)} efforts"
        progress.start(f"{task.name} · {label}", len(items) * len(efforts))
        progress.advance(len(items) * len(efforts) - len(todo))

    def done(j, o):
        effort, i = todo[j]
        # seconds: the item's share of the engine's time (its prefill and its part of each decode step)
        record = {"effort": effort, "batch": [i], "seconds": round(o.engine_seconds, 4),
                  "rows": [_row_of(items[i], o, task.score(o, items[i]))]}
        if store:
            store.append(record)
        rows[effort][i] = record["rows"][0]
        seconds[effort] += record["seconds"]
        if progress:
            progress.advance(1)

    try:
        if todo:
            generate(model, tokenizer, [all_requests[effort][i] for effort, i in todo], batch_size=batch_size,
                     on_done=done, pool=pool)
    finally:
        if progress:
            progress.stop()
    points, samples = [], []
    for effort in efforts:
        ordered = [rows[effort][i] for i in range(len(items))]
        points.append(point_from(effort, [r["score"] for r in ordered], [r["reasoning_tokens"] for r in ordered],
                                 [r["output_tokens"] for r in ordered],
                                 budget_forced=sum(r["budget_forced"] for r in ordered),
                                 unfinished=sum(not r["answered"] for r in ordered),
                                 seconds=round(seconds[effort], 2)))
        samples += [{"effort": effort, **{k: r[k] for k in SAMPLE_KEYS}} for r in ordered]
    return {"task": task.name, "points": [_point_json(p) for p in points], "samples": samples}


SAMPLE_KEYS = ("id", "score", "answer", "reasoning_tokens", "output_tokens", "finish_reason")  # after "effort"


def _row_of(item: dict, o: GenOutput, score: float) -> dict:
    return {"id": item.get("id"), "score": score, "answer": o.answer, "reasoning_tokens": o.reasoning_tokens,
            "output_tokens": o.output_tokens, "finish_reason": o.finish_reason,
            "budget_forced": bool(o.budget_forced), "answered": bool(o.answered)}


def _point_json(p: SweepPoint) -> dict:
    d = asdict(p)
    d["ci95"] = list(p.ci95)
    return d


def run_lm_eval_sweep(model, tokenizer, task: str, efforts: Sequence[int] = DEFAULT_EFFORTS, *,
                      limit: int | None = None, batch_size: int = 8, max_gen_toks: int | None = None,
                      thinking_budget: int | None = None, data_dir=None, include_path: list[str] | None = None,
                      progress=None, store: "SweepStore | None" = None, pool=None) -> dict:
    """The effort sweep on an lm-eval generation task (thinking mode, the chat encoding at each
    effort). Accuracy is the task's first reported metric under its first filter, per document;
    token counts come from the adapter's generation log. With a `store`, each finished effort is
    appended to it and efforts it already holds are not run again. pool: an EnginePool the adapter's
    generations spread over."""
    import tempfile

    from dsv41.evals.lm_eval_model import DSV41LM, make_task_manager, run_tasks

    points, samples, chosen = [], [], None
    with tempfile.TemporaryDirectory(prefix="dsv41-tasks-") as generated:
        tm = None
        for effort in efforts:
            record = store.effort_record(effort) if store else None
            if record is None:
                if tm is None:
                    tm = make_task_manager([task], generated, include_path)
                lm = DSV41LM(model=model, tokenizer=tokenizer, mode="thinking", effort=effort, batch_size=batch_size,
                             max_gen_toks=max_gen_toks, thinking_budget=thinking_budget, progress=progress, pool=pool)
                t0 = time.perf_counter()
                results = run_tasks(lm, [task], tm, limit=limit, data_dir=data_dir)
                if not lm.generation_log:
                    raise ValueError(f"task {task} made no generation requests: the effort sweep needs a generate_until task")
                per_doc = _per_document_scores(results, chosen)
                log = lm.generation_log
                point = point_from(effort, per_doc["scores"], [g["reasoning_tokens"] for g in log],
                                   [g["output_tokens"] for g in log],
                                   budget_forced=sum(g["budget_forced"] for g in log),
                                   unfinished=sum(not g["answered"] for g in log),
                                   seconds=round(time.perf_counter() - t0, 2))
                record = {"effort": effort, "metric": per_doc["key"], "point": _point_json(point),
                          "samples": [{"effort": effort, **g} for g in log]}
                if store:
                    store.append(record)
            chosen = record["metric"]
            points.append(record["point"])
            samples += record["samples"]
    return {"task": task, "metric": chosen, "points": points, "samples": samples}


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


def write_sweep(doc: dict, out_dir: Path, plot: bool = True, plot_path: str | os.PathLike | None = None) -> list[Path]:
    """sweep.json (points and per-item samples), sweep.csv and the figure (sweep.png, or plot_path)
    under out_dir."""
    from dsv41.evals.reports import write_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "sweep.json", out_dir / "sweep.csv"]
    write_atomic(paths[0], json.dumps(doc, indent=2) + "\n")
    write_atomic(paths[1], sweep_csv(doc))
    if plot:
        from dsv41.evals.plots import plot_sweep

        figure = Path(plot_path) if plot_path is not None else out_dir / "sweep.png"
        figure.parent.mkdir(parents=True, exist_ok=True)
        paths.append(plot_sweep(doc, figure))
    return paths


PRESET_OF = {v: k for k, v in EFFORT_PRESETS.items()}  # 50 -> "low", 75 -> "high", 100 -> "max"


# ============================================================================ interrupt and resume
class SettingsChanged(ValueError):
    """The output folder holds a partial sweep made with other settings."""


class SweepStore:
    """`partial.jsonl` in the sweep's output folder: the settings' fingerprint on the first line, then
    one line per finished unit, each appended and flushed to disk as the unit completes. A line cut
    short by a kill is dropped on the next open (that unit is computed again)."""

    NAME = "partial.jsonl"

    def __init__(self, path: Path, fingerprint: dict, records: list[dict]):
        self.path, self.fingerprint, self.records = path, fingerprint, records
        self.reused = len(records)

    @classmethod
    def open(cls, out_dir: str | os.PathLike, fingerprint: dict, fresh: bool = False) -> "SweepStore":
        """Reuse the folder's partial results made with the same settings; with other settings raise
        SettingsChanged (fresh=True discards them and starts over)."""
        out_dir = Path(out_dir)
        path = out_dir / cls.NAME
        if out_dir.exists() and not out_dir.is_dir():
            raise NotADirectoryError(f"{out_dir} is not a folder")
        fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back
        records: list[dict] = []
        if path.exists() and not fresh:
            head, records, good = cls._read(path)
            if head is not None and head.get("settings") != fingerprint:
                changed = sorted(k for k in set(fingerprint) | set(head.get("settings") or {})
                                 if fingerprint.get(k) != (head.get("settings") or {}).get(k))
                raise SettingsChanged(f"{out_dir} holds a partial sweep made with other settings "
                                      f"({', '.join(changed) or 'format'}); pass another --output, or --fresh "
                                      f"to discard it and start over")
            if head is not None:
                with path.open("r+b") as f:  # drop a last line cut short by a kill
                    f.truncate(good)
                return cls(path, fingerprint, records)
        if path.exists():  # --fresh, or a file without a whole first line: the first unit rewrites it
            path.unlink()
        return cls(path, fingerprint, [])

    @staticmethod
    def _read(path: Path) -> tuple[dict | None, list[dict], int]:
        """(the settings line, the unit records, the bytes of whole lines) of a partial.jsonl."""
        good, head, records = 0, None, []
        with path.open("rb") as f:
            for raw in f:
                try:
                    line = json.loads(raw) if raw.endswith(b"\n") else None
                except ValueError:
                    line = None
                if line is None:
                    break
                if head is None:
                    head = line
                else:
                    records.append(line)
                good += len(raw)
        return head, records, good

    def append(self, record: dict) -> None:
        if not self.path.exists():
            from dsv41.evals.reports import write_atomic

            write_atomic(self.path, json.dumps({"settings": self.fingerprint}) + "\n")
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)

    def batches(self, effort: int) -> dict[tuple, dict]:
        """The stored generation batches of one effort, by their item indices."""
        return {tuple(r["batch"]): r for r in self.records if r.get("effort") == effort and "batch" in r}

    def effort_record(self, effort: int) -> dict | None:
        """The stored result of one whole effort (lm-eval tasks)."""
        return next((r for r in self.records if r.get("effort") == effort and "point" in r), None)

    def on_disk(self) -> list[dict]:
        """The unit records the file holds now (after a Ctrl-C, what a rerun will reuse: a record
        written just as the interrupt came is on disk though `append` did not return)."""
        return self._read(self.path)[1] if self.path.exists() else []

    def items_done(self) -> int:
        """Finished effort x item pairs on disk (for an lm-eval task: their documents)."""
        return sum(len(r["batch"]) if "batch" in r else len(r.get("samples") or []) for r in self.on_disk())


def model_fingerprint(model_dir: str | os.PathLike) -> dict:
    """What tells a checkpoint apart without reading its weights: its path, its config's hash and the
    sizes of its files."""
    import hashlib

    model_dir = Path(model_dir).resolve()
    config = model_dir / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else None
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file() and p.suffix == ".safetensors")
    return {"path": str(model_dir), "config_sha256": digest, "weight_bytes": size}
