"""`dsv41 generate` as a user runs it (issue #22): the prompt from stdin, Ctrl-C in --interactive, JSON Lines
for --input-file --json, one-line errors for bad --tools and empty prompts, --max-new-tokens capped to the
model's context, -h and the examples in --help. On the small test checkpoint (tests/checkpoints.py) with a few
generated tokens, or with --print-prompt (no weights loaded). Stdin (a pipe, a terminal) and Ctrl-C are checked on
the command in a subprocess, and so is one --input-file run; the other messages, exit codes and outputs through the
command's entry point in this process (`run_here`), which spares the interpreter's start and torch's import (seconds
a command)."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsv41.model.encoding import encode_messages

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*argv, input: str | bytes | None = None, stdin=None):
    """`python -m dsv41_cli ARGV` with `input` on stdin (an empty stdin when neither is given)."""
    if input is None and stdin is None:
        stdin = subprocess.DEVNULL
    text = not isinstance(input, bytes)
    return subprocess.run([sys.executable, "-m", "dsv41_cli", *argv], input=input, stdin=stdin, capture_output=True,
                          text=text, cwd=ROOT, timeout=600)


def one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def short_context_checkpoint(small_checkpoint, tmp_path_factory):
    """The small checkpoint with a context of 120 positions (its config's max_position_embeddings)."""
    dst = tmp_path_factory.mktemp("short_ctx") / "ckpt"
    shutil.copytree(small_checkpoint, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (cfg.get("text_config") or cfg)["max_position_embeddings"] = 120
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ------------------------------------------------------------------------------ 1. the prompt from stdin
def test_no_prompt_reads_it_from_stdin_and_dash_does_too():
    want = encode_messages([{"role": "user", "content": "Add: 7 3 9 2 5"}], mode="thinking", effort=75)
    for argv in (["--effort", "75"], ["-", "--effort", "75"]):
        r = run_cli("generate", *argv, "--print-prompt", input="Add: 7 3 9 2 5\n")  # the line break is dropped
        assert r.returncode == 0, r.stderr
        assert r.stdout == want


def test_stdin_prompt_generates_as_the_argument_does(small_checkpoint, run_here):
    common = ["--model", str(small_checkpoint), "--mode", "chat", "--max-new-tokens", "3", "--temperature", "0",
              "--json"]
    piped = run_cli("generate", *common, input="Hello\n")  # a real pipe on the command's stdin
    assert piped.returncode == 0, piped.stderr
    given = run_here("generate", "Hello", *common)
    assert given.returncode == 0, given.stderr
    assert json.loads(piped.stdout)["output_ids"] == json.loads(given.stdout)["output_ids"]
    assert json.loads(piped.stdout)["prompt_tokens"] == json.loads(given.stdout)["prompt_tokens"]


def test_no_prompt_on_a_terminal_is_a_one_line_usage_error():
    """A terminal on stdin and no prompt: exit 2 at once with the ways to give one, never a silent wait."""
    leader, follower = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "dsv41_cli", "generate", "--effort", "75", "--print-prompt"],
                           stdin=follower, capture_output=True, text=True, cwd=ROOT, timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert r.returncode == 2 and r.stdout == ""
    line = one_error_line(r)
    assert "no prompt" in line and "stdin" in line and "--interactive" in line


def test_dash_on_a_terminal_reads_the_typed_prompt_up_to_ctrl_d():
    leader, follower = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "dsv41_cli", "generate", "-", "--mode", "chat", "--print-prompt"],
                             stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        os.write(leader, b"Hello\n\x04")  # a line, then Ctrl-D (the terminal's end of file)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert p.returncode == 0, stderr
    assert "end it with Ctrl-D" in stderr
    assert stdout == encode_messages([{"role": "user", "content": "Hello"}], mode="chat")


def test_a_non_utf8_stdin_is_bad_input():
    r = run_cli("generate", "--print-prompt", input=b"\xff\xfe")
    assert r.returncode == 2 and r.stdout == b""
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "not UTF-8" in lines[0]


# ------------------------------------------------------------------------------ 4. errors
@pytest.mark.parametrize("argv,stdin", [
    (["", "--print-prompt"], None),
    (["  \t ", "--print-prompt"], None),
    (["--print-prompt"], "   \n"),
    (["--print-prompt"], ""),
    (["-", "--print-prompt"], "\n\n"),
])
def test_an_empty_or_whitespace_prompt_is_exit_2(argv, stdin, run_here):
    r = run_here("generate", *argv, input=stdin or "")
    assert r.returncode == 2 and r.stdout == ""
    assert "empty" in one_error_line(r)


def test_an_empty_prompt_is_exit_2_before_the_model_loads(small_checkpoint):
    r = run_cli("generate", " ", "--model", str(small_checkpoint), "--max-new-tokens", "2")
    assert r.returncode == 2 and "the prompt is empty" in one_error_line(r)


