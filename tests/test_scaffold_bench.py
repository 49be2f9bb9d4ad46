"""scaffold-bench end to end: the bundled tasks, the oracle under every scaffold, the agent loop's
accounting and feedback, the report, and the `dsv41 scaffold-bench` command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsv41_cli.app import main as cli_main
from dsv41.evals.scaffolds.actions import ToolCall, write_action
from dsv41.evals.scaffolds.backends import BackendError, OracleBackend
from dsv41.evals.scaffolds.bench import markdown_table, run_bench, write_report
from dsv41.evals.scaffolds.loop import run_agent_episode, run_function_calling_item
from dsv41.evals.scaffolds.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from dsv41.evals.scaffolds.scaffold import builtin_scaffold_names, load_scaffold
from dsv41.evals.scaffolds.tasks import TaskError, load_tasks

SCAFFOLDS = ["dsml", "openai-tools", "xml", "backticks"]


@pytest.fixture(scope="module")
def jail() -> Sandbox:
    sandbox = Sandbox(SandboxLimits(wall_seconds=20.0))
    try:
        sandbox.check()
    except SandboxUnavailable as e:
        if os.environ.get("DSV41_SKIP_JAIL_TESTS"):
            pytest.skip(f"jail unavailable: {e}")
        pytest.fail(f"the command jail cannot be set up here ({e}); run .ci/deps-scaffold.sh")
    return sandbox


@pytest.fixture(scope="module")
def bundled():
    return load_tasks()


def test_bundled_task_set_covers_what_the_bench_needs(bundled):
    tasks, items = bundled
    assert builtin_scaffold_names()[:4] == SCAFFOLDS
    assert len(tasks) >= 12
    categories = {t.category for t in tasks}
    assert {"file-edit", "python-bugfix", "text-processing", "multi-step"} <= categories
    assert sum(t.category == "python-bugfix" for t in tasks) >= 2
    assert any(len(t.solution_steps()) >= 3 for t in tasks if t.category == "multi-step")
    assert any(t.setup is not None for t in tasks)
    assert {"simple", "multiple", "parallel", "parallel_multiple", "irrelevance"} == {i.category for i in items}
    for task in tasks:
        assert task.instruction.strip() and task.solution is not None and (task.tests / "test.sh").is_file()


# ---------------------------------------------------------------------------------------------
# The oracle: 100% under every scaffold, and the tests are not tautologies
# ---------------------------------------------------------------------------------------------


def test_oracle_passes_every_bundled_task_under_every_scaffold(jail, bundled):
    tasks, items = bundled
    scaffolds = [load_scaffold(name) for name in SCAFFOLDS]
    report = run_bench(OracleBackend(), scaffolds, tasks, items, [75], jail, jobs=4)
    failures = [(e["scaffold"], e["task"], e["end_reason"], e["detail"]) for e in report["episodes"]
                if not e["passed"] or e["format_errors"]]
    assert failures == []
    assert [r["scaffold"] for r in report["rows"]] == SCAFFOLDS
    for row in report["rows"]:
        assert row["pass_rate"] == 1.0 and row["format_error_rate"] == 0.0
        assert row["tasks"] == len(tasks) + len(items) and row["passed"] == row["tasks"]
        assert row["by_kind"]["agent"]["mean_steps"] > 2  # multi-step solutions replayed step by step
        assert row["mean_output_tokens"] > 0
    for episode in report["episodes"]:
        if episode["kind"] == "agent":
            assert episode["end_reason"] == "submitted"
            assert all(c["returncode"] == 0 for s in episode["step_records"] for c in s["commands"]), episode["task"]


class Scripted:
    """Replies from a list (text, or commands written in the scaffold's format); records what it saw."""

    name = "scripted"

    def __init__(self, replies, tokens=7):
        self.replies, self.tokens, self.seen = list(replies), tokens, []

    def begin(self, task, scaffold):
        self.scaffold = scaffold

    def chat(self, messages, tools, effort):
        self.seen.append({"messages": json.loads(json.dumps(messages)), "tools": tools, "effort": effort})
        reply = self.replies.pop(0) if self.replies else "echo nothing left"
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, str) and reply.startswith("RAW:"):
            return reply[4:], self.tokens
        commands = [reply] if isinstance(reply, str) else reply
        calls = [ToolCall("bash", {"command": c}, f"call_{i}") for i, c in enumerate(commands)]
        return write_action(self.scaffold.action_format, calls, "thinking" if effort else "chat", thought="ok",
                            options=self.scaffold.action_options), self.tokens


