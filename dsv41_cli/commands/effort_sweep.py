"""`dsv41 effort-sweep`: accuracy and output length of a generation task across reasoning efforts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, resolve_device, resolve_model_dir, tune_threads
from dsv41_cli.console import err, fail, out, print_json

BUNDLED_TASKS = ("tiny-reasoning", "tiny_reasoning")
DEFAULT_TASK = "tiny-reasoning"
# The bare command's size: 5 efforts x 30 items of tiny-reasoning, 8.8-9.0 s end to end on the bundled model,
# 2 CPU cores, two engines (docs/evaluation.md, "dsv41 effort-sweep").
DEFAULT_LIMIT = 30
TASK_CHOICES = "tiny-reasoning (the bundled model's task), gsm8k, math, bbh, mmlu-pro or any lm-eval generate_until task"

EPILOG = """Output: --output, default runs/effort-sweep/TASK/ (partial.jsonl as it goes,
then sweep.json, sweep.csv, sweep.png). Ctrl-C keeps every finished point;
the same command again resumes.

Examples:

\b
  dsv41 effort-sweep
  dsv41 effort-sweep tiny-reasoning --limit 300 --batch-size 25
  dsv41 effort-sweep --efforts low,high,max --no-plot --json
  dsv41 effort-sweep gsm8k --model CKPT --limit 100 --data-dir DATA
