"""`dsv41 scaffold-bench`: the same model and tasks under several agent scaffolds, every model-issued
command in a jail (docs/scaffold-bench.md)."""

from __future__ import annotations

import json
import sys
import threading
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt
from dsv41_cli.console import err, fail, print_json

DEFAULT_SCAFFOLDS = "dsml,openai-tools,xml,backticks"


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
    output: Optional[str] = typer.Option(None, "--output", help="Write scaffold-bench.json/.md/.png and episodes.jsonl here."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N agent tasks and the first N function-calling items."),
    endpoint_model: Optional[str] = typer.Option(None, "--endpoint-model", help="Model name sent to the endpoint (default: the first of GET /models)."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", "--api-key-env", help="Environment variable holding the endpoint's API key."),
    request_timeout: float = typer.Option(120.0, "--request-timeout", min=1.0, help="Seconds per endpoint request."),
    retries: int = typer.Option(4, "--retries", min=0, help="Retries of a failed endpoint request (exponential backoff)."),
    effort_style: str = typer.Option("deepseek", "--effort-style", help="How effort reaches the endpoint: deepseek|openai|none."),
    endpoint_extra: Optional[str] = typer.Option(None, "--endpoint-extra", help="JSON object merged into every endpoint request."),
    command_timeout: float = typer.Option(30.0, "--command-timeout", min=1.0, help="Wall-clock seconds per sandboxed command."),
    jobs: int = typer.Option(1, "--jobs", min=1, max=64, help="Episodes run at once (each in its own jail)."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="With --output, draw scaffold-bench.png (needs matplotlib)."),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.evals.scaffolds.backends import BackendFatal, EndpointBackend, OracleBackend, effort_label
    from dsv41.evals.scaffolds.bench import markdown_table, run_bench, write_report
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
        try:
            runner = EndpointBackend(endpoint, endpoint_model, api_key_env=api_key_env, timeout=request_timeout,
                                     retries=retries, effort_style=effort_style, extra_body=extra)
        except ValueError as e:
            fail(str(e))
    else:  # local: the dsv41 engine
        from dsv41_cli.common import resolve_device, resolve_model_dir
        from dsv41.evals.scaffolds.backends import LocalBackend

        runner = LocalBackend(resolve_model_dir(model), resolve_device(device))

    sandbox = Sandbox(SandboxLimits(wall_seconds=command_timeout))
    total = len(scaffold_list) * len(effort_values) * (len(agent_tasks) + len(items))
    done = [0]
    lock = threading.Lock()

    def progress(result) -> None:
        with lock:
            done[0] += 1
        tokens = "?" if result.output_tokens is None else result.output_tokens
        err.print(f"[{done[0]}/{total}] {result.scaffold} effort={effort_label(result.effort)} {result.task}: "
                  f"{'pass' if result.passed else 'FAIL'} steps={result.steps} format_errors={result.format_errors} "
                  f"tokens={tokens} ({result.end_reason})", markup=False, highlight=False, soft_wrap=True)

    try:
        report = run_bench(runner, scaffold_list, agent_tasks, items, effort_values, sandbox,
                           max_steps=max_steps, on_episode=progress, jobs=jobs)
    except SandboxUnavailable as e:
        fail(f"the command jail is not available, so no command was run: {e}")
    except BackendFatal as e:
        fail(f"the backend refused the request: {e}")
    report = {"backend": report.pop("backend"), "rows": report.pop("rows"), **report}
    report["model"] = str(model) if backend == "local" else (getattr(runner, "model", None) if backend == "endpoint" else None)
    report["endpoint"] = endpoint
    report["efforts"] = effort_values
    report["sandbox"] = {"command_timeout_s": command_timeout}
    report["jobs"] = jobs

    if output:
        written = write_report(report, output, plot=plot)
        if written.get("plot_skipped"):
            err.print(f"plot skipped: {written['plot_skipped']}", markup=False)
        err.print("wrote " + ", ".join(v for k, v in written.items() if k != "plot_skipped" and v), markup=False,
                  soft_wrap=True)
    if as_json:
        print_json(report)
    else:
        sys.stdout.write(markdown_table(report))
