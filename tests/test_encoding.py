"""The V4.1 chat encoding against the official encoder's outputs, and the completion parser.

Golden prompts (tests/fixtures/encoding/golden_prompts.json) were produced by running the official
DeepSeek-V4.1 encoder (see tests/fixtures/encoding/make_golden.py); they are compared character for
character. The parser is checked against the official parser's results on well-formed completions
and fuzzed over generated well-formed, truncated, nested, renamed and corrupted shapes, and over every
class of deviation from the official grammar: the report (errors or warnings) is asserted against an
independent implementation of the official parser's verdict. ``context`` (continuing a conversation
over the cache) is checked against the whole rendering of every golden conversation.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from dsv41.model.completion import parse_completion
from dsv41.model.encoding import (
    BOS,
    CALLS_OPEN,
    DSML,
    EOS,
    IMAGE_PLACEHOLDER,
    THINK_END,
    assistant_completion,
    attach_tools,
    check_effort,
    encode_messages,
    encode_messages_with_images,
    parse_effort,
    parse_image_tags,
    render_tool_calls,
)

FIXTURES = Path(__file__).parent / "fixtures" / "encoding"
GOLDEN_PROMPTS = json.loads((FIXTURES / "golden_prompts.json").read_text())["cases"]
GOLDEN_COMPLETIONS = json.loads((FIXTURES / "golden_completions.json").read_text())["cases"]

EFFORT_LINE_75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


# ---------------------------------------------------------------------------------------------
# Golden prompts from the official encoder
# ---------------------------------------------------------------------------------------------


def test_golden_set_covers_the_required_shapes():
    names = {case["name"] for case in GOLDEN_PROMPTS}
    assert len(names) == len(GOLDEN_PROMPTS) >= 15
    efforts = {case["effort"] for case in GOLDEN_PROMPTS}
    assert {None, "low", "high", "max"} <= efforts and any(isinstance(e, int) for e in efforts)
    assert {case["mode"] for case in GOLDEN_PROMPTS} == {"chat", "thinking"}
    prompts = "".join(case["prompt"] for case in GOLDEN_PROMPTS)
    for needle in (CALLS_OPEN, "<tool_result>", "<｜latest_reminder｜>", "## Response Format", "## Tools", IMAGE_PLACEHOLDER):
        assert needle in prompts
    # a mid-conversation system message and a multi-call assistant turn are among the cases
    assert any(p["prompt"].count("<｜System｜>") == 2 for p in GOLDEN_PROMPTS)
    assert any(p["prompt"].count(f"<{DSML} invoke ") >= 3 for p in GOLDEN_PROMPTS)


@pytest.mark.parametrize("case", GOLDEN_PROMPTS, ids=[case["name"] for case in GOLDEN_PROMPTS])
def test_prompt_matches_official_encoder(case):
    prompt, images = encode_messages_with_images(case["messages"], case["mode"], case["effort"], **case["options"])
    assert prompt == case["prompt"]
    assert images == case["images"]
    assert encode_messages(case["messages"], case["mode"], case["effort"], **case["options"]) == prompt


def test_encoding_does_not_mutate_messages():
    case = next(c for c in GOLDEN_PROMPTS if c["name"] == "thinking_parallel_calls_results_reordered")
    messages = json.loads(json.dumps(case["messages"]))
    encode_messages(messages, "thinking")
    assert messages == case["messages"]


def test_spec_examples():
    hello = [{"role": "user", "content": "Hello"}]
    assert encode_messages(hello, "chat") == f"{BOS}<｜User｜>Hello<｜Assistant｜></think>"
    with_system = [{"role": "system", "content": "Be exact."}] + hello
    assert encode_messages(with_system) == f"{BOS}<｜System｜>{EFFORT_LINE_75}Be exact.<｜User｜>Hello<｜Assistant｜><think>"


def test_effort_forms_render_the_same_budget():
    hello = [{"role": "user", "content": "Hi"}]
    for preset, budget in (("low", 50), ("high", 75), ("max", 100)):
        assert encode_messages(hello, "thinking", preset) == encode_messages(hello, "thinking", budget)
        assert f"Reasoning Effort: {budget} (" in encode_messages(hello, "thinking", preset)
    assert encode_messages(hello) == encode_messages(hello, "thinking", 75) == encode_messages(hello, "thinking", None)
    assert "Reasoning Effort" not in encode_messages(hello, "chat", "max")


# ---------------------------------------------------------------------------------------------
# Effort and argument validation
# ---------------------------------------------------------------------------------------------


def test_parse_effort_accepts_presets_and_integers():
    assert [parse_effort(v) for v in ("low", "high", "max", None, 1, 100, 42, "42", " MAX ")] == [50, 75, 100, 75, 1, 100, 42, 42, 100]


@pytest.mark.parametrize("bad", [0, 101, -5, "medium", "xhigh", "", "0", "101", 7.5, True, [75]])
def test_parse_effort_rejects_out_of_range_and_unknown(bad):
    with pytest.raises(ValueError) as error:
        parse_effort(bad)
    message = str(error.value)
    assert "\n" not in message and "1-100" in message and "low, high, max" in message


@pytest.mark.parametrize("bad", [0, 101, "medium"])
def test_encoding_rejects_bad_effort_in_both_modes(bad):
    for mode in ("thinking", "chat"):
        with pytest.raises(ValueError, match="invalid reasoning effort"):
            encode_messages([{"role": "user", "content": "Hi"}], mode, bad)


def test_bad_inputs_raise_value_errors():
    user = {"role": "user", "content": "Hi"}
    with pytest.raises(ValueError, match="mode"):
        encode_messages([user], "fast")
    with pytest.raises(ValueError, match="role"):
        encode_messages([user, {"role": "developer", "content": "x"}], "chat")
    with pytest.raises(ValueError, match="placeholder"):
        encode_messages([{"role": "user", "content": f"sneaky {IMAGE_PLACEHOLDER}"}])
    with pytest.raises(ValueError, match="image"):
        encode_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="task"):
        encode_messages([{"role": "user", "content": "x", "task": "translate"}])
    with pytest.raises(ValueError, match="function"):
        encode_messages([user, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}])


@pytest.mark.parametrize("bad", ["42", " max", "HIGH", "Low", 7.5, True, 0, 101, "medium"])
def test_encoder_takes_only_the_official_effort_forms(bad):
    # the encoder validates as the official one does; only the CLI reads "42" or "MAX" (parse_effort)
    with pytest.raises(ValueError, match="invalid reasoning effort"):
        encode_messages([{"role": "user", "content": "Hi"}], "thinking", bad)
    assert check_effort(None) == 75 and check_effort("max") == 100 and check_effort(1) == 1


@pytest.mark.parametrize("message, index, role", [
    ({"role": "user", "content": None}, 1, "user"),
    ({"role": "user"}, 1, "user"),
    ({"role": "system", "content": 5}, 1, "system"),
    ({"role": "tool", "tool_call_id": "c", "content": {"a": 1}}, 1, "tool"),
    ({"role": "latest_reminder", "content": None}, 1, "latest_reminder"),
    ({"role": "assistant", "content": "x", "reasoning_content": ["r"]}, 1, "assistant"),
])
def test_content_that_is_not_text_or_blocks_names_the_message(message, index, role):
    with pytest.raises(ValueError) as error:
        encode_messages([{"role": "user", "content": "Hi"}, message], "chat")
    text = str(error.value)
    assert f"message {index} (role {role!r})" in text and "\n" not in text
    with pytest.raises(ValueError, match="context message 1"):
        encode_messages([{"role": "user", "content": "Go"}], "chat", context=[{"role": "user", "content": "Hi"}, message])


def test_assistant_content_may_be_null():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_null = encode_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert with_null == encode_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}])


# ---------------------------------------------------------------------------------------------
# context: earlier messages already in the cache
# ---------------------------------------------------------------------------------------------

KNOWN_ROLES = {"system", "user", "assistant", "tool", "latest_reminder"}


def context_splits():
    """Every golden conversation cut after an assistant message (the model's turn, now in the cache)."""
    for case in GOLDEN_PROMPTS:
        messages = case["messages"]
        if not {m["role"] for m in messages} <= KNOWN_ROLES:
            continue
        for k in range(1, len(messages)):
            if messages[k - 1]["role"] == "assistant":
                yield pytest.param(case, k, id=f"{case['name']}-{k}")


@pytest.mark.parametrize("case, k", list(context_splits()))
def test_continuation_is_the_tail_of_the_whole_rendering(case, k):
    messages, mode, effort, options = case["messages"], case["mode"], case["effort"], case["options"]
    whole, images = encode_messages_with_images(messages, mode, effort, **options)
    continuation, new_images = encode_messages_with_images(messages[k:], mode, effort, context=messages[:k], **options)
    assert whole.endswith(continuation) and not continuation.startswith(BOS) and "Reasoning Effort" not in continuation
    assert images[len(images) - len(new_images):] == new_images
    cached = encode_messages(messages[:k], mode, effort, **options)  # what the cache holds after that turn
    keeps_reasoning = mode == "chat" or options.get("drop_thinking") is False or any(m.get("tools") for m in messages)
    if keeps_reasoning:
        assert cached + continuation == whole
    else:
        # thinking mode, earlier reasoning dropped: the whole rendering drops it (and closes the earlier
        # header with </think>); the cache still holds what the model wrote
        last = messages[k - 1]
        assert (last.get("reasoning_content") or "") + THINK_END + (last.get("content") or "") in cached


def test_context_example_thinking_mode():
    context = [{"role": "user", "content": "Q1"}, {"role": "assistant", "reasoning_content": "R1", "content": "A1"}]
    new = [{"role": "user", "content": "Q2"}]
    cached = encode_messages(context)
    assert cached == f"{BOS}<｜System｜>{EFFORT_LINE_75}<｜User｜>Q1<｜Assistant｜><think>R1{THINK_END}A1{EOS}"
    continuation = encode_messages(new, context=context)
    assert continuation == f"<｜User｜>Q2<｜Assistant｜><think>"
    whole = encode_messages(context + new)
    assert whole == f"{BOS}<｜System｜>{EFFORT_LINE_75}<｜User｜>Q1<｜Assistant｜>{THINK_END}A1{EOS}" + continuation
    assert encode_messages(new, context=[]) == encode_messages(new)  # an empty context is none


def test_context_tool_results_follow_the_context_calls_and_are_not_merged_across():
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("a", "b")]
    context = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    results = [{"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"}]
    continuation = encode_messages(results, "chat", context=context)
    assert continuation == "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result><｜Assistant｜></think>"
    # a user message that ends the context is not merged with one that starts the new messages
    split = encode_messages([{"role": "user", "content": "more"}], "chat", context=[{"role": "user", "content": "Hi"}])
    assert split == "<｜User｜>more<｜Assistant｜></think>"


