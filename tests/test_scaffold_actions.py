"""Action formats of the scaffolds: reading, writing (the oracle's side), schema types, BFCL-style call
matching, and a fuzz of the DSML action parser (which is model.completion.parse_completion underneath)."""

from __future__ import annotations

import json
import random

import pytest

from dsv41.evals.scaffolds.actions import FormatError, ToolCall, coerce_arguments, read_action, write_action
from dsv41.evals.scaffolds.scaffold import builtin_scaffold_names, load_scaffold
from dsv41.evals.scaffolds.tasks import FunctionCallingItem, check_calls, values_match
from dsv41.model.encoding import DSML, EOS, THINK_END, render_tool_calls

BASH = load_scaffold("dsml").tools
FORMATS = {"dsml": {}, "json": {}, "xml": {}, "backticks": {"fence_tag": "bash", "call_fence_tag": "python"}}

# Strings that stress each format: quotes, braces, angle brackets, backslashes, newlines, unicode.
TRICKY = [
    "ls -la", "echo \"hi\" > out.txt", "printf '%s\\n' a b", "cat <<'EOF' > f\n{\"a\": [1, 2]}\nEOF",
    "awk '{ s += $1 } END { print s }' nums.txt", "grep -E '<tag>|</tag>' x.html", "echo $HOME && cd /tmp; pwd",
    "python3 -c 'print(\"naïve café 日本語 🚀\")'", "sed -i 's/\\bfoo\\b/bar/g' *.py", "   leading and trailing   ",
    "tab\tseparated", "line1\n\nline3", "echo '｜ fullwidth bar ｜'", "echo 'a < b && c > d'",
]


def _random_value(rng: random.Random):
    kind = rng.randrange(7)
    if kind == 0:
        return rng.choice(TRICKY)
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.choice([0.5, -2.25, 1e-3, 3.0])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return [rng.randint(0, 9), rng.choice(TRICKY[:4]), None]
    if kind == 5:
        return {"k": rng.choice(TRICKY[:6]), "n": rng.randint(0, 5)}
    return "".join(rng.choice("abcxyzé日🙂 <>\"'{}[]\\\n") for _ in range(rng.randint(1, 20)))


# ---------------------------------------------------------------------------------------------
# Round trips: what the oracle writes, every parser reads back exactly
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("action_format", list(FORMATS))
@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_bash_calls_round_trip(action_format, mode):
    for command in TRICKY:
        text = write_action(action_format, [ToolCall("bash", {"command": command}, "call_0")], mode,
                            thought="Let me look.", options=FORMATS[action_format])
        action = read_action(action_format, text, mode, BASH, options=FORMATS[action_format])
        if action_format == "xml":  # values are read as written between the tags, minus one newline each side
            assert [c.arguments for c in action.calls] == [{"command": command}]
        assert [(c.name, c.arguments) for c in action.calls] == [("bash", {"command": command})], text


@pytest.mark.parametrize("action_format", list(FORMATS))
def test_function_calls_round_trip_with_types(action_format):
    rng = random.Random(action_format)
    for _ in range(60):
        names = [rng.choice(["get_weather", "book_hotel", "calc.add"]) for _ in range(rng.randint(1, 3))]
        calls, tools = [], []
        for number, name in enumerate(names):
            values = [_random_value(rng) for _ in range(rng.randint(0, 4))]
            arguments = {f"p{i}_{_json_type(v)}": v for i, v in enumerate(values)}  # one type per name
            if action_format == "xml" and any("</parameter>" in json.dumps(v) for v in arguments.values()):
                continue
            calls.append(ToolCall(name, arguments, f"call_{number}"))
            properties = {k: {"type": _json_type(v)} for k, v in arguments.items()}
            tools.append({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}})
        if not calls:
            continue
        # one schema per name (the last wins; give every call of a name the union of its properties)
        merged: dict = {}
        for tool in tools:
            f = tool["function"]
            merged.setdefault(f["name"], {"type": "object", "properties": {}})["properties"].update(f["parameters"]["properties"])
        tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in merged.items()]
        mode = rng.choice(["thinking", "chat"])
        text = write_action(action_format, calls, mode, thought="t", options=FORMATS[action_format])
        action = read_action(action_format, text, mode, tools, options=FORMATS[action_format])
        got = [(c.name, c.arguments) for c in action.calls]
        assert got == [(c.name, c.arguments) for c in calls], text


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def test_writers_refuse_what_their_format_cannot_hold():
    with pytest.raises(ValueError):
        write_action("backticks", [ToolCall("bash", {"command": "echo ```"})], "chat")
    with pytest.raises(ValueError):
        write_action("xml", [ToolCall("bash", {"command": "echo </parameter>"})], "chat")


