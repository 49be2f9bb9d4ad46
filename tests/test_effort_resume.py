"""`dsv41 effort-sweep` as a newcomer runs it (issue #22): the bare command on the bundled model, the
default output folder, the plot check before the run, and interrupt/resume (SIGINT mid-sweep leaves
partial.jsonl, exit 130 and one line; the rerun reuses every finished point and ends equal to a straight
run). Commands run as `python -m dsv41_cli` in a subprocess, as a user runs them; a few whose checks are a
message, an exit code or files (--plot-file, a refusal, the rerun of a finished sweep) run its entry point,
`dsv41_cli.app.main`, in this process instead, which spares the interpreter's and torch's start."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv41.evals import effort

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    from tests.checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("effort-resume") / "ckpt")


def cli_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "DSV41_MODEL"}
    return {**env, "PYTHONPATH": str(ROOT), "DSV41_THREADS": "1", **extra}


def run_cli(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "dsv41_cli", *map(str, args)], capture_output=True, text=True,
                          env=env or cli_env(), cwd=cwd, timeout=600)


def no_matplotlib_env(tmp_path):
    """The CLI's environment with a matplotlib whose import fails, as if it were not installed."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    return cli_env(PYTHONPATH=f"{fake}{os.pathsep}{ROOT}")


def without_timings(doc: dict) -> dict:
    return {**doc, "points": [{k: v for k, v in p.items() if k != "seconds"} for p in doc["points"]]}


def test_bare_command_sweeps_the_bundled_task_into_runs(tmp_path):
    """No TASK: tiny-reasoning at the five preset efforts, into ./runs/effort-sweep/tiny-reasoning/
    with the figure, and says where. (The default --limit, 30, took 17 s on 2 cores with two engines:
    docs/evaluation.md; here a small --limit keeps it to CI time.)"""
    pytest.importorskip("matplotlib")
    from dsv41.model.assets import bundled_model_dir

    assert bundled_model_dir() is not None, "the bundled dsv41-tiny checkpoint is committed: its absence is a defect"
    r = run_cli("effort-sweep", "--limit", 2, "--max-new-tokens", 8, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["task"] == "tiny-reasoning" and [p["effort"] for p in doc["points"]] == [1, 25, 50, 75, 100]
    assert all(p["n"] == 2 for p in doc["points"])
    out = tmp_path / "runs" / "effort-sweep" / "tiny-reasoning"
    for name in ("sweep.json", "sweep.csv", "partial.jsonl"):
        assert (out / name).is_file()
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"written: {Path('runs/effort-sweep/tiny-reasoning/sweep.json')}" in r.stderr


def test_help_states_the_default_and_h_works():
    from dsv41_cli.commands.effort_sweep import DEFAULT_LIMIT

    r = run_cli("effort-sweep", "-h")
    assert r.returncode == 0, r.stderr
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.stdout).split())  # rich's panels wrap the help text
    assert f"Default: {DEFAULT_LIMIT} for tiny-reasoning" in text and "default runs/effort-sweep/TASK/" in text
    assert "--plot-file" in text and "--no-plot" in text and "--max-new-tokens" in text
    assert text.endswith("dsv41 effort-sweep gsm8k --model CKPT --limit 100 --data-dir DATA")  # the examples last
    assert "Examples:" in text and " dsv41 effort-sweep dsv41 effort-sweep tiny-reasoning" in text


