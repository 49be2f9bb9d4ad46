"""recipes/tiny/device_call.sh: the CPU halves of a training stage's device call, on a small stand-in tree (a git
repository with the script, a fake bundled checkpoint, the directories that move out, and a fake device return)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "tiny" / "device_call.sh"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(tree, *args):
    subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "recipes" / "tiny" / "logs").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "recipes" / "tiny" / "device_call.sh")
    (root / "recipes" / "tiny" / "logs" / "old.json").write_text("{}")
    (root / "tests" / "fixtures").mkdir(parents=True)
    (root / "tests" / "fixtures" / "golden.json").write_text("[1]")
    assets = root / "model" / "assets" / "dsv41-tiny"
    assets.mkdir(parents=True)
    for name in SHARDS:
        (assets / name).write_bytes(b"bundled " + name.encode())
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        (assets / name).write_text(name)
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "tree")
    return root


def _run(tree, hold, *args):
    return subprocess.run(["bash", str(tree / "recipes" / "tiny" / "device_call.sh"), *args], check=False, cwd=tree,
                          env={"PATH": "/usr/bin:/bin", "DSV41_DEVICE_HOLD": str(hold)}, capture_output=True,
                          text=True)


def test_prepare_then_collect_round_trips_and_assembles_the_returned_parts(tree, tmp_path):
    hold = tmp_path / "hold"
    start = tmp_path / "s45"
    start.mkdir()
    for name in SHARDS:
        (start / name).write_bytes(b"stage 45 " + name.encode())
    shutil.copy(tree / "model" / "assets" / "dsv41-tiny" / "config.json", start / "config.json")
    assert _run(tree, hold, "prepare", str(start)).returncode == 0
    assets = tree / "model" / "assets" / "dsv41-tiny"
    assert (assets / SHARDS[1]).read_bytes() == b"stage 45 " + SHARDS[1].encode()
    assert not (tree / "recipes" / "tiny" / "logs").exists() and (hold / "logs" / "old.json").is_file()
    assert _run(tree, hold, "prepare", str(start)).returncode == 2  # not twice before a collect
    # what the device returns: the first shard and config whole, the others in parts, the logs as a tarball
    at = tmp_path / "returned"
    (at / "logs").mkdir(parents=True)
    (at / "config.json").write_text("config.json")
    (at / SHARDS[0]).write_bytes(b"stage 46 first")
    for name in SHARDS[1:]:
        (at / f"{name}.partaa").write_bytes(b"stage 46 ")
        (at / f"{name}.partab").write_bytes(name.encode())
    (at / "logs" / "stage46_train.log").write_text("steps")
    subprocess.run(["tar", "czf", str(at / "logs.tgz"), "-C", str(at), "logs"], check=True)
    out = tmp_path / "runs" / "tiny-t46" / "s46"
    done = _run(tree, hold, "collect", str(at), str(out))
    assert done.returncode == 0, done.stderr
    assert (out / SHARDS[2]).read_bytes() == b"stage 46 " + SHARDS[2].encode()
    assert (out / "tokenizer.json").read_text() == "tokenizer.json"
    assert (out.parent / "logs" / "stage46_train.log").read_text() == "steps"
    # the tree is as committed again
    assert (assets / SHARDS[1]).read_bytes() == b"bundled " + SHARDS[1].encode()
    assert (tree / "recipes" / "tiny" / "logs" / "old.json").is_file() and not hold.exists()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=tree, check=True, capture_output=True,
                            text=True).stdout
    assert status == ""


def test_bad_input_exits_2_and_moves_nothing(tree, tmp_path):
    hold = tmp_path / "hold"
    assert _run(tree, hold, "prepare", str(tmp_path / "missing")).returncode == 2
    assert _run(tree, hold, "sideways").returncode == 2
    assert (tree / "recipes" / "tiny" / "logs").is_dir() and not hold.exists()
    other = tmp_path / "other"
    other.mkdir()
    for name in SHARDS:
        (other / name).write_bytes(b"x")
    (other / "config.json").write_text("another architecture")
    assert _run(tree, hold, "prepare", str(other)).returncode == 2 and not hold.exists()
    done = _run(tree, hold, "collect", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert done.returncode == 2 and not (tmp_path / "out").exists()
