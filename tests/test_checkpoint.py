"""Checkpoint I/O (model/checkpoint/): the official layout as written by the fixture writer, the
runtime layout and its split rules, round trips, expert dtypes, loading, streaming and resume."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dsv41.model import checkpoint as C
from dsv41.model import formats
from dsv41.model.fixtures import fixture_args, write_official_fixture
from dsv41.model.ledger import parameter_inventory


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    return write_official_fixture(tmp_path_factory.mktemp("ckpt") / "official", seed=1)


@pytest.fixture(scope="module")
def runtime(official, tmp_path_factory):
    """mp -> runtime-layout directory converted from the fixture (FP4 experts)."""
    base = tmp_path_factory.mktemp("runtime")
    return {mp: Path(C.convert(official, base / f"mp{mp}", mp=mp)["dst"]) for mp in (1, 2)}


def stored_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def raw_header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


# ------------------------------------------------------------------------------ the official layout
def test_fixture_is_the_official_layout(official):
    args = fixture_args()
    index = json.loads((official / C.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(index["weight_map"]) == sorted(n for n, _, _ in parameter_inventory(args))
    headers = {s: raw_header(official / s) for s in shards}
    entries = [v for h in headers.values() for k, v in h.items() if k != "__metadata__"]
    assert index["metadata"]["total_size"] == sum(v["data_offsets"][1] - v["data_offsets"][0] for v in entries)
    # the Engram tables have shards of their own, at the end (as shards 47/48 of the release)
    assert set(headers[shards[2]]) - {"__metadata__"} == {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"}
    assert set(headers[shards[3]]) - {"__metadata__"} == {"layers.3.engram.embed.weight", "layers.3.engram.embed.scale"}
    entry = {k: v for h in headers.values() for k, v in h.items() if k != "__metadata__"}
    # FP8 linears with 32x32 UE8M0 blocks; packed FP4 experts (I8) with one UE8M0 per 32 inputs
    assert entry["layers.0.attn.wo_a.weight"]["dtype"] == "F8_E4M3"
    assert entry["layers.0.attn.wo_a.scale"] == {**entry["layers.0.attn.wo_a.scale"], "dtype": "F8_E8M0",
                                                 "shape": [64 // 32, 128 // 32]}
    assert entry["layers.0.ffn.experts.3.w2.weight"]["dtype"] == "I8"
    assert entry["layers.0.ffn.experts.3.w2.weight"]["shape"] == [args.dim, args.moe_inter_dim // 2]
    assert entry["layers.0.ffn.experts.3.w2.scale"]["shape"] == [args.dim, args.moe_inter_dim // 32]
    assert entry["layers.1.engram.embed.weight"]["dtype"] == "F8_E4M3"
    assert entry["layers.1.engram.embed.scale"]["shape"][1] == args.engram_head_dim // 32
    for name in ("mtp.2.markov_head.embed.weight", "mtp.2.confidence_head.proj.weight", "mtp.0.main_proj.scale",
                 "image_newline", "vision.blocks.0.attn.wqkv.bias", "aligner.w1.weight", "layers.0.ffn.gate.bias_vl"):
        assert name in entry
    cfg = json.loads((official / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]
    assert (official / "tokenizer.json").is_file() and (official / "tokenizer_config.json").is_file()


def test_shards_read_identically_with_the_safetensors_library(official):
    from safetensors import safe_open

    ckpt = C.open_official(official)
    for shard in ckpt.headers:
        with safe_open(str(official / shard), framework="pt") as f:
            for name in f.keys():
                assert torch.equal(stored_bytes(f.get_tensor(name)), stored_bytes(C.open_tensor(ckpt.tensors[name])))


def test_encodings_decode_to_the_model_that_was_written(official):
    """The stored FP8 bytes and scales decode to the fixture model's weights (fixture seed 1)."""
    from dsv41.model.transformer import Transformer, init_random_

    model = init_random_(Transformer(fixture_args()), seed=1)
    state, _ = C.load_state_dict(official)
    for name, value in model.state_dict().items():
        assert torch.equal(stored_bytes(state[name]), stored_bytes(value)), name
    wo_a = model.layers[2].attn.wo_a
    decoded = formats.dequant_fp8_weight(state["layers.2.attn.wo_a.weight"], state["layers.2.attn.wo_a.scale"], 32)
    assert torch.equal(decoded, wo_a.dequantized_weight())


