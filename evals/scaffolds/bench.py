"""The scaffold bench: the same backend and tasks under several scaffolds (and efforts), one report.

Per (scaffold, effort) row, over all its episodes (agent tasks and function-calling items):

* ``pass_rate``          passed / episodes;
* ``format_error_rate``  steps whose reply could not be read / all steps (model calls);
* ``mean_steps``         model calls per episode (a function-calling item is one);
* ``mean_output_tokens`` generated tokens per episode (null when the backend reports none);

plus the same split by kind (``by_kind``: agent, function_calling). The markdown table is laid out like
Table 4 of the report (one row per harness configuration); the spread of pass rates across scaffolds at
each effort is what says whether the model is robust to the harness.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Callable

from dsv41.evals.scaffolds.backends import effort_label
from dsv41.evals.scaffolds.loop import EpisodeResult, run_agent_episode, run_function_calling_item
from dsv41.evals.scaffolds.sandbox import Sandbox
from dsv41.evals.scaffolds.scaffold import Scaffold
from dsv41.evals.scaffolds.tasks import AgentTask, FunctionCallingItem


def run_bench(backend, scaffolds: list[Scaffold], tasks: list[AgentTask], items: list[FunctionCallingItem],
              efforts: list[int | None], sandbox: Sandbox | None = None, *, max_steps: int | None = None,
              on_episode: Callable[[EpisodeResult], None] | None = None, keep_messages: bool = False,
              jobs: int = 1, done: dict | None = None) -> dict:
    """Run every task and item under every scaffold and effort; return the report (see summarize).

    jobs: episodes run at once (threads; each episode has its own jail). The backend must then be
    thread-safe, its ``begin`` state kept per thread (the oracle and endpoint backends are).
    The jail is checked before the first episode: if it cannot be set up, SandboxUnavailable is raised
    and no command runs.

    done: finished episodes from an earlier, interrupted run ({episode_key(...): EpisodeResult}, see
    PartialResults); they are not run again and take their place in the report, which is then the
    same as an uninterrupted run's."""
    done = done or {}
    if tasks:
        if sandbox is None:
            raise ValueError("agent tasks need a sandbox")
        sandbox.check()
    work = []
    for scaffold in scaffolds:
        for effort in efforts:
            work += [(task, scaffold, effort) for task in tasks]
            work += [(item, scaffold, effort) for item in items]

    def run(entry) -> EpisodeResult:
        task, scaffold, effort = entry
        if task.kind == "agent":
            result = run_agent_episode(task, scaffold, backend, sandbox, effort, max_steps, keep_messages=keep_messages)
        else:
            result = run_function_calling_item(task, scaffold, backend, effort, keep_messages=keep_messages)
        if on_episode:
            on_episode(result)
        return result

    keys = [episode_key(task.kind, task.id, scaffold.name, effort) for task, scaffold, effort in work]
    todo = [entry for entry, key in zip(work, keys) if key not in done]
    if jobs <= 1:
        fresh = [run(entry) for entry in todo]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run, entry) for entry in todo]
            try:
                fresh = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finished = dict(done)
    finished.update({episode_key(r.kind, r.task, r.scaffold, r.effort): r for r in fresh})
    episodes = [finished[key] for key in keys]
    report = summarize(episodes, [s.name for s in scaffolds], efforts)
    report["backend"] = getattr(backend, "name", type(backend).__name__)
    report["scaffolds"] = [s.summary() for s in scaffolds]
    report["tasks"] = {"agent": [t.id for t in tasks], "function_calling": [i.id for i in items]}
    return report


def episode_key(kind: str, task_id: str, scaffold: str, effort: int | None) -> str:
    """What names one episode of a bench: task x scaffold x effort."""
    return json.dumps([kind, task_id, scaffold, effort])


