"""What the wheel ships: the bundled checkpoint and the data the commands read (task sets, held-out
documents, scaffolds, bench tasks, suites), but not the training logs and plots of recipes/tiny/, which
stay in the repository (pyproject.toml, [tool.setuptools.exclude-package-data])."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dsv41_cli", "model", "evals", "recipes")  # [tool.setuptools.packages.find] include
# data folders whose every file a command or the bench reads
DATA_TREES = ("recipes/bench-tasks", "recipes/scaffolds", "recipes/suites", "recipes/tiny/heldout", "evals/tasks",
              "model/assets/dsv41-tiny")


def _repo_files(folder: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """Names in a wheel built (no isolation, no network) from a copy of the package sources, so the
    build leaves no build/ or egg-info behind in the working tree."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip and setuptools are needed to build the wheel")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("dsv41-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


@pytest.mark.slow
def test_the_wheel_leaves_out_training_logs_and_plots(wheel_names):
    assert not [n for n in wheel_names if n.startswith("recipes/tiny/logs/")]
    assert not [n for n in wheel_names if n.endswith((".png", ".jpg", ".svg", "_train.log", "_history.json"))]
    assert _repo_files("recipes/tiny/logs"), "the logs stay in the repository"
    assert (ROOT / "recipes/tiny/loss.png").is_file()


@pytest.mark.slow
def test_the_wheel_ships_the_checkpoint_and_the_data_the_commands_read(wheel_names):
    index = json.loads((ROOT / "model/assets/dsv41-tiny/model.safetensors.index.json").read_text())
    shards = {f"model/assets/dsv41-tiny/{s}" for s in index["weight_map"].values()}
    assert len(shards) == 3 and shards <= wheel_names
    for folder in DATA_TREES:  # every file, task data that looks like a log included (bench-tasks' app.log)
        files = _repo_files(folder)
        assert files and files <= wheel_names, (folder, sorted(files - wheel_names))
    assert {"recipes/tiny/README.md", "recipes/tiny/reproduce.sh", "recipes/tiny/train.py",
            "evals/tasks/tiny_reasoning/heldout.jsonl", "dsv41_cli/app.py"} <= wheel_names
