"""`python -m benchmarks`: the one entry point of benchmarks/ (subcommands, the shared flags --json, --device,
--quick, --tiny mapped onto each script's options or refused in one line), run as a user would, in a
subprocess from the repository root."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.__main__ import SUBS  # noqa: E402


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_subcommand_and_its_script_exists():
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    for name, sub in SUBS.items():
        assert f"  {name} " in proc.stdout, name
        assert (ROOT / "benchmarks" / sub.script).is_file(), sub.script
    assert {"sparse-attention", "indexer", "mhc", "kv-pack", "gemm", "experts", "kernels", "flash-layers", "ced",
            "launches", "e2e", "train-step", "count-train-ops", "smoke", "compile-kernels", "convert"} <= set(SUBS)


def test_shared_flags_map_onto_the_scripts_options(tmp_path):
    out = str(tmp_path / "r.json")
    proc = cli("convert", "--tiny", "--quick", "--json", out, "--print")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["python", "benchmarks/convert_bench.py", "--experts", "4", "--dim", "256",
                                   "--engram-vocab", "20000", "--json", out]
    proc = cli("train-step", "--quick", "--json", out, "--data", ".tinydata", "--print")  # extra options pass through
    assert proc.stdout.split() == ["python", "benchmarks/bench_train_step.py", "--batches", "64", "--steps", "1",
                                   "--out", out, "--data", ".tinydata"]
    proc = cli("flash-layers", "--tiny", "--quick", "--device", "cpu", "--print")
    assert proc.stdout.split()[2:] == ["--quick", "--tiny", "--device", "cpu"]


@pytest.mark.parametrize("args, says", [
    (("gemm", "--tiny"), "--tiny is not available"),
    (("diagnose-kernels", "--json", "x.json"), "--json is not available"),
    (("smoke", "--device", "cuda"), "runs on cpu only"),
    (("sparse-attention", "--device", "cpu"), "runs on cuda only"),
])
def test_flags_without_an_equivalent_are_refused_in_one_line(args, says):
    proc = cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith(f"python -m benchmarks {args[0]}:")


def test_gpu_only_subcommand_says_so_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the subcommand would run")
    proc = cli("mhc", "--quick")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0]


@pytest.mark.slow  # ~20-30 s: bench_gemm, bench_experts and bench_decode_gemms through the interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the smoke run needs Triton's interpreter")
def test_cpu_subcommand_writes_its_json(tmp_path):
    """bench_gemm.py, bench_experts.py and bench_decode_gemms.py end to end at tiny shapes through the interpreter
    (benchmarks/smoke_cpu.py), so a broken script is found before device time is spent on it."""
    out = tmp_path / "smoke.json"
    proc = cli("smoke", "--tiny", "--quick", "--json", str(out), "--out", str(tmp_path / "rows"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "rows" / "gemm.json").exists() and (tmp_path / "rows" / "experts.json").exists()
    data = json.loads(out.read_text())
    assert data["benchmark"] == "smoke_cpu"
    assert len(data["rows"]["gemm"]) == 10 and len(data["rows"]["experts"]) == 4  # gemm: 4 cases, 2 variants, 4 dequant rows
    cases = [r for name in ("gemm", "experts") for r in data["rows"][name] if r["kernel"] != "routed_experts_sweep"]
    assert len(cases) == 12 and all(r["us"] > 0 and r["floor_us"] > 0 for r in cases)
    # bench_decode_gemms: 2 FP8 products (2 variants each) and 3 expert stages (1 variant) timed and swept, then
    # each one's fastest variant
    decode = data["rows"]["decode_gemms"]
    timed = [r for r in decode if r["kernel"] in ("decode_fp8_gemm", "decode_experts")]
    best = [r for r in decode if r["kernel"] == "decode_best"]
    assert len(timed) == 5 and all(r["us"] > 0 and r["floor_us"] > 0 for r in timed)
    assert sorted(r["group"] for r in best) == ["experts all", "experts down", "experts up", "fp8 wo_b", "fp8 wq_a"]
    swept = [r for r in decode if r["kernel"].endswith("_sweep")]
    assert len(swept) == 7 and all(r["us"] > 0 and "error" not in r for r in swept)
    assert all(min(r["us"] for r in swept if r["group"] == b["group"]) == b["us"] for b in best)
    sweep = [r for r in data["rows"]["experts"] if r["kernel"] == "routed_experts_sweep"]
    # the default first, then each configuration against it (the interpreter sums every tile in the same order)
    assert [r["case"] for r in sweep] == ["T=20 default", "T=20 BN32 dec16"]
    assert all(r["same_values_as_default"] and r["graph_over_default"] > 0 for r in sweep[1:])


def test_profile_prefill_groups_kernels_into_families(tmp_path):
    """profile_prefill's tiny CPU run writes its table, and the model's Triton kernels are told apart by name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from profile_prefill import family
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert family("expert_up_kernel") == "experts: up (Triton)"
    assert family("expert_combine_kernel") == "experts: combine (Triton)"
    assert family("split_combine_kernel") == family("tiles_kernel") == "sparse attention (Triton)"
    assert family("scores_kernel") == "indexer (Triton)"
    assert family("void at::native::index_elementwise_kernel<128, 4>") == "torch gather / scatter / index"
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "cuBLAS / CUTLASS GEMM"
    out = tmp_path / "p.json"
    proc = cli("profile-prefill", "--tiny", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["chunk"] == 64 and data["context_before"] == 64 and data["families"]
    assert abs(sum(f["share"] for f in data["families"]) - 1) < 1e-6


def test_host_kernels_benchmark_compares_in_one_process(tmp_path):
    """The host-kernel A/B: both arms run and report how many sequences kept their greedy tokens (the GEMMs'
    summation order differs between the arms, so random prompts may part at a near-tie; the README-like
    prompt of the single sequence does not)."""
    out = tmp_path / "ab.json"
    proc = cli("host-kernels", "--json", str(out), "--rounds", "1", "--requests", "2", "--new-tokens", "8",
               "--max-prompt", "16", timeout=300)
    if proc.returncode == 2 and "not available" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["single_decode_tokens_per_s"]["sequences_token_identical"] == 1
    for part in ("single_decode_tokens_per_s", "concurrent_tokens_per_s"):
        assert 0 <= data[part]["sequences_token_identical"] <= data[part]["sequences"]
        assert data[part]["host"][0] > 0 and data[part]["torch"][0] > 0


def test_the_flash_layers_engine_step_runs_as_the_engine_does(monkeypatch):
    """bench_flash_layers' engine step runs under inference mode, as the engine's callers do: with gradients on,
    the MoE takes its reference loop, which synchronizes with the host and breaks the CUDA graph capture
    (benchmarks/results/h200-2026-12-05-c)."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_flash_layers

    seen = []

    def probe(model, start, spare=0):  # the step's first call: stop there, having seen the mode
        seen.append(torch.is_inference_mode_enabled())
        raise RuntimeError("stop")

    monkeypatch.setattr(bench_flash_layers.fs, "fill_cache", probe)
    with pytest.raises(RuntimeError, match="stop"):
        bench_flash_layers.engine_decode_at(None, 64, 1, 0, False, graphs=False)
    assert seen == [True]
