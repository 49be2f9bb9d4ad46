"""`dsv41 eval`, `dsv41 bpb` and `dsv41 quantize-kv` under torchrun (two gloo processes on the CPU)
against one process: the model split over both ranks (tensor parallelism), loaded from the --mp 2
checkpoint and from the official checkpoint with no convert step, and two model copies of one rank
each (DSV41_TP=1, data parallelism).

One torchrun launch per way of running runs all three commands on each of its layouts (this file run
as a script: each rank calls the CLI's `main` once per command, with its stdout sent to a file of its
own), which keeps the process start-ups, the slow part on a small machine, to two. The one-process reference runs the same
command lines in the test process.

Everything runs offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set and HF_HOME is a temporary
directory; the tasks are lm-eval YAMLs over local JSONL files."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

# offline lm-eval and datasets, a throwaway HF_HOME: set up in conftest.py, before any import

pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

from test_parallel import torchrun  # noqa: E402 - after the environment above

MC_ROWS = [{"question": "2 + 2 =", "choices": ["4", "5", "22"], "label": 0},
           {"question": "The sky is", "choices": ["blue", "green"], "label": 0},
           {"question": "Cats say", "choices": ["woof", "meow", "moo"], "label": 1},
           {"question": "Ice is", "choices": ["cold", "hot"], "label": 0},
           {"question": "One, two,", "choices": [" three", " four", " five", " ten"], "label": 0}]
# the random model answers these with 12 tokens (most others it ends at once)
GEN_ROWS = [{"question": "Say hi", "answer": "hi"}, {"question": "Count: 1 2 3", "answer": "4"},
            {"question": "Name a colour", "answer": "red"}]
# longer than the small model's 64-token context (byte tokens): lm-eval cuts them into several windows
DOCS = ["Tensor parallel ranks must agree on every token, byte for byte, or the collectives hang.",
        "Model copies divide the work and gather the answers back in order.",
        "Ünïcödé bytes count as bytes: bits per byte divides by the UTF-8 length, not by characters."]


@pytest.fixture(scope="module")
def split_checkpoint(small_checkpoint, tmp_path_factory) -> Path:
    """The small checkpoint converted for two ranks (`dsv41 convert --mp 2`)."""
    from dsv41.model.checkpoint import convert

    dst = tmp_path_factory.mktemp("mp2") / "mp2"
    convert(small_checkpoint, dst, mp=2)
    return dst


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A multiple-choice, a generate_until and a loglikelihood_rolling task (lm-eval YAMLs over local
    JSONL), and a corpus for bpb and quantize-kv."""
    d = tmp_path_factory.mktemp("inputs")
    tasks = d / "tasks"
    tasks.mkdir()
    for name, rows in [("mc", MC_ROWS), ("gen", GEN_ROWS), ("docs", [{"text": t} for t in DOCS])]:
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "par_mc.yaml").write_text("task: par_mc\n" + common.format(tasks / "mc.jsonl") + """\
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
metadata: {version: 1.0}
""")
    (tasks / "par_gen.yaml").write_text("task: par_gen\n" + common.format(tasks / "gen.jsonl") + """\
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 12, do_sample: false}
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
metadata: {version: 1.0}
""")
    (tasks / "par_roll.yaml").write_text("task: par_roll\n" + common.format(tasks / "docs.jsonl") + """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity}
  - {metric: bits_per_byte}
metadata: {version: 1.0}
""")
    # bpb and quantize-kv: windows of 16 tokens, several per document, two per batch
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t[:50]}) + "\n" for t in DOCS))
    return d


def command_lines(model: Path, inputs: Path, out: Path) -> dict[str, list[str]]:
    """The three commands, with batches small enough that the work splits into several."""
    corpus = str(inputs / "corpus.jsonl")
    return {
        "eval": ["eval", "par_mc,par_gen,par_roll", "--model", str(model), "--include-path", str(inputs / "tasks"),
                 "--batch-size", "3", "--output", str(out / "eval"), "--device", "cpu", "--json"],
        "bpb": ["bpb", corpus, "--model", str(model), "--max-ctx", "16", "--batch-size", "2", "--bootstrap", "50",
                "--baselines", "gzip", "--device", "cpu", "--json"],
        "quantize-kv": ["quantize-kv", corpus, "--model", str(model), "--max-ctx", "16", "--batch-size", "2",
                        "--device", "cpu", "--json"],
    }


