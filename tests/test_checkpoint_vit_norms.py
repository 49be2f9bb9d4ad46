"""ViT RMSNorm weights stored as BF16 (model/checkpoint/names.py `release_dtype`, `accepted_dtypes`): S0 declares
them fp32, the released V4.1-Flash checkpoint stores them as BF16 (its shard headers: BF16 520, F32 387,
F8_E4M3 357, F8_E8M0 47,589, I8 47,232 tensors, 510,286,023,000 bytes). The inventory, `save_official` and
`dsv41 info` use the release's dtypes; a checkpoint storing them F32 (the bundled dsv41-tiny) still
verifies and loads. Either loads widened to F32 with the same logits, and converts to the runtime layout
and back byte for byte; BF16 anywhere else is still refused."""

from __future__ import annotations

import filecmp
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dsv41.model import checkpoint as C
from dsv41.model import vision as V
from dsv41.model.fixtures import _tokenizer_dir, _tokenizer_json, fixture_args

IMG_ID = 500  # the placeholder must be one of the tiny model's 512 ids
VIT_NORMS = ("vision.blocks.0.norm1.weight", "vision.blocks.0.norm2.weight", "vision.norm.weight")


def vit_args():
    return fixture_args(image_token_id=IMG_ID, vision_min_pixels=28 * 28, vision_max_n_token=40)


def store_as(ckpt: Path, names, dtype: torch.dtype) -> None:
    """Rewrite the shards holding `names` with those tensors in `dtype`, and the index's total_size."""
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt / C.INDEX_FILE).read_text())
    for shard in sorted({index["weight_map"][n] for n in names}):
        tensors = load_file(ckpt / shard)
        tensors.update({n: tensors[n].to(dtype) for n in names if n in tensors})
        save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(e["data_offsets"][1] - e["data_offsets"][0]
                                          for e in stored(ckpt).values())
    (ckpt / C.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """The same model twice: ViT norms stored F32 (as S0 declares them, and as checkpoints written before
    the writer followed the release are) and BF16 (as released, and as `save_official` writes them). The
    norm values are random but bf16-representable, so both hold exactly the same numbers."""
    from dsv41.model.transformer import Transformer, init_random_

    args = vit_args()
    model = init_random_(Transformer(args), seed=4)
    state = model.state_dict()
    g = torch.Generator().manual_seed(5)
    for name in VIT_NORMS:
        state[name] = (1 + 0.3 * torch.randn(state[name].shape, generator=g)).to(torch.bfloat16).float()
    base = tmp_path_factory.mktemp("vit_norms")
    out = {"BF16": C.save_official(state, args, base / "BF16", n_shards=4, tokenizer_dir=_tokenizer_dir(),
                                   tokenizer_json=_tokenizer_json())}
    out["F32"] = base / "F32"
    shutil.copytree(out["BF16"], out["F32"])
    store_as(out["F32"], VIT_NORMS, torch.float32)
    return out


def header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def stored(ckpt: Path) -> dict[str, dict]:
    index = json.loads((ckpt / C.INDEX_FILE).read_text())
    return {k: v for s in set(index["weight_map"].values()) for k, v in header(ckpt / s).items() if k != "__metadata__"}


def test_the_release_stores_65_vit_norm_vectors_in_bf16():
    """The evidence: the only tensors allowed another dtype are the 65 ViT norm vectors of 1024 of
    V4.1-Flash, and storing them as BF16 saves exactly the 133,120 bytes by which the released index's
    total_size falls short of our all-F32 inventory."""
    from dsv41.model.config import preset

    expected = C.expected_tensors(preset("v4.1-flash"))
    flexible = {n: s for n, (s, d) in expected.items() if C.accepted_dtypes(n, d) != (d,)}
    assert len(flexible) == 32 * 2 + 1 and all(s == (1024,) for s in flexible.values())
    assert all(expected[n][1] == "BF16" and C.accepted_dtypes(n, "BF16") == ("BF16", "F32") for n in flexible)
    assert all(C.accepted_dtypes(n, "F32") == ("BF16", "F32") and C.model_dtype(n, "BF16") == "F32" for n in flexible)
    assert sum(math.prod(s) for s in flexible.values()) * (4 - 2) == 133_120
    # nothing else is loosened: text norms, other vision tensors, F32 tensors of the backbone
    for name in ("norm.weight", "layers.0.attn_norm.weight", "layers.0.attn.attn_sink", "vision.blocks.0.attn.wqkv.bias",
                 "vision.blocks.0.norm1.bias", "vision.norms.weight", "xvision.norm.weight"):
        assert C.accepted_dtypes(name, expected.get(name, ((), "F32"))[1]) == (expected.get(name, ((), "F32"))[1],)


def test_bf16_vit_norms_are_stored_and_counted_in_total_size(pair):
    entries = {k: stored(p) for k, p in pair.items()}
    for name in VIT_NORMS:
        assert entries["F32"][name]["dtype"] == "F32" and entries["BF16"][name]["dtype"] == "BF16"
    assert {n: e["dtype"] for n, e in entries["F32"].items() if n not in VIT_NORMS} == \
        {n: e["dtype"] for n, e in entries["BF16"].items() if n not in VIT_NORMS}
    totals = {}
    for key, path in pair.items():
        total = json.loads((path / C.INDEX_FILE).read_text())["metadata"]["total_size"]
        assert total == sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries[key].values())
        totals[key] = total
    assert totals["F32"] - totals["BF16"] == 3 * 32 * 2  # 3 vectors of vision_dim 32, 2 bytes each saved


