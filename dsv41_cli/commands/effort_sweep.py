"""`dsv41 effort-sweep`: accuracy and output length of a generation task across reasoning efforts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, resolve_device, resolve_model_dir, tune_threads
from dsv41_cli.console import err, fail, out, print_json

BUNDLED_TASKS = ("tiny-reasoning", "tiny_reasoning")


def command(
    task: str = typer.Argument(..., help="tiny-reasoning (bundled), or an lm-eval generate_until task or alias."),
    efforts: str = typer.Option("1,25,50,75,100", "--efforts", help="Comma list of efforts 1..100 (or low|high|max)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Items per effort."),
    output: Optional[Path] = typer.Option(None, "--output", help="Directory for sweep.json/csv/png (default: effort-sweep-TASK)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Generation length per item."),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", min=0, help="Force </think> after this many reasoning tokens."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Serve lm-eval datasets from local files (see dsv41 eval)."),
    include_path: Optional[list[Path]] = typer.Option(None, "--include-path", help="A directory of task YAMLs (repeatable)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Skip sweep.png (no matplotlib needed)."),
    model: Optional[str] = ModelOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.model.encoding import parse_effort

    try:
        effort_list = [parse_effort(e) for e in efforts.split(",") if e.strip()]
    except ValueError as e:
        fail(f"--efforts: {e}")
    if not effort_list:
        fail("--efforts is empty")
    if len(set(effort_list)) != len(effort_list):
        fail("--efforts lists an effort twice")
    if data_dir is not None and not data_dir.is_dir():
        fail(f"--data-dir {data_dir}: not a directory")
    bundled = task.strip().lower() in BUNDLED_TASKS
    if not bundled:
        from dsv41_cli.commands.eval_cmd import go_offline, need_lm_eval, quiet_libraries

        if data_dir is not None:
            go_offline()
        quiet_libraries()
        need_lm_eval()
    if not no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("sweep.png needs matplotlib (pip install 'dsv41[plots]'), or pass --no-plot")

    from dsv41.model.checkpoint import load_model

    dev = resolve_device(device)
    model_dir = resolve_model_dir(model)
    try:
        net, args, tokenizer = load_model(model_dir, device=dev)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    tune_threads(args, dev)

    from dsv41_cli.commands.eval_cmd import StepProgress, explain_failure
    from dsv41.evals import effort

    progress = StepProgress(unit="items" if bundled else "")
    if bundled:
        sweep_task = effort.TinyReasoning(max_new_tokens=max_new_tokens or 256)
        try:
            doc = effort.run_sweep(net, tokenizer, sweep_task, effort_list, limit=limit, batch_size=batch_size,
                                   thinking_budget=thinking_budget, progress=progress)
        except ValueError as e:
            fail(str(e))
    else:
        from dsv41.evals.lm_eval_model import UnknownTask
        from dsv41.evals.tasks import resolve

        name = resolve(task, "thinking")
        try:
            doc = effort.run_lm_eval_sweep(net, tokenizer, name, effort_list, limit=limit, batch_size=batch_size,
                                           max_gen_toks=max_new_tokens, thinking_budget=thinking_budget,
                                           data_dir=data_dir, include_path=[str(p) for p in include_path or []],
                                           progress=progress)
        except UnknownTask as e:
            fail(str(e))
        except Exception as e:  # noqa: BLE001 - a dataset that cannot be reached, a task that refuses to run
            import os

            if os.environ.get("DSV41_DEBUG"):
                raise
            fail(explain_failure(e))
    doc["model"] = str(model_dir)
    doc["thinking_budget"] = thinking_budget
    out_dir = output or Path(f"effort-sweep-{task.strip().lower()}")
    paths = effort.write_sweep(doc, out_dir, plot=not no_plot)
    summary = {k: v for k, v in doc.items() if k != "samples"}
    if as_json:
        print_json(summary)
    else:
        _print_table(summary)
        err.print(f"[dim]written: {', '.join(str(p) for p in paths)}[/dim]", markup=True)


def _print_table(doc: dict) -> None:
    from rich.table import Table

    from dsv41.evals.effort import PRESET_OF

    table = Table(title=f"effort sweep: {doc['task']}" + (f" ({doc['metric']})" if doc.get("metric") else ""))
    for col in ("effort", "accuracy", "95% CI", "reasoning tokens", "output tokens", "n"):
        table.add_column(col, justify="right")
    for p in doc["points"]:
        name = f"{p['effort']} ({PRESET_OF[p['effort']]})" if p["effort"] in PRESET_OF else str(p["effort"])
        table.add_row(name, f"{100 * p['accuracy']:.1f}%", f"[{100 * p['ci95'][0]:.1f}, {100 * p['ci95'][1]:.1f}]",
                      f"{p['mean_reasoning_tokens']:.1f}", f"{p['mean_output_tokens']:.1f}", str(p["n"]))
    out.print(table)