def test_image_tags():
    assert parse_image_tags("no images") == "no images"
    assert parse_image_tags("<image>a.png</image>") == [{"type": "image_url", "image_url": {"url": "a.png"}}]
    for bad in ("<image></image>", "<image>a.png", "x </image>"):
        with pytest.raises(ValueError):
            parse_image_tags(bad)
    # without image_tags=True the tags are ordinary text, as in the official encode_messages
    text = [{"role": "user", "content": "see <image>a.png</image>"}]
    assert encode_messages_with_images(text, "chat")[1] == []
    prompt, images = encode_messages_with_images(text, "chat", image_tags=True)
    assert images == [{"type": "image", "url": "a.png"}] and prompt.count(IMAGE_PLACEHOLDER) == 1


def test_attach_tools_creates_or_extends_the_system_message():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    user = {"role": "user", "content": "Hi"}
    assert attach_tools([user], tools) == [{"role": "system", "content": "", "tools": tools}, user]
    system = {"role": "system", "content": "S"}
    assert attach_tools([system, user], tools)[0] == {"role": "system", "content": "S", "tools": tools}
    assert "tools" not in system


# ---------------------------------------------------------------------------------------------
# Parser: agreement with the official parser, round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GOLDEN_COMPLETIONS, ids=[str(i) for i in range(len(GOLDEN_COMPLETIONS))])
def test_parse_matches_official_parser(case):
    parsed = parse_completion(case["completion"], case["mode"])
    official = case["official_parse"]
    assert (parsed.reasoning, parsed.content) == (official["reasoning_content"], official["content"])
    assert [call["function"] for call in parsed.tool_calls] == [call["function"] for call in official["tool_calls"]]
    assert parsed.errors == [] and parsed.warnings == [] and parsed.finished and parsed.finish_reason == "stop"
    if case["message"] is not None:  # rendered from a message (not written by hand)
        assert assistant_completion(case["message"], case["mode"]) == case["completion"]


