"""`dsv41 serve` end to end: a real server (`python -m dsv41_cli serve`, a subprocess on a free loopback
port) on the bundled model, driven by the official `openai` client, lm-eval's `local-completions` and
`local-chat-completions` models, and `scaffold-bench --endpoint`. One server for the module."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "dsv41-tiny"
ADD = "Add: 7 3 9 2 5"  # the README's prompt: greedy, the bundled model answers "Answer: 26"


class Server:
    """`dsv41 serve --port 0 ARGS` in a subprocess; `url` once it listens."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV41_THREADS": "1"}
        env.pop("DSV41_MODEL", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv41_cli", "serve", "--port", "0", "--log-level", "warning",
                                      *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        deadline = time.monotonic() + 120
        self.log: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            found = re.search(r"listening on (http://\S+)/v1", line)
            if found:
                self.base = found.group(1)
                self.url = self.base + "/v1"
                return
        self.proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(self.log) + self.proc.stderr.read())

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, dict]:
        return self.request("GET", path, None, headers)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
        return self.request("POST", path, body, headers)

    def request(self, method, path, body, headers=None):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.stderr.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.tokenizer import load_tokenizer

    return load_tokenizer(bundled_model_dir())


@pytest.fixture(scope="module")
def in_process():
    """The bundled model loaded in this process, (model, tokenizer): what the server's answers are compared
    with. Loaded once for the module; the tests only run it (inference, no state kept between calls)."""
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model

    model, _, tok = load_model(bundled_model_dir())
    return model, tok


@pytest.fixture(scope="module")
def lm_eval_env_once():
    """lm-eval gathers the environment (torch's collect_env: `pip list` and more in subprocesses, about 1 s)
    on every simple_evaluate call; nothing here checks it, so gather it once for the module, as
    `dsv41 eval` does for its runs (`_env_info_once`), and restore lm-eval's own afterwards."""
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator as ev
    from lm_eval.loggers.utils import add_env_info

    gathered: dict = {}

    def once(storage: dict) -> None:
        if not gathered:
            add_env_info(gathered)
        storage.update(gathered)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ev, "add_env_info", once)
        yield


def prompt_tokens(tok, messages, mode="thinking", effort=75, tools=None) -> int:
    from dsv41.model import encoding

    if tools:
        messages = encoding.attach_tools(messages, tools)
    return len(tok.encode(encoding.encode_messages(messages, mode=mode, effort=effort), allow_special=True))


# ------------------------------------------------------------------------------------ the openai client
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, doc, _ = server.get("/health")
    assert status == 200 and doc["status"] == "ok" and doc["model"] == MODEL
    # the load benchmark's counters: tokens committed, the process's memory (RSS, glibc's blocks in use and
    # free, the trims of serve/worker.py)
    assert doc["tokens"] >= 0 and doc["memory"]["rss_mib"] > 0 and doc["memory"]["trims"] >= 0
    status, doc, _ = server.get("/debug/memory")  # only with DSV41_SERVE_DEBUG_MEMORY=1
    assert status == 404


def test_memory_probe_reports_and_trims():
    from dsv41.serve.memory import MemoryProbe, mallinfo, malloc_trim

    if mallinfo() is None:
        pytest.skip("not glibc")
    assert isinstance(malloc_trim(), bool)
    probe = MemoryProbe()
    try:
        blocks = [bytearray(1 << 16) for _ in range(64)]
        doc = probe.report(trim=True)
        assert doc["rss_mib"] > 0 and doc["malloc"]["malloc_in_use_mib"] > 0 and "after_trim" in doc
        assert doc["gc"]["objects"] > 0 and doc["python_traced_mib"]["current"] >= 4  # the 4 MiB above
        del blocks
    finally:
        import tracemalloc

        tracemalloc.stop()