def episode_from_json(doc: dict) -> EpisodeResult:
    """An EpisodeResult back from its to_json() form (step records stay dicts; to_json() gives the same)."""
    names = {f.name for f in fields(EpisodeResult)}
    return EpisodeResult(**{k: v for k, v in doc.items() if k in names})


PARTIAL_FILE = "partial.jsonl"


class SettingsChanged(ValueError):
    """partial.jsonl in the output directory was written by a run with other settings."""


class PartialResults:
    """``partial.jsonl`` in the output directory: the episodes finished so far, so that an interrupted
    bench loses nothing and the same command resumes it.

    The first line is ``{"settings": {...}}`` (what the results depend on); each further line is one
    finished episode (EpisodeResult.to_json()), appended and flushed as the episode ends. A line cut
    short by a crash is dropped when the file is read back. Opening a file written with other
    settings raises SettingsChanged (nothing is mixed, nothing is deleted)."""

    def __init__(self, directory: str | Path, settings: dict):
        self.path = Path(directory) / PARTIAL_FILE
        self.settings = json.loads(json.dumps(settings))
        self.done: dict[str, EpisodeResult] = {}
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
        header = None
        if lines:
            try:
                header = json.loads(lines[0]).get("settings")
            except (ValueError, AttributeError):
                header = None
        if lines and header is not None and header != self.settings:
            changed = sorted(k for k in set(header) | set(self.settings) if header.get(k) != self.settings.get(k))
            raise SettingsChanged(", ".join(changed) or "settings")
        kept = [json.dumps({"settings": self.settings}, ensure_ascii=False)]
        for line, result in _episodes(lines[1:] if header is not None else []):
            self.done[episode_key(result.kind, result.task, result.scaffold, result.effort)] = result
            kept.append(line)
        _write_atomic(self.path, "".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def add(self, result: EpisodeResult) -> None:
        with self._lock:
            self._file.write(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
            self._file.flush()

    def kept(self) -> int:
        """The finished episodes the file holds now (what the same command would reuse): counted from the file
        itself, so that an interrupt landing between an episode's line and a caller's own count cannot make
        the two disagree."""
        with self._lock:
            self._file.flush()
            lines = self.path.read_text(encoding="utf-8").splitlines()[1:]
        return sum(1 for _ in _episodes(lines))

    def close(self) -> None:
        self._file.close()


def _episodes(lines: list[str]):
    """(line, EpisodeResult) of each readable episode line of partial.jsonl; a line cut short is skipped."""
    for line in lines:
        try:
            yield line, episode_from_json(json.loads(line))
        except (ValueError, TypeError):
            continue  # a torn last line


def _aggregate(episodes: list[EpisodeResult]) -> dict:
    n = len(episodes)
    steps = sum(e.steps for e in episodes)
    known_tokens = [e.output_tokens for e in episodes if e.output_tokens is not None]
    passed = sum(e.passed for e in episodes)
    return {
        "tasks": n,
        "passed": passed,
        "pass_rate": passed / n if n else 0.0,
        "format_error_rate": sum(e.format_errors for e in episodes) / steps if steps else 0.0,
        "mean_steps": steps / n if n else 0.0,
        "mean_output_tokens": (sum(known_tokens) / len(known_tokens)) if known_tokens and len(known_tokens) == n else None,
    }


def summarize(episodes: list[EpisodeResult], scaffold_order: list[str], efforts: list[int | None]) -> dict:
    """The report: one row per (scaffold, effort), the spread across scaffolds per effort, and the
    per-episode results."""
    rows = []
    for name in scaffold_order:
        for effort in efforts:
            group = [e for e in episodes if e.scaffold == name and e.effort == effort]
            if not group:
                continue
            row = {"scaffold": name, "effort": effort, **_aggregate(group)}
            row["by_kind"] = {kind: _aggregate([e for e in group if e.kind == kind])
                              for kind in ("agent", "function_calling") if any(e.kind == kind for e in group)}
            ends: dict[str, int] = {}
            for e in group:
                ends[e.end_reason] = ends.get(e.end_reason, 0) + 1
            row["end_reasons"] = ends
            rows.append(row)
    spread = []
    for effort in efforts:
        rates = [r["pass_rate"] for r in rows if r["effort"] == effort]
        if rates:
            spread.append({"effort": effort, "min_pass_rate": min(rates), "max_pass_rate": max(rates),
                           "spread": max(rates) - min(rates)})
    return {"rows": rows, "spread": spread, "episodes": [e.to_json() for e in episodes]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def markdown_table(report: dict) -> str:
    """Table-4-style markdown: one row per scaffold and effort."""
    lines = [
        "| Scaffold | Effort | Tasks | Passed | Pass rate (%) | Agent pass (%) | Function-call pass (%) "
        "| Format errors (%) | Mean steps | Mean output tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        kinds = row.get("by_kind", {})
        agent = kinds.get("agent", {}).get("pass_rate")
        calls = kinds.get("function_calling", {}).get("pass_rate")
        tokens = row["mean_output_tokens"]
        lines.append(
            f"| {row['scaffold']} | {effort_label(row['effort'])} | {row['tasks']} | {row['passed']} "
            f"| {_pct(row['pass_rate'])} | {_pct(agent)} | {_pct(calls)} | {_pct(row['format_error_rate'])} "
            f"| {row['mean_steps']:.2f} | {'-' if tokens is None else f'{tokens:.1f}'} |"
        )
    for s in report.get("spread", []):
        lines.append("")
        lines.append(f"Spread across scaffolds at effort {effort_label(s['effort'])}: "
                     f"{_pct(s['min_pass_rate'])}-{_pct(s['max_pass_rate'])}% "
                     f"({100 * s['spread']:.1f} points).")
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: str | Path) -> Path:
    """A grouped bar plot of pass rate per scaffold (one bar per effort). Needs matplotlib (the
    ``plots`` extra); imported here, not at module import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    scaffolds = list(dict.fromkeys(r["scaffold"] for r in rows))
    efforts = list(dict.fromkeys(r["effort"] for r in rows))
    width = 0.8 / max(len(efforts), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(scaffolds) + 2), 3.6))
    for j, effort in enumerate(efforts):
        xs, heights = [], []
        for i, name in enumerate(scaffolds):
            row = next((r for r in rows if r["scaffold"] == name and r["effort"] == effort), None)
            if row is not None:
                xs.append(i + (j - (len(efforts) - 1) / 2) * width)
                heights.append(100 * row["pass_rate"])
        bars = ax.bar(xs, heights, width=width * 0.95, label=f"effort {effort_label(effort)}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(scaffolds)), scaffolds)
    ax.set_ylabel("pass rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"scaffold-bench, backend {report.get('backend', '?')}")
    if len(efforts) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(report: dict, output_dir: str | Path, *, plot: bool = True, plot_file: str | Path | None = None) -> dict:
    """Write scaffold-bench.json, scaffold-bench.md, episodes.jsonl and (with matplotlib)
    scaffold-bench.png under ``output_dir``; each file appears complete or not at all.
    Returns {kind: path or None, "plot_skipped": reason or None}."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict = {}
    summary = {k: v for k, v in report.items() if k != "episodes"}
    _write_atomic(out / "scaffold-bench.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    written["json"] = str(out / "scaffold-bench.json")
    _write_atomic(out / "scaffold-bench.md", markdown_table(report))
    written["markdown"] = str(out / "scaffold-bench.md")
    _write_atomic(out / "episodes.jsonl",
                  "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in report.get("episodes", [])))
    written["episodes"] = str(out / "episodes.jsonl")
    written["plot"], written["plot_skipped"] = None, None
    if plot:
        try:
            written["plot"] = str(plot_report(report, plot_file or out / "scaffold-bench.png"))
        except ImportError:
            written["plot_skipped"] = "matplotlib is not installed (pip install 'dsv41[plots]')"
    return written