def test_legacy_spellings_are_mapped_to_official_names(official, tmp_path):
    src = tmp_path / "legacy"
    shutil.copytree(official, src)
    index = json.loads((src / C.INDEX_FILE).read_text())
    renames = {"layers.0.attn.wq_a.weight": "model.layers.0.self_attn.q_a_proj.weight",
               "layers.0.attn.wq_a.scale": "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
               "embed.weight": "model.embed_tokens.weight"}
    for old, new in renames.items():
        shard = index["weight_map"].pop(old)
        index["weight_map"][new] = shard
        rewrite_header(src / shard, lambda h, old=old, new=new: {(new if k == old else k): v for k, v in h.items()})
    (src / C.INDEX_FILE).write_text(json.dumps(index))
    ckpt = C.open_official(src)
    assert ckpt.tensors["layers.0.attn.wq_a.scale"].name == "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    assert "embed.weight" in ckpt.tensors


def rewrite_header(path: Path, edit) -> None:
    """Rewrite a shard's header (tensor data unchanged) through `edit(header dict) -> header dict`."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8:8 + n]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


# ------------------------------------------------------------------------------ runtime layout
def test_round_trip_is_bit_exact(official, runtime, tmp_path):
    """official -> runtime (mp 1, mp 2) -> official: every file, hence every tensor, byte for byte."""
    original, _ = C.load_state_dict(official)
    for mp, rt in runtime.items():
        back = Path(C.convert(rt, tmp_path / f"back{mp}", to="official")["dst"])
        assert sorted(os.listdir(back)) == sorted(os.listdir(official))
        for name in os.listdir(official):
            assert filecmp.cmp(official / name, back / name, shallow=False), (mp, name)
        again, _ = C.load_state_dict(back)
        for name, value in original.items():
            assert torch.equal(stored_bytes(again[name]), stored_bytes(value)), name


def test_runtime_layout_files_and_manifest(official, runtime):
    rt = runtime[2]
    manifest = json.loads((rt / C.MANIFEST_FILE).read_text())
    assert manifest["mp"] == 2 and manifest["expert_dtype"] == "fp4" and manifest["wo_a_dtype"] == "bf16"
    assert sorted(os.listdir(rt)) == sorted(["config.json", "tokenizer.json", "tokenizer_config.json", C.MANIFEST_FILE,
                                             C.SCALES_FILE, "model0-mp2.safetensors", "model1-mp2.safetensors"])
    for name, info in manifest["files"].items():
        data = (rt / name).read_bytes()
        assert info["bytes"] == len(data)
        assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert filecmp.cmp(official / "config.json", rt / "config.json", shallow=False)
    assert filecmp.cmp(official / "tokenizer.json", rt / "tokenizer.json", shallow=False)


def test_split_rules_against_the_official_tensors(official, runtime):
    """Each rank's tensors, computed independently here from the official ones (S0's parallel modules)."""
    full, args = C.load_state_dict(official)
    ranks = [C.load_rank_state(runtime[2], r, 2) for r in range(2)]
    for r, state in enumerate(ranks):
        half = lambda t, dim=0: t.chunk(2, dim=dim)[r]
        # column-parallel (heads, output groups, vocabulary) and row-parallel (wo_b) linears
        for name, dim in (("wq_b.weight", 0), ("wq_b.scale", 0), ("wo_b.weight", 1), ("wo_b.scale", 1)):
            name = f"layers.2.attn.{name}"
            assert torch.equal(stored_bytes(state[name]), stored_bytes(half(full[name], dim))), name
        assert torch.equal(state["layers.2.attn.attn_sink"], half(full["layers.2.attn.attn_sink"]))
        assert torch.equal(state["layers.2.attn.indexer.weights_proj.weight"],
                           half(full["layers.2.attn.indexer.weights_proj.weight"]))
        for name in ("embed.weight", "head.weight", "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"):
            assert torch.equal(state[name], half(full[name])), name
        # wo_a: its rows, dequantized to bf16 with the 32x32 scales
        wo_a = formats.dequant_fp8_weight(full["mtp.1.attn.wo_a.weight"], full["mtp.1.attn.wo_a.scale"], 32)
        assert state["mtp.1.attn.wo_a.weight"].dtype == torch.bfloat16
        assert torch.equal(state["mtp.1.attn.wo_a.weight"].float(), half(wo_a))
        assert "mtp.1.attn.wo_a.scale" not in state
        # routed experts whole, by index range; shared experts, gate, Engram wkv, DSpark and vision replicated
        own = {2 * r, 2 * r + 1}
        for e in range(4):
            assert (f"layers.5.ffn.experts.{e}.w2.weight" in state) == (e in own)
        for e in own:
            assert torch.equal(stored_bytes(state[f"layers.5.ffn.experts.{e}.w2.weight"]),
                               stored_bytes(full[f"layers.5.ffn.experts.{e}.w2.weight"]))
        for name in ("layers.5.ffn.shared_experts.w1.weight", "layers.5.ffn.gate.bias_vl", "layers.3.engram.wkv.weight",
                     "mtp.0.main_proj.weight", "mtp.2.confidence_head.proj.weight", "vision.blocks.0.mlp.w1.weight",
                     "aligner.w1.bias", "image_start", "layers.2.hc_attn_fn"):
            assert torch.equal(stored_bytes(state[name]), stored_bytes(full[name])), name
        # the Engram tables by rows (630 and 834 rows: even halves here)
        assert torch.equal(stored_bytes(state["layers.1.engram.embed.weight"]),
                           stored_bytes(half(full["layers.1.engram.embed.weight"])))
    # on the fly from the official layout: the same as the rank files
    for r in range(2):
        direct = C.load_rank_state(official, r, 2)
        assert direct.keys() == ranks[r].keys()
        for name in direct:
            assert torch.equal(stored_bytes(direct[name]), stored_bytes(ranks[r][name])), name


def test_uneven_engram_rows_and_shared_scale_blocks():
    """Engram tables split in ceil(rows/N) parts, the last zero-padded; a weight split finer than its
    32-row scale blocks gives each rank a copy of the block's scale row."""
    args = fixture_args()
    tensors = {"layers.1.engram.embed.weight": ((5, 32), "F8_E4M3"), "layers.1.engram.embed.scale": ((5, 1), "F8_E8M0"),
               "layers.0.attn.wq_b.weight": ((64, 32), "F8_E4M3"), "layers.0.attn.wq_b.scale": ((2, 1), "F8_E8M0")}
    parts = [C.rank_tensors(tensors, args, 4, r) for r in range(4)]
    table = [p["layers.1.engram.embed.weight"][2] for p in parts]
    assert [(t.start, t.stop, t.pad) for t in table] == [(0, 2, 0), (2, 4, 0), (4, 5, 1), (5, 5, 2)]
    assert all(p["layers.1.engram.embed.scale"][0] == (2, 1) for p in parts)
    scales = [p["layers.0.attn.wq_b.scale"][2] for p in parts]
    assert [(s.start, s.stop) for s in scales] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(C.CheckpointError, match="does not divide o_groups"):
        C.check_mp(args, 4)