def _greeting(bundled):
    return next(t for t in bundled[0] if t.id == "create-greeting")


def test_every_verifier_fails_on_the_untouched_workspace(jail, bundled):
    """The oracle's 100% means something: with no work done, every task's test fails."""
    scaffold = load_scaffold("xml")
    submit = write_action("xml", [ToolCall("bash", {"command": f"echo {scaffold.submit_sentinel}"})], "thinking")

    class SubmitAtOnce:  # stateless, so episodes can run in parallel
        name = "submit-at-once"

        def chat(self, messages, tools, effort):
            return submit, 1

    report = run_bench(SubmitAtOnce(), [scaffold], bundled[0], [], [75], jail, jobs=4)
    for episode in report["episodes"]:
        assert episode["end_reason"] == "submitted" and not episode["passed"], episode["task"]
        assert episode["verifier"]["returncode"] not in (0, None), episode["task"]


def test_format_errors_are_fed_back_and_counted(jail, bundled):
    scaffold = load_scaffold("backticks")
    sentinel = scaffold.submit_sentinel
    backend = Scripted(["RAW:I think I should create the file.</think>No code block here.<｜end▁of▁sentence｜>",
                        ["echo a", "echo b"],  # two blocks: backticks takes exactly one
                        "printf 'Hello, sandbox!\\n' > greeting.txt",
                        f"echo {sentinel}"], tokens=11)
    result = run_agent_episode(_greeting(bundled), scaffold, backend, jail, 75)
    assert result.passed and result.end_reason == "submitted"
    assert (result.steps, result.format_errors, result.output_tokens) == (4, 2, 44)
    assert [r.output_tokens for r in result.step_records] == [11] * 4
    assert "no command was found" in result.step_records[0].format_error
    assert "exactly one" in result.step_records[1].format_error
    second_call = backend.seen[1]["messages"]
    assert second_call[-1]["role"] == "user" and "could not be carried out" in second_call[-1]["content"]
    assert backend.seen[0]["tools"] is None and backend.seen[0]["effort"] == 75
    observation = backend.seen[3]["messages"][-1]
    assert observation["role"] == "user" and "<returncode>0</returncode>" in observation["content"]


def test_native_scaffold_sends_tools_and_returns_tool_messages(jail, bundled):
    scaffold = load_scaffold("dsml")
    backend = Scripted([["ls", "printf 'Hello, sandbox!\\n' > greeting.txt"], f"echo {scaffold.submit_sentinel}"])
    result = run_agent_episode(_greeting(bundled), scaffold, backend, jail, None)
    assert result.passed and result.steps == 2
    assert backend.seen[0]["tools"][0]["function"]["name"] == "bash" and backend.seen[0]["effort"] is None
    history = backend.seen[1]["messages"]
    assistant, first, second = history[-3:]
    assert assistant["role"] == "assistant" and [c["id"] for c in assistant["tool_calls"]] == ["call_0", "call_1"]
    assert (first["role"], first["tool_call_id"], second["tool_call_id"]) == ("tool", "call_0", "call_1")


def test_step_limit_sentinel_position_and_backend_errors(jail, bundled):
    scaffold = load_scaffold("xml")
    sentinel = scaffold.submit_sentinel
    never = Scripted([f"echo first; echo {sentinel}"] * 5)  # the sentinel must be the first output line
    result = run_agent_episode(_greeting(bundled), scaffold, never, jail, 75, max_steps=3)
    assert (result.end_reason, result.steps, result.passed) == ("step_limit", 3, False)
    assert result.verifier is not None and result.verifier["returncode"] == 1  # the tests still ran

    failing = Scripted(["ls", BackendError("server down")])
    result = run_agent_episode(_greeting(bundled), scaffold, failing, jail, 75)
    assert result.end_reason == "backend_error" and "server down" in result.detail and not result.passed

    unknown = Scripted([], tokens=None)
    unknown.replies = ["ls", f"echo {sentinel}"]
    result = run_agent_episode(_greeting(bundled), scaffold, unknown, jail, 75)
    assert result.output_tokens is None  # a step without a count makes the total unknown, not smaller


