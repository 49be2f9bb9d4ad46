"""The V4.1 chat encoding against the official encoder's outputs, and the completion parser.

Golden prompts (tests/fixtures/encoding/golden_prompts.json) were produced by running the official
DeepSeek-V4.1 encoder (see tests/fixtures/encoding/make_golden.py); they are compared character for
character. The parser is checked against the official parser's results on well-formed completions
and fuzzed over generated well-formed, truncated, nested, renamed and corrupted shapes.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from model.encoding import (
    BOS,
    CALLS_OPEN,
    DSML,
    EOS,
    IMAGE_PLACEHOLDER,
    THINK_END,
    assistant_completion,
    attach_tools,
    encode_messages,
    encode_messages_with_images,
    parse_completion,
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
    assert parsed.content == "hi" and parsed.errors == [] and parsed.dsml_dialect == "v4"
    assert any("V4-style" in w for w in parsed.warnings)


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
    assert parsed.reasoning == "cut while reasoning" and parsed.errors == [] and not parsed.finished


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
    parsed = parse_completion(shape["text"] + (EOS if eos else ""), shape["mode"])
    check_invariants(parsed)
    assert parsed.errors == [], parsed.errors
    assert (parsed.reasoning, parsed.content) == (shape["reasoning"], shape["content"])
    assert arguments_of(parsed) == [(name, params) for name, params in shape["calls"]]
    assert parsed.finished == eos
    if shape["calls"]:
        has_v4_tag = re.search(rf"</?{DSML}[a-z]", shape["text"]) is not None  # no space before the name
        assert has_v4_tag == (style == "v4") or style == "mixed"
        assert parsed.dsml_dialect == ("v4" if has_v4_tag else "v4.1")
        assert any("V4-style" in w for w in parsed.warnings) == has_v4_tag


def fuzz_truncations(rng, style):
    shape = make_shape(rng, style)
    text, expected = shape["text"], [(name, params) for name, params in shape["calls"]]
    count = 0
    for cut in range(len(text) + 1):
        parsed = parse_completion(text[:cut], shape["mode"])
        check_invariants(parsed)
        count += 1
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
    inner, _, _ = render(random_calls(rng, 2), rng.choice(["v41", "v4"]), rng)
    outer_calls = [("zqouter", {"zpvalue": "before " + inner + " after"})]
    if rng.random() < 0.5:
        text, _, _ = render(outer_calls, "v41", rng)
    else:
        text, _, _ = render(outer_calls, "v41", rng)
        text = text.replace('name="zqouter">', f'name="zqouter">\n{inner}', 1)
    mode = rng.choice(["thinking", "chat"])
    parsed = parse_completion(("r" + THINK_END if mode == "thinking" else "") + "c\n\n" + text + EOS, mode)
    check_invariants(parsed)
    assert parsed.errors


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
    parsed = parse_completion(text, rng.choice(["thinking", "chat"]), finished=rng.choice([None, True, False]))
    assert DSML not in parsed.content and DSML not in parsed.reasoning
    for call in parsed.tool_calls:
        json.loads(call["function"]["arguments"])


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