def test_thinking_chat_with_reasoning_content_and_usage(client, tok):
    messages = [{"role": "user", "content": ADD}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80)
    message = r.choices[0].message
    assert message.reasoning_content.startswith("First: 7+3=10, +9=19, +2=21, +5=26")
    assert message.content == "Answer: 26" and r.choices[0].finish_reason == "stop"
    assert "</think>" not in message.reasoning_content + message.content
    usage = r.usage
    assert usage.prompt_tokens == prompt_tokens(tok, messages)
    reasoning_ids = tok.encode(message.reasoning_content, allow_special=False)
    answer_ids = tok.encode(message.content, allow_special=False)
    # reasoning + </think> + answer + end-of-sentence, each piece as the model wrote it
    assert usage.completion_tokens == len(reasoning_ids) + 1 + len(answer_ids) + 1
    assert usage.completion_tokens_details.reasoning_tokens == len(reasoning_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_mode_and_effort_reach_the_prompt(client, tok):
    messages = [{"role": "user", "content": ADD}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                          extra_body={"thinking": {"type": "disabled"}})
    assert chat.choices[0].message.reasoning_content is None and chat.choices[0].message.content
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    assert chat.usage.prompt_tokens == prompt_tokens(tok, messages, mode="chat")
    for effort, budget in (("medium", 75), ("low", 50), ("max", 100), (30, 30)):
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1,
                                           reasoning_effort=effort)
        # same length for every budget of two digits: the effort line's digits are one token each here
        assert r.usage.prompt_tokens == prompt_tokens(tok, messages, effort=budget)


def test_streamed_deltas_equal_the_plain_answer_for_the_same_seed(client):
    # sixteen sampled tokens (the seed's sample, not the greedy one), streamed in as many chunks
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Add: 4 8 1"}], temperature=0.8, seed=7,
                  max_tokens=16)
    plain = client.chat.completions.create(**kwargs)
    reasoning, content, finish, usage, chunks = "", "", None, None, 0
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            finish = choice.finish_reason or finish
    assert chunks > 5  # streamed, not one block
    assert reasoning == plain.choices[0].message.reasoning_content
    assert content == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


ADD_TOOL = [{"type": "function", "function": {"name": "add", "description": "Add a list of integers.",
                                              "parameters": {"type": "object", "properties": {
                                                  "numbers": {"type": "array", "items": {"type": "integer"}}},
                                                  "required": ["numbers"]}}}]


def test_tool_call_round_trip(client, tok):
    """tools -> the assistant's tool_calls -> the tool result -> an answer. The bundled model never writes
    DSML (it knows only its training domains), so the calls of the first turn are the client's; what is
    checked here is that the server renders tools, calls and results exactly as the V4.1 encoding does
    (the prompt's token count) and answers after the result. Parsing DSML into tool_calls is checked
    token by token in tests/test_serve_stream.py."""
    first = [{"role": "user", "content": ADD}]
    r = client.chat.completions.create(model=MODEL, messages=first, tools=ADD_TOOL, temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == prompt_tokens(tok, first, tools=ADD_TOOL)
    none = client.chat.completions.create(model=MODEL, messages=first, tools=ADD_TOOL, tool_choice="none",
                                          temperature=0, max_tokens=4)
    assert none.usage.prompt_tokens == prompt_tokens(tok, first)  # tool_choice none: no tool list in the prompt
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"numbers": [7, 3, 9, 2, 5]}'}}
    history = first + [{"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_0", "content": "26"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=ADD_TOOL, temperature=0, max_tokens=12)
    assert r.usage.prompt_tokens == prompt_tokens(tok, history, tools=ADD_TOOL)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.reasoning_content


def test_stop_strings_end_the_answer(client):
    # greedy, the answer is "Answer: 26" (test_thinking_chat_...); the stop string applies to the answer only
    # (the reasoning holds " 2" too), and is left out
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ADD}], temperature=0,
                                         max_tokens=80, stop=[" 2"])
    assert cut.choices[0].message.reasoning_content.startswith("First: 7+3=10, +9=19, +2=21, +5=26")
    assert cut.choices[0].message.content == "Answer:" and cut.choices[0].finish_reason == "stop"


