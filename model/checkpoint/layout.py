"""What both layouts share: the file names of a checkpoint directory, which layout a directory holds
(`detect_layout`), its ModelArgs (`load_args`, with runtime.json's manifest), the check of stored tensors
against the config, and the atomic-output helpers (`partial_dir`, `_write_json`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from dsv41.model.checkpoint.names import accepted_dtypes, runtime_args
from dsv41.model.checkpoint.safetensors import CheckpointError, TensorEntry, _Problems
from dsv41.model.config import ModelArgs

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MANIFEST_FILE = "runtime.json"
SCALES_FILE = "official-scales.safetensors"
JOURNAL_FILE = ".convert-journal.json"
# small files that travel with the weights; config.json is required, the others are copied when present
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "special_tokens_map.json")
RUNTIME_FORMAT = "dsv41-runtime"
RUNTIME_VERSION = 1
EXPERT_DTYPES = ("fp4", "fp8", "bf16")


def _read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"missing {path.name} in {path.parent} ({what})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path.name}: expected a JSON object")
    return doc


def load_args(path: str | os.PathLike) -> ModelArgs:
    """ModelArgs of a checkpoint directory (either layout): config.json, plus for the runtime layout
    the storage dtypes from runtime.json."""
    from dsv41.model.config import load_config

    path = Path(path)
    try:
        args = load_config(path)
    except FileNotFoundError:
        raise CheckpointError(f"missing config.json in {path}") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"config.json: {e}") from None
    if (path / MANIFEST_FILE).is_file():
        manifest = _read_manifest(path)
        args = runtime_args(args, manifest["expert_dtype"])
    return args


def detect_layout(path: str | os.PathLike) -> str:
    """'runtime' (runtime.json present) or 'official' (an index, or a single model.safetensors)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / MANIFEST_FILE).is_file():
        return "runtime"
    if (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file():
        return "official"
    raise CheckpointError(f"{path} holds neither {INDEX_FILE} (official layout) nor {MANIFEST_FILE} (runtime layout)")


def _read_manifest(path: Path) -> dict:
    manifest = _read_json(path / MANIFEST_FILE, "the runtime-layout manifest")
    if manifest.get("format") != RUNTIME_FORMAT:
        raise CheckpointError(f"{MANIFEST_FILE}: format is {manifest.get('format')!r}, expected {RUNTIME_FORMAT!r}")
    if manifest.get("version") != RUNTIME_VERSION:
        raise CheckpointError(f"{MANIFEST_FILE}: version {manifest.get('version')} is not supported "
                              f"(this toolkit reads version {RUNTIME_VERSION})")
    mp = manifest.get("mp")
    if not isinstance(mp, int) or mp < 1:
        raise CheckpointError(f"{MANIFEST_FILE}: mp must be a positive integer, not {mp!r}")
    if manifest.get("expert_dtype") not in EXPERT_DTYPES:
        raise CheckpointError(f"{MANIFEST_FILE}: expert_dtype must be one of {', '.join(EXPERT_DTYPES)}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{MANIFEST_FILE}: no files table")
    return manifest


def _check_against_config(found: Mapping[str, TensorEntry], expected: Mapping[str, tuple[tuple[int, ...], str]],
                          problems: _Problems, where: str = "config.json", container: str = "the checkpoint") -> None:
    for name, entry in found.items():
        if name not in expected:
            problems.add(f"{entry.file.name} holds tensor {entry.name}, which is not part of the model {where} "
                         "describes")
            continue
        shape, dtype = expected[name]
        if entry.shape != shape:
            problems.add(f"{entry.file.name}: tensor {entry.name} has shape {list(entry.shape)}, {where} implies "
                         f"{list(shape)}")
        elif entry.dtype not in accepted_dtypes(name, dtype):
            problems.add(f"{entry.file.name}: tensor {entry.name} is {entry.dtype}, {where} implies "
                         f"{' or '.join(accepted_dtypes(name, dtype))}")
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        problems.add(f"{container} lacks tensor {missing[0]}{more} (required by {where})")


def partial_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ".partial")


def _write_json(path: Path, doc: dict) -> None:
    """Deterministic JSON (sorted keys), written to a temporary name and renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
