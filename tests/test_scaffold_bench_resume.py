"""`dsv41 scaffold-bench` loses nothing on interrupt: each finished episode lands in partial.jsonl, a
Ctrl-C (SIGINT) leaves it readable and says how to resume (exit 130), and the same command again
resumes without rerunning finished episodes, to the same result as an uninterrupted run. The oracle
backend on the bundled tasks, cut short with --limit. The interrupted run is a subprocess that gets a
real SIGINT; the other runs go through the same entry point (`dsv41_cli.app.main`) in this process,
which spares each the start of a Python with torch and changes nothing in what the command does."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.evals.scaffolds.sandbox import Sandbox, SandboxUnavailable
from in_process import run_dsv41

BENCH = ["scaffold-bench", "--backend", "oracle", "--scaffolds", "xml,backticks", "--efforts", "low,high",
         "--limit", "2", "--no-plot"]
TOTAL = 2 * 2 * (2 + 2)  # scaffolds x efforts x (agent tasks + function-calling items)


@pytest.fixture(scope="module", autouse=True)
def jail():
    try:
        Sandbox().check()
    except SandboxUnavailable as e:
        if os.environ.get("DSV41_SKIP_JAIL_TESTS"):
            pytest.skip(f"jail unavailable: {e}")
        pytest.fail(f"the command jail cannot be set up here ({e}); run .ci/deps-scaffold.sh")


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def dsv41(*args, cwd: Path) -> subprocess.CompletedProcess:
    """`dsv41 ARGS` in `cwd`, run in this process (tests/in_process.py) with the subprocess's terminal width."""
    return run_dsv41(*args, env={**os.environ, "COLUMNS": _env()["COLUMNS"]}, cwd=cwd)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted run of BENCH (its --output and what it printed): the result a resumed run must
    equal, and a finished output directory that tests copy to start from."""
    cwd = tmp_path_factory.mktemp("straight")
    result = dsv41(*BENCH, "--json", "--output", "out", cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert "resuming" not in result.stderr
    assert len((cwd / "out" / "partial.jsonl").read_text().splitlines()) == 1 + TOTAL
    return cwd / "out", result


def _finished_run(straight, tmp_path: Path) -> Path:
    """A copy of the straight run's --output under tmp_path ("out"): as a finished run leaves it."""
    shutil.copytree(straight[0], tmp_path / "out")
    return tmp_path / "out"


def _without_timings(value):
    """Episode records minus wall-clock seconds (the only thing two runs may differ in)."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _episodes(directory: Path) -> list:
    return [_without_timings(json.loads(line)) for line in (directory / "episodes.jsonl").read_text().splitlines()]


def test_interrupt_then_rerun_resumes_to_the_same_result(tmp_path, straight):
    # interrupted after three finished episodes; default --output under the current directory
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_cli", *BENCH], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("[3/"):
                proc.send_signal(signal.SIGINT)
                break
        rest_err = proc.stderr.read()
        stdout = proc.stdout.read()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = "".join(seen) + rest_err
    out = tmp_path / "runs" / "scaffold-bench" / "bundled"
    assert rc == 130, stderr
    match = re.search(r"^interrupted: (\d+) of (\d+) done, kept in (\S+); run the same command again to resume$",
                      stderr, re.M)
    assert match, stderr
    done = int(match.group(1))
    assert 3 <= done < TOTAL and int(match.group(2)) == TOTAL
    assert Path(tmp_path, match.group(3)).resolve() == out.resolve()
    assert stdout == "" and "Traceback" not in stderr
    # the partial result: a settings line, then one readable line per finished episode
    lines = (out / "partial.jsonl").read_text().splitlines()
    assert "settings" in json.loads(lines[0])
    records = [json.loads(line) for line in lines[1:]]
    assert len(records) == done
    assert all(r["passed"] and r["scaffold"] == "xml" for r in records)
    assert not (out / "scaffold-bench.json").exists()

    # the same command again: reuses what was done, runs only the rest
    resumed = dsv41(*BENCH, "--json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: reused {done} of {TOTAL} episodes" in resumed.stderr
    progress = re.findall(r"^\[(\d+)/(\d+)\]", resumed.stderr, re.M)
    assert [int(k) for k, _ in progress] == list(range(done + 1, TOTAL + 1))
    assert len((out / "partial.jsonl").read_text().splitlines()) == 1 + TOTAL

    # equal to a straight run
    straight_dir, straight_run = straight
    assert _without_timings(json.loads(resumed.stdout)) == _without_timings(json.loads(straight_run.stdout))
    assert json.loads((out / "scaffold-bench.json").read_text()) == \
        json.loads((straight_dir / "scaffold-bench.json").read_text())
    assert _episodes(out) == _episodes(straight_dir)
    assert (out / "scaffold-bench.md").read_text() == (straight_dir / "scaffold-bench.md").read_text()

    # finished: running it once more reruns nothing
    again = dsv41(*BENCH, cwd=tmp_path)
    assert again.returncode == 0 and f"reused {TOTAL} of {TOTAL}" in again.stderr
    assert not re.search(r"^\[\d+/", again.stderr, re.M)


def test_other_settings_do_not_mix_with_old_results(tmp_path, straight):
    before = (_finished_run(straight, tmp_path) / "partial.jsonl").read_text()
    changed = dsv41(*[a if a != "low,high" else "max" for a in BENCH], "--output", "out", cwd=tmp_path)
    assert changed.returncode == 2 and changed.stdout == ""
    assert len(changed.stderr.strip().splitlines()) == 1
    assert "other settings (efforts)" in changed.stderr and "--output" in changed.stderr
    assert (tmp_path / "out" / "partial.jsonl").read_text() == before  # nothing deleted, nothing mixed
    # --fresh discards them and starts over
    fresh = dsv41(*[a if a != "low,high" else "max" for a in BENCH], "--output", "out", "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0 and "resuming" not in fresh.stderr, fresh.stderr
    assert len((tmp_path / "out" / "partial.jsonl").read_text().splitlines()) == 1 + TOTAL // 2
    # --jobs does not change results: it resumes
    jobs = dsv41(*[a if a != "low,high" else "max" for a in BENCH], "--output", "out", "--jobs", "2", cwd=tmp_path)
    assert jobs.returncode == 0 and f"reused {TOTAL // 2} of {TOTAL // 2}" in jobs.stderr


def test_a_torn_last_line_is_dropped_and_rerun(tmp_path, straight):
    partial = _finished_run(straight, tmp_path) / "partial.jsonl"
    lines = partial.read_text().splitlines()
    partial.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    again = dsv41(*BENCH, "--output", "out", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"reused {TOTAL - 1} of {TOTAL}" in again.stderr and f"[{TOTAL}/{TOTAL}]" in again.stderr
    assert [json.loads(line) for line in partial.read_text().splitlines()[1:]][-1]["task"] == json.loads(lines[-1])["task"]


def test_help_has_examples_and_h(tmp_path):
    for flag in ("-h", "--help"):
        result = dsv41("scaffold-bench", flag, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "Examples:" in result.stdout and "dsv41 scaffold-bench --backend oracle" in result.stdout
        assert "--max-new-tokens" in result.stdout and "--plot-file" in result.stdout