# ---------------------------------------------------------------------------------------------
# Each format's reading, and its format errors
# ---------------------------------------------------------------------------------------------


def _completion(content: str, reasoning: str = "thinking about it", mode: str = "thinking") -> str:
    return (f"{reasoning}{THINK_END}" if mode == "thinking" else "") + content + EOS


def test_json_reads_the_shapes_models_write():
    shapes = [
        '{"name": "bash", "arguments": {"command": "ls"}}',
        'I will list the files.\n```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```',
        '{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}',  # OpenAI wire form: arguments as a string
        '{"tool_calls": [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}}]}',
        '[{"name": "bash", "arguments": {"command": "ls"}}]',
        'Config {"a": 1} is not a call. {"name": "bash", "parameters": {"command": "ls"}}',
    ]
    for content in shapes:
        action = read_action("json", _completion(content), "thinking", BASH)
        assert [(c.name, c.arguments) for c in action.calls] == [("bash", {"command": "ls"})], content


@pytest.mark.parametrize("content, message", [
    ('```json\n{"name": "bash", "arguments": {"command": "ls"\n```', "not valid JSON"),
    ('{"name": "bash", "arguments": "{not json}"}', "not valid JSON"),
    ('{"name": "bash", "arguments": [1, 2]}', "must be a JSON object"),
])
def test_json_format_errors(content, message):
    with pytest.raises(FormatError, match=message):
        read_action("json", _completion(content), "thinking", BASH)


def test_xml_reads_and_reports():
    text = _completion("Listing.\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>")
    assert [(c.name, c.arguments) for c in read_action("xml", text, "thinking", BASH).calls] == [("bash", {"command": "ls -la"})]
    for content, message in [
        ("<function=bash>\n<parameter=command>\nls\n</parameter>\n", "not closed with </function>"),
        ("<function=bash>\n<parameter=command>\nls\n</function>", "not closed with </parameter>"),
        ("<function=bash><parameter=command>a</parameter><parameter=command>b</parameter></function>", "twice"),
        ("<function=bash><function=bash></function>", "not closed before"),
        ("oops</function>", "without a <function=NAME>"),
    ]:
        with pytest.raises(FormatError, match=message):
            read_action("xml", _completion(content), "thinking", BASH)


def test_backticks_reads_bash_blocks_and_python_calls():
    opts = FORMATS["backticks"]
    text = _completion("THOUGHT: list\n\n```bash\nls -la\n```")
    assert [c.arguments for c in read_action("backticks", text, "thinking", BASH, options=opts).calls] == [{"command": "ls -la"}]
    two = _completion("```bash\nls\n```\nand\n```bash\npwd\n```")
    assert len(read_action("backticks", two, "thinking", BASH, options=opts).calls) == 2  # the loop rejects >1
    assert read_action("backticks", _completion("```python\nprint(1)\n```"), "thinking", BASH, options=opts).calls == []
    with pytest.raises(FormatError, match="not closed"):
        read_action("backticks", _completion("```bash\nls -la"), "thinking", BASH, options=opts)

    fn = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    calls = read_action("backticks", _completion("```python\nf(a=1, b='x')\ng.h(c=[1, {'d': None}])\n```"), "thinking", fn,
                        options=opts).calls
    assert [(c.name, c.arguments) for c in calls] == [("f", {"a": 1, "b": "x"}), ("g.h", {"c": [1, {"d": None}]})]
    listed = read_action("backticks", _completion("```python\n[f(a=1), f(a=2)]\n```"), "thinking", fn, options=opts).calls
    assert [c.arguments for c in listed] == [{"a": 1}, {"a": 2}]
    for body, message in [("f(1)", "by keyword"), ("f(a=x)", "not a literal"), ("x = f(a=1)", "only hold"),
                          ("f(a=", "not valid Python"), ("f(**d)", "kwargs")]:
        with pytest.raises(FormatError, match=message):
            read_action("backticks", _completion(f"```python\n{body}\n```"), "thinking", fn, options=opts)


