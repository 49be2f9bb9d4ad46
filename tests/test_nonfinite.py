"""Corrupted weights behind intact headers (issue #19 item 9): the loader's value scan, `convert --verify`
and the sampler's logits check each end with a one-line error (exit 2) naming the checkpoint and, where
they can, the tensor and its shard, instead of a torch RuntimeError from sampling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsv41.model import checkpoint as C
from dsv41.model.engine import NonFiniteLogits, Sampler, SamplingConfig


def corrupt(ckpt: Path, tensor: str, nbytes: int = 4096, byte: bytes = b"\xff") -> Path:
    """Overwrite `nbytes` in the middle of `tensor`'s data with `byte` (the header stays intact); returns
    the shard."""
    entry = C.open_official(ckpt, values=False).tensors[tensor]
    nbytes = min(nbytes, entry.nbytes)
    with open(entry.file, "r+b") as f:
        f.seek(entry.offset + (entry.nbytes - nbytes) // 2)
        f.write(byte * nbytes)
    return entry.file


@pytest.fixture
def broken(small_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(small_checkpoint, dst)
    return dst


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from dsv41_cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv41: error:"), err
    return lines[0]


# ------------------------------------------------------------------------------------------ the scan
@pytest.mark.parametrize("dtype, bad, what", [
    (torch.bfloat16, [float("nan"), float("inf")], "non-finite"),
    (torch.float32, [float("-inf"), float("nan"), float("nan")], "non-finite"),
    (torch.float8_e4m3fn, [0x7F, 0xFF], "E4M3 NaN codes"),
    (torch.float8_e8m0fnu, [0xFF], "UE8M0 NaN scales"),
])
def test_out_of_format_counts_every_bad_value(monkeypatch, dtype, bad, what):
    monkeypatch.setattr(C.safetensors, "SCAN_CHUNK", 7)  # several chunks, the bad values in different ones
    if dtype in (torch.bfloat16, torch.float32):
        t = torch.randn(50).to(dtype)
        assert C.out_of_format(t) is None
        for i, v in enumerate(bad):
            t[3 + 20 * i] = v
    else:
        raw = torch.randint(0, 0x7E, (50,), dtype=torch.uint8)  # no NaN code below 0x7F
        assert C.out_of_format(raw.view(dtype)) is None
        for i, v in enumerate(bad):
            raw[3 + 20 * i] = v
        t = raw.view(dtype)
    count, label = C.out_of_format(t)
    assert count == len(bad) and what in label


def test_packed_fp4_and_integers_have_no_bad_values():
    every = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    assert C.out_of_format(every.view(torch.int8)) is None  # 0xFF is two E2M1 codes of -6
    assert C.out_of_format(every) is None


# ------------------------------------------------------------------------------------------ loading
def test_the_loader_names_the_checkpoint_shard_and_tensor(broken):
    shard = corrupt(broken, "layers.0.attn.wq_a.weight")
    with pytest.raises(C.CheckpointError) as info:
        C.load_model(broken)
    message = str(info.value)
    for word in (str(broken), shard.name, "layers.0.attn.wq_a.weight", "E4M3 NaN codes"):
        assert word in message, (word, message)
    C.open_official(broken, values=False)  # the headers alone are still fine


def test_generate_on_corrupt_weights_exits_2_naming_the_tensor(broken, capsys):
    shard = corrupt(broken, "head.weight")
    code, _, err = run_cli(capsys, "generate", "--model", broken, "Add: 7 3 9 2 5", "--max-new-tokens", "8")
    line = one_error_line(err)
    assert code == 2
    for word in (str(broken), shard.name, "head.weight", "non-finite"):
        assert word in line, (word, line)


def test_above_the_scan_limit_generation_stops_on_non_finite_logits(broken, capsys, monkeypatch):
    """A checkpoint too large to scan at load (here: a limit of 0 bytes) loads lazily; the first NaN logits
    end generation with exit 2 naming the checkpoint, not `probability tensor contains inf, nan`."""
    corrupt(broken, "head.weight")
    monkeypatch.setattr(C.safetensors, "LOAD_SCAN_BYTES", 0)
    for extra in ([], ["--temperature", "0.7", "--seed", "1"]):
        code, _, err = run_cli(capsys, "generate", "--model", broken, "Add: 7 3 9 2 5", "--max-new-tokens", "8", *extra)
        line = one_error_line(err)
        assert code == 2 and str(broken) in line and "NaN/inf" in line and "--verify" in line, line


# ------------------------------------------------------------------------------------------ convert --verify
def test_convert_verify_passes_a_clean_checkpoint_in_either_layout(small_checkpoint, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "convert", small_checkpoint, "--verify", "--json")
    doc = json.loads(out)
    n_tensors = len(C.expected_tensors(C.load_args(small_checkpoint)))
    assert code == 0 and doc["layout"] == "official" and doc["tensors"] == n_tensors
    runtime = Path(C.convert(small_checkpoint, tmp_path / "rt", mp=2)["dst"])
    code, out, _ = run_cli(capsys, "convert", runtime, "--verify", "--json")
    assert code == 0 and json.loads(out)["checksums"] == "checked"


def test_convert_verify_names_the_tensor_even_above_the_scan_limit(broken, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(C.safetensors, "LOAD_SCAN_BYTES", 0)  # as for a checkpoint too large to scan at load
    shard = corrupt(broken, "layers.0.ffn.experts.0.w1.scale", nbytes=3)
    corrupt(broken, "head.weight")
    code, out, err = run_cli(capsys, "convert", broken, "--verify", "--json")
    line = one_error_line(err)
    assert code == 2 and out == ""
    for word in (str(broken), shard.name, "layers.0.ffn.experts.0.w1.scale", "3 UE8M0 NaN scales", "1 more problem"):
        assert word in line, (word, line)
    # with a DST, nothing is written
    code, _, err = run_cli(capsys, "convert", broken, tmp_path / "dst", "--verify", "--json")
    assert code == 2 and not (tmp_path / "dst").exists() and not C.partial_dir(tmp_path / "dst").exists()


def test_convert_verify_names_the_tensor_of_a_runtime_rank_file(small_checkpoint, tmp_path, capsys):
    runtime = Path(C.convert(small_checkpoint, tmp_path / "rt", mp=1)["dst"])
    entry = C.open_runtime(runtime).ranks[0]["layers.0.attn.wo_a.weight"]  # bf16 in the runtime layout
    with open(entry.file, "r+b") as f:
        f.seek(entry.offset)
        f.write(b"\xff" * 64)
    code, _, err = run_cli(capsys, "convert", runtime, "--verify")
    line = one_error_line(err.split("\n", 1)[1] if err.startswith("verifying") else err)
    assert code == 2 and "layers.0.attn.wo_a.weight" in line and "32 non-finite" in line, line


def test_convert_without_dst_needs_verify(small_checkpoint, capsys):
    code, _, err = run_cli(capsys, "convert", small_checkpoint)
    assert code == 2 and "DST" in one_error_line(err)


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_sampler_refuses_non_finite_logits(temperature):
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=0), "cpu", source="/models/x")
    logits = torch.randn(100)
    assert 0 <= int(sampler(logits)) < 100
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[7] = bad
        with pytest.raises(NonFiniteLogits, match=r"^/models/x: the model's logits hold 1 NaN/inf of 100 values"):
            sampler(broken)
    assert isinstance(NonFiniteLogits("x"), C.CheckpointError)  # the CLI's exit 2


def test_finite_logits_whose_sum_overflows_pass():
    """The cheap test is the sum's finiteness; finite logits that overflow it go to the exact check and pass."""
    from dsv41.model.engine import check_finite

    huge = torch.full((4, 1000), 3e38)
    assert not torch.isfinite(huge.sum()) and bool(torch.isfinite(huge).all())
    check_finite(huge)
    huge[2, 5] = float("nan")
    with pytest.raises(NonFiniteLogits, match="1 NaN/inf of 4,000 values"):
        check_finite(huge)