ROUND_TRIP_CALLS = [
    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
    {"id": "b", "type": "function", "function": {"name": "search", "arguments": json.dumps(
        {"query": "multi\nline <x> \"q\" 中文 🙂", "filters": {"lang": ["en", None], "on": True}, "top_k": -2.5}, ensure_ascii=False)}},
    {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}},
]


@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_round_trip_tool_calls(mode):
    conversation = [
        {"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "get_weather"}}]},
        {"role": "user", "content": "Go"},
    ]
    assistant = {"role": "assistant", "reasoning_content": "plan" if mode == "thinking" else "", "content": "On it.", "tool_calls": ROUND_TRIP_CALLS}
    head = encode_messages(conversation, mode)
    full = encode_messages(conversation + [assistant], mode)
    assert full.startswith(head)
    parsed = parse_completion(full[len(head):], mode)
    assert parsed.errors == [] and parsed.warnings == [] and parsed.dsml_dialect == "v4.1"
    assert parsed.content == "On it." and parsed.reasoning == assistant["reasoning_content"]
    # same names and the same argument strings (the originals were laid out by json.dumps)
    assert [c["function"] for c in parsed.tool_calls] == [c["function"] for c in ROUND_TRIP_CALLS]
    # and the parsed message encodes back to the same turn
    assert encode_messages(conversation + [parsed.to_message()], mode) == full


# ---------------------------------------------------------------------------------------------
# Parser: specific malformed shapes
# ---------------------------------------------------------------------------------------------


def dsml_call(name, params, space=" "):
    body = "\n".join(
        f'<{DSML}{space}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else json.dumps(v)}</{DSML}{space}parameter>'
        for k, v in params.items()
    )
    return f'<{DSML}{space}invoke name="{name}">\n{body}\n</{DSML}{space}invoke>'


def test_v4_style_tags_are_accepted_and_reported():
    block = f"<{DSML}tool_calls>\n" + dsml_call("f", {"a": 1, "b": "x"}, space="") + f"\n</{DSML}tool_calls>"
    parsed = parse_completion(f"r{THINK_END}hi\n\n{block}{EOS}", "thinking")
    assert [c["function"] for c in parsed.tool_calls] == [{"name": "f", "arguments": '{"a": 1, "b": "x"}'}]
    assert parsed.content == "hi" and parsed.dsml_dialect == "v4" and parsed.errors == []
    # a warning, the one exception to the rule: the official V4.1 parser rejects V4 tags, V4's reads them
    assert len(parsed.warnings) == 1 and "V4-style" in parsed.warnings[0]


def test_truncated_call_is_reported_not_leaked():
    text = f"ok\n\n{CALLS_OPEN}\n" + dsml_call("f", {"a": "1"}) + "\n" + dsml_call("g", {"long": "abcdef"})[:-40]
    parsed = parse_completion(text, "chat")
    assert parsed.content == "ok" and not parsed.finished and parsed.finish_reason == "length"
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f"]
    assert any('"g"' in e for e in parsed.errors)


def test_missing_think_end_and_stray_markup():
    block = f"{CALLS_OPEN}\n" + dsml_call("f", {}) + f"\n</{DSML} calls>"
    parsed = parse_completion(f"reasoning\n\n{block}{EOS}", "thinking")
    assert parsed.reasoning == "reasoning" and len(parsed.tool_calls) == 1 and parsed.errors
    parsed = parse_completion(f"a </{DSML} invoke> b {DSML} c{EOS}", "chat")
    assert DSML not in parsed.content and len(parsed.errors) == 2 and parsed.tool_calls == []
    parsed = parse_completion(f"all reasoning{EOS}", "thinking")
    assert parsed.reasoning == "all reasoning" and parsed.errors
    parsed = parse_completion("cut while reasoning", "thinking")
    assert parsed.reasoning == "cut while reasoning" and not parsed.finished
    assert len(parsed.errors) == 1 and "cut while reasoning" in parsed.errors[0]


def test_unclosed_call_before_the_next_is_named_in_errors():
    first = dsml_call("first", {"a": "1"}).removesuffix(f"</{DSML} invoke>")
    text = f"\n\n{CALLS_OPEN}\n{first}\n" + dsml_call("second", {"b": 2}) + f"\n</{DSML} calls>{EOS}"
    parsed = parse_completion(text, "chat")
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["second"]
    assert any('"first"' in e and "not closed" in e for e in parsed.errors)


def test_bad_json_value_and_duplicate_parameter_are_reported():
    call = (f'<{DSML} invoke name="f">\n<{DSML} parameter name="a" string="false">{{oops</{DSML} parameter>\n'
            f'<{DSML} parameter name="a" string="true">2</{DSML} parameter>\n</{DSML} invoke>')
    parsed = parse_completion(f"\n\n{CALLS_OPEN}\n{call}\n</{DSML} calls>{EOS}", "chat")
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ['{"a": "{oops"}']
    assert len(parsed.errors) == 2


# ---------------------------------------------------------------------------------------------
# Parser fuzz
# ---------------------------------------------------------------------------------------------

# No 'z' in free text, so tool names ("zq...") and parameter names ("zp...") can be traced.
TEXT_PIECES = list("abc xy<>/=\"'{}[]\n\té中🙂|-") + ["think", "DSML", "tool_result", "invoke", "parameter", "calls", " \n\n"]
FORBIDDEN = (DSML, "<think>", "</think>", EOS, "z")


def random_text(rng, max_pieces=12):
    while True:
        text = "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(0, max_pieces)))
        if not any(token in text for token in FORBIDDEN) and not text.endswith("<｜"):
            return text


def random_json(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-10**6, 10**6)
    if kind == 1:
        return rng.choice([0.5, -1.25, 3.0e-7, 1e16])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return random_text(rng, 4)  # a string inside a JSON value
    if kind == 4:
        return rng.randint(0, 3)
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_calls(rng, max_calls=3):
    calls = []
    for number in range(rng.randint(1, max_calls)):
        params = {}
        for p in range(rng.randint(0, 3)):
            params[f"zp{p}"] = random_text(rng, 8) if rng.random() < 0.5 else random_json(rng)
        calls.append((f"zq{number}_{rng.randint(0, 999)}", params))
    return calls


def tag(name, style, rng, closing=False):
    """A DSML tag head in V4.1 (leading space), V4 (no space, tool_calls) or per-tag mixed style."""
    v4 = style == "v4" or (style == "mixed" and rng.random() < 0.5)
    if name == "calls":
        name = "tool_calls" if v4 else " calls"
    else:
        name = name if v4 else " " + name
    return f"<{'/' if closing else ''}{DSML}{name}"


OPEN_TAG_ENDS: list[int] = []  # filled by render(): end offsets of each invoke's opening tag


def render(calls, style, rng):
    """Completion tail for the calls; returns (text, end offset of each invoke, end of the block)."""
    out = tag("calls", style, rng) + ">\n"
    invoke_ends = []
    for number, (name, params) in enumerate(calls):
        out += tag("invoke", style, rng) + f' name="{name}">'
        OPEN_TAG_ENDS.append(len(out))
        out += "\n"
        lines = []
        for key, value in params.items():
            is_string = isinstance(value, str)
            text = value if is_string else json.dumps(value, ensure_ascii=False)
            lines.append(tag("parameter", style, rng) + f' name="{key}" string="{"true" if is_string else "false"}">'
                         + text + tag("parameter", style, rng, closing=True) + ">")
        out += "\n".join(lines) + "\n" + tag("invoke", style, rng, closing=True) + ">"
        invoke_ends.append(len(out))
        out += "\n" if number + 1 < len(calls) else ""
    out += "\n" + tag("calls", style, rng, closing=True) + ">"
    return out, invoke_ends, len(out)


def make_shape(rng, style="v41"):
    mode = rng.choice(["thinking", "chat"])
    reasoning = random_text(rng) if mode == "thinking" else ""
    content = random_text(rng)
    calls = random_calls(rng) if rng.random() < 0.8 else []
    prefix = (reasoning + THINK_END if mode == "thinking" else "") + content
    OPEN_TAG_ENDS.clear()
    block, invoke_ends, block_end = render(calls, style, rng) if calls else ("", [], 0)
    offset = len(prefix) + 2
    text = prefix + ("\n\n" + block if calls else "")
    return {
        "mode": mode, "reasoning": reasoning, "content": content, "calls": calls, "text": text,
        "block_start": offset if calls else None,
        "invoke_ends": [offset + e for e in invoke_ends], "block_end": offset + block_end if calls else None,
        "invoke_open_ends": [offset + e for e in OPEN_TAG_ENDS],
    }


def arguments_of(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def check_invariants(parsed):
    """What must hold for any text: markup never leaks, traced names never leak."""
    for part in (parsed.content, parsed.reasoning):
        assert DSML not in part
        assert "zq" not in part and "zp" not in part
    for call in parsed.tool_calls:
        json.loads(call["function"]["arguments"])
        assert set(call) == {"id", "type", "function"}


def fuzz_valid(rng, style):
    shape = make_shape(rng, style)
    eos = rng.random() < 0.7
    text = shape["text"] + (EOS if eos else "")
    parsed = parse_completion(text, shape["mode"])
    check_invariants(parsed)
    assert (parsed.reasoning, parsed.content) == (shape["reasoning"], shape["content"])
    assert arguments_of(parsed) == [(name, params) for name, params in shape["calls"]]
    assert parsed.finished == eos
    has_v4_tag = re.search(rf"</?{DSML}[a-z]", shape["text"]) is not None  # no space before the name
    # the report is what the official parser says: errors exactly when it rejects the text (V4 tags
    # aside: a warning, see test_v4_style_tags_are_accepted_and_reported)
    if not has_v4_tag:
        assert bool(parsed.errors) == (not official_accepts(text, shape["mode"])), (text, parsed.errors)
    if shape["calls"]:
        assert has_v4_tag == (style == "v4") or style == "mixed"
        assert parsed.dsml_dialect == ("v4" if has_v4_tag else "v4.1")
    assert [w for w in parsed.warnings if "V4-style" in w] == parsed.warnings and len(parsed.warnings) == has_v4_tag
    expected = [] if eos or shape["calls"] else ["cut before the end-of-sentence"]
    assert len(parsed.errors) == len(expected) and all(e in error for e, error in zip(expected, parsed.errors)), parsed.errors


def fuzz_truncations(rng, style):
    shape = make_shape(rng, style)
    text, expected = shape["text"], [(name, params) for name, params in shape["calls"]]
    count = 0
    for cut in range(len(text) + 1):
        parsed = parse_completion(text[:cut], shape["mode"])
        check_invariants(parsed)
        count += 1
        # never silent: what the official parser rejects is an error (a cut call it would return half
        # written, or a complete block cut before the end-of-sentence token, are errors here too)
        # (V4 tags aside: a warning, see test_v4_style_tags_are_accepted_and_reported)
        assert parsed.errors or official_accepts(text[:cut], shape["mode"]) or style != "v41", (text[:cut], parsed)
        thinking_text = shape["reasoning"] + THINK_END
        assert thinking_text.startswith(parsed.reasoning) or shape["mode"] == "chat"
        # a cut may leave the blank line and the '<' that precede the calls block, never more
        assert (shape["content"] + "\n\n<").startswith(parsed.content), (text[:cut], parsed)
        closed = sum(end <= cut for end in shape["invoke_ends"])
        got = arguments_of(parsed)
        assert got == expected[:closed], (text[:cut], parsed)
        markup_begun = shape["block_start"] is not None and DSML in text[shape["block_start"]:cut]
        if markup_begun and cut < shape["block_end"]:
            assert parsed.errors, (text[:cut], parsed)  # a begun block or call is never silently lost
        if closed < len(expected) and shape["invoke_open_ends"][closed] <= cut:
            # the call being written when the text ended is named in the errors
            assert any(json.dumps(expected[closed][0]) in error for error in parsed.errors), (text[:cut], parsed)
        if shape["mode"] == "thinking" and cut >= len(thinking_text):
            assert parsed.reasoning == shape["reasoning"]
    return count


STRAY_TAGS = [f"</{DSML} invoke>", f"</{DSML}invoke>", f"</{DSML} parameter>", f"</{DSML} calls>", f"</{DSML}tool_calls>",
              f"<{DSML} bogus>", f"<{DSML}>", DSML, f"<{DSML} bogus attr=\"1\">"]


def fuzz_stray(rng):
    """Non-opening stray tags in the content, between calls or after the block: every call still
    parsed, the stray reported."""
    shape = make_shape(rng)
    stray = rng.choice(STRAY_TAGS)
    text = shape["text"]
    where = rng.choice(["content", "between", "after"])
    start = len(shape["reasoning"] + THINK_END) if shape["mode"] == "thinking" else 0
    if where == "content" or not shape["calls"]:
        position = rng.randint(start, start + len(shape["content"]))
    elif where == "between":
        position = rng.choice(shape["invoke_ends"])
    else:
        position = len(text)
    parsed = parse_completion(text[:position] + stray + text[position:] + EOS, shape["mode"])
    check_invariants(parsed)
    assert parsed.errors
    assert arguments_of(parsed) == [(name, params) for name, params in shape["calls"]]


def fuzz_nested(rng):
    """A whole calls block inside a string parameter value, or a calls block opened inside another."""
    inner_style = rng.choice(["v41", "v4"])
    inner, _, _ = render(random_calls(rng, 2), inner_style, rng)
    outer_calls = [("zqouter", {"zpvalue": "before " + inner + " after"})]
    if rng.random() < 0.5:
        text, _, _ = render(outer_calls, "v41", rng)
    else:
        text, _, _ = render(outer_calls, "v41", rng)
        text = text.replace('name="zqouter">', f'name="zqouter">\n{inner}', 1)
    mode = rng.choice(["thinking", "chat"])
    text = ("r" + THINK_END if mode == "thinking" else "") + "c\n\n" + text + EOS
    parsed = parse_completion(text, mode)
    check_invariants(parsed)
    # usually an error; a block that fits whole inside a string value is accepted officially: a warning.
    # (A V4 closing tag ends a value here, not officially: there the readings differ, and ours is an error.)
    if inner_style == "v41":
        assert bool(parsed.errors) == (not official_accepts(text, mode)), (text, parsed)
    assert parsed.errors or any("contains DSML markup" in w for w in parsed.warnings)


def fuzz_inside_reasoning(rng):
    """Calls written before </think>: parsed out of the reasoning, reported."""
    shape = make_shape(rng)
    if not shape["calls"]:
        return
    block, _, _ = render(shape["calls"], "v41", rng)
    text = shape["reasoning"] + "\n\n" + block + THINK_END + shape["content"] + EOS
    parsed = parse_completion(text, "thinking")
    check_invariants(parsed)
    assert parsed.errors and parsed.reasoning == shape["reasoning"]
    assert arguments_of(parsed) == [(name, params) for name, params in shape["calls"]]


GARBAGE = [DSML, "<", "</", ">", " calls", "tool_calls", " invoke", "invoke", " parameter", ' name="zqg"', ' string="true"',
           ' string="false"', "\n", "x", "1", "{", "\"", THINK_END, "<think>", EOS[:5], "中"]


def fuzz_garbage(rng):
    text = "".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 40)))
    mode, finished = rng.choice(["thinking", "chat"]), rng.choice([None, True, False])
    parsed = parse_completion(text, mode, finished=finished)
    assert DSML not in parsed.content and DSML not in parsed.reasoning
    if finished is None and parsed.dsml_dialect != "v4":  # never silent (V4 tags aside: a warning)
        assert parsed.errors or official_accepts(text, mode), (text, parsed)
    for call in parsed.tool_calls:
        json.loads(call["function"]["arguments"])


