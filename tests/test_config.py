import json

import pytest

from dsv41.model.config import ModelArgs, load_config, preset

# spec/architecture.md §4.1: (mode, kv source, index source) of every V4.1-Flash backbone layer
EXPECTED_V41 = {0: ("swa", None, None), 1: ("swa", None, None)}
for l in range(2, 20):
    src = 2 if l < 8 else 8 if l < 14 else 14
    EXPECTED_V41[l] = ("full" if l == src else "reuse", src, src)
for l in range(20, 40):
    if l in (20,):
        EXPECTED_V41[l] = ("full", 20, 20)
    elif l in (24, 28, 32, 36):
        EXPECTED_V41[l] = ("reindex", 20, l)
    else:
        idx = max([s for s in (20, 24, 28, 32, 36) if s <= l])
        EXPECTED_V41[l] = ("reuse", 20, idx)


def test_v41_layer_plan_matches_spec_table():
    plan = preset("v4.1-flash").plan
    assert len(plan.layers) == 40 and len(plan.extra) == 3
    for spec in plan.layers:
        assert (spec.mode, spec.kv_source, spec.index_source) == EXPECTED_V41[spec.id], spec
        assert spec.part == ("encoder" if spec.id < 20 else "decoder")
    assert [s.id for s in plan.layers if s.builds_candidates] == [20]
    assert [s.id for s in plan.layers if s.uses_candidates] == [24, 28, 32, 36]
    assert [s.id for s in plan.layers if s.engram is not None] == [1, 14]
    assert [s.id for s in plan.layers if s.dspark_tap] == [37, 38, 39]
    assert all(s.part == "dspark" and s.mode == "swa" for s in plan.extra)
    # reuse layers own nothing of the global branch; only sources do
    assert {s.id for s in plan.layers if s.owns_kv} == {2, 8, 14, 20}
    assert {s.id for s in plan.layers if s.owns_index} == {2, 8, 14, 20, 24, 28, 32, 36}


def test_tiny_preset_has_every_mode():
    plan = preset("tiny").plan
    modes = {(s.part, s.mode, s.compress_ratio) for s in plan.layers}
    assert {("encoder", "swa", 0), ("encoder", "full", 2), ("encoder", "reuse", 2), ("decoder", "full", 1),
            ("decoder", "reuse", 1), ("decoder", "reindex", 1)} <= modes
    assert any(s.builds_candidates for s in plan.layers) and any(s.uses_candidates for s in plan.layers)


def test_hf_config_round_trip(tmp_path):
    args = preset("v4.1-flash")
    (tmp_path / "config.json").write_text(json.dumps(args.to_hf_config()))
    back = load_config(tmp_path)
    for field in ("dim", "n_layers", "compress_ratios", "kv_source_layers", "index_source_layers", "norm_eps",
                  "engram_num_embeddings", "dspark_target_layer_ids", "vision_n_layers", "fp8_block_size",
                  "rope_factor", "original_seq_len", "route_scale", "index_n_heads", "image_token_id"):
        assert getattr(back, field) == getattr(args, field), field
    assert back.family == "v4.1"


def test_flat_inference_config_loads(tmp_path):
    flat = {"dim": 64, "n_layers": 4, "n_mtp_layers": 1, "compress_ratios": [0, 2, 1, 1, 0], "kv_source_layers": [1, 2],
            "index_source_layers": [1, 2], "n_heads": 2, "head_dim": 64, "rope_head_dim": 16, "q_lora_rank": 32,
            "o_groups": 2, "o_lora_rank": 32, "engram_layer_ids": [], "engram_num_embeddings": [],
            "dspark_target_layer_ids": [3], "candidate_source_layer": -1}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    args = load_config(tmp_path)
    assert args.family == "v4.1" and args.dim == 64
    assert [s.mode for s in args.plan] == ["swa", "full", "full", "reuse"]


def test_v4_configs_parse():
    flash = preset("v4-flash")
    assert flash.family == "v4" and flash.n_layers == 43 and len(flash.compress_ratios) == 44
    assert [s.mode for s in flash.plan][:4] == ["swa", "swa", "full", "full"]
    assert flash.plan[3].index_source is None  # HCA layers attend to every entry: no indexer


@pytest.mark.parametrize("bad", [dict(compress_ratios=(0, 0)), dict(kv_source_layers=(0,)), dict(n_heads=63)])
def test_invalid_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        ModelArgs(**bad)
