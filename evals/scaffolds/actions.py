"""Action formats: how a scaffold's tool calls are written in a completion, read back, and (for the
oracle) written from a known call.

Every completion first goes through the one V4.1 completion parser, :func:`dsv41.model.completion.parse_completion`,
which splits reasoning from content and reads any DSML tool-call block. Then, by format:

``dsml``      the calls are the DSML block's calls (native tool calling). Any problem the parser reports
              (a truncated or malformed call, markup before ``</think>``, ...) is a format error: a call the
              model meant to make is never half-executed and never shown back as plain text.
``json``      OpenAI-style JSON written in the content: ``{"name": "bash", "arguments": {...}}``, a list of
              such objects, or ``{"tool_calls": [...]}`` in OpenAI's wire shape (``arguments`` may be an
              object or a JSON string), bare or in a fenced ``json`` block.
``xml``       XML tags as OpenHands writes them for models without native tool calls::

                  <function=bash>
                  <parameter=command>
                  ls -la
                  </parameter>
                  </function>
``backticks`` fenced code blocks as mini-swe-agent reads them: a ```` ```bash ```` block is one command; for
              function-calling items (no bash tool) a ```` ```python ```` block holds keyword-argument
              calls, ``get_weather(city="Paris")``, one per line or as a list.

In the text formats, a DSML block in the reply is a format error (the scaffold asked for its own format).
Values read as text (XML) are converted with the tool's JSON schema (:func:`coerce_arguments`).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from dsv41.model.completion import parse_completion
from dsv41.model.encoding import DSML, EOS, assistant_completion

FORMATS = ("dsml", "json", "xml", "backticks")


class FormatError(Exception):
    """The reply's action could not be read; the message is shown to the model."""


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def openai(self) -> dict:
        """The call in OpenAI wire format (``arguments`` a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class Action:
    """What a reply asked for: the calls, the visible content (no markup of native calls) and the
    reasoning, plus leniencies the parser applied."""

    calls: list[ToolCall]
    content: str
    reasoning: str
    warnings: list[str] = field(default_factory=list)
    native_calls: list[dict] = field(default_factory=list)  # the OpenAI-format calls of a DSML reply
    notes: list[str] = field(default_factory=list)  # completion problems that did not stop reading (text formats)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_action(action_format: str, text: str, mode: str, tools: list[dict] | None, *,
                options: dict | None = None) -> Action:
    """Read the calls in ``text`` (a completion: what follows the generation prompt, special tokens
    included). Raises FormatError with a message for the model. Never raises anything else on any text."""
    if action_format not in FORMATS:
        raise ValueError(f"unknown action format {action_format!r} (known: {', '.join(FORMATS)})")
    options = options or {}
    parsed = parse_completion(text, mode)
    if action_format == "dsml":
        if parsed.errors:
            raise FormatError("; ".join(parsed.errors))
        if not parsed.tool_calls and _ends_in_cut_tag(text):
            raise FormatError("the reply was cut off while opening a tool call (length limit?)")
        calls = []
        for number, call in enumerate(parsed.tool_calls):
            name, raw = call["function"]["name"], call["function"]["arguments"]
            try:
                arguments = json.loads(raw)
            except ValueError as e:  # the parser writes JSON; guard anyway
                raise FormatError(f"arguments of tool call {name!r} are not JSON: {e}") from None
            if not isinstance(arguments, dict):
                raise FormatError(f"arguments of tool call {name!r} are not an object")
            if DSML in name or DSML in raw:
                # A stray tag inside an attribute or a value: the call cannot be what the model meant.
                raise FormatError(f"tool call {name!r} holds DSML markup inside its name or arguments")
            calls.append(ToolCall(name, coerce_arguments(arguments, _schema(tools, name)), call.get("id") or f"call_{number}"))
        return Action(calls, parsed.content, parsed.reasoning, parsed.warnings, parsed.tool_calls)

    if parsed.tool_calls or DSML in text:
        raise FormatError("the reply used DSML tool-call markup; this harness only reads the format described "
                          "in the instructions")
    content = parsed.content
    if action_format == "json":
        calls = _read_json_calls(content)
    elif action_format == "xml":
        calls = _read_xml_calls(content)
    else:
        calls = _read_fenced_calls(content, tools, options)
    for number, call in enumerate(calls):
        call.id = f"call_{number}"
        call.arguments = coerce_arguments(call.arguments, _schema(tools, call.name))
    return Action(calls, content, parsed.reasoning, parsed.warnings, notes=parsed.errors)


_CUT_TAGS = tuple({tag[:n] for tag in (f"<{DSML}", f"</{DSML}") for n in range(2, len(tag) + 1)})


def _ends_in_cut_tag(text: str) -> bool:
    """Whether an unfinished completion stops inside the first characters of a DSML tag."""
    return EOS not in text and text.endswith(_CUT_TAGS)


def _schema(tools: list[dict] | None, name: str) -> dict | None:
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            return function.get("parameters")
    return None


_JSON_START = re.compile(r"[\[{]")
_CALL_LIKE = re.compile(r'[\[{]\s*(\{\s*)?"(name|tool_calls|function)"')


def _calls_from_json(value: Any) -> list[ToolCall] | None:
    """Calls in a decoded JSON value, or None if it is not call-shaped."""
    if isinstance(value, list):
        calls = [_calls_from_json(item) for item in value]
        if not value or any(c is None or len(c) != 1 for c in calls):
            return None
        return [c[0] for c in calls]
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("tool_calls"), list):
        return _calls_from_json(value["tool_calls"])
    if isinstance(value.get("function"), dict):
        return _calls_from_json(value["function"])
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise FormatError(f"the arguments string of call {name!r} is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise FormatError(f"the arguments of call {name!r} must be a JSON object")
    return [ToolCall(name, arguments)]


def _read_json_calls(content: str) -> list[ToolCall]:
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    problems: list[str] = []
    position = 0
    while True:
        match = _JSON_START.search(content, position)
        if match is None:
            break
        start = match.start()
        try:
            value, end = decoder.raw_decode(content, start)
        except ValueError as e:
            if _CALL_LIKE.match(content, start):
                problems.append(f"a tool call is not valid JSON ({e})")
            position = start + 1
            continue
        found = _calls_from_json(value)
        if found is None:
            position = start + 1
            continue
        calls += found
        position = end
    if not calls and problems:
        raise FormatError(problems[0])
    return calls


_XML_FUNCTION = re.compile(r"<function=([^>\s]*)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]*)>")


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _read_xml_calls(content: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    position = 0
    while True:
        opening = _XML_FUNCTION.search(content, position)
        if opening is None:
            break
        name = opening.group(1)
        if not name:
            raise FormatError("<function=...> needs a function name")
        closing = content.find("</function>", opening.end())
        if closing < 0:
            raise FormatError(f"<function={name}> is not closed with </function>")
        body = content[opening.end():closing]
        nested = _XML_FUNCTION.search(body)
        if nested is not None:
            raise FormatError(f"<function={name}> is not closed before <function={nested.group(1)}>")
        arguments: dict[str, Any] = {}
        cursor = 0
        while True:
            parameter = _XML_PARAMETER.search(body, cursor)
            if parameter is None:
                break
            key = parameter.group(1)
            if not key:
                raise FormatError(f"a <parameter=...> of <function={name}> has no name")
            end = body.find("</parameter>", parameter.end())
            if end < 0:
                raise FormatError(f"<parameter={key}> of <function={name}> is not closed with </parameter>")
            if key in arguments:
                raise FormatError(f"<function={name}> gives parameter {key!r} twice")
            arguments[key] = _strip_one_newline(body[parameter.end():end])
            cursor = end + len("</parameter>")
        calls.append(ToolCall(name, arguments))
        position = closing + len("</function>")
    if not calls and "</function>" in content:
        raise FormatError("</function> without a <function=NAME> opening tag")
    return calls


_FENCE = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)\n?```", re.DOTALL)


def _read_fenced_calls(content: str, tools: list[dict] | None, options: dict) -> list[ToolCall]:
    command_tag = options.get("fence_tag", "bash")
    call_tag = options.get("call_fence_tag", "python")
    tool_names = {t.get("function", t).get("name") for t in tools or []}
    blocks = _FENCE.findall(content)
    if "bash" in tool_names:
        commands = [body for tag, body in blocks if tag == command_tag]
        if not commands and content.count("```") % 2 == 1:
            raise FormatError(f"a ```{command_tag} block is not closed with ```")
        return [ToolCall("bash", {"command": body}) for body in commands]
    calls: list[ToolCall] = []
    for tag, body in blocks:
        if tag == call_tag:
            calls += _read_python_calls(body)
    return calls


def _call_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _call_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _read_python_calls(source: str) -> list[ToolCall]:
    try:
        tree = ast.parse(source, mode="exec")
    except SyntaxError as e:
        raise FormatError(f"the ```python block is not valid Python call syntax (line {e.lineno}: {e.msg})") from None
    nodes: list[ast.expr] = []
    for statement in tree.body:
        if not isinstance(statement, ast.Expr):
            raise FormatError("the ```python block may only hold function calls")
        value = statement.value
        nodes += value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    calls = []
    for node in nodes:
        name = _call_name(node.func) if isinstance(node, ast.Call) else None
        if name is None:
            raise FormatError("the ```python block may only hold calls like name(key=value)")
        if node.args:
            raise FormatError(f"call {name}(...) must pass its arguments by keyword")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise FormatError(f"call {name}(...) may not use **kwargs")
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise FormatError(f"argument {keyword.arg!r} of {name}(...) is not a literal value") from None
        calls.append(ToolCall(name, arguments))
    return calls


# ---------------------------------------------------------------------------------------------
# Types from the schema
# ---------------------------------------------------------------------------------------------

_JSON_TYPES = {"integer", "number", "boolean", "array", "object", "null"}


def coerce_arguments(arguments: dict, schema: dict | None) -> dict:
    """Values written as text converted to the JSON type the tool's schema declares (``"3"`` -> 3 for an
    integer, ``"true"`` -> True, ``"[1, 2]"`` -> [1, 2]); anything that does not convert is kept as is."""
    properties = (schema or {}).get("properties") or {}
    out = {}
    for key, value in arguments.items():
        declared = (properties.get(key) or {}).get("type")
        types = set(declared) if isinstance(declared, list) else {declared}
        if isinstance(value, str) and types & _JSON_TYPES and "string" not in types:
            try:
                converted = json.loads(value)
            except ValueError:
                converted = value
            if _has_type(converted, types):
                value = converted
        elif isinstance(value, int) and not isinstance(value, bool) and "number" in types:
            value = value  # an int is a valid JSON number
        out[key] = value
    return out


def _has_type(value: Any, types: set) -> bool:
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    return any(checks[t](value) for t in types if t in checks)


# ---------------------------------------------------------------------------------------------
# Writing (what the oracle replays)
# ---------------------------------------------------------------------------------------------


def write_action(action_format: str, calls: list[ToolCall], mode: str, *, thought: str = "",
                 answer: str | None = None, options: dict | None = None) -> str:
    """The completion a model following the scaffold would write to make ``calls`` (or, with no calls,
    to give ``answer``): reasoning ``thought`` then the action, ending with end-of-sentence.
    Raises ValueError for a call this format cannot write unambiguously."""
    options = options or {}
    if action_format == "dsml":
        message = {"role": "assistant", "content": answer or "", "reasoning_content": thought}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return assistant_completion(message, mode)
    if not calls:
        body = answer or ""
    elif action_format == "json":
        value = [{"name": c.name, "arguments": c.arguments} for c in calls]
        body = "```json\n" + json.dumps(value[0] if len(value) == 1 else value, ensure_ascii=False) + "\n```"
    elif action_format == "xml":
        body = "\n".join(_write_xml_call(c) for c in calls)
    elif action_format == "backticks":
        body = "\n\n".join(_write_fenced_calls(calls, options))
    else:
        raise ValueError(f"unknown action format {action_format!r}")
    if thought and calls and action_format == "backticks":
        body = f"THOUGHT: {thought}\n\n{body}"
    return assistant_completion({"role": "assistant", "content": body, "reasoning_content": thought}, mode)


def _write_xml_call(call: ToolCall) -> str:
    lines = [f"<function={call.name}>"]
    for key, value in call.arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if "</parameter>" in text or "</function>" in text or "<function=" in text or "<parameter=" in text:
            raise ValueError(f"parameter {key!r} holds XML tags of the format itself; it cannot be written")
        lines.append(f"<parameter={key}>\n{text}\n</parameter>")
    lines.append("</function>")
    return "\n".join(lines)


def _write_fenced_calls(calls: list[ToolCall], options: dict) -> list[str]:
    blocks, python_calls = [], []
    for call in calls:
        if call.name == "bash" and set(call.arguments) == {"command"}:
            command = call.arguments["command"]
            if "```" in command:
                raise ValueError("a command containing ``` cannot be written in a fenced block")
            blocks.append(f"```{options.get('fence_tag', 'bash')}\n{command}\n```")
        else:
            arguments = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
            python_calls.append(f"{call.name}({arguments})")
    if python_calls:
        blocks.append(f"```{options.get('call_fence_tag', 'python')}\n" + "\n".join(python_calls) + "\n```")
    return blocks