# ---------------------------------------------------------------------------------------------
# The official parser's verdict, as an oracle for the report
# ---------------------------------------------------------------------------------------------


def official_verdict(text, mode):
    """What the official V4.1 parser (parse_message_from_completion_text) does with ``text``, written
    here from its grammar: None where it raises, else (reasoning, content, [(name, arguments)])."""
    calls_start = f"\n\n<{DSML} calls"

    def read_to(i, stops):  # the earliest stop (the first listed wins a tie) -> (after it, text before, stop)
        found = [(text.find(stop, i), n, stop) for n, stop in enumerate(stops) if text.find(stop, i) >= 0]
        if not found:
            return len(text), text[i:], None
        at, _, stop = min(found)
        return at + len(stop), text[i:at], stop

    reasoning, calls, i = "", [], 0
    if mode == "thinking":
        i, reasoning, stop = read_to(0, [THINK_END, calls_start])
        if stop != THINK_END:
            return None
    i, content, stop = read_to(i, [EOS, calls_start])
    if stop == calls_start:
        while i < len(text):
            i, between, stop = read_to(i, [f"<{DSML} invoke", f"</{DSML} calls>"])
            if between != ">\n" or stop is None:
                return None
            if stop == f"</{DSML} calls>":
                break
            i, head, stop = read_to(i, [f"<{DSML} parameter", f"</{DSML} invoke"])
            name = re.findall(r'^\s*name="(.*?)">\n$', head, flags=re.DOTALL)
            if len(name) != 1:
                return None
            arguments = {}
            while stop == f"<{DSML} parameter":
                i, body, stop = read_to(i, [f"/{DSML} parameter"])
                fields = re.findall(r'^ name="(.*?)" string="(true|false)">(.*?)<$', body, flags=re.DOTALL)
                if len(fields) != 1 or fields[0][0] in arguments:
                    return None
                arguments[fields[0][0]] = fields[0][2] if fields[0][1] == "false" else json.dumps(fields[0][2], ensure_ascii=False)
                i, between, stop = read_to(i, [f"<{DSML} parameter", f"</{DSML} invoke"])
                if between != ">\n":
                    return None
            calls.append((name[0], "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in arguments.items()) + "}"))
        i, after, stop = read_to(i, [EOS])
        if after:
            return None
    elif stop != EOS:
        return None
    if i != len(text) or stop not in (EOS, None):
        return None
    if any(token in part for token in (BOS, EOS, "<think>", THINK_END, DSML) for part in (content, reasoning)):
        return None
    return reasoning, content, calls


def official_accepts(text, mode):
    """The official parser returns a usable message: it does not raise, and each call it returns has a
    plain name and JSON arguments (it accepts a few texts only to return a call that is neither)."""
    verdict = official_verdict(text, mode)
    if verdict is None:
        return False
    for name, arguments in verdict[2]:
        if DSML in name or '"' in name:
            return False
        try:
            json.loads(arguments)
        except ValueError:
            return False
    return True


def test_official_verdict_agrees_with_the_official_parser_on_the_goldens():
    for case in GOLDEN_COMPLETIONS:
        official = case["official_parse"]
        assert official_verdict(case["completion"], case["mode"]) == (
            official["reasoning_content"], official["content"],
            [(c["function"]["name"], c["function"]["arguments"]) for c in official["tool_calls"]])


# Every class of deviation from the official grammar: a change to a well-formed completion, whether the
# official parser rejects the result (an error here) or accepts it (a warning), and a phrase of the report.
U = "<｜User｜>"


def _first_invoke(text):
    return text.index(f"<{DSML} invoke")


def _before_calls(separator):
    """The text before the calls block ends with ``separator`` instead of a blank line (the content's own
    trailing whitespace goes too, or it would still end with one)."""
    def mutate(t):
        at = t.index(CALLS_OPEN)
        return t[:at].rstrip() + separator + t[at:]
    return mutate


def _replace_first(old, new):
    return lambda t: t.replace(old, new, 1)


DEVIATIONS = {
    # name: (mutation of the text without EOS, needs calls, needs thinking, report kind, phrase)
    "bos_in_content": (lambda t: t.replace(THINK_END, THINK_END + "a" + BOS, 1) if THINK_END in t else "a" + BOS + t,
                       False, False, "errors", "stray <｜begin▁of▁sentence｜>"),
    "bos_in_reasoning": (lambda t: "r" + BOS + t, False, True, "errors", "removed from the reasoning"),
    "think_in_content": (lambda t: t.replace(THINK_END, THINK_END + "<think>", 1) if THINK_END in t else "<think>" + t,
                         False, False, "errors", "stray <think>"),
    "think_end_in_content": (lambda t: t.replace(THINK_END, THINK_END + "x" + THINK_END, 1) if THINK_END in t else "x" + THINK_END + t,
                             False, False, "errors", "stray </think>"),
    "leading_think": (lambda t: "<think>" + t, False, True, "errors", "starts with <think>"),
    "other_special_token": (lambda t: t.replace(THINK_END, THINK_END + U, 1) if THINK_END in t else U + t,
                            False, False, "warnings", "special token <｜User｜> removed"),
    "missing_think_end": (lambda t: t.replace(THINK_END, "", 1), False, True, "errors", "</think>"),
    "calls_before_think_end": (lambda t: t.replace(THINK_END, "", 1).replace(f"</{DSML} calls>", f"</{DSML} calls>{THINK_END}", 1),
                               True, True, "errors", "before </think>"),
    "second_block": (lambda t: t + "\n\n" + t[t.index(CALLS_OPEN):], True, False, "errors", "second tool-call block"),
    "no_newline_after_calls_tag": (_replace_first(f"{CALLS_OPEN}\n", CALLS_OPEN), True, False, "errors", "nothing instead of one newline"),
    "blank_line_after_calls_tag": (_replace_first(f"{CALLS_OPEN}\n", CALLS_OPEN + "\n\n"), True, False, "errors", "instead of one newline"),
    "single_newline_before_calls": (_before_calls("\n"), True, False, "errors", "a single newline"),
    "no_blank_line_before_calls": (_before_calls(""), True, False, "errors", "no blank line"),
    "space_between_invokes": (_replace_first(f"</{DSML} invoke>\n", f"</{DSML} invoke> \n"), True, False, "errors", "instead of one newline"),
    "newline_after_block": (lambda t: t + "\n", True, False, "errors", "after the tool-call block"),
    "text_after_block": (lambda t: t + "\n\nmore", True, False, "errors", "text after the tool calls"),
    "text_after_eos": (lambda t: t + EOS + "more", False, False, "errors", "after the end-of-sentence token"),
    "bare_invoke": (lambda t: t.replace(f"{CALLS_OPEN}\n", "", 1).replace(f"\n</{DSML} calls>", "", 1), True, False, "errors",
                    "without a surrounding calls block"),
    "v4_tags": (lambda t: t.replace(f"{DSML} ", DSML).replace(f"{DSML}calls", f"{DSML}tool_calls"), True, False, "warnings", "V4-style"),
    "tag_not_in_official_form": (_replace_first(f"</{DSML} invoke>", f"</{DSML} invoke >"), True, False, "errors", "official form"),
    "attribute_order": (lambda t: re.sub(r'parameter name="([^"]*)" string="(true|false)"', r'parameter string="\2" name="\1"', t, count=1),
                        "params", False, "errors", "official form"),
    "missing_string_attribute": (lambda t: re.sub(r' string="(true|false)"', "", t, count=1), "params", False, "errors", "no string attribute"),
    "odd_string_attribute": (lambda t: re.sub(r' string="(true|false)"', ' string="yes"', t, count=1), "params", False, "errors", 'string="yes"'),
    "duplicate_parameter": (lambda t: re.sub(rf'(<{DSML} parameter [^>]*>.*?</{DSML} parameter>)', r"\1\n\1", t, count=1, flags=re.S),
                            "params", False, "errors", "repeats parameter"),
    "string_false_not_json": (lambda t: t[:_first_invoke(t)] + t[_first_invoke(t):].replace(
        f'<{DSML} invoke name="zq', f'<{DSML} invoke name="zq', 1).replace(
        "\n</" + DSML + " invoke>", f'\n<{DSML} parameter name="zpbad" string="false">{{oops</{DSML} parameter>\n</{DSML} invoke>', 1),
        True, False, "errors", "not valid JSON"),
    "stray_tag_in_content": (lambda t: t.replace(f"\n\n{CALLS_OPEN}", f"x</{DSML} invoke>\n\n{CALLS_OPEN}", 1) if CALLS_OPEN in t
                             else t + f"x</{DSML} invoke>", False, False, "errors", "stray DSML markup"),
    "extra_invoke_attribute": (lambda t: re.sub(rf'(<{DSML} invoke name="[^"]*")>', r'\1 id="7">', t, count=1), True, False,
                               "errors", "attributes after the name"),
    "other_space_before_invoke_name": (_replace_first(f'<{DSML} invoke name=', f'<{DSML} invoke  name='), True, False,
                                       "warnings", "other whitespace before its name"),
    "empty_block": (lambda t: t[: t.index(CALLS_OPEN)] + f"{CALLS_OPEN}\n</{DSML} calls>", True, False, "warnings", "empty tool-call block"),
    "blank_line_before_first_parameter": (lambda t: re.sub(rf'(<{DSML} invoke name="[^"]*">)\n(<{DSML} parameter)', r"\1\n\n\2", t, count=1),
                                          "params", False, "warnings", "a blank line inside tool call"),
    "dsml_in_string_value": (lambda t: re.sub(rf'(<{DSML} parameter name="[^"]*" string="true">)', rf"\1<{DSML} invoke x ", t, count=1),
                             "strings", False, "warnings", "contains DSML markup"),
}


def fuzz_deviation(rng, name):
    mutate, needs_calls, needs_thinking, kind, phrase = DEVIATIONS[name]
    for _ in range(200):  # a shape the mutation applies to
        shape = make_shape(rng)
        calls = shape["calls"]
        if (needs_thinking and shape["mode"] != "thinking") or (needs_calls and not calls):
            continue
        if needs_calls == "params" and not calls[0][1]:
            continue
        if needs_calls == "strings" and not any(isinstance(v, str) for v in calls[0][1].values()):
            continue
        break
    else:
        raise AssertionError(f"no shape for {name}")
    text = mutate(shape["text"])
    if not text.endswith(EOS) and EOS not in text:
        text += EOS
    assert text != shape["text"] + EOS, name
    parsed = parse_completion(text, shape["mode"])
    check_invariants(parsed)
    for token in (BOS, EOS, "<think>", U):
        assert token not in parsed.content and token not in parsed.reasoning
    assert THINK_END not in parsed.content and THINK_END not in parsed.reasoning
    verdict = official_verdict(text, shape["mode"])
    report = parsed.errors if kind == "errors" else parsed.warnings
    assert any(phrase in line for line in report), (name, text, parsed)
    if kind == "warnings":  # accepted officially (V4 tags: by V4's parser): no error, and the warning says what differs
        assert (official_accepts(text, shape["mode"]) or name == "v4_tags") and parsed.errors == [], (name, text, parsed.errors)
        if verdict != (parsed.reasoning, parsed.content, [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]):
            assert name in ("other_special_token", "v4_tags"), name  # a removed token, or V4 tags read
    else:  # rejected, or accepted only to return a broken call (arguments not JSON, attributes in the name)
        assert not official_accepts(text, shape["mode"]), (name, text)
    return parsed


@pytest.mark.parametrize("name", list(DEVIATIONS))
def test_each_deviation_class_is_reported(name):
    rng = random.Random(name)
    for _ in range(30):
        fuzz_deviation(rng, name)


def test_deviations_from_the_issue():
    call = dsml_call("f", {"a": 1})
    block = f"{CALLS_OPEN}\n{call}\n</{DSML} calls>"
    # a begin-of-sentence token in the content: removed, an error
    parsed = parse_completion(f"r{THINK_END}hi{BOS} there{EOS}", "thinking")
    assert parsed.content == "hi there" and any(BOS in e for e in parsed.errors)
    # two blocks: both read, an error
    parsed = parse_completion(f"hi\n\n{block}\n\n{block}{EOS}", "chat")
    assert len(parsed.tool_calls) == 2 and any("second tool-call block" in e for e in parsed.errors)
    # no newline after the calls tag, a single newline before it
    parsed = parse_completion(f"hi\n\n{CALLS_OPEN}{call}\n</{DSML} calls>{EOS}", "chat")
    assert len(parsed.tool_calls) == 1 and parsed.errors
    parsed = parse_completion(f"hi\n{block}{EOS}", "chat")
    assert parsed.content == "hi\n" and len(parsed.tool_calls) == 1 and any("single newline" in e for e in parsed.errors)
    # the well-formed text: nothing reported
    parsed = parse_completion(f"hi\n\n{block}{EOS}", "chat")
    assert parsed.errors == parsed.warnings == [] and parsed.content == "hi"


def test_parser_fuzz():
    rng = random.Random(20260941)
    started = time.perf_counter()
    shapes = 0
    for _ in range(600):
        fuzz_valid(rng, "v41")
        shapes += 1
    for _ in range(300):
        fuzz_valid(rng, rng.choice(["v4", "mixed"]))
        shapes += 1
    for _ in range(24):
        shapes += fuzz_truncations(rng, "v41")
    for _ in range(6):
        shapes += fuzz_truncations(rng, rng.choice(["v4", "mixed"]))
    for _ in range(400):
        fuzz_stray(rng)
        shapes += 1
    for _ in range(200):
        fuzz_nested(rng)
        shapes += 1
    for _ in range(200):
        fuzz_inside_reasoning(rng)
        shapes += 1
    for _ in range(1500):
        fuzz_garbage(rng)
        shapes += 1
    assert shapes >= 1000
    assert time.perf_counter() - started < 10


def test_render_tool_calls_is_what_the_encoder_writes():
    conversation = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "", "tool_calls": ROUND_TRIP_CALLS}]
    assert "\n\n" + render_tool_calls(ROUND_TRIP_CALLS) + EOS in encode_messages(conversation, "chat")


