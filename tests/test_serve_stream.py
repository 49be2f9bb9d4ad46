"""The server's reply builder (serve/stream.py) fed token by token, and the request reader (serve/protocol.py).

The fuzz: completions holding DSML tool-call blocks, reasoning and special tokens, cut after every
token (as max_tokens or a disconnect would cut them) and fed one token at a time: no delta ever holds a
piece of a DSML marker or a special token, the deltas add up to the parse of the whole text, and the
calls come out whole, as parsed."""

from __future__ import annotations

import json

import pytest

from dsv41.model import encoding
from dsv41.model.completion import parse_completion
from dsv41.serve.protocol import APIError, parse_chat, parse_completion_request
from dsv41.serve.stream import STOPPED, ChatReply, StopFilter


@pytest.fixture(scope="module")
def tok():
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.tokenizer import load_tokenizer

    return load_tokenizer(bundled_model_dir())


CALLS = [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris <b>", "days": 3}}},
         {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"numbers": [1, 2]}}}]
COMPLETIONS = [
    ("thinking", encoding.assistant_completion({"role": "assistant", "reasoning_content": "Look it up. x<y",
                                                "content": "Checking.", "tool_calls": CALLS}, "thinking")),
    ("chat", encoding.assistant_completion({"role": "assistant", "content": "Sure:", "tool_calls": CALLS[:1]}, "chat")),
    ("thinking", encoding.assistant_completion({"role": "assistant", "reasoning_content": "a\n\nb",
                                                "content": "Plain answer <｜User｜> with a token."}, "thinking")),
    # tool calls before </think> and a V4-dialect block: the parser's odd paths
    ("thinking", "Reason first\n\n" + encoding.render_tool_calls(CALLS[:1]) + encoding.EOS),
    ("chat", "Answer\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
             + encoding.EOS),
]
SPECIAL_PIECES = ("｜", "DSML", "<think>", "</think>")


def feed(tok, mode, ids, cut):
    reply = ChatReply(tok, mode, [])
    deltas = []
    for token in ids[:cut]:
        assert reply.on_token(token) is None
        deltas += reply.pending
        reply.pending = []
    streamed = list(deltas)
    finish = reply.close("stop" if cut == len(ids) and ids[-1] == tok.eos_id else "length")
    deltas += reply.pending
    return streamed, deltas, finish


@pytest.mark.parametrize("mode,text", COMPLETIONS, ids=[f"{i}-{m}" for i, (m, _) in enumerate(COMPLETIONS)])
def test_no_delta_leaks_a_marker_at_any_cut(tok, mode, text):
    ids = tok.encode(text, allow_special=True)
    assert tok.decode(ids) == text
    for cut in range(1, len(ids) + 1):
        streamed, deltas, finish = feed(tok, mode, ids, cut)
        for d in deltas:
            for channel in ("content", "reasoning_content"):
                piece = d.get(channel, "")
                assert not any(p in piece for p in SPECIAL_PIECES), (cut, d)
                # while tokens come, a '<' that may begin a marker waits for what follows it
                assert d not in streamed or not piece.endswith("<"), (cut, d)
        parsed = parse_completion(tok.decode(ids[:cut]), mode, finished=cut == len(ids))
        assert "".join(d.get("content", "") for d in deltas) == parsed.content, cut
        assert "".join(d.get("reasoning_content", "") for d in deltas) == parsed.reasoning, cut
        calls = [d["tool_call"] for d in deltas if "tool_call" in d]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls], cut
        if cut == len(ids) and parsed.tool_calls:
            assert finish == "tool_calls"
    full = parse_completion(text, mode)
    if "get_weather" in text:
        assert json.loads(full.tool_calls[0]["function"]["arguments"]) == {"city": "Paris <b>", "days": 3}


def test_stop_strings_never_release_their_beginning():
    f = StopFilter(["###", "END"])
    out = "".join(f.push(c) for c in "abc#d##e#") + f.push("##tail")
    assert out == "abc#d##e" and f.stopped and f.push("more") == "" and f.flush() == ""
    g = StopFilter(["END"])
    assert g.push("the EN") == "the " and g.push("D") == "" and g.stopped
    h = StopFilter(["END"])
    assert h.push("E") == "" and h.push("x") == "Ex" and h.flush() == ""


def test_a_stop_string_in_the_answer_ends_the_reply(tok):
    text = encoding.assistant_completion({"role": "assistant", "reasoning_content": "2 STOP 3", "content": "one STOP two"})
    reply = ChatReply(tok, "thinking", ["STOP"])
    results = [reply.on_token(t) for t in tok.encode(text, allow_special=True)]
    assert STOPPED in results  # the engine ends the request at that token
    assert reply.close(STOPPED) == "stop"
    assert "".join(reply.reasoning) == "2 STOP 3" and "".join(reply.content) == "one "


# ------------------------------------------------------------------------------------ the request reader
def chat(**fields):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, "m")


@pytest.mark.parametrize("asked,budget", [("minimal", 50), ("low", 50), ("medium", 75), ("high", 75), ("xhigh", 75),
                                          ("max", 100), ("ultra", 100), (1, 1), (42, 42), ("42", 42), (100, 100),
                                          (None, 75)])
def test_effort_follows_deepseeks_table_onto_the_effort_line(asked, budget):
    params = chat(reasoning_effort=asked) if asked is not None else chat()
    assert (params.mode, params.effort) == ("thinking", budget)
    assert f"Reasoning Effort: {budget} " in params.prompt()


@pytest.mark.parametrize("asked", ["none", "HIGH", 0, 101, 7.5, True, [], "extreme"])
def test_invalid_effort_is_a_400(asked):
    with pytest.raises(APIError) as e:
        chat(reasoning_effort=asked)
    assert e.value.status == 400 and e.value.param == "reasoning_effort"


def test_thinking_switches():
    assert chat(thinking={"type": "disabled"}).mode == "chat"
    assert chat(chat_template_kwargs={"thinking": False}).mode == "chat"
    assert chat(chat_template_kwargs={"thinking": True, "reasoning_effort": 30}).effort == 30
    assert "Reasoning Effort" not in chat(thinking={"type": "disabled"}).prompt()
    with pytest.raises(APIError):
        chat(thinking={"type": "disabled"}, chat_template_kwargs={"thinking": True})
    with pytest.raises(APIError):
        chat(chat_template_kwargs={"enable_thinking": True})


def test_ignored_and_refused_fields():
    assert chat(user="u", metadata={"a": "b"}, parallel_tool_calls=False, presence_penalty=0, logprobs=False).stream is False
    for field, value in (("logit_bias", {"1": 5}), ("logprobs", True), ("response_format", {"type": "json_object"}),
                         ("frequency_penalty", 1.0), ("stream_options", {"include_usage": True})):
        with pytest.raises(APIError) as e:
            chat(**{field: value})
        assert e.value.param == field


def test_completion_prompts_in_every_form():
    def read(prompt, **kw):
        return parse_completion_request({"model": "m", "prompt": prompt, **kw}, "m")

    assert read("text").prompts == ["text"] and read([1, 2]).prompts == [[1, 2]]
    assert read(["a", "b"]).prompts == ["a", "b"] and read([[1], [2, 3]]).prompts == [[1], [2, 3]]
    p = read("x", max_tokens=0, echo=True, logprobs=1)
    assert (p.max_tokens, p.echo, p.logprobs, p.add_special_tokens) == (0, True, 1, True)
    assert read("x").max_tokens == 16  # OpenAI's default
    for bad in ([], [[]], 5, [1, "a"], None):
        with pytest.raises(APIError):
            read(bad)
    with pytest.raises(APIError):
        read("x", stream=True, logprobs=1)
