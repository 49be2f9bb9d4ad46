"""Bits per byte (evals/bpb.py, `dsv41 bpb`): the scoring primitive against the model's own full
forward, the window schemes, the corpus-level aggregation, baselines, bad input."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv41.evals import bpb

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("Le cœur a ses raisons que la raison ne connaît point. "  # non-ASCII: bytes != characters
        "Größe, naïve façade — 東京. The quick brown fox jumps over the lazy dog.\n")


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    from tests.checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("bpb") / "ckpt")


@pytest.fixture(scope="session")
def loaded(small_ckpt):
    from dsv41.model.checkpoint import load_model

    return load_model(small_ckpt)


def full_forward_logprobs(model, seq: list[int]) -> torch.Tensor:
    """ln p(seq[j] | seq[:j]) for j >= 1 from one full forward over seq[:-1] (no cache, no windows)."""
    with torch.inference_mode():
        logits = model(torch.tensor([seq[:-1]]), all_logits=True).float()
    return torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)


def run_cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV41_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "dsv41_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


# ------------------------------------------------------------------------------------ scoring
def test_score_sequences_equals_full_forward(loaded):
    model, _, tok = loaded
    seq = [tok.bos_id] + tok.encode(TEXT, allow_special=False)
    ref = full_forward_logprobs(model, seq)
    whole = bpb.score_sequences(model, [seq], [len(seq) - 1], pad_id=tok.pad_id)[0]
    assert whole.logprob == pytest.approx(float(ref.sum()), rel=1e-5)
    tail = bpb.score_sequences(model, [seq], [7], pad_id=tok.pad_id)[0]  # only the last 7 tokens
    assert tail.logprob == pytest.approx(float(ref[-7:].sum()), rel=1e-5)
    # through the KV cache in chunks of 13 positions (a tiny logits budget): the same sum
    chunked = bpb.score_sequences(model, [seq], [len(seq) - 1], pad_id=tok.pad_id,
                                  max_logits_bytes=4 * model.args.vocab_size * 13)[0]
    assert chunked.logprob == pytest.approx(whole.logprob, rel=1e-3)


def test_batching_with_padding_matches_one_by_one(loaded):
    model, _, tok = loaded
    seqs = [[tok.bos_id] + tok.encode(t, allow_special=False) for t in (TEXT, "short one", TEXT[:40])]
    ns = [len(seqs[0]) - 1, 3, 10]
    together = bpb.score_sequences(model, seqs, ns, pad_id=tok.pad_id, batch_size=3)
    alone = [bpb.score_sequences(model, [s], [n], pad_id=tok.pad_id)[0] for s, n in zip(seqs, ns)]
    for a, b in zip(together, alone):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-3, abs=1e-2)


def test_batches_in_threads_score_as_one_thread(loaded, monkeypatch):
    """Two threads taking the batches (the CPU default on a 2-core machine for a small model) give every
    sequence the single-threaded score, bit for bit, and call on_done once per sequence."""
    model, _, tok = loaded
    texts = (TEXT, "short one", TEXT[:40], TEXT[::-1], "x y z " * 9, TEXT[10:70])
    seqs = [[tok.bos_id] + tok.encode(t, allow_special=False) for t in texts]
    ns = [len(s) - 1 for s in seqs]
    monkeypatch.setenv("DSV41_THREADS", "1")
    assert bpb.scoring_threads(model, 3) == 1
    one = bpb.score_sequences(model, seqs, ns, pad_id=tok.pad_id, batch_size=2)
    monkeypatch.setenv("DSV41_THREADS", str(2 * torch.get_num_threads()))
    assert bpb.scoring_threads(model, 3) == 2 and bpb.scoring_threads(model, 1) == 1
    seen = []
    two = bpb.score_sequences(model, seqs, ns, pad_id=tok.pad_id, batch_size=2, on_done=lambda i, s: seen.append(i))
    assert [(s.logprob, s.greedy, s.n) for s in two] == [(s.logprob, s.greedy, s.n) for s in one]
    assert sorted(seen) == list(range(len(seqs)))


def test_in_threads_raises_the_first_error_and_stops():
    ran = []

    def score(batch, done):
        ran.append(batch)
        if batch == 1:
            raise ValueError("batch 1 failed")
        time.sleep(0.02)  # lets the failing thread run
        return batch * 10

    assert bpb.in_threads([0, 2, 3], score, 2) == [0, 20, 30]
    with pytest.raises(ValueError, match="batch 1 failed"):
        bpb.in_threads(list(range(50)), score, 2)
    assert len(ran) <= 3 + 10  # the other thread stopped at its next batch, far short of 50


def test_in_threads_keeps_quiet_after_an_interrupt():
    """Ctrl-C while the threads score: KeyboardInterrupt reaches the caller once the batches running end, and
    afterwards no on_done call comes (the caller is saving what finished) and no new batch starts."""
    import signal
    import threading

    main = threading.main_thread().ident
    reported, started = [], []

    def score(batch, done):
        started.append(batch)
        if batch == 1:
            signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.05)
        done(batch, batch)
        return batch

    with pytest.raises(KeyboardInterrupt):
        bpb.in_threads(list(range(40)), score, 2, on_done=lambda i, s: reported.append(i))
    # the batches running at the interrupt ended before it was raised (a scoring thread left inside a torch
    # operator when the interpreter finalizes aborts the process)
    assert not any(t.name.startswith("dsv41-score") and t.is_alive() for t in threading.enumerate())
    seen, begun = len(reported), len(started)
    # (no thread is left to report or start a batch; the counts stay)
    assert len(reported) == seen and len(started) <= begun + 2 < 40


def test_greedy_flag(loaded):
    model, _, tok = loaded
    ctx = [tok.bos_id] + tok.encode("abc", allow_special=False)
    seq = list(ctx)
    with torch.inference_mode():
        for _ in range(4):  # extend greedily: the continuation is the model's argmax at each step
            seq.append(int(model(torch.tensor([seq]), all_logits=True)[0, -1].argmax()))
    assert bpb.score_sequences(model, [seq], [4], pad_id=tok.pad_id)[0].greedy
    other = seq[:-1] + [(seq[-1] + 1) % model.args.vocab_size]
    assert not bpb.score_sequences(model, [other], [4], pad_id=tok.pad_id)[0].greedy


@pytest.mark.parametrize("n", [1, bpb.HEAD_ROWS, 2 * bpb.HEAD_ROWS + 13])
def test_score_positions_equals_the_full_logits(loaded, n):
    """The blocked head (fixed blocks, the last padded) against logits of all positions at once: log-probs,
    the greedy flags and the top-k; and forward(head=False) followed by the head is forward's logits."""
    model, _, tok = loaded
    seq = ([tok.bos_id] + tok.encode(TEXT * 3, allow_special=False))[:n + 1]
    ids = torch.tensor([seq[:-1]])
    with torch.inference_mode():
        logits = model(ids, all_logits=True)[0].float()
        hidden = model(ids, all_logits=True, head=False)[0]
        assert torch.equal(model.head(hidden).float(), logits)
        targets = torch.tensor(seq[1:])
        targets[::3] = logits[::3].argmax(-1)  # some positions greedy, most not
        lp, hit, (top_v, top_i) = bpb.score_positions(model, hidden, targets, top=3)
    lse = torch.logsumexp(logits, -1)
    ref = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    assert lp.shape == (n,) and torch.allclose(lp, ref, atol=1e-5, rtol=0)
    assert torch.equal(hit, logits.argmax(-1) == targets) and bool(hit[::3].all())
    ref_v, ref_i = logits.topk(3, -1)
    assert torch.equal(top_i, ref_i) and torch.allclose(top_v, ref_v - lse[:, None], atol=1e-5, rtol=0)
    assert torch.equal(top_v[:, 0][hit], lp[hit])  # an argmax target's log-prob is exactly the top one


