import json
import subprocess
import sys

import pytest

from dsv41.model.config import preset
from dsv41.model.ledger import info, parameter_inventory


@pytest.fixture(scope="module")
def v41():
    return info(preset("v4.1-flash"))


def rel(a, b):
    return abs(a - b) / b


def test_v41_parameter_ledger_matches_report(v41):
    p = v41["params"]
    assert rel(p["backbone"], 551.9e9) < 0.003
    assert rel(p["engram"], 196.6e9) < 0.003
    assert rel(p["dspark"], 14.2e9) < 0.01
    assert rel(p["vision"], 0.49e9) < 0.02
    assert p["total"] == p["backbone"] + p["engram"] + p["dspark"] + p["vision"]


def test_v41_activated_parameters(v41):
    assert rel(v41["activated"]["prefill"], 8e9) < 0.10
    assert rel(v41["activated"]["decode"], 16e9) < 0.10


def test_v41_kv_ledger_is_890_bytes(v41):
    kv = v41["kv"]
    assert kv["global_bytes_per_token"] == 890.0
    assert kv["main_bytes_per_token"] == 720.0 and kv["indexer_bytes_per_token"] == 170.0
    assert kv["swa_bytes_per_layer_window"] == 128 * 528


def test_v4_flash_ledger():
    d = info(preset("v4-flash"))
    # DeepSeek publishes V4-Flash as 284B parameters with 13B activated
    assert rel(d["params"]["backbone"], 284e9) < 0.01
    assert rel(d["activated"]["decode"], 13e9) < 0.05
    ratio = 890.0 / d["kv"]["global_bytes_per_token"]
    assert 0.22 < ratio < 0.28  # "about a quarter of V4-Flash"


def test_fast_inventory_equals_full_construction():
    args = preset("tiny")
    assert sorted(parameter_inventory(args)) == sorted(parameter_inventory(args, fast=False))


def test_official_names_and_shapes_v41(v41):
    inv = {n: (s, d) for n, s, d in parameter_inventory(preset("v4.1-flash"))}
    import torch

    expect = {
        "embed.weight": ((129280, 5120), torch.bfloat16),
        "layers.0.attn.wq_a.weight": ((1280, 5120), torch.float8_e4m3fn),
        "layers.0.attn.wq_a.scale": ((40, 160), torch.float8_e8m0fnu),
        "layers.0.attn.wq_b.scale": ((1024, 40), torch.float8_e8m0fnu),
        "layers.0.attn.wo_a.weight": ((8192, 4096), torch.float8_e4m3fn),
        "layers.0.attn.wo_a.scale": ((256, 128), torch.float8_e8m0fnu),
        "layers.0.attn.wo_b.scale": ((160, 256), torch.float8_e8m0fnu),
        "layers.0.attn.attn_sink": ((64,), torch.float32),
        "layers.0.hc_attn_fn": ((24, 20480), torch.float32),
        "layers.0.hc_ffn_scale": ((3,), torch.float32),
        "layers.2.attn.compressor.wkv.weight": ((512, 5120), torch.bfloat16),
        "layers.2.attn.compressor.wgate.weight": ((512, 5120), torch.bfloat16),
        "layers.2.attn.indexer.wk.weight": ((128, 512), torch.bfloat16),
        "layers.2.attn.indexer.wq_b.weight": ((4096, 1280), torch.float8_e4m3fn),
        "layers.2.attn.indexer.weights_proj.weight": ((32, 5120), torch.bfloat16),
        "layers.5.ffn.experts.383.w1.weight": ((2304, 2560), torch.int8),
        "layers.5.ffn.experts.383.w1.scale": ((2304, 160), torch.float8_e8m0fnu),
        "layers.5.ffn.experts.0.w2.weight": ((5120, 1152), torch.int8),
        "layers.5.ffn.experts.0.w2.scale": ((5120, 72), torch.float8_e8m0fnu),
        "layers.5.ffn.gate.bias_vl": ((384,), torch.float32),
        "layers.1.engram.embed.weight": ((384006168, 256), torch.float8_e4m3fn),
        "layers.14.engram.embed.scale": ((384016682, 8), torch.float8_e8m0fnu),
        "layers.1.engram.wkv.weight": ((25600, 6144), torch.float8_e4m3fn),
        "layers.1.engram.wkv.scale": ((800, 192), torch.float8_e8m0fnu),
        "mtp.0.main_proj.weight": ((5120, 15360), torch.float8_e4m3fn),
        "mtp.2.markov_head.embed.weight": ((129280, 256), torch.bfloat16),
        "mtp.2.markov_head.head.weight": ((129280, 256), torch.bfloat16),
        "mtp.2.confidence_head.proj.weight": ((1, 5376), torch.bfloat16),
        "mtp.1.ffn.experts.127.w3.weight": ((2304, 2560), torch.int8),
        "mtp.1.ffn.gate.bias_vl": ((128,), torch.float32),
    }
    for name, want in expect.items():
        assert inv.get(name) == want, name
    # Reuse layers own no KV or indexer parameters; Reindex layers own only the query side
    assert not any(n.startswith("layers.3.attn.") and ("compressor" in n or "indexer" in n) for n in inv)
    assert not any(n.startswith("layers.24.attn.compressor") or n.startswith("layers.24.attn.indexer.wk") for n in inv)
    assert "layers.24.attn.indexer.wq_b.weight" in inv
    assert not any(".engram." in n for n in inv if not n.startswith(("layers.1.", "layers.14.")))
    assert "hc_head_fn" not in inv  # V4.1 has no hc_head


def test_info_cli_json():
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", "info", "--config", "v4.1-flash", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == "v4.1-flash" and doc["path"] is None
    assert set(doc["params"]) >= {"backbone", "engram", "dspark", "vision", "total"}
    assert doc["kv"]["global_bytes_per_token"] == 890.0
    assert len(doc["layers"]) == 43
    assert doc["layers"][24] == {"id": 24, "part": "decoder", "compress_ratio": 1, "mode": "reindex",
                                 "kv_source": 20, "index_source": 24}


@pytest.mark.parametrize("argv", [["info", "--config", "nope"], ["info", "--bogus"], ["info", "--model", "/nonexistent"]])
def test_info_bad_input_exits_2_with_one_line(argv):
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", *argv], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr
