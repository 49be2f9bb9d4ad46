"""Generation for evaluation and the effort sweep (evals/batch_generate.py, evals/effort.py, `dsv41 effort-sweep`)."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from dsv41.evals import effort
from dsv41.evals.effort import GenRequest, generate, wilson_interval

# offline lm-eval and datasets, a throwaway HF_HOME: set up in conftest.py, before any import


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    from tests.checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("effort") / "ckpt")


@pytest.fixture(scope="session")
def loaded(small_ckpt):
    from dsv41.model.checkpoint import load_model

    return load_model(small_ckpt)


class ScriptedRows:
    """The batch cache of a ScriptedModel: which script each row follows and how far it is."""

    static = False

    def __init__(self, n_rows):
        self.key, self.step = [None] * n_rows, [0] * n_rows
        self.lengths = [0] * n_rows

    def load(self, row, kv, src=0):
        self.key[row], self.step[row], self.lengths[row] = kv.key[src], kv.pos - kv.prompt_len, kv.pos

    def move(self, src, dst):
        self.key[dst], self.step[dst], self.lengths[dst] = self.key[src], self.step[src], self.lengths[src]

    def free(self, row):
        self.key[row], self.lengths[row] = None, 0

    def row_bytes(self, row):
        return {"main": 0, "index_keys": 0, "window": 0}


class ScriptedModel(torch.nn.Module):
    """Emits a fixed token script per sequence (one-hot logits), whatever it is fed: lets a test say
    exactly what the "model" writes, reasoning and stop strings included. A sequence's script is named
    by its prompt's first token; the engine prefills it (forward) and then decodes it in a row of the
    batch cache, one token per step (decode), among other rows at other positions."""

    def __init__(self, scripts: dict[int, list[int]], vocab: int, max_seq_len: int = 512):
        super().__init__()
        self.scripts, self.vocab = scripts, vocab
        self.args = SimpleNamespace(max_seq_len=max_seq_len, max_position_embeddings=max_seq_len, vocab_size=vocab,
                                    dspark_enabled=False)
        self.embed = torch.nn.Embedding(1, 1)

    def new_cache(self, batch_size):
        return SimpleNamespace(pos=0, batch_size=batch_size, key=None, prompt_len=0)

    def new_batch_cache(self, n_rows, max_len):
        return ScriptedRows(n_rows)

    def _logits(self, keys_steps):
        logits = torch.full((len(keys_steps), self.vocab), -1e9)
        for r, (key, step) in enumerate(keys_steps):
            script = self.scripts[key]
            logits[r, script[min(step, len(script) - 1)]] = 0.0
        return logits

    def forward(self, ids, start_pos=0, cache=None, all_logits=False):
        assert start_pos == cache.pos and ids.size(0) == cache.batch_size
        if start_pos == 0:  # the prompt's first token names the script (one per sequence: a batched prefill)
            cache.key = [int(i) for i in ids[:, 0]]
        cache.pos += ids.size(1)
        cache.prompt_len = cache.pos
        return self._logits([(key, 0) for key in cache.key])

    def decode(self, ids, rows):
        assert ids.dim() == 1 and all(rows.key[r] is not None for r in range(ids.size(0)))
        for r in range(ids.size(0)):
            rows.step[r] += 1
            rows.lengths[r] += 1
        return self._logits([(rows.key[r], rows.step[r]) for r in range(ids.size(0))])


@pytest.fixture(scope="session")
def tok(loaded):
    return loaded[2]


def ids_of(tok, text):
    return tok.encode(text, allow_special=True)


def test_stop_strings_apply_only_after_think_end(tok):
    """'Question:' inside the reasoning does not stop generation; in the answer it does."""
    completion = "Let me see. Question: is it 4?</think>The answer is 4.\nQuestion: next<｜end▁of▁sentence｜>"
    script = ids_of(tok, completion)
    model = ScriptedModel({5: script}, tok.vocab_size)
    prompt = [5] + ids_of(tok, "<｜User｜>2+2<｜Assistant｜><think>")
    (out,) = generate(model, tok, [GenRequest(prompt, max_new_tokens=200, until=("Question:",))])
    assert out.reasoning == "Let me see. Question: is it 4?"
    assert out.answer == "The answer is 4.\n"
    assert out.finish_reason == "stop_string" and out.answered
    assert out.reasoning_tokens == len(ids_of(tok, "Let me see. Question: is it 4?"))
    assert out.output_ids == script[:len(out.output_ids)]


def test_no_reasoning_phase_without_think_and_eos_and_length(tok):
    script = ids_of(tok, "plain answer<｜end▁of▁sentence｜>")
    model = ScriptedModel({7: script, 8: ids_of(tok, "x" * 50)}, tok.vocab_size)
    a, b = generate(model, tok, [GenRequest([7, 9, 9], max_new_tokens=100), GenRequest([8, 9, 9], max_new_tokens=5)],
                    batch_size=2)
    assert a.reasoning is None and a.answer == "plain answer" and a.finish_reason == "eos"
    assert a.output_tokens == len(script)
    assert b.answer == "xxxxx" and b.finish_reason == "length" and b.output_tokens == 5


def test_reasoning_that_never_closes_has_no_answer_and_budget_forces_think_end(tok):
    think = ids_of(tok, "<think>")[-1]
    endless = ids_of(tok, "hmm " * 40)
    model = ScriptedModel({3: endless}, tok.vocab_size)
    (out,) = generate(model, tok, [GenRequest([3, think], max_new_tokens=12, until=("hmm",))])
    assert not out.answered and out.answer == "" and out.finish_reason == "length" and out.reasoning_tokens == 12
    (forced,) = generate(model, tok, [GenRequest([3, think], max_new_tokens=12, thinking_budget=4)])
    assert forced.budget_forced and forced.reasoning_tokens == 4
    assert forced.output_ids[4] == tok.token_to_id("</think>") and forced.answered


def test_generation_matches_the_engine(loaded):
    """Greedy decoding over the KV cache gives the engine's tokens; batching equal-length prompts
    gives each row its own."""
    from dsv41.model.engine import GenerationConfig, Generator

    model, _, tok = loaded
    prompts = [ids_of(tok, "<｜begin▁of▁sentence｜><｜User｜>abc<｜Assistant｜>"),
               ids_of(tok, "<｜begin▁of▁sentence｜><｜User｜>xyz<｜Assistant｜>")]
    assert len(prompts[0]) == len(prompts[1])
    engine = Generator(model, tok)
    want = [engine.generate(p, GenerationConfig(max_new_tokens=12, stop_ids=(tok.eos_id,))).output_ids for p in prompts]
    alone = [generate(model, tok, [GenRequest(p, max_new_tokens=12)])[0].output_ids for p in prompts]
    assert alone == want
    together = [o.output_ids for o in generate(model, tok, [GenRequest(p, max_new_tokens=12) for p in prompts],
                                               batch_size=2)]
    assert together == want


def test_wilson_interval():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson_interval(0, 20)[0] == 0.0 and 0 < wilson_interval(0, 20)[1] < 0.2
    assert wilson_interval(20, 20)[1] == 1.0


def test_tiny_reasoning_scoring_uses_the_answer_part():
    task = effort.TinyReasoning()
    item = {"answer": 17}
    right = effort.GenOutput("Answer: 17", "9+8=17", [1] * 9, 5, "eos")
    wrong_in_answer = effort.GenOutput("Answer: 16", "9+8=17", [1] * 9, 5, "eos")
    unfinished = effort.GenOutput("", "9+8=17", [1] * 9, 9, "length", answered=False)
    assert task.score(right, item) == 1.0
    assert task.score(wrong_in_answer, item) == 0.0
    assert task.score(unfinished, item) == 0.0  # the sum in the reasoning does not count


def test_effort_sweep_cli_tiny_reasoning(small_ckpt, tmp_path, run_here):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep"
    r = run_here("effort-sweep", "tiny-reasoning", "--model", small_ckpt, "--efforts", "1,50,max", "--limit", 3,
                 "--max-new-tokens", 4, "--output", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["task"] == "tiny-reasoning" and [p["effort"] for p in doc["points"]] == [1, 50, 100]
    for p in doc["points"]:
        assert p["n"] == 3 and 0 <= p["ci95"][0] <= p["accuracy"] <= p["ci95"][1] <= 1
        assert 1 <= p["mean_output_tokens"] <= 4 and p["mean_reasoning_tokens"] <= p["mean_output_tokens"]
    saved = json.loads((out / "sweep.json").read_text())
    assert len(saved["samples"]) == 9 and saved["points"] == doc["points"]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [int(r["effort"]) for r in rows] == [1, 50, 100]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_toy_math_task(tmp_path):
    """A three-item generate_until task from a local YAML (tmp_path/tasks/toy_math.yaml, data beside it)."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"q": f"{a}+{a}", "a": str(2 * a)}) + "\n" for a in range(3)))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "toy_math.yaml").write_text(f"""task: toy_math
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'data.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}} ="
doc_to_target: "{{{{a}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 5, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")


def test_effort_sweep_on_an_lm_eval_task(loaded, tmp_path):
    """Any generate_until task from a local YAML: the prompts carry each effort."""
    pytest.importorskip("lm_eval")
    write_toy_math_task(tmp_path)
    prompts = []
    import dsv41.evals.lm_eval_model as M

    real_generate = M.generate

    def spy(model, tok, requests, **kw):
        prompts.extend(tok.decode(r.prompt_ids) for r in requests)
        return real_generate(model, tok, requests, **kw)

    try:
        M.generate = spy
        doc = effort.run_lm_eval_sweep(loaded[0], loaded[2], "toy_math", [10, 90], include_path=[str(tmp_path / "tasks")])
    finally:
        M.generate = real_generate
    assert doc["metric"] == "exact_match,none" and [p["n"] for p in doc["points"]] == [3, 3]
    assert all(p["mean_output_tokens"] <= 5 for p in doc["points"])
    assert sum("Reasoning Effort: 10 " in p for p in prompts) == 3 and sum("Reasoning Effort: 90 " in p for p in prompts) == 3
    assert all(p.endswith("<think>") for p in prompts)