@pytest.mark.parametrize("tools,expect", [
    ([{"type": "function"}], 'tool 1 has no "function" object'),
    ([{"name": "get_weather", "parameters": {}}], "looks like a bare function"),
    ({"type": "function", "function": {"name": "f"}}, "expected a JSON list of tools, got a JSON object"),
    (["get_weather"], "tool 1 is a JSON string"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"parameters": {}}}],
     'tool 2: "function" has no "name"'),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], '"parameters" is a JSON list'),
    ([{"type": "function", "function": "f"}], '"function" is a JSON string'),
    ([{"type": "code_interpreter", "function": {"name": "f"}}], 'only "function" tools'),
])
def test_a_malformed_tools_file_names_what_is_wrong(tmp_path, tools, expect, run_here):
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(tools))
    r = run_here("generate", "Hi", "--tools", str(f), "--print-prompt")
    assert r.returncode == 2 and r.stdout == ""
    line = one_error_line(r)
    assert expect in line and f"--tools {f}" in line and "cannot encode" not in line


def test_malformed_tools_inside_messages_are_named_too(tmp_path, run_here):
    f = tmp_path / "m.json"
    f.write_text(json.dumps([{"role": "system", "content": "", "tools": [{"type": "function"}]},
                             {"role": "user", "content": "Hi"}]))
    r = run_here("generate", "--messages", str(f), "--print-prompt")
    assert r.returncode == 2
    line = one_error_line(r)
    assert "message 1 ('system') tools: tool 1 has no \"function\" object" in line


def test_a_well_formed_tools_file_still_renders(tmp_path, run_here):
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function",
              "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": parameters}}]
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(tools))
    r = run_here("generate", "Weather in Paris?", "--tools", str(f), "--print-prompt")
    assert r.returncode == 0, r.stderr
    assert '"name": "get_weather"' in r.stdout