def test_completions_echo_logprobs_match_the_in_process_scores(server, in_process):
    import torch

    model, tok = in_process
    text = "The capital of France is Paris."
    status, doc, _ = server.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 0, "echo": True,
                                                     "logprobs": 1, "temperature": 0})
    assert status == 200, doc
    (choice,) = doc["choices"]
    ids = tok.encode(text)
    lp = choice["logprobs"]
    assert choice["text"] == text and "".join(lp["tokens"]) == text and len(lp["token_logprobs"]) == len(ids)
    seq = [tok.bos_id] + ids  # conditioned on BOS, as the lm-eval adapter scores
    with torch.inference_mode():
        logits = model(torch.tensor([seq[:-1]]), all_logits=True).float()[0]
    expected = (logits.log_softmax(-1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)).tolist()
    assert lp["token_logprobs"] == pytest.approx(expected, rel=1e-4, abs=1e-4)  # fp32 sums of other thread counts
    greedy = logits.argmax(-1).tolist()
    for token, top, best in zip(lp["token_logprobs"], lp["top_logprobs"], greedy):
        assert len(top) == 1 and max(top.values()) >= token
    assert [max(top.values()) == t for t, top in zip(lp["token_logprobs"], lp["top_logprobs"])] == \
        [b == s for b, s in zip(greedy, seq[1:])]
    assert doc["usage"]["prompt_tokens"] == len(seq) and doc["usage"]["completion_tokens"] == 0
    # token ids, two prompts, one generated token each: one choice per prompt
    status, doc, _ = server.post("/v1/completions", {"model": MODEL, "prompt": [ids, ids[:3]], "max_tokens": 1,
                                                     "temperature": 0})
    assert status == 200 and [c["index"] for c in doc["choices"]] == [0, 1] and doc["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------------ bad requests: 400, nothing changes
BAD = [
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, "model", "model_not_found"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"},
     "reasoning_effort", "invalid_reasoning_effort"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": 101},
     "reasoning_effort", "invalid_reasoning_effort"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]},
     "tools", "invalid_tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": {"name": "x"}}, "tools", "invalid_tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, "messages",
     "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 5000}]}, "messages", "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, "presence_penalty",
     "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"model": MODEL, "messages": "hi"}, "messages", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
      "tools": ADD_TOOL}, "tool_choice", "unsupported_parameter"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[b[1] + "-" + str(b[2]) for b in BAD])
