"""The CLI's shared output: a stderr console for progress and logs, stdout kept for results, and
the one-line error path (exit 2 for bad input, 1 for internal errors)."""

from __future__ import annotations

import json
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
    """Print `dsv41: error: <message>` on stderr and leave with `code`."""
    line = " ".join(str(message).split())  # one line, whatever the exception text held
    err.print(f"[bold red]dsv41: error:[/] {line}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


def print_json(doc) -> None:
    """One JSON document on stdout and nothing else there."""
    sys.stdout.write(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
