"""Files that ship with the package: the bundled dsv41-tiny checkpoint (once trained)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
BUNDLED_NAME = "dsv41-tiny"  # `--model dsv41-tiny` / DSV41_MODEL=dsv41-tiny name this checkpoint


def bundled_model_dir() -> Path | None:
    """The bundled checkpoint directory, or None when this install has none."""
    d = ASSETS / BUNDLED_NAME
    return d if (d / "config.json").is_file() else None