def run_commands(commands: dict[str, list[str]], out: Path, rank: int = 0) -> dict[str, int]:
    """Each command through the CLI's entry point in this process; its stdout to out/NAME.rankR.out.
    Returns the exit codes."""
    from dsv41_cli.app import main

    codes = {}
    out.mkdir(parents=True, exist_ok=True)
    for name, argv in commands.items():
        with open(out / f"{name}.rank{rank}.out", "w") as f, contextlib.redirect_stdout(f):
            try:
                main(argv)
            except SystemExit as e:
                codes[name] = e.code
    return codes


def worker(commands_file: str, out_dir: str) -> None:
    """One rank (under torchrun): every command, then its exit codes in rank{R}.codes.json."""
    from dsv41.model.parallel import init_from_env

    ctx = init_from_env("cpu")  # as the first command would; its stdout quieting then stays out of the way
    rank = ctx.rank
    codes = run_commands(json.loads(Path(commands_file).read_text()), Path(out_dir), rank)
    (Path(out_dir) / f"rank{rank}.codes.json").write_text(json.dumps(codes))


# ---------------------------------------------------------------------------------- comparing
def read_samples(eval_dir: Path) -> dict[str, dict[int, dict]]:
    return {task: {s["doc_id"]: s for s in map(json.loads, (eval_dir / f"samples_{task}.jsonl").read_text().splitlines())}
            for task in ("par_mc", "par_gen", "par_roll")}


def assert_same_eval(got: dict, ref: dict, got_dir: Path, ref_dir: Path, tol: dict) -> None:
    """Per item: the log-likelihoods (and greedy flags) of every choice, every document's rolling
    log-likelihood and every generated answer; then the task metrics."""
    samples, ref_samples = read_samples(got_dir), read_samples(ref_dir)
    for task in ref_samples:
        assert samples[task].keys() == ref_samples[task].keys(), task
    for doc_id, ref_s in ref_samples["par_mc"].items():
        s = samples["par_mc"][doc_id]
        assert len(s["resps"]) == len(ref_s["resps"]) == len(MC_ROWS[doc_id]["choices"])
        for (ll, greedy), (ref_ll, ref_greedy) in ((r[0], q[0]) for r, q in zip(s["resps"], ref_s["resps"])):
            assert ll == pytest.approx(ref_ll, **tol) and greedy == ref_greedy
        assert s["acc"] == ref_s["acc"]
    for doc_id, ref_s in ref_samples["par_roll"].items():
        assert samples["par_roll"][doc_id]["resps"][0][0] == pytest.approx(ref_s["resps"][0][0], **tol)
    for doc_id, ref_s in ref_samples["par_gen"].items():
        assert samples["par_gen"][doc_id]["resps"] == ref_s["resps"]  # greedy text, identical
    assert all(len(s["resps"][0][0]) > 12 for s in ref_samples["par_gen"].values())  # real, varied output
    for task, metrics in ref["results"].items():
        for key, value in metrics.items():
            if key.startswith(("acc", "exact_match")):
                assert got["results"][task][key] == value, (task, key)
            elif isinstance(value, float):
                assert got["results"][task][key] == pytest.approx(value, **tol), (task, key)


def assert_same_bpb(got: dict, ref: dict, tol: dict) -> None:
    assert len(got["models"]) == len(ref["models"]) == 1
    m, ref_m = got["models"][0], ref["models"][0]
    assert m["max_ctx"] == ref_m["max_ctx"] == 16
    assert m["overall_bpb"] == pytest.approx(ref_m["overall_bpb"], **tol)
    for c, ref_c in zip(m["corpora"], ref_m["corpora"]):
        assert (c["bytes"], c["documents"], c["tokens"]) == (ref_c["bytes"], ref_c["documents"], ref_c["tokens"])
        assert c["bpb"] == pytest.approx(ref_c["bpb"], **tol)
        assert c["ci95"] == pytest.approx(ref_c["ci95"], **tol)
    assert got["baselines"] == ref["baselines"]


def assert_same_quantize_kv(got: dict, ref: dict, tol: dict) -> None:
    assert (got["tokens"], got["bytes"], got["max_ctx"]) == (ref["tokens"], ref["bytes"], ref["max_ctx"])
    rows = list(zip(got["formats"], ref["formats"])) + [
        (r, q) for c, ref_c in zip(got["corpora"], ref["corpora"]) for r, q in zip(c["formats"], ref_c["formats"])]
    assert len(rows) == 3 * (1 + len(ref["corpora"]))
    for r, q in rows:
        assert r["format"] == q["format"]
        for key in ("bytes_per_token", "main_bytes_per_token", "indexer_bytes_per_token", "top1_agreement"):
            assert r[key] == q[key], key  # storage bytes and argmax decisions: exact
        for key in ("bpb", "delta_bpb", "kld_mean", "kld_p99", "mean_dp", "rms_dp"):
            assert r[key] == pytest.approx(q[key], **tol), key