def test_bad_scored_counts():
    with pytest.raises(ValueError):
        bpb.score_sequences(None, [[1, 2, 3]], [3])
    with pytest.raises(ValueError):
        bpb.score_sequences(None, [[1, 2, 3]], [0])


# ------------------------------------------------------------------------------------ windows
@pytest.mark.parametrize("n,ctx", [(1, 4), (10, 4), (12, 4), (13, 5), (30, 30), (31, 30)])
def test_disjoint_windows_are_lm_evals(n, ctx):
    lm_utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 100 + n))
    ours = bpb.rolling_windows(tokens, 0, ctx)
    theirs = [((a + b)[-(ctx + 1):], len(b)) for a, b in
              map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(tokens, 0, ctx, 1))]
    assert ours == theirs


@pytest.mark.parametrize("n,ctx,stride", [(50, 16, 4), (50, 16, 16), (17, 16, 5), (3, 16, 2), (64, 8, 1)])
def test_windows_score_every_token_once_with_context(n, ctx, stride):
    tokens = list(range(1000, 1000 + n))
    full = [7] + tokens
    scored = []
    for seq, k in bpb.rolling_windows(tokens, 7, ctx, stride):
        assert len(seq) <= ctx + 1
        start = full.index(seq[0]) if seq[0] != 7 else 0
        assert full[start:start + len(seq)] == seq  # a window is a contiguous slice of the document
        positions = range(start + len(seq) - k, start + len(seq))
        scored += list(positions)
        if positions[0] > ctx:  # past the first window: at least ctx - stride tokens of context
            assert len(seq) - k >= ctx - stride
    assert scored == list(range(1, n + 1))


