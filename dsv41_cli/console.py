"""The CLI's shared output: a stderr console for progress and logs, stdout kept for results, and
the one-line error path (exit 2 for bad input, 1 for internal errors)."""

from __future__ import annotations

import json
import re
import sys

import typer
from rich.console import Console

err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1


class BadInput(Exception):
    """A problem with what the user gave us: printed as one line, exit code 2."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> "typer.Exit":
    """Print `dsv41: error: <message>` on stderr and leave with `code`.

    The message is plain text, never Rich markup: `pip install 'dsv41[eval]'` keeps its brackets. A
    message already escaped for Rich (`rich.markup.escape`) prints the same (its `\\[` shows as `[`)."""
    from rich.text import Text

    line = " ".join(str(message).split())  # one line, whatever the exception text held
    line = re.sub(r"\\(\[)", r"\1", line)
    err.print(Text.assemble(("dsv41: error:", "bold red"), " ", line), soft_wrap=True)
    raise typer.Exit(code)


# The optional extras of pyproject.toml and what each brings; the one spelling of every install hint.
EXTRAS = {"eval": "lm-eval, datasets", "plots": "matplotlib", "kernels": "triton"}


def install_hint(extra: str) -> str:
    """`pip install 'dsv41[EXTRA]'` (print it with `fail`, `note` or markup=False: Rich would eat `[EXTRA]`)."""
    return f"pip install 'dsv41[{extra}]'"


def need_module(module: str, extra: str, what: str, alternative: str = "") -> None:
    """Fail (exit 2, one line with the install hint) unless `module` imports: call it before the work
    starts, so that a missing extra never costs a run. `what` says what needs it ("--plot")."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        fail(f"{what} needs {module}: {install_hint(extra)}" + (f" ({alternative})" if alternative else ""))


def note(message: str) -> None:
    """`note: <message>` on stderr, plain text (brackets stay)."""
    from rich.text import Text

    err.print(Text.assemble(("note:", "yellow"), " ", str(message)), soft_wrap=True)


def print_json(doc) -> None:
    """One JSON document on stdout and nothing else there."""
    sys.stdout.write(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