def test_function_calling_items_are_one_step(bundled):
    items = {i.id: i for i in bundled[1]}
    scaffold = load_scaffold("xml")
    item = items["fc-parallel-weather"]
    text = write_action("xml", [ToolCall("get_weather", {"city": "Nairobi"}), ToolCall("get_weather", {"city": "oslo", "unit": "celsius"})],
                        "thinking")
    result = run_function_calling_item(item, scaffold, Scripted([f"RAW:{text}"]), 75)
    assert result.passed and result.steps == 1 and result.format_errors == 0
    wrong = write_action("xml", [ToolCall("get_weather", {"city": "Nairobi"})], "thinking")
    assert not run_function_calling_item(item, scaffold, Scripted([f"RAW:{wrong}"]), 75).passed
    broken = run_function_calling_item(item, scaffold, Scripted(["RAW:x</think><function=get_weather>"]), 75)
    assert not broken.passed and broken.format_errors == 1
    irrelevant = run_function_calling_item(items["fc-irrelevance-arithmetic"], scaffold,
                                           Scripted(["RAW:x</think>It is 391.<｜end▁of▁sentence｜>"]), 75)
    assert irrelevant.passed


# ---------------------------------------------------------------------------------------------
# Tasks from a user directory, report files, the command line
# ---------------------------------------------------------------------------------------------


def _user_tasks(root: Path) -> Path:
    task = root / "shout"
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True)
    (task / "instruction.md").write_text("Write the contents of words.txt in upper case to LOUD.txt.\n")
    (task / "task.toml").write_text('[metadata]\ncategory = "text-processing"\n[verifier]\ntimeout_sec = 20\n')
    (task / "environment" / "words.txt").write_text("quiet words\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n# step: look\ncat words.txt\n# step: shout\ntr a-z A-Z < words.txt > LOUD.txt\n")
    (task / "tests" / "test.sh").write_text('[ "$(cat LOUD.txt)" = "QUIET WORDS" ]\n')
    (root / "calls.jsonl").write_text(json.dumps({
        "id": "user-fc", "category": "simple", "question": "Add 2 and 3.",
        "functions": [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}],
        "ground_truth": [{"add": {"a": [2], "b": [3]}}]}) + "\n")
    return root


def test_task_layout_errors(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "missing")
    with pytest.raises(TaskError, match="no task directories"):
        load_tasks(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "instruction.md").write_text("x")
    with pytest.raises(TaskError, match="tests/test.sh"):
        load_tasks(tmp_path)
    good = _user_tasks(tmp_path / "good")
    (good / "more.jsonl").write_text('{"id": "shout", "question": "q", "functions": [], "ground_truth": []}\n')
    with pytest.raises(TaskError, match="two tasks or items"):
        load_tasks(good)
    (good / "more.jsonl").write_text("{not json\n")
    with pytest.raises(TaskError, match="not JSON"):
        load_tasks(good)
    (good / "more.jsonl").write_text('{"id": "x", "question": "q", "functions": [], "ground_truth": [{"f": {"a": 1}}]}\n')
    with pytest.raises(TaskError, match="list of values"):
        load_tasks(good)


def test_scaffold_file_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown scaffold"):
        load_scaffold("no-such-scaffold")
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(load_scaffold("xml").path).read_text().replace("action_format: xml", "action_format: morse"))
    with pytest.raises(ValueError, match="action_format"):
        load_scaffold(bad)
    bad.write_text(Path(load_scaffold("xml").path).read_text().replace("{{ error }}", "{{ mistake }}"))
    with pytest.raises(ValueError, match="unknown placeholders"):
        load_scaffold(bad)
    custom = tmp_path / "mine.json"
    data = __import__("yaml").safe_load(Path(load_scaffold("backticks").path).read_text())
    data["name"] = "mine"
    custom.write_text(json.dumps(data))
    assert load_scaffold(custom).name == "mine"


