"""The inference engine: chunked prefill, DSpark verification and rollback, sampling, budgets."""

import json
import subprocess
import sys

import pytest
import torch

from dsv41.model import dspark
from dsv41.model.engine import GenerationConfig, Generator, Sampler, SamplingConfig, filter_top_p


@pytest.fixture(scope="module")
def gen(tiny_model):
    return Generator(tiny_model)


def prompt(n, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def one_token_greedy(model, ids, n):
    """Greedy decoding with the one-sequence forward, one token per step over a KVCache: the path whose
    numerics DSpark's verification forward shares (the engine's batched decode step sums in its own
    order: docs/generation.md, batch invariance)."""
    cache = model.new_cache(1)
    logits = model(torch.tensor([ids]), 0, cache)
    out = []
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache.pos, cache)
    return out


def test_chunked_prefill_equals_single_prefill(tiny_model, gen):
    ids = prompt(37, seed=1)
    with torch.inference_mode():
        one = gen.prefill(tiny_model.new_cache(1), ids)
        for chunk in (5, 8, 16):
            chunked = gen.prefill(tiny_model.new_cache(1), ids, chunk=chunk)
            assert torch.allclose(one, chunked, atol=2e-2), chunk
            assert one.argmax() == chunked.argmax()


@pytest.mark.parametrize("n_prompt", [9, 20, 33])
def test_dspark_greedy_is_token_identical(gen, n_prompt):
    # identical to one-token steps of the same forward on these prompts of the tiny model; in general DSpark
    # and plain decoding agree up to the first near-tie (the guarantee and its measured bound, against the
    # engine's own decoding: tests/test_dspark_greedy.py)
    ids = prompt(n_prompt, seed=n_prompt)
    spec = gen.generate(ids, GenerationConfig(max_new_tokens=24, stop_ids=(), dspark=True))
    assert spec.output_ids == one_token_greedy(gen.model, ids, 24)
    assert spec.dspark["steps"] > 0 and len(spec.dspark["acceptance_per_position"]) == 5


def test_dspark_rollback_with_an_oracle_drafter(gen, monkeypatch):
    """Drafts that are right for a while then wrong exercise every acceptance length: the output must
    still equal plain greedy decoding, and the acceptance statistics must count what was accepted."""
    ids = prompt(19, seed=7)
    truth = one_token_greedy(gen.model, ids, 40)
    real_draft = dspark.markov_draft
    calls = {"n": 0}

    def oracle(model, U, hidden, anchors, sample):
        tokens, logits, conf = real_draft(model, U, hidden, anchors, sample)
        # position of the anchor in the true output: the drafts should be the tokens after it
        done = oracle.committed
        good = truth[done + 1: done + 1 + tokens.size(1)]
        wrong_at = calls["n"] % (tokens.size(1) + 1)  # 0..5 correct drafts, cycling
        calls["n"] += 1
        out = list(good) + [0] * (tokens.size(1) - len(good))
        if wrong_at < len(out):
            out[wrong_at] = (out[wrong_at] + 1) % 512
        return torch.tensor([out]), logits, conf

    oracle.committed = 0

    def track(token):
        oracle.committed += 1

    monkeypatch.setattr(dspark, "markov_draft", oracle)
    track_calls = []
    oracle.committed = -1  # the first on_token call is the first anchor (index 0)

    def on_token(t):
        oracle.committed += 1
        track_calls.append(t)

    spec = gen.generate(ids, GenerationConfig(max_new_tokens=40, stop_ids=(), dspark=True), on_token=on_token)
    assert spec.output_ids == truth
    acc = spec.dspark["acceptance_per_position"]
    assert acc[0] > 0.5 and acc[0] > acc[4]  # early positions survive more often
    assert spec.dspark["mean_accepted_per_step"] > 2.0


def test_rollback_restores_the_cache(tiny_model, gen):
    ids = prompt(26, seed=3)
    extra = prompt(6, seed=4)
    with torch.inference_mode():
        cache = tiny_model.new_cache(1)
        gen.prefill(cache, ids)
        cache.checkpoint()
        tiny_model(torch.tensor([extra]), start_pos=cache.pos, cache=cache)
        from dsv41.model.engine import _engram_history

        cache.rollback(len(ids) + 2, _engram_history(tiny_model, ids + extra[:2]))
        after = tiny_model(torch.tensor([[5, 6, 7]]), start_pos=cache.pos, cache=cache, all_logits=True)
        fresh = tiny_model.new_cache(1)
        gen.prefill(fresh, ids + extra[:2])
        want = tiny_model(torch.tensor([[5, 6, 7]]), start_pos=fresh.pos, cache=fresh, all_logits=True)
    # same positions, same tokens; only the chunking differs (6-token forward vs 2), so the sums may
    # differ in the last bits
    assert torch.allclose(after, want, atol=1e-2) and torch.equal(after.argmax(-1), want.argmax(-1))


