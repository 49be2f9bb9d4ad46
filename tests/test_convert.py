"""`dsv41 convert` from the command line: broken downloads exit 2 with one line naming the problem and
leave no DST; kill -9 in the middle of a conversion, then --resume, gives the uninterrupted bytes."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv41.model import checkpoint as C
from dsv41.model.fixtures import write_official_fixture

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    return write_official_fixture(tmp_path_factory.mktemp("ckpt") / "official", seed=2)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from dsv41_cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def edit_header(path: Path, edit, extra_data: bytes = b"") -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8:8 + n]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:] + extra_data)


def shard_of(src: Path, tensor: str) -> Path:
    return src / json.loads((src / C.INDEX_FILE).read_text())["weight_map"][tensor]


def edit_index(src: Path, edit) -> None:
    index = json.loads((src / C.INDEX_FILE).read_text())
    edit(index["weight_map"])
    (src / C.INDEX_FILE).write_text(json.dumps(index))


def truncate(src):
    path = shard_of(src, "layers.2.attn.wq_b.weight")
    path.write_bytes(path.read_bytes()[:-100])
    return [path.name, "truncated"]


def missing_shard(src):
    path = shard_of(src, "layers.3.engram.embed.weight")
    path.unlink()
    return ["missing shard", path.name]


def index_names_absent_tensor(src):
    shard = shard_of(src, "norm.weight").name
    edit_index(src, lambda m: m.__setitem__("layers.0.attn.wq_a.bias", shard))
    return [C.INDEX_FILE, "layers.0.attn.wq_a.bias", shard, "does not contain it"]


def unlisted_tensor(src):
    path = shard_of(src, "layers.1.engram.embed.weight")

    def add(header):
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        header["layers.1.engram.extra"] = {"dtype": "F32", "shape": [2], "data_offsets": [end, end + 8]}
        return header

    edit_header(path, add, extra_data=bytes(8))
    return [path.name, "layers.1.engram.extra", "does not list"]


def wrong_shape(src):
    path = shard_of(src, "layers.4.attn.wo_a.weight")

    def transpose(header):
        header["layers.4.attn.wo_a.weight"]["shape"] = header["layers.4.attn.wo_a.weight"]["shape"][::-1]
        return header

    edit_header(path, transpose)
    return [path.name, "layers.4.attn.wo_a.weight", "[128, 64]", "[64, 128]"]


def wrong_dtype(src):
    path = shard_of(src, "layers.0.ffn.experts.1.w1.scale")

    def retype(header):
        header["layers.0.ffn.experts.1.w1.scale"]["dtype"] = "U8"
        return header

    edit_header(path, retype)
    return [path.name, "layers.0.ffn.experts.1.w1.scale", "U8", "F8_E8M0"]


def tensor_the_model_lacks(src):
    path = shard_of(src, "layers.1.engram.embed.weight")

    def add(header):
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        header["layers.1.engram.extra"] = {"dtype": "F32", "shape": [2], "data_offsets": [end, end + 8]}
        return header

    edit_header(path, add, extra_data=bytes(8))
    edit_index(src, lambda m: m.__setitem__("layers.1.engram.extra", path.name))
    return [path.name, "layers.1.engram.extra", "not part of the model"]


def tensor_the_checkpoint_lacks(src):
    from safetensors.torch import load_file, save_file

    path = shard_of(src, "mtp.2.confidence_head.proj.weight")
    tensors = load_file(path)
    del tensors["mtp.2.confidence_head.proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    edit_index(src, lambda m: m.pop("mtp.2.confidence_head.proj.weight"))
    return ["lacks tensor mtp.2.confidence_head.proj.weight"]


@pytest.mark.parametrize("corrupt", [truncate, missing_shard, index_names_absent_tensor, unlisted_tensor, wrong_shape,
                                     wrong_dtype, tensor_the_model_lacks, tensor_the_checkpoint_lacks])
def test_broken_checkpoint_exits_2_with_one_line(official, tmp_path, capsys, corrupt):
    src = tmp_path / "src"
    shutil.copytree(official, src)
    words = corrupt(src)
    dst = tmp_path / "dst"
    code, out, err = run_cli(capsys, "convert", src, dst, "--mp", "2")
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("dsv41: error:"), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not dst.exists() and not C.partial_dir(dst).exists()


def test_usage_errors_exit_2(official, tmp_path, capsys):
    for argv, words in (
        (["--expert-dtype", "fp16"], ["--expert-dtype", "fp16"]),
        (["--mp", "3"], ["--mp 3", "n_heads"]),
        (["--to", "hf"], ["--to"]),
    ):
        code, _, err = run_cli(capsys, "convert", official, tmp_path / "dst", *argv)
        assert code == 2 and all(w in err for w in words), err
        assert not (tmp_path / "dst").exists()
    code, _, err = run_cli(capsys, "convert", official, tmp_path / "dst", "--to", "official")
    assert code == 2 and "already in the official layout" in err


def test_dry_run_prints_the_plan(official, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "convert", official, tmp_path / "dst", "--mp", "2", "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and not (tmp_path / "dst").exists()
    assert plan["mp"] == 2 and plan["tensors"] == sum(f["tensors"] for f in plan["files"])
    assert [f["name"] for f in plan["files"]][:2] == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    assert plan["files"][0]["bytes"] == plan["files"][1]["bytes"] > 0


def test_kill_9_then_resume_is_byte_identical(official, tmp_path, capsys):
    reference = Path(C.convert(official, tmp_path / "reference", mp=2)["dst"])
    dst = tmp_path / "dst"
    partial = C.partial_dir(dst)
    journal = partial / C.JOURNAL_FILE
    # a window to interrupt in: the test's own process slows every fsync (a finished file's, the journal's)
    # by 0.3 s, so the kill lands while the second rank file is still being written
    slow_fsync = ("import os, sys, time; _fsync = os.fsync; "
                  "os.fsync = lambda fd: (time.sleep(0.3), _fsync(fd))[1]; "
                  "from dsv41_cli.app import main; main(sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", slow_fsync, "convert", str(official), str(dst), "--mp", "2"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                done = json.loads(journal.read_text()).get("done", {})
            except (OSError, ValueError):
                done = {}
            if "model0-mp2.safetensors" in done and (partial / "model1-mp2.safetensors.tmp").exists():
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the conversion finished before it could be interrupted"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists() and (partial / "model0-mp2.safetensors").is_file()

    code, out, err = run_cli(capsys, "convert", official, dst, "--mp", "2", "--resume")
    assert code == 0, err
    assert "reusing 1 verified file(s): model0-mp2.safetensors" in err
    assert not partial.exists()
    assert sorted(os.listdir(dst)) == sorted(os.listdir(reference))
    for name in os.listdir(reference):
        assert filecmp.cmp(reference / name, dst / name, shallow=False), name