@pytest.fixture(scope="module")
def one_process(small_checkpoint, inputs, tmp_path_factory) -> tuple[Path, dict]:
    """The reference: the three commands in one process (this one) on the whole model."""
    out = tmp_path_factory.mktemp("one")
    codes = run_commands(command_lines(small_checkpoint, inputs, out), out)
    assert codes == {"eval": 0, "bpb": 0, "quantize-kv": 0}, codes
    return out, {name: json.loads((out / f"{name}.rank0.out").read_text()) for name in codes}


def launch(model: Path | dict[str, Path], inputs: Path, out: Path, env: dict | None = None) -> dict:
    """The three commands on `model` in one torchrun launch: {command: rank 0's document}. With a dict
    {layout: checkpoint} every layout's commands run in that one launch (the start-up paid once), and the
    result is {layout: {command: document}}; layout L's files go to out/L."""
    layouts = model if isinstance(model, dict) else {"": model}
    commands = {f"{name}@{layout}" if layout else name: argv for layout, path in layouts.items()
                for name, argv in command_lines(path, inputs, out / layout).items()}
    (out / "commands.json").write_text(json.dumps(commands))
    r = torchrun(2, str(Path(__file__)), str(out / "commands.json"), str(out), env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(2):
        assert json.loads((out / f"rank{rank}.codes.json").read_text()) == {name: 0 for name in commands}, r.stderr[-4000:]
        for name in commands:  # rank 0 alone prints (and writes --output files)
            assert ((out / f"{name}.rank{rank}.out").read_text() != "") == (rank == 0), (name, rank)
    docs = {name: json.loads((out / f"{name}.rank0.out").read_text()) for name in commands}
    if not isinstance(model, dict):
        return docs
    return {layout: {name: docs[f"{name}@{layout}"] for name in ("eval", "bpb", "quantize-kv")} for layout in layouts}


# ---------------------------------------------------------------------------------- tests
def test_commands_on_a_model_split_over_two_ranks_match_one_process(small_checkpoint, split_checkpoint, inputs,
                                                                     one_process, tmp_path):
    """Tensor parallelism: both ranks run every forward together, from the --mp 2 checkpoint (each rank
    maps its own file) and from the official checkpoint itself (each rank cuts its part at load, no
    convert step), both layouts in one launch. The sums of the split matmuls are ordered differently,
    hence a float tolerance."""
    ref_dir, ref = one_process
    results = launch({"mp2": split_checkpoint, "official": small_checkpoint}, inputs, tmp_path)
    tol = {"rel": 1e-4, "abs": 1e-3}  # as tests/test_parallel.py's log-likelihoods
    for layout, got in results.items():
        assert got["eval"]["config"]["parallel"] == {"world": 2, "tp": 2, "model_copies": 1}, layout
        assert_same_eval(got["eval"], ref["eval"], tmp_path / layout / "eval", ref_dir / "eval", tol)
        assert_same_bpb(got["bpb"], ref["bpb"], tol)
        assert_same_quantize_kv(got["quantize-kv"], ref["quantize-kv"], tol)
    # the two layouts give each rank the same bytes (tests/test_torchrun_layouts.py), hence the same numbers
    assert results["official"]["bpb"]["models"][0]["overall_bpb"] == results["mp2"]["bpb"]["models"][0]["overall_bpb"]
    assert results["official"]["quantize-kv"]["formats"] == results["mp2"]["quantize-kv"]["formats"]


def test_commands_on_two_model_copies_match_one_process(small_checkpoint, inputs, one_process, tmp_path):
    """Data parallelism (DSV41_TP=1): each rank holds the whole model and takes every other batch
    (bpb, quantize-kv, log-likelihoods) or request (generation); each batch is the one a single
    process runs, so the numbers agree to float rounding of the sums at most."""
    ref_dir, ref = one_process
    got = launch(small_checkpoint, inputs, tmp_path, env={"DSV41_TP": "1"})
    assert got["eval"]["config"]["parallel"] == {"world": 2, "tp": 1, "model_copies": 2}
    tol = {"rel": 1e-12, "abs": 1e-12}
    assert_same_eval(got["eval"], ref["eval"], tmp_path / "eval", ref_dir / "eval", tol)
    assert_same_bpb(got["bpb"], ref["bpb"], tol)
    assert_same_quantize_kv(got["quantize-kv"], ref["quantize-kv"], tol)
    # one request cache, rank 0's
    assert [p.name.endswith("_rank0.db") for p in (tmp_path / "eval" / "cache").iterdir()] == [True]


if __name__ == "__main__":  # a rank, under torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(*sys.argv[1:3])