# ---------------------------------------------------------------------------------------------
# context where a conversation continues over the cache: `dsv41 generate --interactive`
# ---------------------------------------------------------------------------------------------


class _CharTokenizer:
    """One id per character (special tokens included): enough to see which text each prompt holds."""

    eos_id = 1

    def encode(self, text, allow_special=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids)

    def token_to_id(self, token):
        return None


def test_interactive_chat_continues_over_the_generated_ids(monkeypatch):
    from types import SimpleNamespace

    from dsv41_cli.commands import generate as cli

    tok = _CharTokenizer()
    replies = iter([f"R1{THINK_END}A1{EOS}", f"R2{THINK_END}A2", f"R3{THINK_END}A3{EOS}"])  # the second is cut
    seen = []

    class Engine:
        args = SimpleNamespace(image_token_id=-1)

        def generate(self, ids, config, on_token=None, images=None):
            seen.append(list(ids))
            out = tok.encode(next(replies))
            return SimpleNamespace(prompt_tokens=len(ids), output_ids=out, finish_reason="stop" if EOS in tok.decode(out) else "length",
                                   prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0, peak_memory_bytes=0,
                                   kv_bytes_per_token=0.0, dspark=None, prefill=None, budget_forced=False)

    lines = iter(["Q1", "Q2", "Q3", "/exit"])
    ctx = SimpleNamespace(is_main=False, on_main=lambda f, *a: next(lines))
    cli._interactive(Engine(), tok, None, "thinking", 75, None, None, ctx=ctx)
    texts = [tok.decode(ids) for ids in seen]
    q1 = [{"role": "user", "content": "Q1"}]
    turn1 = q1 + [{"role": "assistant", "reasoning_content": "R1", "content": "A1"}]
    assert texts[0] == encode_messages(q1)
    # turn 2 continues over the ids of turn 1 (its reasoning kept), with the new turn rendered after its context
    assert texts[1] == texts[0] + f"R1{THINK_END}A1{EOS}" + encode_messages([{"role": "user", "content": "Q2"}], context=turn1)
    # the second reply was cut (no end-of-sentence token): turn 3 renders the whole conversation again
    turn2 = turn1 + [{"role": "user", "content": "Q2"}, {"role": "assistant", "reasoning_content": "R2", "content": "A2"}]
    assert texts[2] == encode_messages(turn2 + [{"role": "user", "content": "Q3"}])


