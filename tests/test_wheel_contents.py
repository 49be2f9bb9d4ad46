"""What the wheel ships and how it installs: one import root (dsv41.model, dsv41.evals, dsv41.recipes from
the folders model/, evals/, recipes/; setup.py), the bundled checkpoint and the data the commands read (task
sets, held-out documents, scaffolds, bench tasks, suites), but not the training logs and plots of
recipes/tiny/, which stay in the repository (pyproject.toml, [tool.setuptools.exclude-package-data]). The
installed wheel works from a directory that holds a `model.py` and an `evals/` of a user's own."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("dsv41", "dsv41_cli", "model", "evals", "recipes", "serve")  # the folders setup.py installs
# data folders whose every file a command or the bench reads
DATA_TREES = ("recipes/bench-tasks", "recipes/scaffolds", "recipes/suites", "recipes/tiny/heldout", "evals/tasks",
              "model/assets/dsv41-tiny")


def _repo_files(folder: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Names in a wheel built (no isolation, no network) from a copy of the package sources, so the
    build leaves no build/ or egg-info behind in the working tree."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip and setuptools are needed to build the wheel")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in SOURCES:
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("dsv41-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _in_wheel(path: str) -> str:
    """A repository path as the wheel names it: model/x -> dsv41/model/x (dsv41_cli/ stays)."""
    top = path.split("/", 1)[0]
    return f"dsv41/{path}" if top in ("model", "evals", "recipes", "serve") else path


@pytest.mark.slow
def test_the_wheel_leaves_out_training_logs_and_plots(wheel_names):
    assert not [n for n in wheel_names if n.startswith("dsv41/recipes/tiny/logs/")]
    assert not [n for n in wheel_names if n.endswith((".png", ".jpg", ".svg", "_train.log", "_history.json"))]
    assert _repo_files("recipes/tiny/logs"), "the logs stay in the repository"
    assert (ROOT / "recipes/tiny/loss.png").is_file()


@pytest.mark.slow
def test_the_wheel_ships_the_checkpoint_and_the_data_the_commands_read(wheel_names):
    index = json.loads((ROOT / "model/assets/dsv41-tiny/model.safetensors.index.json").read_text())
    shards = {f"dsv41/model/assets/dsv41-tiny/{s}" for s in index["weight_map"].values()}
    assert len(shards) == 3 and shards <= wheel_names
    for folder in DATA_TREES:  # every file, task data that looks like a log included (bench-tasks' app.log)
        files = {_in_wheel(f) for f in _repo_files(folder)}
        assert files and files <= wheel_names, (folder, sorted(files - wheel_names))
    assert {"dsv41/__init__.py", "dsv41/recipes/tiny/README.md", "dsv41/recipes/tiny/reproduce.sh",
            "dsv41/recipes/tiny/train.py", "dsv41/evals/tasks/tiny_reasoning/heldout.jsonl",
            "dsv41/model/kernels/__init__.py", "dsv41/model/kernels/host_kernels.c", "dsv41_cli/app.py",
            "dsv41/serve/app.py",
            "dsv41_cli/commands/serve.py"} <= wheel_names
    # one import root: no generic top-level name
    assert {n.split("/", 1)[0] for n in wheel_names if not n.split("/", 1)[0].endswith(".dist-info")} == \
        {"dsv41", "dsv41_cli"}


@pytest.mark.slow
def test_the_installed_wheel_ignores_a_users_model_and_evals(wheel, tmp_path):
    """The wheel (not editable) in a fresh venv, run from a directory whose own `model.py` and `evals/`
    would stop the command if they were imported. The venv borrows the dependencies (torch, ...) of the
    environment running the tests through a .pth line, which adds that folder after the venv's own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "outer_dependencies.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    user = tmp_path / "user"
    (user / "evals").mkdir(parents=True)
    (user / "model.py").write_text("raise SystemExit('the user model.py was imported')\n")
    (user / "evals" / "__init__.py").write_text("raise SystemExit('the user evals/ was imported')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DSV41_MODEL")}
    r = subprocess.run([str(python), "-m", "dsv41_cli", "info", "--json"], cwd=user, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert Path(json.loads(r.stdout)["path"]).is_relative_to(site / "dsv41" / "model" / "assets")
    r = subprocess.run([str(python), "-c", "import dsv41.evals.bpb, dsv41.recipes.tiny.config, model"],
                       cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert "the user model.py was imported" in r.stderr  # the user's own name is still theirs