"""


def command(
    task: Optional[str] = typer.Argument(
        None, show_default=False,
        help="tiny-reasoning (bundled; the default with the bundled model), or an lm-eval generate_until task or alias."),
    efforts: str = typer.Option("1,25,50,75,100", "--efforts", help="Comma list of efforts 1..100 (or low|high|max)."),
    limit: Optional[int] = typer.Option(
        None, "--limit", min=1, show_default=False,
        help=f"At most the first N items of the task, in its order, at every effort. Default: {DEFAULT_LIMIT} for "
             f"tiny-reasoning (9 s measured on 2 CPU cores; 300 is the whole set, 44 s), every item for an lm-eval task."),
    output: Optional[Path] = typer.Option(
        None, "--output", show_default=False,
        help="Folder for partial.jsonl, sweep.json, sweep.csv and sweep.png (default below). The same "
             "command again with the same folder resumes an interrupted sweep."),
    fresh: bool = typer.Option(False, "--fresh", help="Discard the partial results in --output and start over."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Requests decoding at once per engine (its "
                                   "rows; the results do not depend on it)."),
    engines: int = typer.Option(0, "--engines", min=0, show_default=False,
                                help="Engines decoding at once on the CPU, one process each, --batch-size rows each "
                                     "(default: one per CPU core, at most 8; 1 on a GPU). The results do not depend on it."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, show_default=False,
                                                 help="Generation length per item (default 256 for tiny-reasoning, "
                                                      "the task's own for lm-eval)."),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", min=0, help="Force </think> after this many reasoning tokens."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Serve lm-eval datasets from local files (see dsv41 eval)."),
    include_path: Optional[list[Path]] = typer.Option(None, "--include-path", help="A directory of task YAMLs (repeatable)."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Draw the sweep's figure (needs matplotlib: the plots extra)."),
    plot_file: Optional[Path] = typer.Option(None, "--plot-file", show_default=False,
                                             help="Write the figure here (.png, .svg, .pdf) instead of OUTPUT/sweep.png; implies --plot."),
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
    if plot_file is not None:
        plot = True
        if plot_file.suffix.lower() not in (".png", ".svg", ".pdf"):
            fail(f"--plot-file {plot_file}: name a .png, .svg or .pdf file")
    model_dir = resolve_model_dir(model)
    if task is None:
        from dsv41.model.assets import bundled_model_dir

        bundled_dir = bundled_model_dir()
        if bundled_dir is None or Path(model_dir).resolve() != Path(bundled_dir).resolve():
            fail(f"no TASK given: with --model {model_dir} name the task to sweep: {TASK_CHOICES}")
        task = DEFAULT_TASK
    bundled = task.strip().lower() in BUNDLED_TASKS
    task_key = DEFAULT_TASK if bundled else task.strip().lower()
    if bundled and limit is None:
        limit = DEFAULT_LIMIT
    if not bundled:
        from dsv41_cli.commands.eval_cmd import go_offline, need_lm_eval, quiet_libraries

        if data_dir is not None:
            go_offline()
        quiet_libraries()
        need_lm_eval()
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail(escape("the sweep's figure needs matplotlib: pip install 'dsv41[plots]' (or pass --no-plot)"))

    from dsv41.model.checkpoint import load_model

    dev = resolve_device(device)
    if engines > 1 and dev != "cpu":
        fail(f"--engines {engines}: several engines run on the CPU only (one process each); on {dev} use one")
    out_dir = output or Path("runs") / "effort-sweep" / task_key.replace("/", "_")
    from dsv41_cli.commands.eval_cmd import StepProgress, explain_failure
    from dsv41.evals import effort

    settings = {"task": task_key, "model": effort.model_fingerprint(model_dir), "device": dev, "efforts": effort_list,
                "limit": limit, "max_new_tokens": max_new_tokens, "thinking_budget": thinking_budget,
                "batch_size": batch_size}
    if not bundled:
        settings.update(data_dir=str(data_dir.resolve()) if data_dir else None,
                        include_path=[str(p.resolve()) for p in include_path or []])
    try:
        store = effort.SweepStore.open(out_dir, settings, fresh=fresh)
    except effort.SettingsChanged as e:
        fail(str(e))
    except OSError as e:
        fail(f"--output {out_dir}: {e.strerror or e}")

    progress = StepProgress(unit="items" if bundled else "")
    if bundled:
        sweep_task = effort.TinyReasoning(max_new_tokens=max_new_tokens or 256)
        items = sweep_task.items(limit)
        total, unit = len(items) * len(effort_list), "items"
    else:
        total, unit = len(effort_list), "efforts"
    done = (store.items_done() if bundled else len(store.records)) if store.reused else 0
    from dsv41.evals.engine_pool import EnginePool, default_engines

    # the generations spread over this process's engine and engines - 1 worker processes (the same results); a
    # bundled sweep knows its size, so the workers start now and load the checkpoint while this process does
    pool = EnginePool(None, model_dir, engines or default_engines(dev), batch_size, device=dev)
    try:
        if bundled and pool.spreads(total - done):
            pool.start()
        try:
            net, args, tokenizer = load_model(model_dir, device=dev)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
        tune_threads(args, dev)
        if store.reused:
            err.print(f"resuming: reused {done} of {total} {unit} from {store.path}", markup=False, soft_wrap=True)
        from dsv41.model.engine import Generator

        pool.attach(Generator(net, tokenizer, source=model_dir))
        if bundled:
            try:
                doc = effort.run_sweep(net, tokenizer, sweep_task, effort_list, batch_size=batch_size,
                                       thinking_budget=thinking_budget, progress=progress, store=store, items=items,
                                       pool=pool)
            except ValueError as e:
                fail(str(e))
        else:
            from dsv41.evals.lm_eval_model import UnknownTask
            from dsv41.evals.tasks import resolve

            name = resolve(task, "thinking")
            try:
                doc = effort.run_lm_eval_sweep(net, tokenizer, name, effort_list, limit=limit, batch_size=batch_size,
                                               pool=pool,
                                               max_gen_toks=max_new_tokens, thinking_budget=thinking_budget,
                                               data_dir=data_dir, include_path=[str(p) for p in include_path or []],
                                               progress=progress, store=store)
            except UnknownTask as e:
                fail(str(e))
            except Exception as e:  # noqa: BLE001 - a dataset that cannot be reached, a task that refuses to run
                import os

                if os.environ.get("DSV41_DEBUG"):
                    raise
                fail(explain_failure(e))
    except KeyboardInterrupt:
        pool.close()  # the workers stop before the line below (finally closes again: a no-op)
        progress.stop()
        done = store.items_done() if bundled else len(store.on_disk())
        err.print(f"interrupted: {done} of {total} done, kept in {out_dir}; run the same command again to resume",
                  markup=False, soft_wrap=True)
        raise typer.Exit(130)
    finally:
        pool.close()
    doc["model"] = str(model_dir)
    doc["thinking_budget"] = thinking_budget
    paths = effort.write_sweep(doc, out_dir, plot=plot, plot_path=plot_file)
    summary = {k: v for k, v in doc.items() if k != "samples"}
    if as_json:
        print_json(summary)
    else:
        _print_table(summary)
    err.print(f"written: {', '.join(str(p) for p in paths)}", markup=False, soft_wrap=True)


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
