"""`dsv41 bpb`: bits per byte of one or more models on text corpora, beside compressor baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import EXIT_INTERNAL, err, fail, need_module, out, print_json


EPILOG = """Examples:

  dsv41 bpb corpus.txt

  dsv41 bpb docs/ notes.jsonl --model dsv41-tiny --model CKPT --plot-file bpb.svg

  dsv41 bpb corpus.txt --window strided:256 --baselines gzip,xz --json
"""


def command(
    paths: list[Path] = typer.Argument(..., help="Corpora: files (a .jsonl file = one document per line's \"text\") or directories."),
    models: Optional[list[str]] = typer.Option(None, "--model", envvar="DSV41_MODEL",
                                               help="Checkpoint directory, or dsv41-tiny (the bundled model); "
                                                    "repeat to compare models. Default: dsv41-tiny."),
    window: str = typer.Option("disjoint", "--window", help="disjoint | strided:S (score S new tokens per window)."),
    max_ctx: int = typer.Option(0, "--max-ctx", min=0, help="Window length in tokens (0: the model's training context)."),
    baselines: str = typer.Option("gzip,bz2,xz,zstd", "--baselines", help="Compressors to compare with (comma list, or 'none')."),
    plot: bool = typer.Option(False, "--plot/--no-plot", help="Draw a grouped bar chart to bpb.png (needs "
                              "matplotlib: the plots extra). `--plot FILE.png` still works as --plot-file FILE.png."),
    plot_file: Optional[Path] = typer.Option(None, "--plot-file", show_default=False,
                                             help="Write the chart here (.png, .svg or .pdf); implies --plot."),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    bootstrap: int = typer.Option(1000, "--bootstrap", min=0, help="Bootstrap resamples for the 95% interval (0: none)."),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.evals import bpb

    ctx = start_ranks(device)  # one process, or one rank under torchrun: rank 0 prints, plots and shows progress
    note = err.print if ctx.is_main else (lambda *a, **k: None)
    try:
        bpb.parse_window(window)
    except ValueError as e:
        fail(str(e))
    wanted = [] if baselines.strip().lower() in ("", "none") else [b.strip() for b in baselines.split(",") if b.strip()]
    for b in wanted:
        if b not in bpb.COMPRESSORS:
            fail(f"--baselines: unknown compressor {b!r} (known: {', '.join(bpb.COMPRESSORS)})")
    if plot_file is not None and plot_file.suffix.lower() not in (".png", ".svg", ".pdf"):
        fail(f"--plot-file {plot_file}: use a .png, .svg or .pdf file name")
    if plot_file is None and plot:
        plot_file = Path("bpb.png")
    if plot_file is not None:  # before any model is loaded: a missing extra never costs a run
        need_module("matplotlib", "plots", "--plot", "or drop --plot")
    corpora = []
    for p in paths:
        try:
            corpora.append(bpb.load_corpus(p))
        except bpb.CorpusError as e:
            fail(str(e))
    bpb.unique_names(corpora)
    model_dirs = [resolve_model_dir(m) for m in (models or [None])]
    # notes only once the input is known good: a bad-input error stays the one line on stderr
    unavailable = [b for b in wanted if not bpb.compressor_available(b)]
    if unavailable:
        note(f"[yellow]note:[/] {', '.join(unavailable)} not installed (pip install zstandard); left out", markup=True)
    wanted = [b for b in wanted if b not in unavailable]
    for c in corpora:
        if c.skipped:
            note(f"[yellow]note:[/] {c.name}: skipped {len(c.skipped)} file(s) that are not UTF-8 text", markup=True)
    specs, seen = [], {}
    for d in model_dirs:
        name = d.name
        seen[name] = seen.get(name, 0) + 1
        specs.append(bpb.ModelSpec(name if seen[name] == 1 else f"{name}#{seen[name]}", _loader(d, ctx)))

    from dsv41_cli.commands.eval_cmd import StepProgress

    try:
        doc = bpb.run_bpb(specs, corpora, window=window, max_ctx=max_ctx, baselines=wanted, batch_size=batch_size,
                          bootstrap_iters=bootstrap, progress=StepProgress(enabled=ctx.is_main, unit="tokens"), ctx=ctx)
    except ValueError as e:
        fail(str(e))
    if unavailable:
        doc["baselines_unavailable"] = unavailable
    if not ctx.is_main:  # every rank computed the same document; rank 0 reports it
        return
    if as_json:  # the result first: a plot that fails never loses it
        print_json(doc)
    else:
        _print_table(doc)
    if plot_file is not None:
        from dsv41.evals.plots import plot_bpb

        try:
            plot_bpb(doc, plot_file)
        except (OSError, ValueError) as e:
            fail(f"--plot-file {plot_file}: {e}", code=EXIT_INTERNAL)
        err.print(f"plot written to {plot_file}", markup=False, style="dim")


def _loader(model_dir: Path, ctx):
    return lambda: load_on_ranks(model_dir, ctx)  # this rank's part of the model under torchrun


def _print_table(doc: dict) -> None:
    from rich.table import Table

    table = Table(title=f"bits per byte ({doc['window']} windows, lower is better)")
    table.add_column("corpus")
    for col in ("bytes", "docs", "tokens"):
        table.add_column(col, justify="right")
    for m in doc["models"]:
        table.add_column(f"{m['model']} (ctx {m['max_ctx']})", justify="right")
    for b in doc["baselines"]:
        table.add_column(b, justify="right", style="dim")
    first = doc["models"][0]["corpora"]
    for k, c in enumerate(first):
        cells = [c["name"], f"{c['bytes']:,}", str(c["documents"]), f"{c['tokens']:,}"]
        for m in doc["models"]:
            r = m["corpora"][k]
            ci = f" [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["ci95"] else ""
            cells.append(f"{r['bpb']:.4f}{ci}")
        cells += [f"{doc['baselines'][b][c['name']]:.4f}" for b in doc["baselines"]]
        table.add_row(*cells)
    total_bytes = sum(c["bytes"] for c in first)
    overall = ["overall", f"{total_bytes:,}", str(sum(c["documents"] for c in first)), ""]
    overall += [f"{m['overall_bpb']:.4f}" for m in doc["models"]]
    overall += [f"{sum(v * c['bytes'] for v, c in zip(doc['baselines'][b].values(), first)) / total_bytes:.4f}"
                for b in doc["baselines"]]
    table.add_row(*overall, style="bold")
    out.print(table)