def test_text_formats_reject_dsml_calls():
    dsml = _completion("\n\n" + render_tool_calls([{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]))
    for action_format in ("json", "xml", "backticks"):
        with pytest.raises(FormatError, match="DSML"):
            read_action(action_format, dsml, "thinking", BASH, options=FORMATS[action_format])


def test_only_the_content_is_read_not_the_reasoning():
    text = "Maybe ```bash\nrm -rf /\n``` no.</think>```bash\nls\n```" + EOS
    calls = read_action("backticks", text, "thinking", BASH, options=FORMATS["backticks"]).calls
    assert [c.arguments for c in calls] == [{"command": "ls"}]


def test_coerce_arguments_follows_the_schema():
    schema = {"properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
                             "l": {"type": "array"}, "o": {"type": "object"}, "s": {"type": "string"},
                             "u": {"type": ["integer", "null"]}}}
    raw = {"n": "3", "x": "2.5", "b": "true", "l": "[1, 2]", "o": '{"a": 1}', "s": "42", "u": "null", "extra": "7"}
    assert coerce_arguments(raw, schema) == {"n": 3, "x": 2.5, "b": True, "l": [1, 2], "o": {"a": 1}, "s": "42",
                                             "u": None, "extra": "7"}
    assert coerce_arguments({"n": "three", "b": "yes", "l": "{}"}, schema) == {"n": "three", "b": "yes", "l": "{}"}


# ---------------------------------------------------------------------------------------------
# BFCL-style matching
# ---------------------------------------------------------------------------------------------


def _item(truth, functions=None):
    functions = functions or [{"name": "f", "parameters": {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}}},
                              {"name": "g", "parameters": {"type": "object", "properties": {"a": {}}}}]
    return FunctionCallingItem("t", "simple", "q", functions, truth)


def test_check_calls():
    item = _item([{"f": {"a": ["Paris", "Paris, France"], "b": [3], "c": ["", "x"]}}])
    assert check_calls([("f", {"a": "paris", "b": 3})], item)[0]
    assert check_calls([("f", {"a": "Paris, France", "b": 3.0, "c": "X"})], item)[0]
    assert not check_calls([("f", {"a": "Rome", "b": 3})], item)[0]
    assert not check_calls([("f", {"a": "Paris"})], item)[0]  # b is required
    assert not check_calls([("f", {"a": "Paris", "b": 3, "zzz": 1})], item)[0]  # unknown argument
    assert not check_calls([("g", {"a": "Paris"})], item)[0]
    assert not check_calls([], item)[0]
    assert not check_calls([("f", {"a": "Paris", "b": 3})] * 2, item)[0]
    assert not check_calls([("f", {"a": "Paris", "b": "3"})], item)[0]  # a string is not the number 3

    parallel = _item([{"f": {"a": ["x"]}}, {"f": {"a": ["y"]}}])
    assert check_calls([("f", {"a": "y"}), ("f", {"a": "x"})], parallel)[0]
    assert not check_calls([("f", {"a": "x"}), ("f", {"a": "x"})], parallel)[0]
    irrelevant = _item([])
    assert check_calls([], irrelevant)[0] and not check_calls([("f", {})], irrelevant)[0]


def test_values_match_types():
    assert values_match(3, 3.0) and values_match(3.0, 3) and not values_match(3.5, 3)
    assert not values_match(True, 1) and not values_match(1, True) and values_match(False, False)
    assert values_match(["A", 1], ["a", 1]) and not values_match(["a"], ["a", "b"])
    assert values_match({"on": "07.00 "}, {"on": "0700"}) and not values_match({"on": "07:00"}, {"on": "0700"}) and not values_match({"on": "7"}, {"off": "7"})