def test_no_task_with_another_model_names_the_tasks(small_ckpt, tmp_path):
    r = run_cli("effort-sweep", "--model", small_ckpt, cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no TASK given" in lines[0] and "tiny-reasoning" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_missing_matplotlib_fails_before_the_run_with_the_install_hint(small_ckpt, tmp_path):
    """(That --no-plot then runs without matplotlib is the --fresh run of test_plot_file_and_changed_settings.)"""
    r = run_cli("effort-sweep", "tiny-reasoning", "--model", small_ckpt, "--limit", 1, "--efforts", "1",
                "--max-new-tokens", 2, cwd=tmp_path, env=no_matplotlib_env(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["dsv41: error: the sweep's figure needs matplotlib: "
                                             "pip install 'dsv41[plots]' (or pass --no-plot)"]
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_plot_file_and_changed_settings(small_ckpt, tmp_path, run_here):
    pytest.importorskip("matplotlib")
    out, fig = tmp_path / "o", tmp_path / "figs" / "sweep.svg"
    base = ("effort-sweep", "tiny-reasoning", "--model", small_ckpt, "--efforts", "1,max", "--max-new-tokens", 3,
            "--output", out)
    r = run_here(*base, "--limit", 2, "--plot-file", fig)
    assert r.returncode == 0, r.stderr
    assert fig.read_text().lstrip().startswith("<?xml") and not (out / "sweep.png").exists()
    # other settings in the same folder: refused in one line naming the flags, nothing mixed
    before = (out / "partial.jsonl").read_text()
    r = run_here(*base, "--limit", 3, "--no-plot")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "other settings (limit)" in line and "--output" in line and "--fresh" in line
    assert (out / "partial.jsonl").read_text() == before
    # --fresh starts over; and --no-plot runs where matplotlib cannot be imported, drawing nothing
    r = run_cli(*base, "--limit", 3, "--no-plot", "--fresh", "--json", env=no_matplotlib_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert [p["n"] for p in json.loads(r.stdout)["points"]] == [3, 3] and "reused" not in r.stderr
    assert [p["n"] for p in json.loads((out / "sweep.json").read_text())["points"]] == [3, 3]  # written again
    assert not (out / "sweep.png").exists()


def test_sigint_mid_sweep_keeps_finished_points_and_the_rerun_resumes(small_ckpt, tmp_path, run_here, request):
    """SIGINT after the first points are on disk: exit 130, one line, a readable partial.jsonl; the
    same command again reuses those points (no batch generated twice) and ends equal to a straight run."""
    efforts, limit = [1, 50, 100], 4
    args = ["effort-sweep", "tiny-reasoning", "--model", small_ckpt, "--efforts", ",".join(map(str, efforts)),
            "--limit", limit, "--max-new-tokens", 24, "--batch-size", 1, "--no-plot"]

    def start(output, *more):
        return subprocess.Popen([sys.executable, "-m", "dsv41_cli", *map(str, args), "--output", str(output), *more],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)

    # the straight run to compare with runs beside the interrupted one: the two share nothing, and a second
    # process on the cores only slows the interrupted one down, which leaves its interrupt more time to land
    straight = tmp_path / "straight"
    straight_run = start(straight, "--json")
    request.addfinalizer(straight_run.kill)  # not left running by a failed check (no-op once it has ended)
    out = tmp_path / "resumed"
    partial = out / "partial.jsonl"
    proc = start(out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and len(partial.read_text().splitlines()) >= 3:  # settings + 2 finished batches
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    total = len(efforts) * limit
    lines = [ln for ln in stderr.splitlines() if ln.startswith("interrupted:")]
    assert len(lines) == 1, stderr
    m = re.fullmatch(rf"interrupted: (\d+) of {total} done, kept in (.+); run the same command again to resume",
                     lines[0])
    assert m and Path(m.group(2)) == out, lines[0]
    assert "Traceback" not in stderr and not (out / "sweep.json").exists()
    kept = partial.read_text().splitlines()
    records = [json.loads(x) for x in kept[1:]]  # every line whole and readable
    assert json.loads(kept[0])["settings"]["limit"] == limit
    done = sum(len(r["batch"]) for r in records)
    assert 2 <= done < total and int(m.group(1)) == done

    r = run_cli(*args, "--output", out, "--json")
    assert r.returncode == 0, r.stderr
    assert f"resuming: reused {done} of {total} items from {partial}" in r.stderr
    final = partial.read_text().splitlines()
    assert final[:len(kept)] == kept  # the finished points kept as they were...
    keys = [(json.loads(x)["effort"], tuple(json.loads(x)["batch"])) for x in final[1:]]
    assert len(keys) == len(set(keys)) == total  # ...and none generated again (batch size 1: one line per item)

    _, straight_stderr = straight_run.communicate(timeout=600)
    assert straight_run.returncode == 0, straight_stderr
    assert "reused" not in straight_stderr
    a, b = (json.loads((d / "sweep.json").read_text()) for d in (out, straight))
    assert without_timings(a) == without_timings(b)
    assert (out / "sweep.csv").read_text() == (straight / "sweep.csv").read_text()
    # and a third run of a finished sweep reuses everything (nothing to generate: in this process)
    r3 = run_here(*args, "--output", out, "--json")
    assert r3.returncode == 0 and f"reused {total} of {total} items" in r3.stderr
    assert without_timings(json.loads((out / "sweep.json").read_text())) == without_timings(a)


def test_store_drops_a_line_cut_short_and_refuses_other_settings(tmp_path):
    settings = {"task": "t", "efforts": [1, 2], "limit": 3}
    store = effort.SweepStore.open(tmp_path, settings)
    assert not (tmp_path / "partial.jsonl").exists()  # written with the first finished unit
    store.append({"effort": 1, "batch": [0, 1], "seconds": 0.1, "rows": []})
    with (tmp_path / "partial.jsonl").open("a") as f:
        f.write('{"effort": 2, "batch": [0')  # a kill mid-line
    again = effort.SweepStore.open(tmp_path, settings)
    assert again.reused == 1 and list(again.batches(1)) == [(0, 1)] and again.batches(2) == {}
    again.append({"effort": 2, "batch": [0, 1], "seconds": 0.1, "rows": []})
    assert [json.loads(x).get("effort") for x in (tmp_path / "partial.jsonl").read_text().splitlines()] == [None, 1, 2]
    with pytest.raises(effort.SettingsChanged, match=r"other settings \(efforts\)"):
        effort.SweepStore.open(tmp_path, {**settings, "efforts": [1]})
    assert effort.SweepStore.open(tmp_path, {**settings, "efforts": [1]}, fresh=True).reused == 0
    assert not (tmp_path / "partial.jsonl").exists()


def test_lm_eval_sweep_resumes_per_effort(small_ckpt, tmp_path):
    """An lm-eval task's unit is one effort: an interrupt in the second effort keeps the first, and the
    rerun generates only the second, ending equal to a straight run."""
    pytest.importorskip("lm_eval")
    import dsv41.evals.lm_eval_model as M
    from dsv41.model.checkpoint import load_model
    from test_effort import write_toy_math_task

    model, _, tok = load_model(small_ckpt)
    write_toy_math_task(tmp_path)
    real_generate, calls = M.generate, []

    def spy(model, tok, requests, **kw):
        texts = [tok.decode(r.prompt_ids) for r in requests]
        calls.extend(texts)
        if any("Reasoning Effort: 90 " in t for t in texts) and interrupt:
            raise KeyboardInterrupt
        return real_generate(model, tok, requests, **kw)

    run = dict(include_path=[str(tmp_path / "tasks")])
    settings = {"task": "toy_math"}
    try:
        M.generate = spy
        interrupt = True
        with pytest.raises(KeyboardInterrupt):
            effort.run_lm_eval_sweep(model, tok, "toy_math", [10, 90], store=effort.SweepStore.open(tmp_path / "o", settings), **run)
        assert len(effort.SweepStore.open(tmp_path / "o", settings).on_disk()) == 1
        interrupt, calls[:] = False, []
        store = effort.SweepStore.open(tmp_path / "o", settings)
        assert store.reused == 1
        resumed = effort.run_lm_eval_sweep(model, tok, "toy_math", [10, 90], store=store, **run)
        assert calls and all("Reasoning Effort: 90 " in t for t in calls)  # effort 10 not generated again
        straight = effort.run_lm_eval_sweep(model, tok, "toy_math", [10, 90], **run)
    finally:
        M.generate = real_generate
    assert without_timings(resumed) == without_timings(straight)