def image_prompt(args):
    import io

    import PIL.Image

    g = torch.Generator().manual_seed(0)
    pixels = (torch.tensor([200, 30, 30]).view(1, 1, 3) + torch.randint(-25, 26, (70, 70, 3), generator=g)).clamp(0, 255)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels.to(torch.uint8).numpy(), "RGB").save(buf, "PNG")
    ids, types, inputs = V.expand_image_placeholders([0, 17, 300, IMG_ID, 41, 42, 43, 44, 45], [buf.getvalue()], args)
    return torch.tensor([ids]), inputs


def logits_of(path: Path) -> torch.Tensor:
    model, args, _ = C.load_model(path)
    for name in VIT_NORMS:  # widened to the model's F32 whatever the storage
        assert model.get_parameter(name).dtype == torch.float32, name
    ids, inputs = image_prompt(args)
    with torch.inference_mode():
        return model(ids, images=[inputs], all_logits=True)


def test_bf16_vit_norms_load_widened_with_the_logits_of_the_f32_checkpoint(pair):
    f32, _ = C.load_state_dict(pair["F32"])
    bf16, _ = C.load_state_dict(pair["BF16"])
    for name in VIT_NORMS:
        assert bf16[name].dtype == torch.float32 and torch.equal(bf16[name], f32[name])
    want = logits_of(pair["F32"])
    assert torch.isfinite(want).all()
    assert torch.equal(logits_of(pair["BF16"]), want)
    # the rank loaders widen too, split on the fly from the official layout
    for r in range(2):
        rank = C.load_rank_state(pair["BF16"], r, 2)
        for name in VIT_NORMS:
            assert rank[name].dtype == torch.float32 and torch.equal(rank[name], f32[name])


@pytest.mark.parametrize("mp", [1, 2])
def test_bf16_vit_norms_convert_to_runtime_and_back_byte_for_byte(pair, tmp_path, mp):
    src = pair["BF16"]
    rt = Path(C.convert(src, tmp_path / "rt", mp=mp)["dst"])
    for r in range(mp):  # the runtime rank files keep the stored BF16
        entries = header(rt / C.rank_file(r, mp))
        assert all(entries[n]["dtype"] == "BF16" for n in VIT_NORMS)
        rank = C.load_rank_state(rt, r, mp)
        assert all(rank[n].dtype == torch.float32 for n in VIT_NORMS)
    back = Path(C.convert(rt, tmp_path / "back", to="official")["dst"])
    assert sorted(os.listdir(back)) == sorted(os.listdir(src))
    for name in os.listdir(src):
        assert filecmp.cmp(src / name, back / name, shallow=False), name
    if mp == 2:
        assert torch.equal(logits_of(rt), logits_of(pair["F32"]))


