"""The `dsv41` command line: registers the commands and turns exceptions into exit codes.

Each command module parses its flags, calls a library function, and renders the result; nothing
else lives here."""

from __future__ import annotations

import os
import sys

import typer

from dsv41_cli.commands import convert, generate, info, quantize_kv, scaffold_bench
from dsv41_cli.commands import bpb, effort_sweep, eval_cmd

app = typer.Typer(
    name="dsv41",
    help="Run, convert and evaluate DeepSeek-V4.1-Flash (and the bundled dsv41-tiny model).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Run, convert and evaluate DeepSeek-V4.1-Flash."""


app.command("info", help="Parameter, layer-plan and KV-cache ledgers of a model.")(info.command)
app.command("generate", help="Chat and thinking generation (V4.1 chat encoding, effort, DSpark).")(generate.command)
app.command("convert", help="Convert a checkpoint between the official and the runtime layout.")(convert.command)
app.command("eval", help="lm-evaluation-harness tasks and the report's tables (suites) on the model.")(eval_cmd.command)
app.command("bpb", help="Bits per byte on text corpora, several models side by side, compressor baselines.")(bpb.command)
app.command("effort-sweep", help="Accuracy and output tokens across reasoning efforts (report Figure 9).")(effort_sweep.command)
app.command("scaffold-bench", help="The same model and tasks under several agent scaffolds, commands in a jail.")(scaffold_bench.command)
app.command("quantize-kv", help="Bytes per token and quality cost of each main-KV storage format (fp4/fp8/bf16).")(quantize_kv.command)


def _click_exceptions():
    try:  # typer vendors its own copy of click; its exception classes live there
        from typer._click import exceptions
    except ImportError:  # older typer runs on plain click
        from click import exceptions
    return exceptions


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. Usage errors and bad input: one line on stderr, exit 2. Internal
    errors: one line, exit 1 (DSV41_DEBUG=1 shows the traceback)."""
    from dsv41_cli.console import EXIT_INTERNAL, err

    click_exc = _click_exceptions()
    try:
        rc = app(args=argv, standalone_mode=False)
    except typer.Exit as e:  # a command chose its exit code (fail() raises this)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("dsv41: interrupted", markup=False)
        sys.exit(130)
    except click_exc.ClickException as e:  # usage errors: unknown flag, missing value, bad choice
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `dsv41` or a group without a command
            print(e.ctx.get_help())
            sys.exit(0)
        err.print(f"dsv41: error: {' '.join(e.format_message().split())}", markup=False)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - the last line of defence
        # model.checkpoint.CheckpointError (a bad checkpoint found mid-command, e.g. non-finite logits) is
        # bad input: one line, exit 2 (matched by name, so this line of defence imports nothing)
        if any(c.__name__ == "CheckpointError" for c in type(e).__mro__):
            err.print(f"dsv41: error: {' '.join(str(e).split())}", markup=False, soft_wrap=True)
            sys.exit(2)
        if os.environ.get("DSV41_DEBUG"):
            raise
        err.print(f"dsv41: internal error: {type(e).__name__}: {' '.join(str(e).split())}", markup=False)
        sys.exit(EXIT_INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)