# ---------------------------------------------------------------------------------------------
# DSML action parser fuzz
# ---------------------------------------------------------------------------------------------

NAMES = ["bash", "get_weather", "search", "日本語ツール", "tool-ü", "a.b"]
UNICODE_BITS = ["日本語", "🚀🔥", "naïve", "שלום", "\u200b", "e\u0301", "｜", "＜tag＞", "\u3000", "Ω≈ç√"]


def _marker(rng: random.Random) -> str:
    return f"MK{rng.getrandbits(40):010x}"


def _intended_calls(rng: random.Random) -> list[dict]:
    """Calls whose every value holds a unique marker, so a leaked fragment can be spotted."""
    calls = []
    for _ in range(rng.randint(1, 3)):
        arguments = {}
        for i in range(rng.randint(1, 3)):
            marker = _marker(rng)
            kind = rng.randrange(4)
            if kind == 0:
                value = f"{rng.choice(TRICKY)} {marker} {rng.choice(UNICODE_BITS)}"
            elif kind == 1:
                value = {"m": marker, "n": rng.randint(0, 99), "u": rng.choice(UNICODE_BITS)}
            elif kind == 2:
                value = [marker, rng.randint(0, 9)]
            else:
                value = f"{marker}\n{rng.choice(UNICODE_BITS)}\n"
            arguments[f"arg{i}_{rng.choice(['x', 'ü', 'n'])}"] = value
        calls.append({"type": "function", "function": {"name": rng.choice(NAMES), "arguments": arguments}})
    return calls


def _markers(calls: list[dict]) -> list[str]:
    return [m for c in calls for m in __import__("re").findall(r"MK[0-9a-f]{10}", json.dumps(c["function"]["arguments"], ensure_ascii=False))]


def _v4_style(block: str) -> str:
    block = block.replace(f"<{DSML} calls>", f"<{DSML}tool_calls>").replace(f"</{DSML} calls>", f"</{DSML}tool_calls>")
    return block.replace(f"{DSML} invoke", f"{DSML}invoke").replace(f"{DSML} parameter", f"{DSML}parameter")


def _fuzz_case(rng: random.Random, shape: str):
    """(completion, mode, intended calls, whether an exact read is required)."""
    calls = _intended_calls(rng)
    block = render_tool_calls(calls)
    mode = rng.choice(["thinking", "chat"])
    reasoning = rng.choice(["", "Let me think. ", f"I need {rng.choice(UNICODE_BITS)} first.\n"]) if mode == "thinking" else ""
    head = rng.choice(["", "Running it now.", f"Voilà {rng.choice(UNICODE_BITS)}"])
    exact = True
    if shape == "valid":
        pass
    elif shape == "renamed-v4":
        block = _v4_style(block) if rng.random() < 0.7 else _mix_styles(rng, block)
    elif shape == "truncated":
        body = (f"{reasoning}{THINK_END}" if mode == "thinking" else "") + head + "\n\n" + block
        cut = rng.randint(len(body) - len(block), len(body))
        return body[:cut], mode, calls, False
    elif shape == "stray":
        stray = rng.choice([f"</{DSML} invoke>", f"<{DSML} foo>", DSML, f"<{DSML} parameter name=\"z\" string=\"true\">",
                            f"</{DSML} calls>", f"<{DSML} calls>", f"<{DSML}", "</｜DSML｜"])
        where = rng.randint(0, len(block))
        block = block[:where] + stray + block[where:]
        exact = False
    elif shape == "interleaved":
        choice = rng.randrange(3)
        if mode == "thinking" and choice == 0:  # the call written inside the reasoning
            text = reasoning + "\n\n" + block + THINK_END + head + EOS
            return text, mode, calls, False
        if mode == "thinking" and choice == 1:  # no </think> at all
            return reasoning + head + "\n\n" + block + EOS, mode, calls, False
        head = head + f" (I considered {rng.choice(['invoke', 'calls', 'parameter'])} tags) " + rng.choice(UNICODE_BITS)
    elif shape == "unicode":
        head = "".join(rng.choice(UNICODE_BITS) for _ in range(rng.randint(1, 6)))
    text = (f"{reasoning}{THINK_END}" if mode == "thinking" else "") + head + "\n\n" + block + EOS
    return text, mode, calls, exact