def restore_shard(src: Path, tensor: str, dtype: torch.dtype) -> Path:
    """Rewrite the shard holding `tensor` with that tensor in `dtype` (the index stays valid)."""
    from safetensors.torch import load_file, save_file

    path = src / json.loads((src / C.INDEX_FILE).read_text())["weight_map"][tensor]
    tensors = load_file(path)
    tensors[tensor] = tensors[tensor].to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("tensor, dtype, words", [
    ("layers.0.attn.attn_sink", torch.bfloat16, ["layers.0.attn.attn_sink is BF16", "implies F32"]),
    ("layers.2.ffn.gate.bias", torch.bfloat16, ["layers.2.ffn.gate.bias is BF16", "implies F32"]),
    ("vision.norm.weight", torch.float16, ["vision.norm.weight is F16", "implies BF16 or F32"]),
])
def test_other_dtypes_are_still_refused_with_one_line(pair, tmp_path, capsys, tensor, dtype, words):
    from dsv41_cli.app import main

    src = tmp_path / "src"
    shutil.copytree(pair["BF16"], src)
    shard = restore_shard(src, tensor, dtype)
    with pytest.raises(C.CheckpointError, match="implies"):
        C.load_model(src)
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(src), str(tmp_path / "dst")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("dsv41: error:"), err
    for word in [shard.name] + words:
        assert word in err[0], (word, err[0])
    assert not (tmp_path / "dst").exists()


def test_save_official_refuses_bf16_outside_the_vit_norms(tmp_path):
    from dsv41.model.transformer import Transformer

    args = vit_args()
    state = Transformer(args).state_dict()
    state["layers.0.attn.attn_sink"] = state["layers.0.attn.attn_sink"].to(torch.bfloat16)
    with pytest.raises(C.CheckpointError, match="layers.0.attn.attn_sink is BF16 .*needs F32"):
        C.save_official(state, args, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


# the release's numbers (spec/peers.md: a tally of the V4.1-Flash shard headers)
RELEASE = {"tensors": 96_085, "bytes": 510_286_023_000,
           "by_dtype": {"BF16": 520, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47_589, "I8": 47_232}}


def test_the_inventory_matches_the_release_tensor_for_tensor_count_and_byte_for_byte():
    """From the inventory alone (the model on the meta device, no weights): every dtype's count and the
    byte total of the released shard headers."""
    from dsv41.model.config import preset

    expected = C.expected_tensors(preset("v4.1-flash"))
    totals = C.inventory_totals((n, s, d) for n, (s, d) in expected.items())
    assert totals["tensors"] == RELEASE["tensors"] and totals["bytes"] == RELEASE["bytes"]
    assert {k: v["tensors"] for k, v in totals["by_dtype"].items()} == RELEASE["by_dtype"]
    assert sum(v["bytes"] for v in totals["by_dtype"].values()) == RELEASE["bytes"]


def test_info_json_reports_the_release_numbers(capsys):
    from dsv41_cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--config", "v4.1-flash", "--json"])
    assert exit_info.value.code == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ck["layout"] == "official"
    assert (ck["tensors"], ck["bytes"]) == (RELEASE["tensors"], RELEASE["bytes"])
    assert {k: v["tensors"] for k, v in ck["by_dtype"].items()} == RELEASE["by_dtype"]


def test_the_writer_stores_vit_norms_as_released(tmp_path):
    """F32 norms that BF16 holds exactly are written BF16 (as released); F32 values BF16 would round stay
    F32 (lossless); either way the checkpoint verifies and loads them back exactly, as F32."""
    from dsv41.model.transformer import Transformer, init_random_

    args = vit_args()
    state = init_random_(Transformer(args), seed=1).state_dict()
    exact = {n: (1 + 0.25 * torch.arange(state[n].numel()) / state[n].numel()).to(torch.bfloat16).float()
             for n in VIT_NORMS}
    rounded = dict(exact, **{"vision.norm.weight": exact["vision.norm.weight"] + 2.0 ** -12})
    for label, norms, want in (("exact", exact, "BF16"), ("rounded", rounded, None)):
        dst = C.save_official({**state, **norms}, args, tmp_path / label)
        entries = stored(dst)
        for name in VIT_NORMS:
            dtype = want or ("F32" if name == "vision.norm.weight" else "BF16")
            assert entries[name]["dtype"] == dtype, (label, name)
        loaded, _ = C.load_state_dict(dst)
        for name in VIT_NORMS:
            assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], norms[name]), (label, name)


def test_the_bundled_checkpoint_with_f32_vit_norms_still_loads():
    from dsv41.model.assets import bundled_model_dir

    path = bundled_model_dir()
    assert path is not None, "the bundled dsv41-tiny checkpoint is committed: its absence is a defect"
    entries = stored(path)
    norms = [n for n in entries if C.model_dtype(n, "BF16") == "F32" and C.accepted_dtypes(n, "BF16") != ("BF16",)]
    assert norms and all(entries[n]["dtype"] in ("F32", "BF16") for n in norms)
    state, _ = C.load_state_dict(path)
    assert all(state[n].dtype == torch.float32 for n in norms)
