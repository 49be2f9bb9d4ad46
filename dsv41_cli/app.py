"""The `dsv41` command line: registers the commands and turns exceptions into exit codes.

Each command module parses its flags, calls a library function, and renders the result; nothing
else lives here. The command modules are imported only when their command runs (or its --help is
asked for): `dsv41 --help` and `dsv41 info` do not pay for the others' imports. A module may define
`EPILOG` (its --help's "Examples:" section) and `CONTEXT_SETTINGS`; both are picked up here.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer
from typer.core import TyperCommand, TyperGroup

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}

# name: (module under dsv41_cli.commands, one-line help). The order is the order of `dsv41 --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("info", "Parameter, layer-plan and KV-cache ledgers of a model."),
    "generate": ("generate", "Chat and thinking generation (V4.1 chat encoding, effort, DSpark)."),
    "convert": ("convert", "Convert a checkpoint between the official and the runtime layout."),
    "eval": ("eval_cmd", "lm-evaluation-harness tasks and the report's tables (suites) on the model."),
    "bpb": ("bpb", "Bits per byte on text corpora, several models side by side, compressor baselines."),
    "effort-sweep": ("effort_sweep", "Accuracy and output tokens across reasoning efforts (report Figure 9)."),
    "scaffold-bench": ("scaffold_bench", "The same model and tasks under several agent scaffolds, commands in a jail."),
    "quantize-kv": ("quantize_kv", "Bytes per token and quality cost of each main-KV storage format (fp4/fp8/bf16)."),
    "serve": ("serve", "An OpenAI-compatible HTTP endpoint on the continuous-batching engine."),
}


class _Listed(TyperCommand):
    """A command as `dsv41 --help` and shell completion list it: name and help, no module imported."""


class LazyGroup(TyperGroup):
    """Commands registered by name; a command's module is imported when the command is resolved to run
    (or to show its own --help, or to complete its options)."""

    def __init__(self, **attrs):
        super().__init__(**attrs)
        for name, (_, help_text) in COMMANDS.items():
            self.commands.setdefault(name, _Listed(name=name, help=help_text, callback=None,
                                                   rich_markup_mode=self.rich_markup_mode))

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        if isinstance(cmd, _Listed):
            cmd = self.commands[name] = load_command(name, self.rich_markup_mode)
        return name, cmd, rest


def load_command(name: str, rich_markup_mode="rich"):
    """The click command of `name`, built from its module's `command` function."""
    from typer.main import get_command_from_info
    from typer.models import CommandInfo

    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(f"dsv41_cli.commands.{module_name}")
    settings = {**CONTEXT_SETTINGS, **getattr(module, "CONTEXT_SETTINGS", {})}
    info = CommandInfo(name=name, callback=module.command, help=help_text, epilog=getattr(module, "EPILOG", None),
                       context_settings=settings)
    return get_command_from_info(info, pretty_exceptions_short=True, rich_markup_mode=rich_markup_mode)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("dsv41")
        except PackageNotFoundError:  # a source tree that is not installed
            v = "unknown (not installed)"
        print(f"dsv41 {v}")
        raise typer.Exit(0)


app = typer.Typer(
    name="dsv41",
    cls=LazyGroup,
    help="Run, convert and evaluate DeepSeek-V4.1-Flash (and the bundled dsv41-tiny model).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT_SETTINGS,
)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                 help="Print `dsv41 VERSION` and exit."),
) -> None:
    """Run, convert and evaluate DeepSeek-V4.1-Flash."""


def _click_exceptions():
    try:  # typer vendors its own copy of click; its exception classes live there
        from typer._click import exceptions
    except ImportError:  # older typer runs on plain click
        from click import exceptions
    return exceptions


# a file name after bpb's --plot: the chart formats, and other image names (refused by --plot-file in one line)
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".gif", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".bmp", ".eps", ".ps")


def rewrite_legacy_args(argv: list[str]) -> list[str]:
    """Old spellings kept working by rewriting them before parsing (docs: the flag conventions):
    `dsv41 bpb ... --plot FILE.png` (an image file name after --plot, as before --plot/--no-plot and --plot-file
    existed) becomes `--plot-file FILE.png`; `--plot=FILE.png` too."""
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)  # root options take no value
    if command is None or argv[command] != "bpb":
        return argv
    start = command + 1
    out = argv[:start]
    i = start
    while i < len(argv):
        a = argv[i]
        if a == "--":  # everything after -- is a positional argument
            out += argv[i:]
            break
        if a == "--plot" and i + 1 < len(argv) and argv[i + 1].lower().endswith(PLOT_SUFFIXES):
            out += ["--plot-file", argv[i + 1]]
            i += 2
            continue
        if a.startswith("--plot=") and a.lower().endswith(PLOT_SUFFIXES):
            out.append("--plot-file=" + a[len("--plot="):])
        else:
            out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. Usage errors and bad input: one line on stderr, exit 2. Internal
    errors: one line, exit 1 (DSV41_DEBUG=1 shows the traceback)."""
    from dsv41_cli.console import EXIT_INTERNAL, err

    argv = rewrite_legacy_args(list(sys.argv[1:] if argv is None else argv))
    click_exc = _click_exceptions()
    try:
        rc = app(args=argv, prog_name="dsv41", standalone_mode=False)
    except typer.Exit as e:  # a command chose its exit code (fail() raises this)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("dsv41: interrupted", markup=False)
        sys.exit(130)
    except click_exc.ClickException as e:  # usage errors: unknown flag, missing value, bad choice
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `dsv41` or a group without a command
            print(e.ctx.get_help())
            sys.exit(0)
        err.print(f"dsv41: error: {' '.join(e.format_message().split())}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - the last line of defence
        # model.checkpoint.CheckpointError (a bad checkpoint found mid-command, e.g. non-finite logits) is
        # bad input: one line, exit 2 (matched by name, so this line of defence imports nothing)
        if any(c.__name__ == "CheckpointError" for c in type(e).__mro__):
            err.print(f"dsv41: error: {' '.join(str(e).split())}", markup=False, soft_wrap=True)
            sys.exit(2)
        if os.environ.get("DSV41_DEBUG"):
            raise
        err.print(f"dsv41: internal error: {type(e).__name__}: {' '.join(str(e).split())}", markup=False, soft_wrap=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)