def test_cli_rejects_a_message_without_content(tmp_path):
    import subprocess
    import sys

    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "system", "content": "S"}, {"role": "user", "content": None}]))
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", "generate", "--messages", str(messages), "--print-prompt"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "message 1 (role 'user')" in lines[0] and "content" in lines[0]


def test_prefix_cache_holds_the_reply_for_the_next_turn(tiny_model, tmp_path):
    """With a prefix cache, the engine stores the conversation after each reply (prompt and generated
    tokens): the next turn, continued over those ids, finds all of them cached, and the live entry
    (within its TTL) makes that hit exact."""
    import torch

    from dsv41.model.engine import GenerationConfig, Generator
    from dsv41.model.prefix_cache import PrefixCache

    gen = Generator(tiny_model)
    ids = torch.randint(3, 512, (31,), generator=torch.Generator().manual_seed(5)).tolist()
    pc = PrefixCache(tmp_path)
    first = gen.generate(ids, GenerationConfig(max_new_tokens=12, stop_ids=(), prefix_cache=pc))
    follow = ids + first.output_ids + [7, 8, 9]
    config = lambda cache: GenerationConfig(max_new_tokens=4, stop_ids=(), prefix_cache=cache)
    second = gen.generate(follow, config(pc))
    # 42 of the 43 tokens were fed to the model (the last reply token never is): 42 = a multiple of every ratio
    assert second.prefill["cached_tokens"] == 42 and second.prefill["prefix_hit"] == "exact"
    assert second.output_ids == gen.generate(follow, config(None)).output_ids