@pytest.mark.parametrize("host_pass", [True, False])
def test_the_greedy_pick_checks_every_row(host_pass, monkeypatch):
    """engine.checked_greedy_ids (the batched decode step's greedy pick): the argmax of each row when all are
    finite, and check_finite's error when any row holds a NaN or an inf, from the C pass or torch's."""
    from dsv41.model import engine
    from dsv41.model.kernels import host

    if not host_pass:
        monkeypatch.setattr(host, "available", lambda: False)
    logits = torch.randn(5, 300)
    logits[:, 17] = 3e38  # finite, and the sum overflows
    assert torch.equal(engine.checked_greedy_ids(logits, "ckpt"), logits.argmax(-1))
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[3, 299] = bad
        with pytest.raises(NonFiniteLogits, match=r"^ckpt: the model's logits hold 1 NaN/inf of 1,500 values"):
            engine.checked_greedy_ids(broken, "ckpt")


def test_speculative_verification_checks_the_target_logits(tiny_model):
    from dsv41.model.engine import Generator

    gen = Generator(tiny_model, source="ckpt")
    target = torch.randn(3, 8)
    target[1, 2] = float("nan")
    with pytest.raises(NonFiniteLogits, match="^ckpt: "):
        gen._accept(target, torch.randn(2, 8), [0, 1], Sampler(SamplingConfig(), "cpu", "ckpt"))
