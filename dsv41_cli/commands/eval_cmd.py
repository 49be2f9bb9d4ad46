"""`dsv41 eval`: lm-evaluation-harness tasks (or a report suite) on our model."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import err, fail, out, print_json


class StepProgress:
    """A rich progress bar with ETA on stderr, driven by start(label, total) / advance(n) / stop()."""

    def __init__(self, enabled: bool = True, unit: str = ""):
        self.enabled, self.unit = enabled, unit
        self._bar = self._task = None

    def start(self, label: str, total: int) -> None:
        if not self.enabled:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn(self.unit), TimeElapsedColumn(), TextColumn("ETA"),
                             TimeRemainingColumn(), console=err, transient=False)
        self._bar.start()
        self._task = self._bar.add_task(label, total=total)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def quiet_libraries() -> None:
    """lm-eval and datasets log and draw tqdm bars on stderr; keep them to errors."""
    import logging

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("lm-eval", "lm_eval", "datasets", "evaluate", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)


def go_offline() -> None:
    """No Hub access: set before `datasets`/`huggingface_hub` are imported (they read it once)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def need_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
        import datasets  # noqa: F401
    except ImportError:
        fail("dsv41 eval needs lm-eval and datasets: pip install 'dsv41[eval]'")


def command(
    tasks: Optional[str] = typer.Argument(None, help="Comma list of lm-eval task names or aliases (mmlu-pro, gsm8k, humaneval, ...)."),
    suite: Optional[str] = typer.Option(None, "--suite", help="A report suite: table1, table3 or smoke (or a suite .toml file)."),
    limit: Optional[float] = typer.Option(None, "--limit", min=0, help="Documents per task (a fraction if < 1)."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", min=0, help="Override the tasks' few-shot count."),
    mode: Optional[str] = typer.Option(None, "--mode", help="thinking|chat: apply the V4.1 chat encoding (default: raw text, as a base model)."),
    effort: str = typer.Option("high", "--effort", help="Reasoning effort 1..100 or low|high|max (with --mode thinking)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    max_gen_toks: Optional[int] = typer.Option(None, "--max-gen-toks", min=1, help="Override every task's generation length."),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", min=0, help="Force </think> after this many reasoning tokens."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Serve datasets from DIR/<hub path>/<split>.jsonl (implies offline)."),
    include_path: Optional[list[Path]] = typer.Option(None, "--include-path", help="A directory of task YAMLs (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", help="Write results.json, samples and a resume cache here."),
    confirm_run_unsafe_code: bool = typer.Option(False, "--confirm-run-unsafe-code", help="Allow tasks that execute model-written code (HumanEval)."),
    offline: bool = typer.Option(False, "--offline", help="Never contact the Hugging Face Hub."),
    model: Optional[str] = ModelOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    if mode is not None and mode not in ("thinking", "chat"):
        fail(f"--mode must be thinking or chat, not {mode!r}")
    from dsv41.model import encoding

    try:
        effort_value = encoding.parse_effort(effort)
    except ValueError as e:
        fail(str(e))
    if not tasks and not suite:
        fail("give TASKS (a comma list) or --suite NAME")
    if tasks and suite:
        fail("give TASKS or --suite, not both")
    if data_dir is not None and not data_dir.is_dir():
        fail(f"--data-dir {data_dir}: not a directory")
    for p in include_path or []:
        if not p.is_dir():
            fail(f"--include-path {p}: not a directory")

    suite_spec = None
    if suite:
        from dsv41.evals.reports import SuiteError, load_suite

        try:
            suite_spec = load_suite(suite)
        except SuiteError as e:
            fail(str(e))
    if offline or data_dir is not None or (suite_spec is not None and suite_spec.offline):
        go_offline()
    quiet_libraries()
    need_lm_eval()

    # one process, or one rank under torchrun: every rank runs lm-eval and the model calls (the adapter
    # divides the work between model copies), rank 0 alone shows progress, prints and writes files
    ctx = start_ranks(device)
    model_dir = resolve_model_dir(model)
    net, args, tokenizer = load_on_ranks(model_dir, ctx)

    from dsv41.evals.lm_eval_model import DSV41LM

    progress = StepProgress(enabled=ctx.is_main)

    def make_lm(lm_mode):
        return DSV41LM(model=net, tokenizer=tokenizer, mode=lm_mode, effort=effort_value, batch_size=batch_size,
                       max_gen_toks=max_gen_toks, thinking_budget=thinking_budget, progress=progress, ctx=ctx)

    settings = {"model": str(model_dir), "mode": mode, "effort": effort_value if mode == "thinking" else None,
                "limit": limit, "num_fewshot": num_fewshot, "batch_size": batch_size, "max_gen_toks": max_gen_toks,
                "thinking_budget": thinking_budget, "data_dir": str(data_dir) if data_dir else None,
                "device": ctx.device}
    if ctx.distributed:
        settings["parallel"] = {"world": ctx.world, "tp": ctx.tp, "model_copies": ctx.dp}
    if suite_spec is not None:
        _run_suite(suite_spec, make_lm, mode, settings, limit, num_fewshot, data_dir, include_path, output,
                   confirm_run_unsafe_code, as_json)
        return
    names = [t for t in (s.strip() for s in tasks.split(",")) if t]
    if not names:
        fail("TASKS is empty")
    _run_tasks(names, make_lm(mode), settings, limit, num_fewshot, data_dir, include_path, output,
               confirm_run_unsafe_code, as_json)


def _cache_path(output: Path | None, lm, settings: dict) -> str | None:
    """The request cache (sqlite) under --output, keyed by everything that changes answers. Under
    torchrun rank 0 alone keeps it (`DSV41LM.open_request_cache`)."""
    if output is None:
        return None
    key = json.dumps({"model": settings["model"], "tok": lm.tokenizer_name, "max_gen_toks": lm.max_gen_toks,
                      "max_length": lm.max_length}, sort_keys=True)
    return str(output / "cache" / hashlib.sha256(key.encode()).hexdigest()[:16])


def _evaluate(names, lm, limit, num_fewshot, data_dir, include_path, output, confirm, settings):
    from dsv41.evals.lm_eval_model import make_task_manager, run_tasks
    from dsv41.evals.tasks import resolve

    resolved = [resolve(n, lm.mode) for n in names]
    with tempfile.TemporaryDirectory(prefix="dsv41-tasks-") as generated:
        tm = make_task_manager(resolved, generated, [str(p) for p in include_path or []])
        limit_arg = int(limit) if limit is not None and limit >= 1 else limit
        return resolved, run_tasks(lm, resolved, tm, limit=limit_arg, num_fewshot=num_fewshot, data_dir=data_dir,
                                   cache_path=_cache_path(output, lm, settings), confirm_run_unsafe_code=confirm)


def explain_failure(e: Exception) -> str:
    """One line for a task that could not run."""
    text = " ".join(str(e).split())
    if "OfflineModeIsEnabled" in text or "Couldn't reach" in text or "offline" in text.lower():
        return f"dataset not available offline ({text[:160]}); serve it with --data-dir"
    if "unsafe" in text.lower():
        return "executes model-written code: pass --confirm-run-unsafe-code"
    return f"{type(e).__name__}: {text[:200]}"


def _run_tasks(names, lm, settings, limit, num_fewshot, data_dir, include_path, output, confirm, as_json):
    from dsv41.evals.lm_eval_model import UnknownTask

    try:
        resolved, results = _evaluate(names, lm, limit, num_fewshot, data_dir, include_path, output, confirm, settings)
    except UnknownTask as e:
        fail(str(e))
    except Exception as e:  # a dataset that cannot be reached, a task that refuses to run
        if os.environ.get("DSV41_DEBUG"):
            raise
        fail(explain_failure(e))
    from dsv41.evals.lm_eval_model import metrics_of

    doc = {"results": metrics_of(results), "config": {**settings, "tasks": resolved,
                                                       "served_locally": results.get("served_locally", [])}}
    if not lm.ctx.is_main:  # every rank holds rank 0's results; rank 0 reports them
        return
    if output is not None:
        from dsv41.evals.reports import write_eval_outputs

        write_eval_outputs(output, results, doc)
    if as_json:
        print_json(doc)
    else:
        _print_table(results)
        if output is not None:
            err.print(f"[dim]results written to {output}[/dim]", markup=True)


def _print_table(results: dict) -> None:
    from rich.table import Table

    from dsv41.evals.reports import result_rows

    table = Table(title="dsv41 eval", show_lines=False)
    for col in ("Task", "Filter", "n-shot", "Metric", "", "Value", "± Stderr"):
        table.add_column(col, justify="right" if col in ("n-shot", "Value", "± Stderr") else "left")
    for r in result_rows(results):
        table.add_row(r["task"], r["filter"], str(r["n_shot"]), r["metric"], r["arrow"], f"{r['value']:.4f}",
                      "" if r["stderr"] is None else f"{r['stderr']:.4f}")
    out.print(table)


def _run_suite(suite, make_lm, mode, settings, limit, num_fewshot, data_dir, include_path, output, confirm, as_json):
    from dsv41.evals.reports import row_mode, run_suite, write_report

    output = output or Path(f"eval-{suite.name}")

    def evaluate_row(row):
        lm = make_lm(row_mode(row, suite, mode))
        return _evaluate([row.task], lm, limit, row.shots if num_fewshot is None else num_fewshot, data_dir,
                         include_path, output, confirm, settings)[1]

    from dsv41.model.parallel import current

    is_main = current().is_main
    report = run_suite(suite, evaluate_row, explain_failure,
                       log=(lambda m: err.print(m, markup=False)) if is_main else (lambda m: None),
                       mode_override=mode)
    if not is_main:  # every rank computed the same report; rank 0 writes it
        return
    report["config"] = settings
    paths = write_report(report, output)
    if as_json:
        print_json(report)
    else:
        from dsv41.evals.reports import render_markdown

        out.print(render_markdown(report), markup=False)
        err.print(f"[dim]report written to {', '.join(str(p) for p in paths)}[/dim]", markup=True)
