"""The DeepSeek-V4.1 completion parser: completion text -> reasoning, content, DSML tool calls.

The inverse of the chat encoding (``model/encoding.py``, which draws the DSML tool-call layout and
defines the special tokens and tag names imported here; it imports nothing from this module).
:func:`parse_completion` accepts everything the official parser accepts and, unlike it, never raises.
No special token or DSML fragment reaches the content or the reasoning, and every deviation from the
official grammar is reported: in ``errors`` what the official parser rejects (or accepts only to
return a broken call), in ``warnings`` what it accepts (docs/generation.md has the table). V4's DSML
tags (``tool_calls``, no space before the tag name) are read as an accepted dialect, with a warning.
:class:`CompletionStream` is its incremental form for streaming: fed one token id at a time, it emits
reasoning/content deltas and tool calls as soon as they are certain, exactly consistent with
:func:`parse_completion` of the whole text.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from dsv41.model.encoding import (
    BOS,
    CALLS_OPEN,
    CALLS_TAG,
    DSML,
    EOS,
    INVOKE_TAG,
    PARAMETER_TAG,
    THINK_END,
    THINK_START,
    _check_mode,
    _short,
    to_json,
)


@dataclass
class ParsedCompletion:
    """A completion split into its parts.

    reasoning: text before ``</think>`` (thinking mode); content: the answer text, free of DSML
    markup; tool_calls: OpenAI-format calls (``id`` is ``call_{n}``, ``arguments`` a JSON string
    laid out as the official parser lays it out); errors: one line per format problem (a call that
    could not be parsed is named here, never silently dropped): each deviation from the official grammar
    that the official parser rejects; warnings: each deviation it accepts (a special token removed, an
    empty calls block, markup inside a value, ...); finished: the end-of-sentence token was seen;
    finish_reason: "stop" when finished, else "length"; dsml_dialect: "v4.1", "v4" or None.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = "length"
    dsml_dialect: str | None = None

    def to_message(self) -> dict:
        """The assistant message to append to the conversation for the next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            message["tool_calls"] = copy.deepcopy(self.tool_calls)
        return message


# ``<｜DSML｜ invoke`` / ``</｜DSML｜tool_calls`` ...: slash, optional space, tag name.
_TAG_HEAD = re.compile(rf"<(/?){DSML}(\s*)([A-Za-z_]*)")
_TAG_ATTRIBUTES = re.compile(r'((?:\s+[A-Za-z_][\w-]*="[^"]*")*)\s*>')
_ATTRIBUTE = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')
_PARAMETER_CLOSE = re.compile(rf"</{DSML}\s*parameter\s*>")
_BLOCK_NAMES = {"calls": "calls", "tool_calls": "calls", "invoke": "invoke", "parameter": "parameter"}
_DSML_PREFIXES = tuple(f"<{DSML}"[:n] for n in range(2, len(DSML) + 1)) + tuple(f"</{DSML}"[:n] for n in range(3, len(DSML) + 2))


# The tags exactly as the official V4.1 encoder writes them (and its parser requires them).
_OFFICIAL_FORMS = {
    ("calls", False): re.compile(rf"<{DSML}{CALLS_TAG}>"),
    ("calls", True): re.compile(rf"</{DSML}{CALLS_TAG}>"),
    ("invoke", False): re.compile(rf'<{DSML}{INVOKE_TAG} name="[^"]*">'),
    ("invoke", True): re.compile(rf"</{DSML}{INVOKE_TAG}>"),
    ("parameter", False): re.compile(rf'<{DSML}{PARAMETER_TAG} name="[^"]*" string="(?:true|false)">'),
    ("parameter", True): re.compile(rf"</{DSML}{PARAMETER_TAG}>"),
}
# An invoke tag with other whitespace before the name: the official parser reads it (a warning).
_INVOKE_OTHER_SPACE = re.compile(rf'<{DSML}{INVOKE_TAG}\s*name="[^"]*">')
# An invoke tag with attributes after the name: the official parser reads them into the name.
_INVOKE_EXTRA_ATTRIBUTES = re.compile(rf'<{DSML}{INVOKE_TAG}\s*name="[^"]*"(?:\s+[A-Za-z_][\w-]*="[^"]*")+>')


@dataclass
class _Tag:
    start: int
    end: int  # index after the tag (after '>' when complete)
    kind: str  # calls | invoke | parameter | unknown | bare (a DSML token without '<') | cut (truncated)
    closing: bool = False
    attributes: dict = field(default_factory=dict)
    v4_style: bool = False
    text: str = ""


def _next_marker(text: str, start: int) -> int:
    """Start of the next DSML markup at or after ``start`` (the '<' or '</' before the DSML token), or -1."""
    position = text.find(DSML, start)
    if position < 0:
        return -1
    if text.startswith("</", position - 2) and position - 2 >= start:
        return position - 2
    if position - 1 >= start and text[position - 1] == "<":
        return position - 1
    return position


def _read_tag(text: str, start: int) -> _Tag:
    """The DSML tag starting at ``start`` (which must be a marker position)."""
    head = _TAG_HEAD.match(text, start)
    if head is None:  # the token alone, without '<'
        return _Tag(start, start + len(DSML), "bare", text=DSML)
    closing, space, name = head.group(1) == "/", head.group(2), head.group(3)
    kind = _BLOCK_NAMES.get(name, "unknown")
    v4_style = kind != "unknown" and (space == "" or name == "tool_calls")
    rest = _TAG_ATTRIBUTES.match(text, head.end())
    if rest is not None:
        attributes = dict(_ATTRIBUTE.findall(rest.group(1)))
        return _Tag(start, rest.end(), kind, closing, attributes, v4_style, text[start : rest.end()])
    # No well-formed end: truncated if nothing follows but the tag's own beginnings, else malformed.
    following = _next_marker(text, head.end())
    limit = len(text) if following < 0 else following
    close = text.find(">", head.end(), limit)
    if close < 0 and following < 0:
        return _Tag(start, len(text), "cut", closing, {}, v4_style, text[start:])
    end = close + 1 if close >= 0 else limit
    return _Tag(start, end, "unknown", closing, {}, v4_style, text[start:end])


class _DsmlReader:
    """Reads the DSML region(s) of the text after the reasoning; collects calls and problems."""

    def __init__(self, text: str, finished: bool):
        self.text = text
        self.finished = finished
        self.calls: list[dict] = []
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.seen_v41 = False
        self.seen_v4 = False
        self.blocks = 0  # calls blocks opened (a bare invoke opens one implicitly)
        self.closed_block = False  # a calls block was read to its closing tag
        self.cut = False  # the text ended inside markup (reported)
        self.start_blank = False  # position 0 counts as preceded by a blank line

    def note_style(self, tag: _Tag) -> None:
        if tag.kind in ("calls", "invoke", "parameter"):
            if tag.v4_style:
                self.seen_v4 = True
                return
            self.seen_v41 = True
            form = _OFFICIAL_FORMS[(tag.kind, tag.closing)]
            if form.fullmatch(tag.text):
                return
            if tag.kind == "invoke" and not tag.closing and _INVOKE_OTHER_SPACE.fullmatch(tag.text):
                self.warnings.append(f"a tool call's tag with other whitespace before its name: {_short(tag.text)}")
            elif tag.kind == "invoke" and not tag.closing and _INVOKE_EXTRA_ATTRIBUTES.fullmatch(tag.text):
                # accepted officially, but with the other attributes read into the call's name
                self.errors.append(f"attributes after the name of a tool call ignored: {_short(tag.text)}")
            elif tag.kind == "parameter" and not tag.closing and tag.attributes.get("string") not in ("true", "false"):
                pass  # read_parameter names the missing or odd string attribute
            elif tag.kind == "invoke" and not tag.closing and "name" not in tag.attributes:
                pass  # read_invoke names the call without a name
            else:
                shown = form.pattern.replace('"[^"]*"', '"..."').replace("(?:true|false)", "true|false")
                self.errors.append(f"DSML tag not in the official form {shown}: {_short(tag.text)}")

    def separator(self, start: int, where: str, after_invoke_tag: bool = False) -> int:
        """Skips whitespace between two DSML tags. The official layout is one newline; after an invoke's
        opening tag the official parser also accepts a blank line, which the encoder writes before the
        closing tag of a call without parameters (a blank line before a parameter is a warning)."""
        position = self.skip_space(start)
        if position >= len(self.text) or _next_marker(self.text, position) != position:
            return position
        found = self.text[start:position]
        if after_invoke_tag and found == "\n\n":
            if not self.text.startswith(f"</{DSML}", position):
                self.warnings.append(f"a blank line {where}")
        elif after_invoke_tag and found == "\n" and self.text.startswith(f"</{DSML}", position):
            self.warnings.append(f"one newline {where} (the encoder writes a blank line in a call without parameters)")
        elif found != "\n":
            self.errors.append(f"{_short(found) if found else 'nothing'} instead of one newline {where}")
        return position

    def skip_space(self, position: int) -> int:
        while position < len(self.text) and self.text[position].isspace():
            position += 1
        return position

    def truncated(self, what: str) -> None:
        self.cut = True
        reason = "the completion ended" if not self.finished else "the end-of-sentence token came"
        self.errors.append(f"{what} is incomplete: {reason} before it was closed")

    def stray(self, tag: _Tag, where: str) -> None:
        self.errors.append(f"stray DSML markup {where} dropped: {_short(tag.text)}")

    # -- the text after the reasoning ---------------------------------------------------------

    def read(self) -> str:
        """Returns the content: the text outside DSML markup."""
        text, content, cursor = self.text, [], 0
        after_calls = False  # a calls block (or a bare invoke) has been read
        while cursor < len(text):
            marker = _next_marker(text, cursor)
            before = text[cursor:] if marker < 0 else text[cursor:marker]
            if not after_calls:
                content.append(before)
            elif before.strip():
                # Officially nothing but the end-of-sentence token may follow the calls block.
                self.errors.append(f"text after the tool calls kept as content: {_short(before.strip())}")
                content.append(("\n\n" if "".join(content).strip() else "") + before.strip())
            elif before:
                self.errors.append(f"{_short(before)} after the tool-call block (officially the end-of-sentence token follows it directly)")
            if marker < 0:
                break
            tag = _read_tag(text, marker)
            self.note_style(tag)
            if tag.kind in ("calls", "invoke") and not tag.closing:
                if self.blocks:
                    self.errors.append("a second tool-call block (officially one block ends the reply); its calls were read too")
                elif not (text.endswith("\n\n", 0, marker) or (marker == 0 and self.start_blank)):
                    found = "no blank line" if not text.endswith("\n", 0, marker) else "a single newline"
                    self.errors.append(f"the tool calls follow {found} (officially \"\\n\\n\" precedes the calls block)")
                self.blocks += 1
            if tag.kind == "calls" and not tag.closing:
                cursor, after_calls = self.read_block(tag.end, implicit=False), True
            elif tag.kind == "invoke" and not tag.closing:
                self.errors.append("tool call written without a surrounding calls block; read anyway")
                cursor, after_calls = self.read_block(marker, implicit=True), True
            elif tag.kind == "cut":
                self.truncated(f"DSML tag {_short(tag.text)}")
                cursor = len(text)
            else:
                self.stray(tag, "outside a tool-call block")
                cursor = tag.end
        return "".join(content)

    def read_block(self, position: int, implicit: bool) -> int:
        """Reads invokes until the block's closing tag; returns the index after the block."""
        text = self.text
        first, calls_before = True, len(self.calls)
        invokes = 0
        while True:
            if first and implicit:
                position = self.skip_space(position)
            else:
                position = self.separator(position, "between tool-call tags")
            first = False
            if position >= len(text):
                if not implicit:
                    self.truncated("the tool-call block")
                return position
            if _next_marker(text, position) != position:
                if implicit:  # ordinary text ends a block that was never opened
                    return position
                position = self.drop_text(position, "the tool-call block")
                continue
            tag = _read_tag(text, position)
            self.note_style(tag)
            if tag.kind == "invoke" and not tag.closing:
                invokes += 1
                position = self.read_invoke(tag)
            elif tag.kind == "calls" and tag.closing:
                if implicit:
                    self.stray(tag, "after tool calls without an opening block")
                else:
                    self.closed_block = True
                    if not invokes:
                        self.warnings.append("an empty tool-call block (no calls in it)")
                return tag.end
            elif tag.kind == "cut":
                self.truncated(f"DSML tag {_short(tag.text)}")
                return len(text)
            else:
                self.stray(tag, "inside a tool-call block")
                position = tag.end

    def drop_text(self, position: int, where: str) -> int:
        """Text between DSML tags where the grammar has none: reported as an error and dropped up to the
        next marker. Returns where reading goes on."""
        marker = _next_marker(self.text, position)
        end = len(self.text) if marker < 0 else marker
        self.errors.append(f"text inside {where} dropped: {_short(self.text[position:end].strip())}")
        return end

    def read_invoke(self, opening: _Tag) -> int:
        """Reads one call from its opening tag; appends it when complete. Returns where reading goes on."""
        text = self.text
        name = opening.attributes.get("name")
        label = f"tool call {_short(name)}" if name is not None else "a tool call without a name"
        parameters: list[tuple[str, str, bool]] = []  # (name, value text, is_string)
        valid = name is not None
        if name is None:
            self.errors.append(f"tool call without a name attribute dropped: {_short(opening.text)}")
        position = opening.end
        after_tag = True
        while True:
            position = self.separator(position, f"inside {label}", after_invoke_tag=after_tag)
            after_tag = False
            if position >= len(text):
                self.truncated(label)
                return position
            if _next_marker(text, position) != position:
                position = self.drop_text(position, label)
                continue
            tag = _read_tag(text, position)
            self.note_style(tag)
            if tag.kind == "parameter" and not tag.closing:
                position, parameter = self.read_parameter(tag, label)
                if parameter is None:
                    valid = False
                    if position >= len(text):
                        return position
                elif any(parameter[0] == seen[0] for seen in parameters):
                    self.errors.append(f"{label} repeats parameter {_short(parameter[0])}; the first value is kept")
                else:
                    parameters.append(parameter)
            elif tag.kind == "invoke" and tag.closing:
                if valid:
                    self.calls.append(_openai_call(len(self.calls), name, parameters))
                else:
                    self.errors.append(f"{label} could not be parsed and was dropped")
                return tag.end
            elif tag.kind == "cut":
                self.truncated(label)
                return len(text)
            elif (tag.kind == "invoke" and not tag.closing) or tag.kind == "calls":
                self.errors.append(f"{label} was not closed before {_short(tag.text)}; it was dropped")
                return position  # the enclosing block reads this tag
            else:
                self.stray(tag, f"inside {label}")
                position = tag.end

    def read_parameter(self, opening: _Tag, label: str) -> tuple[int, tuple[str, str, bool] | None]:
        """A parameter's value runs to the first parameter closing tag, as in the official parser."""
        text = self.text
        closing = _PARAMETER_CLOSE.search(text, opening.end)
        name = opening.attributes.get("name")
        what = f"parameter {_short(name)} of {label}" if name is not None else f"a parameter without a name in {label}"
        if closing is None:
            self.truncated(what)
            return len(text), None
        if closing.group(0) != f"</{DSML}{PARAMETER_TAG}>":
            if re.match(rf"</{DSML}parameter", closing.group(0)):
                self.seen_v4 = True
            else:
                self.errors.append(f"DSML tag not written in the official form: {_short(closing.group(0))}")
        value = text[opening.end : closing.start()]
        if name is None:
            self.errors.append(f"{what} makes the call unparseable")
            return closing.end(), None
        if DSML in value:
            self.warnings.append(
                f"{what} contains DSML markup; its value runs to the first parameter closing tag, as officially"
            )
        flag = opening.attributes.get("string")
        if flag in ("true", "false"):
            is_string = flag == "true"
        else:
            is_string = not _is_json(value)
            found = "no string attribute" if flag is None else f"string={_short(flag)}"
            self.errors.append(f"{what} has {found} (officially \"true\" or \"false\"); read as {'a string' if is_string else 'JSON'}")
        if not is_string and not _is_json(value):
            self.errors.append(f"{what} is marked string=\"false\" but is not valid JSON; kept as a string")
            is_string = True
        return closing.end(), (name, value, is_string)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _openai_call(number: int, name: str, parameters: list[tuple[str, str, bool]]) -> dict:
    """Arguments laid out as the official parser does: ``{"key": value, ...}`` with JSON values verbatim."""
    fields = [f"{to_json(key)}: {to_json(value) if is_string else value}" for key, value, is_string in parameters]
    arguments = "{" + ", ".join(fields) + "}"
    return {"id": f"call_{number}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _strip_cut_marker(text: str) -> tuple[str, bool]:
    """A truncated completion may end inside a DSML tag's first characters (``...\\n\\n<｜DS``).
    A lone trailing ``<`` is kept: it is not markup and may be the answer's own text."""
    for prefix in sorted(_DSML_PREFIXES, key=len, reverse=True):
        if text.endswith(prefix):
            return text[: -len(prefix)], True
    return text, False


# Special tokens the official parser rejects inside the content or the reasoning (errors), and the
# other special tokens, which it lets through (warnings); both are removed here.
_REJECTED_IN_TEXT = (BOS, EOS, THINK_START, THINK_END)
_OTHER_SPECIAL = re.compile(r"<｜[^<>｜\s]{1,40}｜>")


def _scrub_special_tokens(text: str, where: str, result: "ParsedCompletion") -> str:
    """``text`` without special tokens; each kind removed is reported (DSML is handled by the reader)."""
    for token in _REJECTED_IN_TEXT:
        if token in text:
            text = text.replace(token, "")
            result.errors.append(f"stray {token} removed from the {where}")
    for token in sorted(set(_OTHER_SPECIAL.findall(text))):
        text = text.replace(token, "")
        result.warnings.append(f"special token {token} removed from the {where}")
    return text


def parse_completion(text: str, mode: str = "thinking", *, finished: bool | None = None) -> ParsedCompletion:
    """Split a completion (the generated text after the prompt, special tokens included) into
    reasoning, content and OpenAI-format tool calls.

    mode: the mode the prompt was encoded in. In thinking mode the reasoning is the text before
        ``</think>``; without ``</think>`` it runs to the first DSML markup or to the end.
    finished: whether generation stopped at the end-of-sentence token; by default, whether the text
        contains it. Text after the token is ignored (an error).

    Never raises on any text. No special token and no DSML markup (V4.1 tags, V4 tags, stray or
    half-written tags) ever reaches ``content`` or ``reasoning``. Every deviation from the official
    V4.1 grammar is reported: in ``errors`` when the official parser rejects the text (or, for a
    ``string="false"`` value that is not JSON, would return arguments that are not JSON), in
    ``warnings`` when it accepts it. docs/generation.md has the table.
    """
    _check_mode(mode)
    result = ParsedCompletion()
    end = text.find(EOS)
    body = text if end < 0 else text[:end]
    if end >= 0 and text[end + len(EOS) :]:
        result.errors.append(f"text after the end-of-sentence token ignored: {_short(text[end + len(EOS):])}")
    result.finished = end >= 0 if finished is None else finished
    result.finish_reason = "stop" if result.finished else "length"
    start_blank = False
    cut_reasoning = False

    if mode == "thinking":
        if body.startswith(THINK_START):
            body = body[len(THINK_START) :]
            result.errors.append("the completion starts with <think>, which belongs to the prompt; removed")
        think_end = body.find(THINK_END)
        markup = _next_marker(body, 0)
        if think_end >= 0 and (markup < 0 or think_end < markup):
            result.reasoning, body = body[:think_end], body[think_end + len(THINK_END) :]
        elif markup >= 0:
            start_blank = body.endswith("\n\n", 0, markup)
            result.reasoning, body = body[:markup].removesuffix("\n\n"), body[markup:]
            result.errors.append("tool calls began before </think>; the text before them is taken as reasoning")
        else:
            result.reasoning, body = body, ""
            if result.finished:
                result.errors.append("the completion ended without </think>; all of it is taken as reasoning")
            else:
                cut_reasoning = True
                result.errors.append("the completion was cut while reasoning (no </think>, no end-of-sentence token)")
                result.reasoning, cut = _strip_cut_marker(result.reasoning)
                if cut:
                    result.reasoning = result.reasoning.removesuffix("\n\n")
                    result.warnings.append("a DSML tag cut off at the end was removed")

    reader = _DsmlReader(body, result.finished)
    reader.start_blank = start_blank
    content = reader.read()
    first_markup = _next_marker(body, 0)
    if first_markup >= 0:
        # The calls block follows a blank line that belongs to neither the content nor the calls.
        # (``content`` starts with ``body[:first_markup]`` verbatim.)
        head, tail = content[:first_markup], content[first_markup:]
        content = head.removesuffix("\n\n") + tail
    if not result.finished:
        stripped, cut = _strip_cut_marker(content)
        if cut:
            content = stripped.removesuffix("\n\n")
            result.warnings.append("a DSML tag cut off at the end was removed")
        if not (cut_reasoning or reader.cut or reader.closed_block):
            # Officially only a completed tool-call block may end without the end-of-sentence token.
            result.errors.append("the completion was cut before the end-of-sentence token")

    result.reasoning = _scrub_special_tokens(result.reasoning, "reasoning", result)
    result.content = _scrub_special_tokens(content, "content", result)
    result.tool_calls = reader.calls
    result.errors += reader.errors
    result.warnings += reader.warnings
    if reader.seen_v4:
        # The one deviation the official V4.1 parser rejects that is a warning: V4's own grammar (its
        # official parser reads these tags), kept as an accepted dialect.
        result.warnings.append(
            f"V4-style DSML tags accepted (V4.1 writes {CALLS_OPEN}, with a space before the tag name; the "
            "official V4.1 parser rejects V4 tags, V4's reads them)"
        )
    result.dsml_dialect = "v4" if reader.seen_v4 else ("v4.1" if reader.seen_v41 else None)
    return result


# ---------------------------------------------------------------------------------------------
# Streaming: CompletionStream, fed one token id at a time
# ---------------------------------------------------------------------------------------------


@dataclass
class StreamEvent:
    """One event of :class:`CompletionStream`.

    kind: "reasoning" | "content" (``text`` is a delta) | "tool_call" (one whole call: ``index``, ``id``,
    ``name`` and its ``arguments`` JSON string) | "finish" (``finish_reason`` and ``parsed``, the
    :func:`parse_completion` result of the whole text)."""

    kind: str
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    finish_reason: str | None = None
    parsed: ParsedCompletion | None = None
    result: Any = None  # finish, from the engine's stream (model/engine.py Generator.stream): the GenerationResult


# What a text tail may still turn into: markup, the end of the reasoning, the end of the completion.
_MARKER_PATTERNS = (f"<{DSML}", f"</{DSML}", DSML, EOS)
_REASONING_PATTERNS = _MARKER_PATTERNS + (THINK_END,)
_SPECIAL_FULL = re.compile(r"<｜[^<>｜\s]{1,40}｜>")
_SPECIAL_PREFIX = re.compile(r"<(?:｜(?:[^<>｜\s]{0,40}|[^<>｜\s]{1,40}｜))?")


def _removable_tails(patterns: tuple[str, ...]) -> tuple[frozenset, int]:
    """Every beginning of a text end that the parser may still drop or treat as markup: an ending
    ``pattern`` (or none) after the tail parse_completion removes from a text before markup or at a
    cut, at most a blank line, a cut tag's beginning (``<｜DS``) and a blank line again."""
    words = {a + cut + b + pattern for a in ("", "\n\n") for cut in ("",) + _DSML_PREFIXES
             for b in ("", "\n\n") for pattern in ("",) + patterns}
    prefixes = frozenset(word[:n] for word in words for n in range(1, len(word) + 1))
    return prefixes, max(len(word) for word in words)


_CONTENT_TAILS = _removable_tails(_MARKER_PATTERNS)
_REASONING_TAILS = _removable_tails(_REASONING_PATTERNS)


def _held_tail(text: str, tails: tuple[frozenset, int]) -> int:
    """Length of the longest suffix of ``text`` that may still be dropped or become markup."""
    prefixes, limit = tails
    for size in range(min(len(text), limit), 0, -1):
        if text[-size:] in prefixes:
            return size
    return 0


class _TokenRemover:
    """Streaming ``str.replace(token, "")`` for a token whose only '<' is its first character (no
    two occurrences can overlap, so text is final as soon as it cannot be the token's beginning)."""

    def __init__(self, token: str):
        self.token, self.buf = token, ""

    def push(self, text: str) -> str:
        if not self.buf and "<" not in text:
            return text
        out = []
        for c in text:
            if self.buf:
                candidate = self.buf + c
                if self.token.startswith(candidate):
                    self.buf = "" if candidate == self.token else candidate
                    continue
                out.append(self.buf)
                self.buf = ""
            if c == "<":
                self.buf = "<"
            else:
                out.append(c)
        return "".join(out)


class _SpecialRemover:
    """Streaming removal of ``<｜name｜>`` tokens (``_OTHER_SPECIAL``). The batch rule removes each
    distinct token found, one after the other, so a removal may join its neighbours into a token
    removed later (``<｜a<｜b｜>｜>`` with ``<｜a｜>`` elsewhere). Where a removed token directly follows
    the beginning of another (the only way that can happen), the stream freezes: nothing more is
    released, and the exact text comes from the whole-text parse."""

    def __init__(self):
        self.left = self.buf = ""
        self.frozen = False

    def push(self, text: str) -> str:
        if self.frozen:
            return ""
        if not self.buf and not self.left and "<" not in text:
            return text
        out = []
        for c in text:
            if self.buf:
                candidate = self.buf + c
                if _SPECIAL_FULL.fullmatch(candidate):
                    if self.left:  # a removal next to a token's beginning: the batch result may differ
                        self.frozen = True
                        return "".join(out)
                    self.buf = ""
                    continue
                if _SPECIAL_PREFIX.fullmatch(candidate):
                    self.buf = candidate
                    continue
                if c == "<":  # the held beginning is followed by text that stays: keep it beside
                    out.append(self.left)
                    self.left, self.buf = self.buf, "<"
                    continue
                out.append(self.left + self.buf + c)
                self.left = self.buf = ""
                continue
            if c == "<":
                self.buf = "<"
            else:
                out.append(c)
        return "".join(out)


class _Scrubber:
    """The streaming form of ``_scrub_special_tokens``: what it releases is a prefix of the batch
    result for every continuation of the text pushed so far."""

    def __init__(self):
        self.stages = [_TokenRemover(token) for token in _REJECTED_IN_TEXT] + [_SpecialRemover()]

    def push(self, text: str) -> str:
        for stage in self.stages:
            if not text:
                break
            text = stage.push(text)
        return text


class CompletionStream:
    """Incremental :func:`parse_completion`: fed one generated token id at a time, it returns the
    events that are certain so far (see docs/generation.md, "Streaming the parse").

    Reasoning and content text stream as they come, except a tail that may still turn out to be
    markup (a prefix of ``<｜DSML｜``, ``</think>`` or the end-of-sentence token, after up to a blank
    line and a cut tag's beginning, which the parser drops before a calls block or at a cut) and, in the
    scrubbing of special tokens, a tail that may still be a special token. From the first DSML marker
    on, the content is held until :meth:`close`; each tool call is emitted whole (one event) once its
    closing tag is read. :meth:`close` flushes the rest from ``parse_completion`` of the whole text,
    so the concatenated deltas equal its reasoning, content and calls exactly.
    """

    def __init__(self, tokenizer, mode: str = "thinking"):
        _check_mode(mode)
        self.tokenizer, self.mode = tokenizer, mode
        self.ids: list[int] = []
        self._pending: list[int] = []  # ids whose text ends in an incomplete UTF-8 sequence
        self._chunks: list[str] = []  # the decoded text so far
        self._phase = "start" if mode == "thinking" else "content"  # start|reasoning|content|dsml|end|closed
        self._buf = ""  # text of the current phase not yet released (bounded outside "dsml")
        self._raw_reasoning: list[str] = []
        self._scrub = {"reasoning": _Scrubber(), "content": _Scrubber()}
        self._sent = {"reasoning": 0, "content": 0}  # characters emitted per channel
        self._dsml: list[str] = []  # text from the first marker on
        self._dsml_tail = ""  # the last characters of it (tags split across tokens)
        self._closing_seen = False  # a closing tag began since the last read of the calls
        self._calls_sent: list[dict] = []

    @property
    def text(self) -> str:
        """The decoded text so far (complete UTF-8 characters only)."""
        return "".join(self._chunks)

    # -- input -------------------------------------------------------------------------------

    def feed(self, token_id: int) -> list[StreamEvent]:
        """Add one token; returns the events it made certain (often none)."""
        if self._phase == "closed":
            raise RuntimeError("CompletionStream.feed after close")
        self.ids.append(int(token_id))
        new = self._decode(int(token_id))
        if not new:
            return []
        self._chunks.append(new)
        return self._advance(new)

    def close(self, finish_reason: str) -> list[StreamEvent]:
        """End of generation: the held-back text, the calls not yet emitted, then the "finish" event,
        whose ``parsed`` is ``parse_completion(text, mode, finished=finish_reason == "stop")``."""
        if self._phase == "closed":
            raise RuntimeError("CompletionStream.close called twice")
        self._phase = "closed"
        text = self.tokenizer.decode(self.ids, skip_special=False)
        parsed = parse_completion(text, self.mode, finished=finish_reason == "stop")
        events = self._emit_exact("reasoning", parsed.reasoning) + self._emit_exact("content", parsed.content)
        events += self._emit_calls(parsed.tool_calls)
        events.append(StreamEvent("finish", finish_reason=finish_reason, parsed=parsed))
        return events

    def _decode(self, token_id: int) -> str:
        """The new text of one token; ids whose text ends in an incomplete UTF-8 sequence wait."""
        self._pending.append(token_id)
        text = self.tokenizer.decode(self._pending, skip_special=False)
        if not text.endswith("\ufffd"):
            self._pending = []
            return text
        if len(self._pending) > 8:  # invalid bytes: release what cannot change any more
            head = self.tokenizer.decode(self._pending[:-4], skip_special=False)
            if head + self.tokenizer.decode(self._pending[-4:], skip_special=False) == text:
                self._pending = self._pending[-4:]
                return head
        return ""

    # -- the phases --------------------------------------------------------------------------

    def _advance(self, new: str) -> list[StreamEvent]:
        if self._phase == "dsml":
            return self._advance_dsml(new)
        if self._phase == "end":
            return []
        self._buf += new
        events: list[StreamEvent] = []
        if self._phase == "start":  # thinking mode: a leading <think> is dropped (an error)
            if THINK_START.startswith(self._buf) and len(self._buf) < len(THINK_START):
                return events
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
            self._phase = "reasoning"
        if self._phase == "reasoning":
            events += self._advance_reasoning()
        if self._phase == "content":
            events += self._advance_content()
        return events

    def _find_ends(self, with_think_end: bool) -> tuple[int, str | None, int]:
        """The first end of the current text run in ``_buf``: (start, kind, index after it)."""
        found: list[tuple[int, str, int]] = []
        position = self._buf.find(DSML)
        if position >= 0:
            start = position
            if self._buf.startswith("</", position - 2) and position >= 2:
                start = position - 2
            elif position >= 1 and self._buf[position - 1] == "<":
                start = position - 1
            found.append((start, "marker", start))
        position = self._buf.find(EOS)
        if position >= 0:
            found.append((position, "eos", position))
        if with_think_end:
            position = self._buf.find(THINK_END)
            if position >= 0:
                found.append((position, "think_end", position + len(THINK_END)))
        if not found:
            return -1, None, -1
        return min(found)

    def _release(self, channel: str, raw: str) -> list[StreamEvent]:
        if channel == "reasoning":
            self._raw_reasoning.append(raw)
        text = self._scrub[channel].push(raw)
        if not text:
            return []
        self._sent[channel] += len(text)
        return [StreamEvent(channel, text=text)]

    def _emit_exact(self, channel: str, exact: str) -> list[StreamEvent]:
        """The rest of a channel whose exact text is known (a prefix of it was emitted)."""
        rest = exact[self._sent[channel]:]
        self._sent[channel] = len(exact)
        return [StreamEvent(channel, text=rest)] if rest else []

    def _advance_reasoning(self) -> list[StreamEvent]:
        start, kind, after = self._find_ends(with_think_end=True)
        if kind is None:
            keep = _held_tail(self._buf, _REASONING_TAILS)
            events = self._release("reasoning", self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return events
        if kind == "eos":  # the reasoning was never closed: its end depends on `finished`
            keep = _held_tail(self._buf[:start], _REASONING_TAILS)
            events = self._release("reasoning", self._buf[: start - keep])
            self._phase, self._buf = "end", ""
            return events
        before = self._buf[:start]
        if kind == "marker":  # tool calls began before </think>: the blank line before them is dropped
            whole = ("".join(self._raw_reasoning) + before).removesuffix("\n\n")
        else:
            whole = "".join(self._raw_reasoning) + before
        self._raw_reasoning = [whole]
        exact = _scrub_special_tokens(whole, "reasoning", ParsedCompletion())
        events = self._emit_exact("reasoning", exact)
        if kind == "marker":
            rest, self._buf = self._buf[start:], ""
            return events + self._enter_dsml(rest)
        self._phase, self._buf = "content", self._buf[after:]
        return events

    def _advance_content(self) -> list[StreamEvent]:
        start, kind, _ = self._find_ends(with_think_end=False)
        if kind is None:
            keep = _held_tail(self._buf, _CONTENT_TAILS)
            events = self._release("content", self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return events
        head = self._buf[:start]
        if kind == "marker":  # the blank line before the first markup belongs to no part
            head = head.removesuffix("\n\n")
        # an unfinished completion loses a cut tag's beginning and the blank line before it
        keep = _held_tail(head, _CONTENT_TAILS)
        events = self._release("content", head[: len(head) - keep])
        if kind == "eos":
            self._phase, self._buf = "end", ""
            return events
        rest, self._buf = self._buf[start:], ""
        return events + self._enter_dsml(rest)

    def _enter_dsml(self, text: str) -> list[StreamEvent]:
        """From the first marker on, the content waits for close(); calls are read as they close."""
        self._phase = "dsml"
        self._dsml, self._dsml_tail = [], ""
        return self._advance_dsml(text)

    def _advance_dsml(self, new: str) -> list[StreamEvent]:
        self._dsml.append(new)
        window = self._dsml_tail + new
        self._dsml_tail = window[-24:]
        if f"</{DSML}" in window:
            self._closing_seen = True
        if EOS in window:  # nothing after it counts; close() reads the rest
            self._phase = "end"
            return []
        if not (self._closing_seen and ">" in new):
            return []
        self._closing_seen = False
        # The calls depend only on the text from the first marker on (and each call, once its closing
        # tag is read, stays as it is whatever follows).
        calls = parse_completion("".join(self._dsml), "chat", finished=False).tool_calls
        return self._emit_calls(calls)

    def _emit_calls(self, calls: list[dict]) -> list[StreamEvent]:
        events = []
        for index in range(len(self._calls_sent), len(calls)):
            call = calls[index]
            self._calls_sent.append(call)
            function = call["function"]
            events.append(StreamEvent("tool_call", index=index, id=call["id"], name=function["name"],
                                      arguments=function["arguments"]))
        return events