def test_bad_requests_get_400_and_change_nothing(server, body, param, code):
    status, doc, _ = server.post("/v1/chat/completions", {**body, "stream": True} if param == "model" else body)
    assert status == 400, doc
    error = doc["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]
    status, health, _ = server.get("/health")
    assert health["inflight"] == 0 and health["running"] == 0 and health["waiting"] == 0


def test_malformed_json_and_unknown_route(server):
    status, doc, _ = server.post("/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in doc["error"]["message"]
    status, doc, _ = server.get("/v1/embeddings")
    assert status in (404, 405) and doc["error"]["message"]


# ------------------------------------------------------------------------------------ lm-eval through the endpoint
def test_lm_eval_local_completions_scores_equal_the_in_process_model(server, in_process, lm_eval_env_once, tmp_path):
    import lm_eval

    from dsv41.evals.lm_eval_model import DSV41LM, make_task_manager

    model, tok = in_process
    tm = make_task_manager(["smoke_mmlu"], tmp_path / "generated", None)
    local = DSV41LM(model=model, tokenizer=tok, batch_size=4)
    # two questions, four choices each: eight (context, continuation) pairs scored both ways, two at a time
    # through the server (each an echo request that also generates a token: about 0.3 s on a 2-core CPU)
    ours = lm_eval.simple_evaluate(model=local, tasks=["smoke_mmlu"], limit=2, task_manager=tm, log_samples=True)
    theirs = lm_eval.simple_evaluate(
        model="local-completions", tasks=["smoke_mmlu"], limit=2, task_manager=tm, log_samples=True,
        model_args=f"model={MODEL},base_url={server.url}/completions,tokenizer_backend=remote,"
                   "tokenized_requests=True,num_concurrent=2,max_retries=1")
    assert theirs["results"]["smoke_mmlu"]["acc,none"] == ours["results"]["smoke_mmlu"]["acc,none"]
    a = [r[0] for s in ours["samples"]["smoke_mmlu"] for r in s["resps"]]
    b = [r[0] for s in theirs["samples"]["smoke_mmlu"] for r in s["resps"]]
    assert len(a) == len(b) == 8
    assert [x[0] for x in b] == pytest.approx([x[0] for x in a], rel=1e-5, abs=1e-4)
    assert [x[1] for x in b] == [x[1] for x in a]  # the is-greedy flags


def test_lm_eval_local_chat_completions_equals_the_in_process_model(server, in_process, lm_eval_env_once, tmp_path):
    import lm_eval

    from dsv41.evals.lm_eval_model import DSV41LM, make_task_manager

    model, tok = in_process
    tm = make_task_manager(["tiny_reasoning"], tmp_path / "generated", None)
    common = dict(tasks=["tiny_reasoning"], limit=3, task_manager=tm, log_samples=True, apply_chat_template=True,
                  gen_kwargs="max_gen_toks=72")
    ours = lm_eval.simple_evaluate(model=DSV41LM(model=model, tokenizer=tok, mode="thinking", effort="high"), **common)
    theirs = lm_eval.simple_evaluate(model="local-chat-completions",
                                     model_args=f"model={MODEL},base_url={server.url}/chat/completions,"
                                                "num_concurrent=3,max_retries=1", **common)
    answers = [s["resps"][0][0] for s in ours["samples"]["tiny_reasoning"]]
    assert [s["resps"][0][0] for s in theirs["samples"]["tiny_reasoning"]] == answers
    assert any(answers)  # some reasoning closed within the budget: answers, not only empty strings
    assert theirs["results"]["tiny_reasoning"]["exact_match,none"] == ours["results"]["tiny_reasoning"]["exact_match,none"]


# ------------------------------------------------------------------------------------ scaffold-bench --endpoint
def test_scaffold_bench_endpoint_runs_end_to_end(server, tmp_path, capsys):
    from dsv41.evals.scaffolds.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
    from dsv41_cli.app import main as cli_main

    try:
        Sandbox(SandboxLimits(wall_seconds=20.0)).check()
    except SandboxUnavailable as e:
        if os.environ.get("DSV41_SKIP_JAIL_TESTS"):
            pytest.skip(f"jail unavailable: {e}")
        pytest.fail(f"the command jail cannot be set up here ({e}); run .ci/deps-scaffold.sh")
    # the bundled model writes no tool calls, so each reply is a format error fed back to the model, however long
    # it is: a few tokens per call take both steps through the server (the prompts' prefill is most of the time)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["scaffold-bench", "--endpoint", server.url, "--scaffolds", "dsml", "--limit", "1", "--efforts",
                  "chat,low", "--max-new-tokens", "4", "--max-steps", "2", "--retries", "0", "--json",
                  "--output", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    doc = json.loads(captured.out)
    assert doc["backend"] == "endpoint" and doc["model"] == MODEL
    assert {row["effort"] for row in doc["rows"]} == {None, 50} and all(row["tasks"] == 2 for row in doc["rows"])
    episodes = [json.loads(line) for line in (tmp_path / "out" / "episodes.jsonl").read_text().splitlines()]
    assert episodes and all(e["steps"] >= 1 and e["output_tokens"] > 0 for e in episodes)