def test_report_files(tmp_path):
    episodes = []
    from dsv41.evals.scaffolds.bench import summarize
    from dsv41.evals.scaffolds.loop import EpisodeResult

    for scaffold, passed in (("xml", [1, 1, 0, 1]), ("dsml", [1, 0, 0, 0])):
        for i, ok in enumerate(passed):
            episodes.append(EpisodeResult(f"t{i}", "agent", "x", scaffold, 50, bool(ok), "submitted", steps=2 + i,
                                          format_errors=i % 2, output_tokens=100 * (i + 1)))
    report = summarize(episodes, ["xml", "dsml"], [50])
    report["backend"] = "test"
    xml, dsml = report["rows"]
    assert (xml["passed"], xml["pass_rate"], xml["mean_steps"], xml["mean_output_tokens"]) == (3, 0.75, 3.5, 250.0)
    assert xml["format_error_rate"] == pytest.approx(2 / 14)
    assert dsml["pass_rate"] == 0.25 and report["spread"][0]["spread"] == 0.5
    table = markdown_table(report)
    assert "| xml | 50 (low) | 4 | 3 | 75.0 |" in table and "50.0 points" in table
    written = write_report(report, tmp_path / "out")
    for key in ("json", "markdown", "episodes"):
        assert Path(written[key]).is_file()
    assert json.loads(Path(written["json"]).read_text())["rows"][0]["scaffold"] == "xml"
    assert len(Path(written["episodes"]).read_text().splitlines()) == 8
    assert not list((tmp_path / "out").glob("*.tmp*"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert written["plot"] is None and "matplotlib" in written["plot_skipped"]
    else:
        assert Path(written["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run_cli(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["scaffold-bench", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_cli_oracle_on_user_tasks(jail, tmp_path, capsys):
    tasks = _user_tasks(tmp_path / "tasks")
    code, out, err = _run_cli(["--backend", "oracle", "--scaffolds", "xml,openai-tools", "--tasks", str(tasks),
                               "--efforts", "low,max", "--output", str(tmp_path / "out"), "--json", "--jobs", "2"],
                              capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["backend"] == "oracle" and doc["efforts"] == [50, 100]
    assert [(r["scaffold"], r["effort"]) for r in doc["rows"]] == [("xml", 50), ("xml", 100), ("openai-tools", 50),
                                                                  ("openai-tools", 100)]
    for row in doc["rows"]:
        assert {"scaffold", "effort", "tasks", "passed", "pass_rate", "format_error_rate", "mean_steps",
                "mean_output_tokens"} <= set(row)
        assert (row["tasks"], row["passed"], row["format_error_rate"]) == (2, 2, 0.0)
    assert (tmp_path / "out" / "scaffold-bench.md").is_file() and (tmp_path / "out" / "scaffold-bench.json").is_file()
    assert "[8/8]" in err


@pytest.mark.parametrize("args, message", [
    ([], "choose a backend"),
    (["--backend", "nonsense"], "--backend must be one of"),
    (["--backend", "endpoint"], "needs --endpoint"),
    (["--backend", "oracle", "--efforts", "0"], "--efforts"),
    (["--backend", "oracle", "--efforts", "extreme"], "--efforts"),
    (["--backend", "oracle", "--scaffolds", "xml,nope"], "unknown scaffold"),
    (["--backend", "oracle", "--scaffolds", "xml,xml"], "twice"),
    (["--backend", "oracle", "--tasks", "/no/such/dir"], "does not exist"),
    (["--endpoint", "ftp://example"], "http"),
    (["--endpoint", "http://127.0.0.1:9", "--effort-style", "loud"], "effort_style"),
    (["--endpoint", "http://127.0.0.1:9", "--endpoint-extra", "[1]"], "JSON object"),
])
def test_cli_bad_input_exits_2(args, message, capsys):
    code, out, err = _run_cli(args, capsys)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_oracle_run_imports_no_torch(jail, tmp_path):
    """The oracle backend needs no model: the command lists its backends (`local` when torch is installed)
    without importing torch, which alone takes seconds of every run's start."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "dsv41_cli", "scaffold-bench", "--backend", "oracle",
                        "--scaffolds", "xml", "--limit", "1", "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    modules = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "dsv41.evals.scaffolds.backends" in modules  # the probe sees the command's imports...
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}  # ...and no torch among them
    assert (tmp_path / "out" / "scaffold-bench.json").is_file()


def test_cli_refuses_to_run_without_the_jail(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found
    code, out, err = _run_cli(["--backend", "oracle", "--scaffolds", "xml", "--limit", "1"], capsys)
    assert code == 2 and "no command was run" in err and out == ""


def test_local_backend_runs_the_engine_under_a_scaffold(jail, bundled, small_checkpoint):
    """The local backend: the dsv41 engine answers inside the agent loop. A random model will not
    solve anything; what matters is that its completions go through the same parser and accounting."""
    from dsv41.evals.scaffolds.backends import LocalBackend, local_backend_available

    assert local_backend_available()
    backend = LocalBackend(small_checkpoint, "cpu", max_new_tokens=6)
    tasks, items = bundled
    report = run_bench(backend, [load_scaffold("dsml")], tasks[:1], items[:1], [75], jail, max_steps=2)
    assert len(report["episodes"]) == 2
    row = report["rows"][0]
    assert row["tasks"] == 2 and row["mean_output_tokens"] > 0
    text, n = backend.chat([{"role": "user", "content": "hi"}], None, None)
    assert isinstance(text, str) and 0 < n <= 6
