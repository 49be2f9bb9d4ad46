"""`dsv41 eval`: lm-evaluation-harness tasks (or a report suite) on our model.

Offline: the Hub is probed once (`dsv41.evals.tasks.offline.hub_reachable`) before datasets is imported;
when it cannot be reached the run goes offline, so nothing waits on retries, and a dataset that is not
here is reported with the files to put where. Interrupt and resume: every answered request goes to the
request cache in --output as it finishes, results.json (tasks) or the report and rows/ (suites) are
rewritten after each task or row; Ctrl-C keeps them, and the same command resumes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import err, out, print_json

EPILOG = """Examples:

\b
  dsv41 eval tiny-reasoning --mode thinking --limit 20
  dsv41 eval mmlu-pro --data-dir DATA --limit 50 --output runs/eval/mmlu-pro
  dsv41 eval --suite smoke --limit 20 --confirm-run-unsafe-code
  dsv41 eval --suite table1 --data-dir DATA --model CKPT
"""
INSTALL_HINT = "pip install 'dsv41[eval]'"
FINGERPRINT = "settings.json"


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


def _fail(message: str, code: int = 2) -> "typer.Exit":
    """`dsv41: error: <message>` on stderr, one line, printed without markup (so `dsv41[eval]` keeps its
    brackets), and leave with `code`."""
    err.print(f"dsv41: error: {' '.join(str(message).split())}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _note(message: str) -> None:
    err.print(message, markup=False, soft_wrap=True)


def quiet_libraries() -> None:
    """lm-eval and datasets log and draw tqdm bars on stderr; keep them to errors."""
    import logging

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("lm-eval", "lm_eval", "datasets", "evaluate", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)


def go_offline() -> None:
    """No Hub access: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (and the libraries' flags if imported)."""
    from dsv41.evals.tasks.offline import set_offline

    set_offline()


def decide_offline(offline: bool, data_dir, suite_offline: bool, own_tasks_only: bool = False) -> tuple[bool, str]:
    """(run offline?, why the Hub was found unreachable or ""). Asked or implied offline: no probe.
    Otherwise one connect to the Hub, at most ~1.5 s, so that lm-eval never starts its retries."""
    from dsv41.evals.tasks.offline import env_offline, hub_reachable

    if offline or data_dir is not None or suite_offline or own_tasks_only or env_offline():
        return True, ""
    reachable, why = hub_reachable()
    return (not reachable), why


def need_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
        import datasets  # noqa: F401
    except ImportError:
        _fail(f"dsv41 eval needs lm-eval and datasets: {INSTALL_HINT}")



def default_output(tasks: Optional[str], suite_name: Optional[str]) -> Path:
    """runs/eval/<task-or-suite>/ under the current directory (several tasks: joined with '+')."""
    name = suite_name or "+".join(t.strip() for t in (tasks or "").split(",") if t.strip())
    return Path("runs") / "eval" / (re.sub(r"[^A-Za-z0-9_.+-]+", "_", name)[:120] or "eval")


def command(
    tasks: Optional[str] = typer.Argument(None, show_default=False,
                                          help="Comma list of lm-eval task names or aliases (mmlu-pro, gsm8k, humaneval, tiny-reasoning, ...)."),
    suite: Optional[str] = typer.Option(None, "--suite", show_default=False, help="A report suite: table1, table3 or smoke (or a suite .toml file)."),
    limit: Optional[float] = typer.Option(None, "--limit", min=0, show_default=False,
                                          help="At most the first N items of each task, in the dataset's order."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", min=0, show_default=False, help="Override the tasks' few-shot count."),
    mode: Optional[str] = typer.Option(None, "--mode", show_default=False, help="thinking|chat: apply the V4.1 chat encoding (default: raw text, as a base model)."),
    effort: str = typer.Option("high", "--effort", help="Reasoning effort 1..100 or low|high|max (with --mode thinking)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    engines: int = typer.Option(0, "--engines", min=0, show_default=False,
                                help="Engines generating at once on the CPU, one process each (default: one per CPU "
                                     "core, at most 8; 1 on a GPU or under torchrun). The results do not depend on it."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, show_default=False,
                                                 help="Generation length of every generating task (default: each task's own)."),
    max_gen_toks: Optional[int] = typer.Option(None, "--max-gen-toks", min=1, hidden=True, help="Old name of --max-new-tokens."),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", min=0, show_default=False, help="Force </think> after this many reasoning tokens."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", show_default=False,
                                            help="Serve datasets from DIR/<hub path>/<split>.jsonl (implies offline; docs/evaluation.md, Offline data)."),
    include_path: Optional[list[Path]] = typer.Option(None, "--include-path", show_default=False, help="A directory of task YAMLs (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", show_default=False,
                                          help="Folder for results.json, samples, the report and the resume cache. Default: runs/eval/TASKS-or-SUITE/. "
                                               "Rerunning the same command there resumes an interrupted run."),
    confirm_run_unsafe_code: bool = typer.Option(False, "--confirm-run-unsafe-code", help="Allow tasks that execute model-written code (HumanEval)."),
    offline: bool = typer.Option(False, "--offline", help="Never contact the Hugging Face Hub (also: HF_HUB_OFFLINE=1; an unreachable Hub is detected)."),
    model: Optional[str] = ModelOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    if mode is not None and mode not in ("thinking", "chat"):
        _fail(f"--mode must be thinking or chat, not {mode!r}")
    if max_gen_toks is not None:
        if max_new_tokens is not None and max_new_tokens != max_gen_toks:
            _fail("--max-new-tokens and --max-gen-toks (its old name) disagree: give one")
        max_new_tokens = max_gen_toks
    from dsv41.model import encoding

    try:
        effort_value = encoding.parse_effort(effort)
    except ValueError as e:
        _fail(str(e))
    if not tasks and not suite:
        _fail("give TASKS (a comma list) or --suite NAME")
    if tasks and suite:
        _fail("give TASKS or --suite, not both")
    if data_dir is not None and not data_dir.is_dir():
        _fail(f"--data-dir {data_dir}: not a directory")
    for p in include_path or []:
        if not p.is_dir():
            _fail(f"--include-path {p}: not a directory")
    names = [t for t in (s.strip() for s in (tasks or "").split(",")) if t]
    if tasks and not names:
        _fail("TASKS is empty")

    suite_spec = None
    if suite:
        from dsv41.evals.reports import SuiteError, load_suite

        try:
            suite_spec = load_suite(suite)
        except SuiteError as e:
            _fail(str(e))

    from dsv41.evals.tasks import OWN_TASKS, resolve

    own_only = bool(names) and not include_path and all(resolve(n, mode) in OWN_TASKS for n in names)
    run_offline, unreachable = decide_offline(offline, data_dir, suite_spec is not None and suite_spec.offline, own_only)
    if run_offline:
        go_offline()
    if unreachable:
        _note(f"dsv41: the Hugging Face Hub cannot be reached ({unreachable}); running offline: datasets come "
              "from --data-dir or the local cache")
    if names and run_offline:  # every dataset the tasks need must be here: say which files before loading the model
        from dsv41.evals.tasks.offline import check_alias_data

        problems = [(n, m) for n, m in ((n, check_alias_data(n, data_dir)) for n in names) if m]
        if problems:
            more = f" (no data either: {', '.join(n for n, _ in problems[1:])})" if len(problems) > 1 else ""
            _fail(problems[0][1] + more)
    quiet_libraries()
    need_lm_eval()

    output = output or default_output(tasks, suite_spec.name if suite_spec else None)
    model_dir = resolve_model_dir(model)
    fingerprint = {"what": {"suite": suite_spec.name} if suite_spec else {"tasks": names}, "model": str(model_dir),
                   "mode": mode, "effort": effort_value if mode is not None or suite_spec is not None else None,
                   "limit": limit,
                   "num_fewshot": num_fewshot, "max_new_tokens": max_new_tokens, "thinking_budget": thinking_budget,
                   "include_path": [str(p) for p in include_path or []]}
    _check_fingerprint(output, fingerprint)

    # one process, or one rank under torchrun: every rank runs lm-eval and the model calls (the adapter
    # divides the work between model copies), rank 0 alone shows progress, prints and writes files
    ctx = start_ranks(device)
    if engines > 1 and (ctx.distributed or ctx.device != "cpu"):
        _fail(f"--engines {engines}: several engines run on the CPU in one command (one process each), not on "
              f"{ctx.device} or under torchrun")
    net, args, tokenizer = load_on_ranks(model_dir, ctx)

    from dsv41.evals.engine_pool import EnginePool, default_engines
    from dsv41.evals.lm_eval_model import DSV41LM, GENERATION_ROWS
    from dsv41.model.engine import Generator

    progress = StepProgress(enabled=ctx.is_main)
    lms: list = []
    # generate_until's requests spread over this process's engine and engines - 1 worker processes
    pool = EnginePool(Generator(net, tokenizer, source=model_dir), model_dir,
                      1 if ctx.distributed else (engines or default_engines(ctx.device)), max(batch_size, GENERATION_ROWS))

    def make_lm(lm_mode):
        lm = DSV41LM(model=net, tokenizer=tokenizer, mode=lm_mode, effort=effort_value, batch_size=batch_size,
                     max_gen_toks=max_new_tokens, thinking_budget=thinking_budget, progress=progress, ctx=ctx,
                     pool=pool)
        lms.append(lm)
        return lm

    settings = {"model": str(model_dir), "mode": mode, "effort": effort_value if mode == "thinking" else None,
                "limit": limit, "num_fewshot": num_fewshot, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                "thinking_budget": thinking_budget, "data_dir": str(data_dir) if data_dir else None,
                "device": ctx.device, "offline": run_offline}
    if ctx.distributed:
        settings["parallel"] = {"world": ctx.world, "tp": ctx.tp, "model_copies": ctx.dp}
    if ctx.is_main:
        from dsv41.evals.reports import write_atomic

        write_atomic(output / FINGERPRINT, json.dumps(fingerprint, indent=2) + "\n")
    run = dict(limit=limit, num_fewshot=num_fewshot, data_dir=data_dir, include_path=include_path, output=output,
               confirm=confirm_run_unsafe_code, offline=run_offline, settings=settings)
    with pool:
        if suite_spec is not None:
            _run_suite(suite_spec, make_lm, mode, run, as_json, ctx, lms)
        else:
            _run_tasks(names, make_lm(mode), run, as_json, ctx)


def _check_fingerprint(output: Path, fingerprint: dict) -> None:
    """--output holding an earlier run with other settings: refuse (exit 2) rather than mix them."""
    f = output / FINGERPRINT
    kept = (output / "results.json").is_file() or any((output / "rows").glob("*.json")) or _cached(output) > 0
    if not f.is_file() or not kept:  # nothing kept there yet (e.g. a run that stopped on missing data)
        return
    try:
        old = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    changed = [k for k in fingerprint if old.get(k) != fingerprint[k]]
    if changed:
        k = changed[0]
        name = {"what": "tasks/suite", "max_new_tokens": "--max-new-tokens", "num_fewshot": "--num-fewshot",
                "include_path": "--include-path", "thinking_budget": "--thinking-budget"}.get(k, f"--{k}")
        _fail(f"{output} holds a run with other settings ({name}: {old.get(k)} there, {fingerprint[k]} now); "
              f"give this run its own --output DIR (or delete {output} to start over)")


def _cached(output: Path) -> int:
    """How many answers the request cache in `output` holds (sqlitedict's table "unnamed")."""
    import sqlite3

    n = 0
    for db in (output / "cache").glob("*.db"):
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                n += con.execute('SELECT COUNT(*) FROM "unnamed"').fetchone()[0]
        except sqlite3.Error:
            continue
    return n


def _cache_path(output: Path | None, lm, settings: dict) -> str | None:
    """The request cache (sqlite) under --output, keyed by everything that changes answers. Under
    torchrun rank 0 alone keeps it (`DSV41LM.open_request_cache`)."""
    if output is None:
        return None
    key = json.dumps({"model": settings["model"], "tok": lm.tokenizer_name, "max_gen_toks": lm.max_gen_toks,
                      "max_length": lm.max_length}, sort_keys=True)
    return str(output / "cache" / hashlib.sha256(key.encode()).hexdigest()[:16])


def _evaluate(names, lm, run, num_fewshot=None):
    from dsv41.evals.lm_eval_model import make_task_manager, run_tasks
    from dsv41.evals.tasks import resolve

    limit = run["limit"]
    resolved = [resolve(n, lm.mode) for n in names]
    with tempfile.TemporaryDirectory(prefix="dsv41-tasks-") as generated:
        tm = make_task_manager(resolved, generated, [str(p) for p in run["include_path"] or []])
        limit_arg = int(limit) if limit is not None and limit >= 1 else limit
        return resolved, run_tasks(lm, resolved, tm, limit=limit_arg,
                                   num_fewshot=run["num_fewshot"] if num_fewshot is None else num_fewshot,
                                   data_dir=run["data_dir"], cache_path=_cache_path(run["output"], lm, run["settings"]),
                                   confirm_run_unsafe_code=run["confirm"], offline=run["offline"])


def explain_failure(e: Exception) -> str:
    """One line for a task that could not run."""
    from dsv41.evals.tasks.offline import DataUnavailable, is_offline_error

    text = " ".join(str(e).split())
    if isinstance(e, DataUnavailable):
        return text
    if is_offline_error(e) or "offline" in text.lower():
        return (f"dataset not available offline ({text[:160]}); serve it with --data-dir DIR "
                '(docs/evaluation.md, "Offline data")')
    if "unsafe" in text.lower():
        return "executes model-written code: pass --confirm-run-unsafe-code"
    if "math_verify" in text or "antlr4" in text:
        return f"needs sympy, math_verify and antlr4-python3-runtime 4.11 (lm-eval's math extra): {INSTALL_HINT}"
    return f"{type(e).__name__}: {text[:200]}"


def _merge(total: dict | None, results: dict) -> dict:
    """lm-eval results of several runs (one task each) as one results dict."""
    if total is None:
        return dict(results)
    for k, v in results.items():
        if isinstance(v, dict) and isinstance(total.get(k), dict):
            total[k] = {**total[k], **v}
        elif k == "served_locally":
            total[k] = total.get(k, []) + [x for x in v if x not in total.get(k, [])]
        else:
            total[k] = v
    return total


def _interrupted(done: int, total: int, unit: str, output: Path, lms: list) -> None:
    asked = sum(lm.asked for lm in lms)
    answered = min(sum(lm.answered for lm in lms), asked)
    extra = f" ({answered} of {asked} requests answered so far are cached)" if asked else ""
    _note(f"interrupted: {done} of {total} {unit} done{extra}, kept in {output}; "
          "run the same command again to resume")


def _reused_note(lms: list, output: Path) -> None:
    reused = sum(lm.reused for lm in lms)
    if reused:
        _note(f"resumed: {reused} answers reused from the request cache in {output}")


def _run_tasks(names, lm, run, as_json, ctx):
    from dsv41.evals.lm_eval_model import UnknownTask
    from dsv41.evals.reports import write_atomic, write_eval_outputs

    output = run["output"]
    results, resolved = None, []
    try:
        for k, name in enumerate(names):
            try:
                (task,), res = _evaluate([name], lm, run)
            except UnknownTask as e:
                _fail(str(e))
            except KeyboardInterrupt:
                raise
            except Exception as e:  # a dataset that cannot be reached, a task that refuses to run
                if os.environ.get("DSV41_DEBUG"):
                    raise
                _fail(explain_failure(e))
            resolved.append(task)
            results = _merge(results, res)
            if ctx.is_main:  # the tasks finished so far, on disk (a partial results.json until the last)
                doc = _summary(results, run["settings"], resolved, names[k + 1:])
                write_eval_outputs(output, results, doc)
    except KeyboardInterrupt:
        if ctx.is_main:
            if not resolved:
                write_atomic(output / "results.json", json.dumps(
                    {"dsv41": {"complete": False, "done": [], "pending": names,
                               "requests": {"answered": lm.answered, "asked": lm.asked}}}, indent=2) + "\n")
            _interrupted(len(resolved), len(names), "tasks", output, [lm])
        raise typer.Exit(130)
    if not ctx.is_main:  # every rank holds rank 0's results; rank 0 reports them
        return
    doc = _summary(results, run["settings"], resolved, [])
    _reused_note([lm], output)
    if as_json:
        print_json({"results": doc["results"], "config": doc["config"]})
    else:
        _print_table(results)
    _note(f"results written to {output}")


def _summary(results: dict, settings: dict, resolved: list, pending: list) -> dict:
    from dsv41.evals.lm_eval_model import metrics_of

    return {"results": metrics_of(results), "complete": not pending, "pending": pending,
            "config": {**settings, "tasks": resolved, "served_locally": results.get("served_locally", [])}}


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


def _run_suite(suite, make_lm, mode, run, as_json, ctx, lms):
    from dsv41.evals.reports import row_mode, run_suite, runnable, write_atomic, write_report
    from dsv41.evals.tasks.offline import DataUnavailable, check_alias_data

    output = run["output"]
    rows_dir = output / "rows"
    done: dict[int, dict] = {}
    for k in runnable(suite):  # rows an earlier run of these settings finished
        f = rows_dir / f"{k:02d}.json"
        try:
            entry = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
        except ValueError:
            entry = None
        if entry and entry.get("status") == "ok" and entry.get("benchmark") == suite.rows[k].benchmark:
            done[k] = entry
    if done and ctx.is_main:
        _note(f"resumed: {len(done)} finished rows reused from {output}")

    def evaluate_row(row):
        if run["offline"]:  # no data here: mark the row at once, never wait on the Hub
            missing = check_alias_data(row.task, run["data_dir"])
            if missing:
                raise DataUnavailable(missing)
        lm = make_lm(row_mode(row, suite, mode))
        return _evaluate([row.task], lm, run, num_fewshot=row.shots if run["num_fewshot"] is None else None)[1]

    finished = []
    latest = {}  # the newest partial report, written again if an interrupt lands between its writes

    def on_row(k, entry, partial):
        if suite.rows[k].task is not None:
            finished.append(k)
        if not ctx.is_main:
            return
        partial["config"] = run["settings"]
        latest["report"] = partial
        if suite.rows[k].task is not None:
            write_atomic(rows_dir / f"{k:02d}.json", json.dumps(entry, indent=2, default=str) + "\n")
        write_report(partial, output)

    log = (lambda m: _note(m)) if ctx.is_main else (lambda m: None)
    try:
        report = run_suite(suite, evaluate_row, explain_failure, log=log, mode_override=mode, done=done, on_row=on_row)
    except KeyboardInterrupt:
        if ctx.is_main:
            if "report" in latest:  # each write is atomic; this makes the report agree with rows/ on disk
                write_report(latest["report"], output)
            _interrupted(len(finished), len(runnable(suite)), "rows", output, lms)
        raise typer.Exit(130)
    if not ctx.is_main:  # every rank computed the same report; rank 0 writes it
        return
    report["config"] = run["settings"]
    paths = write_report(report, output)
    _reused_note(lms, output)
    if as_json:
        print_json(report)
    else:
        from dsv41.evals.reports import render_markdown

        import sys

        sys.stdout.write(render_markdown(report))  # as written to report.md: no wrapping, no markup
        sys.stdout.flush()
    _note(f"report written to {', '.join(str(p) for p in paths)}")