def test_max_new_tokens_beyond_the_context_is_capped_with_a_note(short_context_checkpoint, run_here):
    r = run_here("generate", "Hello", "--model", str(short_context_checkpoint), "--mode", "chat", "--temperature", "0",
                 "--max-new-tokens", "100000", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    room = 120 - doc["prompt_tokens"]
    assert doc["max_new_tokens_capped_to"] == room and doc["tokens"]["total"] <= room
    assert doc["finish_reason"] == "length" or doc["tokens"]["total"] < room
    notes = [x for x in r.stderr.splitlines() if x.startswith("note:")]
    assert notes == [f"note: --max-new-tokens 100000 capped to {room}: the model's context is 120 tokens and the "
                     f"prompt takes {doc['prompt_tokens']}"]
    # within the context: no note, no field
    r = run_here("generate", "Hello", "--model", str(short_context_checkpoint), "--mode", "chat", "--max-new-tokens",
                 "2", "--json")
    assert r.returncode == 0 and "note:" not in r.stderr and "max_new_tokens_capped_to" not in json.loads(r.stdout)


def test_a_prompt_that_fills_the_context_is_exit_2(short_context_checkpoint, run_here):
    r = run_here("generate", "x" * 150, "--model", str(short_context_checkpoint), "--mode", "chat",
                 "--max-new-tokens", "4")
    assert r.returncode == 2 and "context is 120" in one_error_line(r)


# ------------------------------------------------------------------------------ 3. --input-file --json
def test_input_file_json_prints_json_lines_even_for_one_prompt(small_checkpoint, tmp_path, run_here):
    common = ["--model", str(small_checkpoint), "--max-new-tokens", "2", "--temperature", "0", "--mode", "chat",
              "--json"]
    one = tmp_path / "one.txt"
    one.write_text("only prompt\n")
    r = run_here("generate", "--input-file", str(one), *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and r.stdout.endswith("}\n")  # one compact document on one line
    assert json.loads(r.stdout)["tokens"]["total"] <= 2
    three = tmp_path / "three.txt"
    three.write_text("first\n\nsecond\n\n\n\nthird\n")
    r = run_here("generate", "--input-file", str(three), *common)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 3
    assert [json.loads(x)["prompt_tokens"] for x in lines] == [9, 10, 9]  # in the file's order
    # a single PROMPT with --json stays one (indented) document
    r = run_here("generate", "Hello", *common)
    assert r.returncode == 0 and r.stdout.startswith("{\n") and json.loads(r.stdout)["tokens"]["total"] <= 2


def test_input_file_runs_the_prompts_together_as_each_alone(small_checkpoint, tmp_path, run_here):
    """--input-file hands every prompt to the engine at once (prompts of different lengths, outputs of
    different lengths): each greedy reply is the one its prompt gets alone (`generate PROMPT`, run in this
    process at the torch threads the command sets: the tokens of a process of its own); a prompt that cannot fit
    the --max-batch-tokens budget is exit 2 before any work."""
    common = ["--model", str(small_checkpoint), "--max-new-tokens", "12", "--temperature", "0", "--mode", "chat",
              "--json"]
    prompts = ["a short one", "a somewhat longer prompt than the first one, with more words in it", "mid length"]
    f = tmp_path / "p.txt"
    f.write_text("\n\n".join(prompts) + "\n")
    r = run_cli("generate", "--input-file", str(f), "--max-batch-size", "2", *common)
    assert r.returncode == 0, r.stderr
    together = [json.loads(x)["output_ids"] for x in r.stdout.splitlines()]
    alone = [json.loads(run_here("generate", p, *common).stdout)["output_ids"] for p in prompts]
    assert together == alone
    r = run_here("generate", "--input-file", str(f), "--max-batch-tokens", "15", *common)
    assert r.returncode == 2 and "--max-batch-tokens" in one_error_line(r)


# ------------------------------------------------------------------------------ 5. flags, -h, examples
def test_dash_h_shows_the_help_with_stdin_json_lines_and_examples(run_here):
    r = run_here("generate", "-h")
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.replace("│", " ").split())
    assert "--max-new-tokens" in flat and "JSON Lines" in flat and "stdin" in flat and "Ctrl-C" in flat
    examples = r.stdout[r.stdout.index("Examples:"):]
    commands = [x.strip() for x in examples.splitlines() if x.strip().startswith(("dsv41 ", "echo "))]
    assert 2 <= len(commands) <= 4 and any("| dsv41 generate" in c for c in commands)
    assert run_here("generate", "--help").stdout == r.stdout


# ------------------------------------------------------------------------------ 2. Ctrl-C in --interactive
class _Reader:
    """Collects a pipe's bytes in a thread, so the test can wait for text to appear."""

    def __init__(self, pipe):
        self.data = b""
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self.thread.start()

    def _run(self, pipe):
        for chunk in iter(lambda: pipe.read1(4096), b""):
            with self.lock:
                self.data += chunk

    def text(self) -> str:
        with self.lock:
            return self.data.decode("utf-8", "replace")

    def wait_for(self, pred, what: str, timeout: float = 180.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.text()
            if pred(t):
                return t
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; got {self.text()!r}")


def test_interactive_ctrl_c_cancels_the_reply_not_the_conversation(short_context_checkpoint):
    """SIGINT while a reply is written (a reply of 100+ tokens: the context's room): the reply stops, the next
    line gets a reply of its own, and SIGINT at the empty prompt ends the chat with exit 0."""
    from checkpoints import small_tokenizer

    p = subprocess.Popen([sys.executable, "-m", "dsv41_cli", "generate", "--interactive", "--model",
                          str(short_context_checkpoint), "--mode", "chat", "--temperature", "0",
                          "--max-new-tokens", "100000"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    out, err = _Reader(p.stdout), _Reader(p.stderr)
    try:
        p.stdin.write(b"Hello\n")
        p.stdin.flush()
        # the reply has begun: text after the prompt marker (the model writes ~110 tokens, seconds of work)
        out.wait_for(lambda t: len(t.split(">>> ", 1)[-1]) >= 3, "the first reply")
        p.send_signal(signal.SIGINT)
        err.wait_for(lambda t: "reply cancelled" in t, "the cancellation note")
        assert p.poll() is None, "Ctrl-C ended the conversation"
        p.stdin.write(b"Hi again\n")
        p.stdin.flush()
        err.wait_for(lambda t: "prompt tokens" in t, "the second reply's stats line")
        out.wait_for(lambda t: t.count(">>> ") == 3, "the prompt after the second reply")
        p.send_signal(signal.SIGINT)  # Ctrl-C at an empty prompt ends the chat
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out.thread.join(10)
    err.thread.join(10)
    stderr = err.text()
    assert "interrupted" not in stderr and "Traceback" not in stderr
    stats = [x for x in stderr.splitlines() if "prompt tokens" in x]
    assert len(stats) == 1  # the cancelled reply has none
    # the cancelled turn left nothing behind: the second prompt is "Hi again" alone, rendered from the start
    tok = small_tokenizer()
    alone = encode_messages([{"role": "user", "content": "Hi again"}], mode="chat")
    n_alone = len(tok.encode(alone, add_special_tokens=False).ids)
    assert re.match(rf"{n_alone} prompt tokens · (\d+) generated", stats[0]), stats[0]
    generated = int(re.search(r"· (\d+) generated", stats[0]).group(1))
    assert generated == 120 - n_alone  # the whole room: capped, with the note
    assert f"capped to {120 - n_alone}" in stderr
