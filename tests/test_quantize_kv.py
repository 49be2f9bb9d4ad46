"""`dsv41 quantize-kv`: per-format bytes per token (measured), BPB, KL against bf16, top-1 agreement."""

import json
import subprocess
import sys

import pytest
import torch

from dsv41.evals.bpb import Corpus, Document, score_corpus
from dsv41.evals.quantize_kv import evaluate, parse_formats
from dsv41.model.ledger import kv_ledger


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from dsv41.model.checkpoint import load_model
    from tests.checkpoints import make_small_checkpoint

    ckpt = make_small_checkpoint(tmp_path_factory.mktemp("qkv") / "ckpt")
    model, args, tok = load_model(ckpt)
    return ckpt, model.eval().requires_grad_(False), args, tok


def corpus(name="c"):
    texts = ["The cache stores main KV entries packed, two E2M1 codes per byte. " * 3,
             "def f(x):\n    return x * 2  # the window ring holds FP8\n" * 3]
    return Corpus(name, [Document(f"{name}{i}", t) for i, t in enumerate(texts)])


def test_formats_against_the_bf16_reference(small):
    ckpt, model, args, tok = small
    doc = evaluate(model, tok, [corpus()], ["bf16", "fp8", "fp4"], max_ctx=32, batch_size=4)
    rows = {r["format"]: r for r in doc["formats"]}
    assert list(rows) == ["bf16", "fp8", "fp4"]
    assert doc["tokens"] == sum(len(tok.encode(d.text, allow_special=False)) for d in corpus().documents)
    ref = rows["bf16"]
    assert ref["kld_mean"] == 0 and ref["top1_agreement"] == 1 and ref["delta_bpb"] == 0 and ref["rms_dp"] == 0
    for f in ("fp8", "fp4"):
        assert rows[f]["kld_mean"] > 0 and rows[f]["kld_max"] >= rows[f]["kld_p99"] >= 0
        assert 0 < rows[f]["top1_agreement"] <= 1
    # coarser storage, larger distortion on a random model (FP4 has 4x the grid step of FP8)
    assert rows["fp4"]["kld_mean"] > rows["fp8"]["kld_mean"]
    # bytes measured from the packed caches = the ledger (every window holds 32 positions, a multiple of m)
    ledger = kv_ledger(args)
    assert rows["fp4"]["bytes_per_token"] == ledger["global_bytes_per_token"] == rows["fp4"]["ledger_bytes_per_token"]
    assert rows["fp8"]["bytes_per_token"] == rows["fp8"]["ledger_bytes_per_token"]
    assert rows["bf16"]["bytes_per_token"] == rows["bf16"]["ledger_bytes_per_token"]
    assert rows["fp4"]["bytes_per_token"] < rows["fp8"]["bytes_per_token"] < rows["bf16"]["bytes_per_token"]
    assert rows["fp4"]["window_bytes_per_layer"] == ledger["swa_bytes_per_layer_window"]
    # the fp4 run is the default cache: its BPB is what evals/bpb.py measures with the same windows
    scores = score_corpus(model, tok, corpus(), max_ctx=32)
    bpb = sum(s.nll for s in scores) / (torch.log(torch.tensor(2.0)).item() * corpus().n_bytes)
    assert rows["fp4"]["bpb"] == pytest.approx(bpb, rel=1e-4)
    assert doc["corpora"][0]["formats"][2]["bpb"] == pytest.approx(rows["fp4"]["bpb"])


def test_max_tokens_cuts_each_corpus(small):
    _, model, _, tok = small
    doc = evaluate(model, tok, [corpus("a"), corpus("b")], ["fp4"], max_ctx=32, max_tokens=50)
    assert [c["tokens"] for c in doc["corpora"]] == [50, 50] and doc["tokens"] == 100
    assert doc["corpora"][0]["bytes"] == 50  # byte-level tokenizer: one token per byte here
    assert [r["format"] for r in doc["formats"]] == ["fp4"]


def test_parse_formats():
    from dsv41.evals.quantize_kv import FORMATS
    from dsv41.model.cache import MAIN_FORMATS

    assert set(FORMATS) == set(MAIN_FORMATS)
    assert parse_formats("fp4, bf16") == ["fp4", "bf16"]
    for bad in ("fp4,int4", "", "fp4,fp4"):
        with pytest.raises(ValueError):
            parse_formats(bad)


def test_cli_json_and_bad_input(small, tmp_path, capsys):
    from dsv41_cli.app import main

    ckpt = small[0]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": d.text}) for d in corpus().documents))
    with pytest.raises(SystemExit) as exit_:  # in-process: the subprocess start-up (torch import) is slow
        main(["quantize-kv", "--model", str(ckpt), str(path), "--formats", "fp4,bf16", "--max-ctx", "16",
              "--max-tokens", "40", "--json"])
    assert exit_.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == 40 and [f["format"] for f in doc["formats"]] == ["fp4", "bf16"]
    for key in ("bytes_per_token", "bpb", "kld_mean", "kld_p99", "top1_agreement"):
        assert isinstance(doc["formats"][0][key], float)
    run = lambda *a: subprocess.run([sys.executable, "-m", "dsv41_cli", "quantize-kv", "--model", str(ckpt), *a],
                                    capture_output=True, text=True)
    r = run(str(path), "--formats", "fp4,int4")
    assert r.returncode == 2 and "int4" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "no such file" in r.stderr