def test_models_from_either_layout_give_identical_logits(official, runtime):
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    logits = {}
    for key, path in (("official", official), ("mp1", runtime[1]), ("mp2", runtime[2])):
        model, args, tokenizer = C.load_model(path)
        assert tokenizer.vocab_size == 129280
        assert model.layers[0].attn.wo_a.kind == ("fp8" if key == "official" else "dense")
        logits[key] = model(ids, all_logits=True)
    assert torch.equal(logits["mp1"], logits["mp2"])
    assert torch.equal(logits["official"], logits["mp1"])  # wo_a runs on its exactly dequantized values anyway
    assert torch.isfinite(logits["mp1"]).all()


# ------------------------------------------------------------------------------ expert dtypes
def test_fp4_to_fp8_experts_is_lossless_and_reversible(official, tmp_path):
    rt = Path(C.convert(official, tmp_path / "fp8", mp=2, expert_dtype="fp8")["dst"])
    full, _ = C.load_state_dict(official)
    converted, args = C.load_state_dict(rt)
    assert args.expert_dtype == "fp8"
    n = 0
    for name in full:
        if ".experts." in name and name.endswith(".weight"):
            scale = name[:-6] + "scale"
            assert converted[name].dtype == torch.float8_e4m3fn
            assert converted[scale].shape == (converted[name].shape[0] // 32, converted[name].shape[1] // 32)
            exact = formats.dequant_fp4_weight(full[name], full[scale], 32)
            assert torch.equal(formats.dequant_fp8_weight(converted[name], converted[scale], 32), exact), name
            n += 1
    assert n == 11 * 4 * 3
    # and back: the same values in packed FP4 (scales may be chosen differently, so compare values)
    back, _ = C.load_state_dict(C.convert(rt, tmp_path / "back", to="official")["dst"])
    for name in full:
        if ".experts." in name and name.endswith(".weight"):
            scale = name[:-6] + "scale"
            assert torch.equal(formats.dequant_fp4_weight(back[name], back[scale], 32),
                               formats.dequant_fp4_weight(full[name], full[scale], 32)), name
        elif ".experts." not in name:
            assert torch.equal(stored_bytes(back[name]), stored_bytes(full[name])), name


def test_bf16_experts_hold_the_exact_values(official, tmp_path):
    rt = C.convert(official, tmp_path / "bf16", expert_dtype="bf16")["dst"]
    full, _ = C.load_state_dict(official)
    converted, _ = C.load_state_dict(rt)
    name = "mtp.2.ffn.experts.1.w3.weight"
    assert converted[name].dtype == torch.bfloat16 and name[:-6] + "scale" not in converted
    assert torch.equal(converted[name].float(), formats.dequant_fp4_weight(full[name], full[name[:-6] + "scale"], 32))


# ------------------------------------------------------------------------------ streaming, atomicity, resume
def test_small_chunks_give_the_same_bytes(official, runtime, tmp_path, monkeypatch):
    """Row ranges, column bands and whole tensors cut at chunk boundaries stream the same bytes."""
    monkeypatch.setattr(C.safetensors, "CHUNK_BYTES", 1000)
    out = Path(C.convert(official, tmp_path / "mp2", mp=2)["dst"])
    for name in os.listdir(runtime[2]):
        assert filecmp.cmp(runtime[2] / name, out / name, shallow=False), name


def test_dry_run_writes_nothing(official, tmp_path):
    plan = C.convert(official, tmp_path / "dst", mp=2, dry_run=True)
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()
    assert [f["name"] for f in plan["files"]] == ["model0-mp2.safetensors", "model1-mp2.safetensors", C.SCALES_FILE]
    assert plan["bytes"] == sum(f["bytes"] for f in plan["files"])


class InterruptAfter(C.Progress):
    def __init__(self, tensors):
        self.left = tensors

    def advance(self, nbytes, tensors=0):
        self.left -= tensors
        if self.left < 0:
            raise KeyboardInterrupt


def test_resume_reuses_verified_files_and_rewrites_the_rest(official, runtime, tmp_path):
    dst = tmp_path / "out"
    n_rank0 = len(C.read_header(runtime[2] / "model0-mp2.safetensors").tensors)
    with pytest.raises(KeyboardInterrupt):
        C.convert(official, dst, mp=2, progress=InterruptAfter(n_rank0 + 10))
    partial = C.partial_dir(dst)
    assert not dst.exists() and (partial / "model0-mp2.safetensors").is_file()
    assert (partial / "model1-mp2.safetensors.tmp").is_file()  # the interrupted file, never renamed
    notes = []
    progress = C.Progress()
    progress.note = notes.append
    result = C.convert(official, dst, mp=2, resume=True, progress=progress)
    assert result["reused"] == ["model0-mp2.safetensors"] and not partial.exists()
    for name in os.listdir(runtime[2]):
        assert filecmp.cmp(runtime[2] / name, dst / name, shallow=False), name
    # a journaled file that no longer matches its sha256 is rewritten, not reused
    dst2 = tmp_path / "out2"
    with pytest.raises(KeyboardInterrupt):
        C.convert(official, dst2, mp=2, progress=InterruptAfter(n_rank0 + 10))
    done = C.partial_dir(dst2) / "model0-mp2.safetensors"
    data = bytearray(done.read_bytes())
    data[-1] ^= 1
    done.write_bytes(bytes(data))
    assert C.convert(official, dst2, mp=2, resume=True)["reused"] == []
    assert filecmp.cmp(runtime[2] / "model0-mp2.safetensors", dst2 / "model0-mp2.safetensors", shallow=False)


def test_bad_data_while_writing_leaves_no_destination(official, tmp_path, monkeypatch):
    def broken(values, name):
        raise C.CheckpointError(f"{name}: simulated")

    monkeypatch.setattr(C.plan, "_check_bf16_exact", broken)
    with pytest.raises(C.CheckpointError, match="simulated"):
        C.convert(official, tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


def test_runtime_verification_catches_truncated_rank_file(runtime, tmp_path):
    rt = tmp_path / "rt"
    shutil.copytree(runtime[2], rt)
    f = rt / "model1-mp2.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(C.CheckpointError, match="model1-mp2.safetensors is truncated"):
        C.load_model(rt)


def test_parts_finer_than_scale_blocks_round_trip(tmp_path):
    """o_lora_rank 16: each rank's half of wo_b's 32 input columns lies inside one 32-wide scale block,
    so both ranks carry that scale column; reassembly takes it once."""
    args = fixture_args(vision=False, o_lora_rank=16)
    src = write_official_fixture(tmp_path / "official", args, tokenizer=False)
    rt = C.convert(src, tmp_path / "rt", mp=2)["dst"]
    full, _ = C.load_state_dict(src)
    for r in range(2):
        state = C.load_rank_state(rt, r, 2)
        assert state["layers.4.attn.wo_b.weight"].shape == (args.dim, 16)
        name = "layers.4.attn.wo_b.scale"
        assert torch.equal(stored_bytes(state[name]), stored_bytes(full[name]))
    back = Path(C.convert(rt, tmp_path / "back", to="official")["dst"])
    for name in os.listdir(src):
        assert filecmp.cmp(src / name, back / name, shallow=False), name


@pytest.mark.parametrize("spread", [0, 3, 6])
def test_table_fp4_to_fp8_matches_the_float_reference(spread):
    """The converter's byte-table FP4 -> FP8 equals model.formats.fp4_weight_to_fp8 bit for bit (group
    scales spread over 2^spread within a tile, zero groups, -0 codes)."""
    g = torch.Generator().manual_seed(spread)
    w = torch.randn(128, 256, generator=g)
    w = w * torch.exp2(torch.randint(-spread, spread + 1, (128, 8), generator=g).float()).repeat_interleave(32, 1)
    w[:16, :32] = 0.0  # zero groups inside a live tile
    w[3, 40] = -1e-30  # rounds to -0
    packed, scale = formats.quant_fp4_weight(w, 32)
    want_w, want_s = formats.fp4_weight_to_fp8(packed.view(torch.int8), scale, 32, check_lossless=True)
    got_w, got_s = C.fp4_experts_to_fp8(packed.view(torch.int8), scale, 32)
    assert torch.equal(got_w.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(got_s.view(torch.uint8), want_s.view(torch.uint8))
    assert torch.equal(C.fp4_experts_to_values(packed, scale), formats.dequant_fp4_weight(packed, scale, 32))


def test_table_fp4_to_fp8_refuses_what_it_cannot_keep():
    w = torch.ones(32, 64)
    w[0, :32] = 2.0 ** -20  # a group 2^-20 below its tile's largest: its FP4 values fall below E4M3
    packed, scale = formats.quant_fp4_weight(w, 32)
    with pytest.raises(ValueError, match="not exact"):
        C.fp4_experts_to_fp8(packed, scale, 32)
