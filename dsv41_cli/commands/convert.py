"""`dsv41 convert`: official layout <-> runtime layout (model/checkpoint/ does the work)."""

from __future__ import annotations

import time
from typing import Optional

import typer

from dsv41_cli.common import JsonOpt
from dsv41_cli.console import EXIT_INTERNAL, err, fail, out, print_json


EPILOG = """Examples:

  dsv41 convert HF_CKPT RUNTIME_CKPT --mp 8 --expert-dtype fp4

  dsv41 convert HF_CKPT RUNTIME_CKPT --resume

  dsv41 convert RUNTIME_CKPT HF_COPY --to official --verify

  dsv41 convert HF_CKPT --verify
"""


def command(
    src: str = typer.Argument(..., help="Checkpoint directory to convert (official or runtime layout)."),
    dst: Optional[str] = typer.Argument(None, help="Output directory; must not exist. Written atomically. "
                                        "Optional with --verify."),
    mp: Optional[int] = typer.Option(None, "--mp", help="Model-parallel ranks of the runtime layout (default 1)."),
    expert_dtype: Optional[str] = typer.Option(
        None, "--expert-dtype", help="Routed experts in the runtime layout: fp4|fp8|bf16 (default fp4)."),
    to: str = typer.Option("runtime", "--to", help="runtime|official"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Verify SRC and print the plan; write nothing."),
    resume: bool = typer.Option(False, "--resume", help="Reuse the verified files that an interrupted or failed "
                                "conversion left in DST.partial."),
    verify: bool = typer.Option(False, "--verify", help="Also read every tensor of SRC: no NaN/inf, no NaN codes "
                                "(and the runtime layout's sha256s). Without DST: verify only."),
    as_json: bool = JsonOpt,
):
    from dsv41.model.checkpoint import EXPERT_DTYPES, CheckpointError, convert, partial_dir, verify_checkpoint

    if dst is None and not verify:
        fail("missing DST: give an output directory (or --verify to only verify SRC)")
    if to not in ("runtime", "official"):
        fail(f"--to must be runtime or official, not {to!r}")
    if to == "official" and (mp is not None or expert_dtype is not None):
        fail("--mp and --expert-dtype apply to --to runtime; --to official reads them from SRC's runtime.json")
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        fail(f"--expert-dtype must be one of {', '.join(EXPERT_DTYPES)}, not {expert_dtype!r}")
    if mp is not None and mp < 1:
        fail(f"--mp must be at least 1, not {mp}")
    started = time.perf_counter()
    if verify:
        try:
            checked = verify_checkpoint(src, None if as_json else BarProgress("verifying"))
        except CheckpointError as e:
            fail(f"{src}: {e}" if str(src) not in str(e) else str(e))
        checked["seconds"] = round(time.perf_counter() - started, 3)
        if dst is None:
            if as_json:
                print_json(checked)
            else:
                out.print(f"verified {checked['src']} ({checked['layout']} layout): {checked['tensors']:,} tensors, "
                          f"{checked['bytes'] / 1e9:,.3f} GB, every value in format"
                          + (", sha256 of every file as recorded" if checked["checksums"] else "")
                          + f" ({checked['seconds']:.1f} s)")
            return
    progress = None if (dry_run or as_json) else BarProgress()
    from pathlib import Path

    work = partial_dir(Path(dst))
    try:
        result = convert(src, dst, to=to, mp=mp or 1, expert_dtype=expert_dtype or "fp4", dry_run=dry_run,
                         resume=resume, progress=progress or JsonProgress())
    except CheckpointError as e:
        fail(str(e) + (_resume_hint(work) if not dry_run and work.is_dir() else ""))
    except OSError as e:  # disk full, permissions: what is finished stays for --resume
        fail(f"{e}{_resume_hint(work)}", code=EXIT_INTERNAL)
    except KeyboardInterrupt:  # Ctrl-C: the finished files stay; the one line says how to go on
        if progress is not None:
            progress.finish()
        if dry_run or not work.is_dir():
            raise
        err.print(f"dsv41: interrupted{_resume_hint(work)}", markup=False, soft_wrap=True)
        raise typer.Exit(130)
    result["seconds"] = round(time.perf_counter() - started, 3)
    if verify:
        result["verified"] = checked
    if as_json:
        print_json(result)
    elif dry_run:
        render_plan(result)
    else:
        rate = result["bytes"] / max(result["seconds"], 1e-9) / 1e6
        out.print(f"wrote {result['dst']}: {len(result['files'])} files, {result['tensors']:,} tensors, "
                  f"{result['bytes'] / 1e9:,.3f} GB in {result['seconds']:.1f} s ({rate:,.0f} MB/s)"
                  + (f"; reused {len(result['reused'])} verified file(s)" if result["reused"] else ""))


def _resume_hint(work) -> str:
    return f"; finished files are kept in {work}: run the same command with --resume to continue"


def render_plan(plan: dict) -> None:
    from rich.table import Table

    what = (f"{plan['src']} -> {plan['dst']} ({plan['to']} layout"
            + (f", mp={plan['mp']}, experts {plan['expert_dtype']})" if plan["to"] == "runtime" else ")"))
    out.print(f"[bold]plan[/] {what}")
    t = Table()
    t.add_column("file")
    t.add_column("tensors", justify="right")
    t.add_column("bytes", justify="right")
    for f in plan["files"]:
        t.add_row(f["name"], f"{f['tensors']:,}", f"{f['bytes']:,}")
    t.add_row("[bold]total[/]", f"{plan['tensors']:,}", f"{plan['bytes']:,}")
    out.print(t)
    if plan["copied"]:
        out.print("copied: " + ", ".join(plan["copied"]))


class JsonProgress:
    """Notes only (to stderr), for --json and --dry-run runs."""

    def start(self, total_bytes, total_tensors): ...

    def advance(self, nbytes, tensors=0): ...

    def note(self, message):
        err.print(f"dsv41: {message}", markup=False)

    def finish(self): ...


class BarProgress(JsonProgress):
    """A rich progress bar on stderr: bytes written, tensors, speed, ETA."""

    def __init__(self, label: str = "converting"):
        self.bar = None
        self.label = label

    def start(self, total_bytes, total_tensors):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.bar = Progress(TextColumn(self.label), BarColumn(), DownloadColumn(),
                            TextColumn("{task.fields[tensors]:,}/{task.fields[total_tensors]:,} tensors"),
                            TransferSpeedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=err, transient=False)
        self.task = self.bar.add_task("convert", total=total_bytes, tensors=0, total_tensors=total_tensors)
        self.tensors = 0
        self.bar.start()

    def advance(self, nbytes, tensors=0):
        self.tensors += tensors
        self.bar.update(self.task, advance=nbytes, tensors=self.tensors)

    def finish(self):
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
