"""`dsv41 info` without torch (issue #22): its ledgers come from model/inventory.py (the tensor inventory
computed from the config) and model/kv_layout.py (the KV-bytes table), not from a model built on the meta
device. Checked here: the torch-free inventory equals the meta-device model's (names, shapes, dtypes, order)
for every config `info` takes; its byte sizes and release dtypes equal the checkpoint package's; `info`
prints the documents commit 26ff6f6 printed (tests/fixtures/info_26ff6f6.json); and `dsv41 info` never
imports torch.

The fixture was written by the code of 26ff6f6 (its `dsv41.model.ledger.info`):

    git archive 26ff6f6 | tar -x -C OLD && PYTHONPATH=OLD python tests/test_info_startup.py --write
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "info_26ff6f6.json"


def _bundled():
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.config import load_config

    return load_config(bundled_model_dir())


def _preset(name, **changes):
    def make():
        from dsv41.model.config import preset

        args = preset(name)
        return args.replace(**changes) if changes else args
    return make


# every kind of config `info` takes: the bundled checkpoint's (HF layout, with vision), the presets, and
# the storage variants the inventory must follow (runtime layout, bf16, trainable masters, no vision/DSpark)
CASES = {
    "bundled": _bundled,
    "tiny": _preset("tiny"),
    "v4.1-flash": _preset("v4.1-flash"),
    "v4-flash": _preset("v4-flash"),
    "v4-pro": _preset("v4-pro"),
    "tiny-runtime": _preset("tiny", wo_a_dtype="bf16", expert_dtype="fp8"),
    "tiny-bf16": _preset("tiny", dtype="bf16", expert_dtype=None),
    "tiny-trainable": _preset("tiny", trainable=True),
    "v4.1-flash-text-only": _preset("v4.1-flash", vision_n_layers=0, dspark_block_size=0),
}


# ------------------------------------------------------------------------------------------- inventory
@pytest.mark.parametrize("case", list(CASES))
def test_inventory_equals_the_meta_device_model(case):
    """names, shapes, dtypes and order: model/inventory.py against the model built on the meta device
    (checkpoint.names.parameter_inventory; V4: its spec-built table). Counts and bytes follow from these."""
    from dsv41.model.checkpoint.names import parameter_inventory
    from dsv41.model.checkpoint.safetensors import st_name
    from dsv41.model.inventory import parameter_inventory as plain

    args = CASES[case]()
    meta = [(name, tuple(shape), st_name(dtype)) for name, shape, dtype in parameter_inventory(args)]
    mine = plain(args)
    assert len(mine) == len(meta)
    assert mine == meta


def test_inventory_equals_the_full_construction():
    """...and the meta inventory's shortcut (one routed expert, replicated by name) is not what makes them
    agree: against every expert built, as a set."""
    from dsv41.model.checkpoint.names import parameter_inventory
    from dsv41.model.checkpoint.safetensors import st_name
    from dsv41.model.inventory import parameter_inventory as plain

    for args in (CASES["bundled"](), CASES["tiny"]()):
        full = [(name, tuple(shape), st_name(dtype)) for name, shape, dtype in parameter_inventory(args, fast=False)]
        assert sorted(plain(args)) == sorted(full)


def test_inventory_rejects_what_the_model_rejects():
    from dsv41.model.inventory import parameter_inventory as plain

    tiny = CASES["tiny"]()
    with pytest.raises(ValueError, match="exactly one shared expert"):
        plain(tiny.replace(n_shared_experts=2))
    with pytest.raises(ValueError, match="not a multiple of the scale block"):
        plain(tiny.replace(engram_head_dim=48))


def test_dtype_sizes_and_release_dtypes_agree_with_the_checkpoint_package():
    import torch

    from dsv41.model.checkpoint import names
    from dsv41.model.checkpoint.safetensors import ST_DTYPES
    from dsv41.model.inventory import ITEMSIZE
    from dsv41.model.ledger import checkpoint_ledger

    assert ITEMSIZE == {k: torch.empty(0, dtype=v).element_size() for k, v in ST_DTYPES.items()}
    for case in ("bundled", "v4.1-flash", "v4-flash", "tiny-runtime"):
        args = CASES[case]()
        want = names.inventory_totals((n, s, d) for n, (s, d) in names.expected_tensors(args).items())
        assert checkpoint_ledger(args) == {"layout": "official", **want}, case
    flash = checkpoint_ledger(CASES["v4.1-flash"]())  # the release's shard headers (docs/architecture.md)
    assert (flash["tensors"], flash["bytes"]) == (96085, 510286023000)
    assert {k: v["tensors"] for k, v in flash["by_dtype"].items()} == {
        "BF16": 520, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47589, "I8": 47232}


# ------------------------------------------------------------------------------------------- the documents
def _expected() -> dict:
    return json.loads(FIXTURE.read_text())["docs"]


@pytest.mark.parametrize("case", list(CASES))
def test_info_document_is_the_one_26ff6f6_printed(case):
    """The whole document, key order and float digits included (as `--json` prints it)."""
    from dsv41.model.ledger import info

    doc = info(CASES[case]())
    assert json.dumps(doc, indent=2) == json.dumps(_expected()[case], indent=2)


def _run(*argv: str, importtime: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DSV41_MODEL"}
    return subprocess.run([sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "dsv41_cli", *argv],
                          capture_output=True, text=True, env=env)


def _imported(stderr: str) -> set[str]:
    """Module names from `python -X importtime` (one line per import: self | cumulative | name)."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_info_json_prints_the_same_bytes_without_importing_torch():
    from dsv41.model.assets import bundled_model_dir

    r = _run("info", "--json", importtime=True)
    assert r.returncode == 0, r.stderr[-2000:]
    want = {**_expected()["bundled"], "path": str(bundled_model_dir())}
    assert r.stdout == json.dumps(want, indent=2) + "\n"
    modules = _imported(r.stderr)
    assert "dsv41.model.ledger" in modules  # the probe sees the ledger's imports...
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}  # ...and no torch among them


@pytest.mark.parametrize("argv", [["info"], ["info", "--config", "v4.1-flash", "--json"],
                                  ["info", "--config", "v4-pro"]])
def test_info_imports_no_torch(argv):
    r = _run(*argv, importtime=True)
    assert r.returncode == 0, r.stderr[-2000:]
    modules = _imported(r.stderr)
    assert "dsv41.model.ledger" in modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert "Parameters" in r.stdout or '"params"' in r.stdout


def _write_fixture() -> None:
    """Run with the code whose documents are the reference (see the module docstring)."""
    from dsv41.model import ledger

    docs = {case: ledger.info(make()) for case, make in CASES.items()}
    FIXTURE.write_text(json.dumps({"written_by": "dsv41.model.ledger.info of 26ff6f6", "docs": docs},
                                  separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE}: {len(docs)} documents from {ledger.__file__}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        _write_fixture()
    else:
        raise SystemExit("usage: PYTHONPATH=OLD_TREE python tests/test_info_startup.py --write")