def _mix_styles(rng: random.Random, block: str) -> str:
    lines = block.split("\n")
    return "\n".join(_v4_style(line) if rng.random() < 0.5 else line for line in lines)


def _expected(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_dsml_action_parser_fuzz():
    """>= 1,000 completions of many shapes through the dsml scaffold's reader: it never raises anything
    but FormatError; a well-formed call (V4.1 or V4 tags, any unicode around) is read exactly; anything
    else is either read exactly or rejected as a whole (never a silent subset of the calls), and no DSML
    markup or fragment of an intended call ever shows up in the content or the reasoning."""
    rng = random.Random(20260411)
    shapes = ["valid", "renamed-v4", "truncated", "stray", "interleaved", "unicode"]
    counts = {s: 0 for s in shapes}
    outcomes = {"exact": 0, "format_error": 0, "no_call": 0}
    for _ in range(1500):
        shape = rng.choice(shapes)
        counts[shape] += 1
        text, mode, calls, exact = _fuzz_case(rng, shape)
        try:
            action = read_action("dsml", text, mode, None)
        except FormatError as e:
            assert str(e), "a format error needs a message for the model"
            assert not exact, f"a well-formed {shape} completion was rejected: {e}\n{text!r}"
            outcomes["format_error"] += 1
            continue
        got = [(c.name, c.arguments) for c in action.calls]
        visible = action.content + action.reasoning
        assert DSML not in visible and "<｜DS" not in visible and "</｜DS" not in visible, (shape, text, visible)
        for marker in _markers(calls):
            assert marker not in visible, f"a call's value leaked into the text ({shape}): {text!r}"
        if got:
            assert got == _expected(calls), f"{shape}: read {got} from {text!r}"
            outcomes["exact"] += 1
        else:
            # Nothing read and nothing reported: only when the completion holds no DSML markup at all
            # (a truncation before the calls block began).
            assert shape == "truncated" and "｜DSML" not in text and not text.endswith(("<｜", "</｜")), (shape, text)
            outcomes["no_call"] += 1
    assert sum(counts.values()) >= 1000 and min(counts.values()) >= 150, counts
    assert outcomes["exact"] > 500 and outcomes["format_error"] > 150, outcomes


def test_dsml_reader_rejects_partial_blocks_as_a_whole():
    calls = [{"type": "function", "function": {"name": "bash", "arguments": {"command": "echo one"}}},
             {"type": "function", "function": {"name": "bash", "arguments": {"command": "echo two"}}}]
    block = render_tool_calls(calls)
    cut = block.index("echo two") + 4
    with pytest.raises(FormatError, match="incomplete"):
        read_action("dsml", f"ok{THINK_END}\n\n{block[:cut]}", "thinking", BASH)
    complete = read_action("dsml", f"ok{THINK_END}\n\n{block}{EOS}", "thinking", BASH)
    assert [c.arguments["command"] for c in complete.calls] == ["echo one", "echo two"]


@pytest.mark.parametrize("name", builtin_scaffold_names())
def test_builtin_scaffolds_load_and_render(name):
    scaffold = load_scaffold(name)
    assert scaffold.name == name
    prompt = scaffold.system_prompt()
    assert scaffold.submit_sentinel in prompt and "{{" not in prompt
    if scaffold.action_format in ("json", "xml"):
        assert '"name": "bash"' in prompt  # the tool schema is shown in the prompt
    observation = scaffold.observation(None, "x" * 30_000, "killed")
    assert len(observation) < 11_000 and "characters elided" in observation and "killed" in observation
    assert "boom" in scaffold.format_error("boom")
