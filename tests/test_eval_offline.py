"""`dsv41 eval` without a network (issue #22): an unreachable Hub is detected once and nothing waits on
retries, missing data is named file by file, suites run what they can, interrupt and resume, the
converter into the --data-dir layout, the reports' citation. A run is a subprocess as a user runs it; a rerun
whose checks are its messages, exit code and files runs the command's entry point in this process instead
(`run_here`, tests/conftest.py), under the same environment, which spares it the interpreter's, torch's and
lm-eval's start. The Hub is "unreachable" by pointing HF_ENDPOINT at a closed local port (no network is used)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent
CLOSED_PORT_HUB = "http://127.0.0.1:9"  # discard port, nothing listens: connection refused at once


def hub_down_env(**extra) -> dict:
    """No offline flags set: the command itself must find out that the Hub cannot be reached."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update({"PYTHONPATH": str(ROOT), "DSV41_THREADS": "1", "HF_ENDPOINT": CLOSED_PORT_HUB,
                "HTTPS_PROXY": "", "https_proxy": "", "ALL_PROXY": "", "all_proxy": ""})
    env.update(extra)
    return env


def dsv41(*args, cwd=ROOT, env=None, timeout=600):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", *map(str, args)], capture_output=True, text=True,
                       env=env or hub_down_env(), cwd=cwd, timeout=timeout)
    return r, time.monotonic() - t0


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    from tests.checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("eval-offline") / "ckpt")


# ------------------------------------------------------------------------------------ failing fast
def test_offline_mmlu_pro_fails_fast_and_says_what_to_put_where(tmp_path):
    r, seconds = dsv41("eval", "mmlu-pro", "--limit", 1, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert seconds < 10, f"took {seconds:.1f} s"
    assert "Retry" not in r.stderr and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert "cannot be reached" in lines[0] and "running offline" in lines[0]
    error = lines[-1]
    assert error.startswith("dsv41: error: mmlu-pro needs the Hub dataset TIGER-Lab/MMLU-Pro")
    for text in ("test.jsonl", "validation.jsonl", "DIR/TIGER-Lab/MMLU-Pro/", "--data-dir DIR", "Offline data"):
        assert text in error
    assert not (tmp_path / "runs").exists()  # nothing written for a run that never started


def test_empty_data_dir_names_the_missing_files(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    r, seconds = dsv41("eval", "mmlu-pro", "--data-dir", empty, cwd=tmp_path)
    assert r.returncode == 2 and seconds < 10
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"dsv41: error: --data-dir {empty} has no TIGER-Lab/MMLU-Pro")
    assert f"{empty}/TIGER-Lab/MMLU-Pro/test.jsonl" in line and f"{empty}/TIGER-Lab/MMLU-Pro/validation.jsonl" in line
    # half there: only the missing split is named
    (empty / "TIGER-Lab" / "MMLU-Pro").mkdir(parents=True)
    (empty / "TIGER-Lab" / "MMLU-Pro" / "test.jsonl").write_text("{}\n")
    r, _ = dsv41("eval", "mmlu-pro", "--data-dir", empty, cwd=tmp_path)
    assert r.returncode == 2 and "validation.jsonl" in r.stderr and "test.jsonl," not in r.stderr
    # the wrong layout: the files straight in DIR are found and the right folder named
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "test.jsonl").write_text("{}\n")
    r, _ = dsv41("eval", "mmlu-pro", "--data-dir", wrong, cwd=tmp_path)
    assert r.returncode == 2 and f"found test.jsonl directly in {wrong}" in r.stderr
    assert f"belong in {wrong}/TIGER-Lab/MMLU-Pro/" in r.stderr


# the suite row both suite tests end with: the offline tiny-reasoning task
TINY_REASONING_ROW = """
[[rows]]
section = "S"
benchmark = "tiny-reasoning"
metric = "EM"
shots = 0
task = "tiny-reasoning"
result = "exact_match,none"
mode = "thinking"
"""


