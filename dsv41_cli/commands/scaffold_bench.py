"""`dsv41 scaffold-bench`: the same model and tasks under several agent scaffolds, every model-issued
command in a jail (docs/scaffold-bench.md)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt
from dsv41_cli.console import err, fail, install_hint, need_module, note, print_json

DEFAULT_SCAFFOLDS = "dsml,openai-tools,xml,backticks"

EPILOG = """Examples:

\b
  dsv41 scaffold-bench --backend oracle --limit 3
  dsv41 scaffold-bench --endpoint http://localhost:8000/v1 --efforts low,high,max
  dsv41 scaffold-bench --backend local --model CKPT --scaffolds dsml,xml --max-new-tokens 1024

Results go to runs/scaffold-bench/TASKS/ (--output), each finished episode to partial.jsonl as it ends;
after Ctrl-C, the same command again resumes where it stopped.
"""

def _backend_choices() -> list[str]:
    from dsv41.evals.scaffolds.backends import local_backend_available

    return (["local"] if local_backend_available() else []) + ["endpoint", "oracle"]


def parse_efforts(text: str) -> list[int | None]:
    """`--efforts`: a comma list of 1..100, low|high|max, or chat (no thinking)."""
    from dsv41.model.encoding import parse_effort

    efforts: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "chat":
            value = None
        else:
            try:
                value = parse_effort(int(part) if part.lstrip("-").isdigit() else part)
            except ValueError as e:
                fail(f"--efforts: {e}")
        if value not in efforts:
            efforts.append(value)
    if not efforts:
        fail("--efforts needs at least one value (1..100, low, high, max or chat)")
    return efforts


def command(
    model: Optional[str] = ModelOpt,
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="An OpenAI-compatible server (base URL such as "
                                           "http://host:8000/v1, or the full .../chat/completions URL)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="What answers: local (the dsv41 engine on --model), "
                                          "endpoint or oracle. Default: endpoint when --endpoint is given."),
    scaffolds: str = typer.Option(DEFAULT_SCAFFOLDS, "--scaffolds", help="Comma list of built-in scaffolds or scaffold files."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="A task directory in the Harbor-like layout (default: the bundled tasks)."),
    efforts: str = typer.Option("high", "--efforts", help="Comma list of efforts: 1..100, low|high|max (50|75|100), or chat."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Model calls per agent episode (default: the task's, else 30)."),
    output: Optional[str] = typer.Option(None, "--output", help="Write partial.jsonl (as episodes finish), scaffold-bench.json/.md/.png "
                                         "and episodes.jsonl here; rerunning with the same --output resumes. "
                                         "Default: runs/scaffold-bench/<tasks>/ (bundled, or the --tasks directory's name)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N agent tasks and the first N function-calling items, in the set's order."),
    fresh: bool = typer.Option(False, "--fresh", help="Discard the partial results in --output and start over."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Tokens generated per model call: local "
                                                 "backend (default 512); sent as max_tokens to an endpoint (default: the server's)."),
    endpoint_model: Optional[str] = typer.Option(None, "--endpoint-model", help="Model name sent to the endpoint (default: the first of GET /models)."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", "--api-key-env", help="Environment variable holding the endpoint's API key."),
    request_timeout: float = typer.Option(120.0, "--request-timeout", min=1.0, help="Seconds per endpoint request."),
    retries: int = typer.Option(4, "--retries", min=0, help="Retries of a failed endpoint request (exponential backoff)."),
    effort_style: str = typer.Option("deepseek", "--effort-style", help="How effort reaches the endpoint: deepseek|openai|none."),
    endpoint_extra: Optional[str] = typer.Option(None, "--endpoint-extra", help="JSON object merged into every endpoint request."),
    command_timeout: float = typer.Option(30.0, "--command-timeout", min=1.0, help="Wall-clock seconds per sandboxed command."),
    jobs: int = typer.Option(1, "--jobs", min=1, max=64, help="Episodes run at once (each in its own jail)."),
    plot: Optional[bool] = typer.Option(None, "--plot/--no-plot", help="Draw scaffold-bench.png in --output (needs matplotlib). "
                                        "Default: drawn when matplotlib is installed."),
    plot_file: Optional[str] = typer.Option(None, "--plot-file", help="Draw the plot to this file (.png/.svg/.pdf; implies --plot)."),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.evals.scaffolds.backends import BackendFatal, EndpointBackend, OracleBackend, effort_label
    from dsv41.evals.scaffolds.bench import (PARTIAL_FILE, PartialResults, SettingsChanged, markdown_table, run_bench,
                                             write_report)
    from dsv41.evals.scaffolds.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
    from dsv41.evals.scaffolds.scaffold import load_scaffold
    from dsv41.evals.scaffolds.tasks import TaskError, load_tasks

    choices = _backend_choices()
    if backend is None:
        if endpoint:
            backend = "endpoint"
        elif model and "local" in choices:
            backend = "local"
        else:
            fail("choose a backend: --model PATH or --backend local (the dsv41 engine), --endpoint URL "
                 "(an OpenAI-compatible server) or --backend oracle")
    if backend not in choices:
        fail(f"--backend must be one of {', '.join(choices)}, not {backend!r}"
             + ("" if "local" in choices or backend != "local" else " (the local inference engine is not installed)"))
    if backend == "endpoint" and not endpoint:
        fail("--backend endpoint needs --endpoint URL")
    if endpoint and backend != "endpoint":
        fail(f"--endpoint is only used by the endpoint backend, not {backend}")
    effort_values = parse_efforts(efforts)

    try:
        scaffold_list = [load_scaffold(name.strip()) for name in scaffolds.split(",") if name.strip()]
    except ValueError as e:
        fail(str(e))
    if not scaffold_list:
        fail("--scaffolds names no scaffold")
    if len({s.name for s in scaffold_list}) != len(scaffold_list):
        fail("--scaffolds names a scaffold twice")
    try:
        agent_tasks, items = load_tasks(tasks)
        if limit:
            agent_tasks, items = agent_tasks[:limit], items[:limit]
        if backend == "oracle":
            for task in agent_tasks:
                task.solution_steps()  # every task needs its reference solution
    except TaskError as e:
        fail(str(e))

    if plot_file:
        if plot is False:
            fail("--plot-file and --no-plot contradict each other")
        plot = True
        if Path(plot_file).suffix.lower() not in (".png", ".svg", ".pdf"):
            fail(f"--plot-file must end in .png, .svg or .pdf, not {plot_file!r}")
    if plot:
        need_module("matplotlib", "plots", "--plot-file" if plot_file else "--plot", "or --no-plot")
    elif plot is None:
        try:
            import matplotlib  # noqa: F401
            plot = True
        except ImportError:
            plot = False
            note(f"no plot: matplotlib is not installed ({install_hint('plots')})")

    out_dir = Path(output) if output else Path("runs") / "scaffold-bench" / (Path(tasks).resolve().name if tasks else "bundled")
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--output {out_dir} is a file, not a directory")

    if backend == "oracle":
        runner = OracleBackend()
    elif backend == "endpoint":
        extra = None
        if endpoint_extra:
            try:
                extra = json.loads(endpoint_extra)
            except ValueError as e:
                fail(f"--endpoint-extra is not JSON: {e}")
            if not isinstance(extra, dict):
                fail("--endpoint-extra must be a JSON object")
        if max_new_tokens is not None:
            extra = {"max_tokens": max_new_tokens, **(extra or {})}
        try:
            runner = EndpointBackend(endpoint, endpoint_model, api_key_env=api_key_env, timeout=request_timeout,
                                     retries=retries, effort_style=effort_style, extra_body=extra)
        except ValueError as e:
            fail(str(e))
    else:  # local: the dsv41 engine
        from dsv41_cli.common import resolve_device, resolve_model_dir
        from dsv41.evals.scaffolds.backends import LocalBackend

        model_dir = resolve_model_dir(model)
        runner = LocalBackend(model_dir, resolve_device(device), **({} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}))

    # what the results depend on: a rerun with other settings must not mix with these (--jobs, --output,
    # --plot and --json change nothing in the results)
    settings = {
        "backend": backend,
        "model": (str(Path(model_dir).resolve()) if backend == "local" else
                  getattr(runner, "model", None) if backend == "endpoint" else None),
        "endpoint": endpoint,
        "endpoint_model": endpoint_model,
        "tasks": str(Path(tasks).resolve()) if tasks else "bundled",
        "agent_tasks": [t.id for t in agent_tasks],
        "function_calling": [i.id for i in items],
        "scaffolds": [s.summary() for s in scaffold_list],
        "efforts": effort_values,
        "limit": limit,
        "max_steps": max_steps,
        "max_new_tokens": max_new_tokens,
        "command_timeout": command_timeout,
        "effort_style": effort_style if backend == "endpoint" else None,
        "endpoint_extra": endpoint_extra,
    }
    sandbox = Sandbox(SandboxLimits(wall_seconds=command_timeout))
    if agent_tasks:
        try:
            sandbox.check()  # before anything is written: without the jail nothing runs
        except SandboxUnavailable as e:
            fail(f"the command jail is not available, so no command was run: {e}")
    if fresh:
        (out_dir / PARTIAL_FILE).unlink(missing_ok=True)
    try:
        partial = PartialResults(out_dir, settings)
    except SettingsChanged as e:
        fail(f"{out_dir / PARTIAL_FILE} holds results of a run with other settings ({e}); "
             f"use a new --output DIR, or --fresh to discard them and start over")
    except OSError as e:
        fail(f"cannot write to --output {out_dir}: {e}")

    total = len(scaffold_list) * len(effort_values) * (len(agent_tasks) + len(items))
    reused = sum(1 for _ in partial.done)
    if reused:
        err.print(f"resuming: reused {reused} of {total} episodes from {partial.path}", markup=False, soft_wrap=True)
    done = [reused]
    lock = threading.Lock()

    def progress(result) -> None:
        partial.add(result)
        with lock:
            done[0] += 1
        tokens = "?" if result.output_tokens is None else result.output_tokens
        err.print(f"[{done[0]}/{total}] {result.scaffold} effort={effort_label(result.effort)} {result.task}: "
                  f"{'pass' if result.passed else 'FAIL'} steps={result.steps} format_errors={result.format_errors} "
                  f"tokens={tokens} ({result.end_reason})", markup=False, highlight=False, soft_wrap=True)

    try:
        report = run_bench(runner, scaffold_list, agent_tasks, items, effort_values, sandbox,
                           max_steps=max_steps, on_episode=progress, jobs=jobs, done=partial.done)
    except SandboxUnavailable as e:
        fail(f"the command jail is not available, so no command was run: {e}")
    except BackendFatal as e:
        fail(f"the backend refused the request: {e} ({done[0]} of {total} episodes kept in {out_dir})")
    except KeyboardInterrupt:  # the count of what the file holds (an interrupt may land inside `progress`)
        err.print(f"interrupted: {partial.kept()} of {total} done, kept in {out_dir}; "
                  "run the same command again to resume", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130)
    finally:
        partial.close()
    report = {"backend": report.pop("backend"), "rows": report.pop("rows"), **report}
    report["model"] = str(model) if backend == "local" else (getattr(runner, "model", None) if backend == "endpoint" else None)
    report["endpoint"] = endpoint
    report["efforts"] = effort_values
    report["sandbox"] = {"command_timeout_s": command_timeout}
    report["jobs"] = jobs

    if plot_file:
        Path(plot_file).parent.mkdir(parents=True, exist_ok=True)
    written = write_report(report, out_dir, plot=plot, plot_file=plot_file)
    if written.get("plot_skipped"):
        err.print(f"plot skipped: {written['plot_skipped']}", markup=False)
    err.print("wrote " + ", ".join(v for k, v in written.items() if k != "plot_skipped" and v), markup=False,
              soft_wrap=True)
    if as_json:
        print_json(report)
    else:
        sys.stdout.write(markdown_table(report))