def test_parse_window():
    assert bpb.parse_window("disjoint") is None
    assert bpb.parse_window("strided:512") == 512
    for bad in ("strided:0", "strided:x", "sliding", "strided:"):
        with pytest.raises(ValueError):
            bpb.parse_window(bad)


# ------------------------------------------------------------------------------------ corpus bpb
def test_bpb_of_a_file_is_the_nll_over_utf8_bytes(loaded, small_ckpt, tmp_path):
    """`dsv41 bpb FILE --json` = -sum ln p / (ln 2 x UTF-8 bytes), the sum from one full forward."""
    model, _, tok = loaded
    f = tmp_path / "doc.txt"
    f.write_text(TEXT, encoding="utf-8")
    n_bytes = len(TEXT.encode("utf-8"))
    assert n_bytes > len(TEXT)  # the text really has multi-byte characters
    ids = tok.encode(TEXT, allow_special=False)
    expected = -float(full_forward_logprobs(model, [tok.bos_id] + ids).sum()) / (math.log(2) * n_bytes)
    r = run_cli("bpb", f, "--model", small_ckpt, "--max-ctx", len(ids) + 5, "--baselines", "gzip", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    row = doc["models"][0]["corpora"][0]
    assert row["bytes"] == n_bytes and row["tokens"] == len(ids) and row["documents"] == 1
    assert row["bpb"] == pytest.approx(expected, rel=1e-4)
    assert doc["models"][0]["overall_bpb"] == pytest.approx(expected, rel=1e-4)
    assert row["ci95"] is None  # one document: nothing to bootstrap
    assert doc["baselines"]["gzip"]["doc.txt"] == pytest.approx(
        8 * len(gzip.compress(TEXT.encode(), compresslevel=9, mtime=0)) / n_bytes)


def test_corpus_bpb_is_a_ratio_of_sums(loaded, tmp_path):
    model, args, tok = loaded
    texts = ["a" * 200, TEXT, "x"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    corpus = bpb.load_corpus(tmp_path / "c.jsonl")
    docs = bpb.score_corpus(model, tok, corpus, max_ctx=32)
    per_doc = [bpb.bits_per_byte(d.nll, d.n_bytes) for d in docs]
    row = bpb.summarize(corpus, docs, bootstrap_iters=200)
    total = sum(d.nll for d in docs) / (math.log(2) * sum(len(t.encode()) for t in texts))
    assert row["bpb"] == pytest.approx(total)
    assert row["bpb"] != pytest.approx(sum(per_doc) / len(per_doc), rel=1e-3)  # not a mean of per-document values
    lo, hi = row["ci95"]
    assert lo <= row["bpb"] <= hi and lo < hi
    assert bpb.summarize(corpus, docs, bootstrap_iters=0)["ci95"] is None


def test_strided_no_worse_than_disjoint_on_the_trained_model(tmp_path):
    """More context per scored token must not hurt a trained language model (the bundled one)."""
    from dsv41.model.assets import bundled_model_dir

    path = bundled_model_dir()
    assert path is not None, "the bundled dsv41-tiny checkpoint is committed: its absence is a defect"
    from dsv41.model.checkpoint import load_model

    model, args, tok = load_model(path)
    rows = [json.loads(line) for line in (ROOT / "recipes/tiny/heldout/prose.jsonl").read_text().splitlines()[:2]]
    corpus = bpb.Corpus("prose", [bpb.Document(r["name"], r["text"][:3000]) for r in rows])
    disjoint = bpb.summarize(corpus, bpb.score_corpus(model, tok, corpus, 128), 0)["bpb"]
    strided = bpb.summarize(corpus, bpb.score_corpus(model, tok, corpus, 128, stride=32), 0)["bpb"]
    assert strided <= disjoint


def test_directory_corpus_and_several_models(loaded, tmp_path):
    pytest.importorskip("matplotlib")
    from dsv41.evals.plots import plot_bpb

    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("hello world " * 10)
    (d / "sub" / "b.md").write_text("# title\nsome text\n")
    (d / "bin.dat").write_bytes(b"\xff\xfe\x00binary")
    (d / ".hidden").write_text("ignored")
    corpus = bpb.load_corpus(d)
    assert [doc.name for doc in corpus.documents] == ["a.txt", "sub/b.md"] and corpus.skipped == ["bin.dat"]
    specs = [bpb.ModelSpec("first", lambda: loaded), bpb.ModelSpec("second", lambda: loaded)]
    doc = bpb.run_bpb(specs, [corpus], window="strided:8", max_ctx=16, baselines=["bz2"], bootstrap_iters=50)
    assert doc["window"] == "strided:8" and [m["model"] for m in doc["models"]] == ["first", "second"]
    first, second = (m["corpora"][0] for m in doc["models"])
    assert first["bpb"] == pytest.approx(second["bpb"]) and first["documents"] == 2
    assert doc["models"][0]["max_ctx"] == 16 and set(doc["baselines"]) == {"bz2"}
    png = plot_bpb(doc, tmp_path / "fig.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="stride"):
        bpb.run_bpb(specs[:1], [corpus], window="strided:32", max_ctx=16)


@pytest.mark.process
@pytest.mark.parametrize("args,message", [
    (["/no/such/corpus"], "no such file"),
    (["{f}", "--window", "sliding"], "--window"),
    (["{f}", "--baselines", "lz4"], "unknown compressor"),
    (["{f}", "--plot", "{tmp}/fig.gif"], "--plot"),
])
@pytest.mark.parametrize("zstd", ["installed", "missing"])
def test_bad_input_exits_2(small_ckpt, tmp_path, args, message, zstd):
    """One line on stderr, with or without the `eval` extra: the note that zstd is missing (a default
    baseline) must not come before the error."""
    f = tmp_path / "t.txt"
    f.write_text("some text")
    args = [a.format(f=f, tmp=tmp_path) for a in args]
    env = None
    if zstd == "missing":  # a module on the path first that fails to import, as if the extra were absent
        hide = tmp_path / "hide"
        hide.mkdir()
        (hide / "zstandard.py").write_text("raise ImportError('zstandard hidden by the test')\n")
        env = {"PYTHONPATH": f"{hide}{os.pathsep}{ROOT}"}
    r = run_cli("bpb", *args, "--model", small_ckpt, env_extra=env)
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