def accept_distribution(p_logits, q_logits, trials=20000):
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=0), "cpu")
    # the drafts, independent draws from q, drawn at once (one multinomial call, not one a trial)
    drafts = torch.multinomial(torch.softmax(q_logits, -1), trials, replacement=True, generator=sampler.gen).tolist()
    target, draft = torch.stack([p_logits, p_logits]), q_logits.unsqueeze(0)
    counts = [0] * p_logits.size(-1)
    for d in drafts:
        n, nxt = Generator._accept(None, target, draft, [d], sampler)
        counts[d if n == 1 else nxt] += 1
    return torch.tensor(counts) / trials


def test_rejection_sampling_keeps_the_target_distribution():
    p_logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0])
    q_logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 0.5])  # a poor drafter
    emp = accept_distribution(p_logits, q_logits)
    assert torch.allclose(emp, torch.softmax(p_logits, -1), atol=0.015), emp


def test_top_p_filter():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.allclose(filter_top_p(probs, 0.7), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    assert torch.allclose(filter_top_p(probs, 1.0), probs)


def test_seeded_sampling_is_reproducible(gen):
    ids = prompt(12, seed=5)
    cfg = GenerationConfig(max_new_tokens=16, stop_ids=(), sampling=SamplingConfig(temperature=1.0, top_p=0.9, seed=123))
    a, b = gen.generate(ids, cfg), gen.generate(ids, cfg)
    assert a.output_ids == b.output_ids


def test_thinking_budget_forces_the_end_of_reasoning(gen):
    ids = prompt(12, seed=6)
    cfg = GenerationConfig(max_new_tokens=12, stop_ids=(), thinking_budget=4, think_end_id=511)
    out = gen.generate(ids, cfg)
    assert out.output_ids[4] == 511 and out.budget_forced and 511 not in out.output_ids[:4]
    spec = gen.generate(ids, GenerationConfig(max_new_tokens=12, stop_ids=(), thinking_budget=4, think_end_id=511,
                                              dspark=True))
    assert spec.output_ids == out.output_ids


def test_ref_index_quirk_flag_changes_decoding_only_when_asked(tiny_model):
    """REF's decode-time indexer reads the last published keys: with a ratio-2 group open, layer 2
    scores against layer 4's (m=1) keys. The default cache fixes that and matches the full forward."""
    ids = torch.tensor([prompt(41, seed=8)])
    with torch.inference_mode():
        full = tiny_model(ids, all_logits=True)
        outs = {}
        for quirk in (False, True):
            cache = tiny_model.new_cache(1, ref_index_quirk=quirk)
            steps = [tiny_model(ids[:, :20], cache=cache, all_logits=True)]
            for t in range(20, 41):
                steps.append(tiny_model(ids[:, t:t + 1], start_pos=t, cache=cache, all_logits=True))
            outs[quirk] = torch.cat(steps, dim=1)
    assert torch.allclose(outs[False], full, atol=2e-2)
    diff = (outs[True] - outs[False]).abs().amax(dim=-1)[0]
    assert diff[:20].max() == 0  # prefill publishes every source's keys: no quirk there
    assert diff[20:].max() > 1e-3  # decode steps with an open ratio-2 group score the wrong keys


# ------------------------------------------------------------------------------------------- CLI
@pytest.mark.process
def test_print_prompt_equals_the_encoder(run_here):
    from dsv41.model.encoding import encode_messages

    r = run_here("generate", "Hello", "--system", "Be exact.", "--effort", "max", "--print-prompt")
    assert r.returncode == 0, r.stderr
    assert r.stdout == encode_messages([{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Hello"}],
                                       mode="thinking", effort=100)
    r = run_here("generate", "Hello", "--mode", "chat", "--print-prompt")
    assert r.stdout == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"


@pytest.mark.process
@pytest.mark.parametrize("effort", ["0", "101", "medium"])
def test_bad_effort_exits_2_with_one_line(effort, run_here):
    r = run_here("generate", "Hello", "--effort", effort, "--print-prompt")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "effort" in r.stderr


@pytest.mark.process
def test_generate_json_on_a_checkpoint(small_checkpoint, run_here):
    r = run_here("generate", "Hello", "--model", str(small_checkpoint), "--max-new-tokens", "8", "--temperature", "0",
                 "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) >= {"prompt_tokens", "output_ids", "reasoning", "content", "tool_calls", "finish_reason", "tokens",
                        "stats"}
    assert len(doc["output_ids"]) == doc["tokens"]["total"] <= 8
    assert doc["stats"]["dspark"] is None and doc["stats"]["kv_bytes_per_token"] > 0
    r2 = run_here("generate", "Hello", "--model", str(small_checkpoint), "--max-new-tokens", "8", "--temperature", "0",
                  "--json", "--dspark")
    doc2 = json.loads(r2.stdout)
    assert doc2["output_ids"] == doc["output_ids"]
    assert doc2["stats"]["dspark"]["mean_accepted_per_step"] >= 1.0


@pytest.mark.process
def test_generate_input_file_writes_json_lines(small_checkpoint, tmp_path, run_here):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    r = run_here("generate", "--input-file", str(f), "--model", str(small_checkpoint), "--max-new-tokens", "3",
                 "--temperature", "0", "--json", "--mode", "chat")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert len(lines) == 2 and all(len(d["output_ids"]) <= 3 for d in lines)


@pytest.mark.process
def test_generate_bad_inputs_exit_2(tmp_path, run_here):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    for argv in (["--messages", str(bad)], ["--messages", str(tmp_path / "missing.json")], [],
                 ["Hi", "--mode", "fast"], ["Hi", "--model", str(tmp_path / "nowhere")]):
        r = run_here("generate", *argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------- CED and prefix cache
def test_ced_replay_runs_the_decoder_on_the_tail_only(tiny_model, tiny_args):
    ids = torch.tensor([prompt(40, seed=11)])
    win = tiny_args.window_size
    with torch.inference_mode():
        full_cache, replay_cache = tiny_model.new_cache(1), tiny_model.new_cache(1)
        full = tiny_model(ids, cache=full_cache, all_logits=True)
        rep = tiny_model(ids, cache=replay_cache, all_logits=True, ced="replay")
    assert rep.shape[1] == win  # logits of the decoder's tail only
    # the decoder's global KV (layer 4 = L/2, m=1) comes from the encoder output over every token
    assert replay_cache.layer(4).n_compressed == full_cache.layer(4).n_compressed == 40
    assert torch.equal(replay_cache.compressed(4), full_cache.compressed(4))
    assert torch.equal(replay_cache.compressed(2), full_cache.compressed(2))  # the encoder is untouched
    # truncated SWA changes the tail a little, not a lot
    assert (rep - full[:, -win:]).abs().max() < 0.05
    with pytest.raises(ValueError):
        tiny_model(ids, ced="sometimes")


def test_prefix_cache_exact_hit_and_bounded_replay(gen, tmp_path):
    from dsv41.model.prefix_cache import PrefixCache

    ids = prompt(40, seed=12)
    cfg = lambda pc, **kw: GenerationConfig(max_new_tokens=8, stop_ids=(), prefix_cache=pc, **kw)
    base = gen.generate(ids, GenerationConfig(max_new_tokens=8, stop_ids=()))
    pc = PrefixCache(tmp_path)
    first = gen.generate(ids[:31], cfg(pc))
    assert first.prefill["prefix_hit"] is None
    exact = gen.generate(ids, cfg(pc))
    assert exact.prefill == {"cached_tokens": 30, "replayed_tokens": 0, "prefilled_tokens": 10, "decoder_tokens": 10,
                             "prefix_hit": "exact"}  # stored at 30 = a multiple of every ratio
    assert exact.output_ids == base.output_ids  # a live hit is exact
    fresh = PrefixCache(tmp_path)  # another process: global KV from disk, no SWA state
    replay = gen.generate(ids, cfg(fresh))
    assert replay.prefill["prefix_hit"] == "bounded_replay" and replay.prefill["replayed_tokens"] == 8
    assert replay.output_ids[:2] == base.output_ids[:2]  # an approximation, but a close one
    # a damaged entry is a miss, never an error
    for f in tmp_path.glob("*.pt"):
        f.write_bytes(b"garbage")
    miss = gen.generate(ids, cfg(PrefixCache(tmp_path)))
    assert miss.prefill["prefix_hit"] is None and miss.output_ids == base.output_ids


@pytest.mark.process
def test_interactive_chat_keeps_history_and_obeys_commands(small_checkpoint):
    # a process of its own: the chat reads its lines from a real stdin, and installs a Ctrl-C handler while it replies
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", "generate", "--interactive", "--model", str(small_checkpoint),
                        "--max-new-tokens", "3", "--temperature", "0", "--mode", "chat"],
                       input="Hello\n/clear\nHi again\n/exit\nnever read\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("prompt tokens") == 2  # one stats line per turn; /clear and /exit are commands