def test_suite_runs_the_available_row_and_marks_the_missing_one(small_ckpt, tmp_path, run_here):
    suite = tmp_path / "two.toml"
    suite.write_text("""name = "two"
title = "Two rows"
columns = ["Ref"]

[[rows]]
section = "S"
benchmark = "MMLU-Pro"
metric = "EM"
shots = 5
task = "mmlu-pro"
result = "exact_match,custom-extract"
reference = { "Ref" = 74.1 }

""" + TINY_REASONING_ROW)
    out = tmp_path / "out"
    args = ("eval", "--suite", suite, "--model", small_ckpt, "--limit", 2, "--max-new-tokens", 4, "--output", out, "--json")
    r, seconds = dsv41(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Retry" not in r.stderr and "fatal:" not in r.stderr
    rows = {row["benchmark"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows["tiny-reasoning"]["status"] == "ok" and rows["tiny-reasoning"]["n"] == 2
    assert rows["MMLU-Pro"]["status"] == "not run"
    assert "TIGER-Lab/MMLU-Pro" in rows["MMLU-Pro"]["reason"] and "test.jsonl" in rows["MMLU-Pro"]["reason"]
    assert seconds < 120, f"took {seconds:.1f} s"
    assert "not run [1]" in (out / "report.md").read_text()
    # the same command again (in this process: nothing left to generate): the finished row is reused, the
    # missing one tried again (and marked again)
    r2 = run_here(*args, env=hub_down_env())
    assert r2.returncode == 0, r2.stderr
    assert "resumed: 1 finished rows reused" in r2.stderr
    rows2 = {row["benchmark"]: row for row in json.loads(r2.stdout)["rows"]}
    assert rows2["tiny-reasoning"] == rows["tiny-reasoning"] and rows2["MMLU-Pro"]["status"] == "not run"
    # other settings in the same folder: refused in one line, naming the flag
    r3 = run_here(*args[:-5], "--max-new-tokens", 5, "--output", out, env=hub_down_env())
    assert r3.returncode == 2 and "--max-new-tokens" in r3.stderr and "--output" in r3.stderr
    assert len(r3.stderr.strip().splitlines()) == 2  # the unreachable-Hub note and the error


# ------------------------------------------------------------------------------------ interrupt and resume
def interrupted(args, cwd, ready) -> tuple[str, str]:
    """Run `dsv41 ARGS` with the Hub unreachable, send SIGINT once ready() holds; its (stdout, stderr) after
    checking it stopped with exit 130."""
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=hub_down_env(), cwd=cwd)
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted: " + proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    return stdout, stderr


def _cached_answers(out: Path) -> int:
    from sqlitedict import SqliteDict

    n = 0
    for db in (out / "cache").glob("*.db") if (out / "cache").is_dir() else []:
        try:
            with SqliteDict(str(db), flag="r") as d:
                n += len(d)
        except Exception:  # noqa: BLE001 - being written at this moment
            pass
    return n


def test_interrupt_keeps_the_answers_and_the_rerun_resumes(small_ckpt, tmp_path):
    # 16 requests: with the faster decode step of 2026-12-03 all 8 of an earlier version could be answered between
    # the second answer's cache write and the interrupt, on a loaded 2-core machine
    args = ["eval", "tiny-reasoning", "--mode", "thinking", "--model", small_ckpt, "--limit", 16, "--batch-size", 1,
            "--max-new-tokens", 24]
    # the reference: uninterrupted, default --output (runs/eval/tiny-reasoning/ under the current folder). It runs
    # beside the interrupted run (the two share nothing, and a second process on the cores only slows the
    # interrupted one down, which leaves its interrupt more time to land), on one engine: the results do not
    # depend on the engines, and a worker process would only add its start
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    reference_run = subprocess.Popen([sys.executable, "-m", "dsv41_cli", *map(str, args), "--engines", "1", "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hub_down_env(),
                                     cwd=ref_dir)
    try:
        out = tmp_path / "out"
        stdout, stderr = interrupted([*args, "--output", out, "--json"], tmp_path, lambda: _cached_answers(out) >= 2)
        ref_stdout, ref_stderr = reference_run.communicate(timeout=600)
    finally:
        if reference_run.poll() is None:  # a failed check above: not left running
            reference_run.kill()
            reference_run.communicate()
    assert reference_run.returncode == 0, ref_stderr
    assert "fatal:" not in ref_stderr  # lm-eval's git lookup outside a repository stays quiet
    reference = json.loads(ref_stdout)["results"]
    default_out = ref_dir / "runs" / "eval" / "tiny-reasoning"
    assert (default_out / "results.json").is_file() and (default_out / "samples_tiny_reasoning.jsonl").is_file()

    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: 0 of 1 tasks done") and f"kept in {out}" in last
    assert last.endswith("run the same command again to resume")
    kept = _cached_answers(out)
    assert 2 <= kept < 16
    partial = json.loads((out / "results.json").read_text())  # readable: what is done and what is not
    assert partial["dsv41"]["complete"] is False and partial["dsv41"]["pending"] == ["tiny-reasoning"]

    r, _ = dsv41(*args, "--output", out, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"resumed: {kept} answers reused" in r.stderr
    assert json.loads(r.stdout)["results"] == reference  # equal to the uninterrupted run
    ref_samples = [json.loads(x)["resps"] for x in (default_out / "samples_tiny_reasoning.jsonl").read_text().splitlines()]
    samples = [json.loads(x)["resps"] for x in (out / "samples_tiny_reasoning.jsonl").read_text().splitlines()]
    assert samples == ref_samples
    assert json.loads((out / "results.json").read_text())["dsv41"]["complete"] is True


# ------------------------------------------------------------------------------------ converter
def test_prepare_converts_parquet_json_and_jsonl_into_the_data_dir_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"question_id": i, "question": f"q{i}", "options": ["a", "b"], "answer": "A", "answer_index": 0,
             "category": "math", "src": "t", "cot_content": ""} for i in range(3)]
    hub_copy = tmp_path / "download" / "data"  # as the Hub repository keeps it
    hub_copy.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:2]), hub_copy / "test-00000-of-00002.parquet")
    (hub_copy / "test-00001-of-00002.jsonl").write_text(json.dumps(rows[2]) + "\n")
    (hub_copy / "validation-00000-of-00001.json").write_text(json.dumps(rows[:1]))
    data = tmp_path / "DATA"
    r = subprocess.run([sys.executable, "-m", "dsv41.evals.tasks.prepare", "mmlu-pro", str(tmp_path / "download"),
                        "--data-dir", str(data)], capture_output=True, text=True, env=hub_down_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"ready: dsv41 eval mmlu-pro --data-dir {data}" in r.stdout
    folder = data / "TIGER-Lab" / "MMLU-Pro"
    assert sorted(p.name for p in folder.iterdir()) == ["test.jsonl", "validation.jsonl"]
    assert [json.loads(x) for x in (folder / "test.jsonl").read_text().splitlines()] == rows
    from dsv41.evals.tasks import local_split_files
    from dsv41.evals.tasks.offline import check_alias_data

    assert set(local_split_files(data, "TIGER-Lab/MMLU-Pro")) == {"test", "validation"}
    assert check_alias_data("mmlu-pro", data) is None
    # a config (gsm8k's "main") goes into its folder; a split missing is reported, exit 1
    (tmp_path / "test.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n')
    r = subprocess.run([sys.executable, "-m", "dsv41.evals.tasks.prepare", "gsm8k", str(tmp_path / "test.jsonl"),
                        "--data-dir", str(data)], capture_output=True, text=True, env=hub_down_env(), cwd=tmp_path)
    assert r.returncode == 1 and (data / "openai" / "gsm8k" / "main" / "test.jsonl").is_file()
    assert f"{data}/openai/gsm8k/main/train.jsonl" in r.stderr
    r = subprocess.run([sys.executable, "-m", "dsv41.evals.tasks.prepare", "no-such", str(tmp_path / "test.jsonl"),
                        "--data-dir", str(data)], capture_output=True, text=True, env=hub_down_env(), cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ reports, hints, flags
def test_reports_cite_the_technical_report_by_its_title():
    from dsv41.evals.reports import load_suite, render_html, render_markdown, run_suite

    title = "DeepSeek-V4.1-Flash: Pushing the Limits of KV Cache Compression"
    seeds = ROOT.parent / "shared" / "seeds" / "002_44e618c9b471be1a.txt"
    if seeds.is_file():
        assert seeds.read_text(encoding="utf-8").lstrip().startswith(title)
    for name in ("table1", "table3"):
        report = run_suite(load_suite(name), lambda row: {}, str)
        for text in (render_markdown(report), render_html(report), json.dumps(report)):
            assert title in text and "shared/seeds" not in text and "(shared" not in text


def test_install_hint_keeps_its_brackets(tmp_path):
    code = ("import sys, typer; sys.modules['lm_eval'] = None  # as if lm-eval were not installed\n"
            "from dsv41_cli.commands.eval_cmd import need_lm_eval\n"
            "try:\n    need_lm_eval()\nexcept typer.Exit as e:\n    sys.exit(e.exit_code)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=hub_down_env(), cwd=tmp_path)
    assert r.returncode == 2 and "pip install 'dsv41[eval]'" in r.stderr
    from dsv41_cli.commands.eval_cmd import explain_failure

    err = ModuleNotFoundError("`sympy`, `math_verify` and `antlr4-python3-runtime==4.11` are required")
    assert "pip install 'dsv41[eval]'" in explain_failure(err)


def test_help_flags_and_the_old_generation_flag(tmp_path):
    """(--max-gen-toks alone runs as --max-new-tokens: test_eval.py's test_mmlu_pro_from_data_dir; a run without
    --output writes runs/eval/TASK/ under the current folder: the reference run of
    test_interrupt_keeps_the_answers_and_the_rerun_resumes.)"""
    r, _ = dsv41("eval", "-h", cwd=tmp_path)
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout and "--max-gen-toks" not in r.stdout
    assert "runs/eval/" in r.stdout
    r, _ = dsv41("eval", "tiny-reasoning", "--max-new-tokens", 4, "--max-gen-toks", 5, cwd=tmp_path)
    assert r.returncode == 2 and "--max-gen-toks" in r.stderr


def test_suite_interrupt_keeps_finished_rows_and_resumes(small_ckpt, tmp_path, run_here):
    suite = tmp_path / "pair.toml"
    suite.write_text("""name = "pair"
title = "Two offline rows"
columns = []
offline = true

[[rows]]
section = "S"
benchmark = "GSM8K exemplars"
metric = "EM"
shots = 0
task = "smoke-gsm8k"
result = "exact_match,flexible-extract"

""" + TINY_REASONING_ROW)
    out = tmp_path / "out"
    args = ["eval", "--suite", suite, "--model", small_ckpt, "--limit", 3, "--batch-size", 1, "--max-new-tokens", 24,
            "--output", out, "--json"]
    _, stderr = interrupted(args, tmp_path, lambda: (out / "rows" / "00.json").is_file())
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: 1 of 2 rows done") and f"kept in {out}" in last
    partial = json.loads((out / "report.json").read_text())  # the partial report: one row done, one pending
    assert [r["status"] for r in partial["rows"]] == ["ok", "pending"]
    assert "pending" in (out / "report.md").read_text()
    # the rerun: what it checks is on disk and in its output, not in its process
    r = run_here(*args, env=hub_down_env())
    assert r.returncode == 0, r.stderr
    assert "resumed: 1 finished rows reused" in r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [row["status"] for row in rows] == ["ok", "ok"] and rows[0] == partial["rows"][0]


def test_an_interrupt_between_the_row_file_and_the_report_still_leaves_the_partial_report(tmp_path, monkeypatch):
    """Ctrl-C may land after rows/NN.json is written and before report.json: the report on disk must still
    agree with rows/ (a CI run once caught exactly that window with the subprocess test above)."""
    import types

    import typer

    from dsv41.evals import reports
    from dsv41_cli.commands import eval_cmd

    suite_file = tmp_path / "pair.toml"
    suite_file.write_text('name = "pair"\ntitle = "Two rows"\ncolumns = []\noffline = true\n' + TINY_REASONING_ROW
                          + TINY_REASONING_ROW.replace('benchmark = "tiny-reasoning"', 'benchmark = "second"'))
    suite = reports.load_suite(str(suite_file))
    out = tmp_path / "out"
    entry = {**reports._entry(suite, suite.rows[0]), "this_run": 50.0, "n": 3}
    reports.write_atomic(out / "rows" / "00.json", json.dumps(entry))  # finished by an earlier run
    real_write_report, calls = reports.write_report, []

    def write_report_interrupted_once(report, out_dir):
        calls.append(1)
        if len(calls) == 1:  # the signal arrives just before the first report write
            raise KeyboardInterrupt
        return real_write_report(report, out_dir)

    monkeypatch.setattr(reports, "write_report", write_report_interrupted_once)

    def never(mode):
        raise AssertionError("row 1 must not start")

    run = {"output": out, "offline": True, "data_dir": None, "settings": {"limit": 3}, "num_fewshot": None}
    with pytest.raises(typer.Exit) as stop:
        eval_cmd._run_suite(suite, never, None, run, True, types.SimpleNamespace(is_main=True), [])
    assert stop.value.exit_code == 130 and len(calls) == 2
    partial = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in partial["rows"]] == ["ok", "pending"] and partial["config"] == {"limit": 3}


def test_ctrl_c_waits_for_a_request_cache_operation_to_finish():
    """sigint_deferred (the request cache's reads and writes): a Ctrl-C inside the block is raised after it, once
    the block's work is done; the default handler is back afterwards."""
    import os

    from dsv41.evals.lm_eval_model import sigint_deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the signal is delivered here and held back
            done.append("written")
    assert done == ["written"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with sigint_deferred():  # no signal: nothing raised
        done.append("again")
    assert done == ["written", "again"]
