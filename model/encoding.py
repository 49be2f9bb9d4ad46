"""The DeepSeek-V4.1 chat encoding and its inverse, on strings.

Encoding (messages -> prompt text) reproduces the official V4.1 encoder character for character
(spec/architecture.md §7; golden prompts in tests/fixtures/encoding/ were produced by running it).
Parsing (completion text -> reasoning, content, tool calls) accepts everything the official parser
accepts and, unlike it, never raises. No special token or DSML fragment reaches the content or the
reasoning, and every deviation from the official grammar is reported: in ``errors`` what the official
parser rejects (or accepts only to return a broken call), in ``warnings`` what it accepts
(docs/generation.md has the table).

Prompt layout
-------------
``BOS``, then one rendering per message::

    system (first)   <｜System｜>[effort line]{content}[\\n\\n{tools section}][\\n\\n{response format}]
    system (later)   <｜System｜>{content}...              (a later system message opens a turn, like a user)
    user             <｜User｜>{text or blocks joined by \\n\\n}        (tool results folded in as blocks)
    latest_reminder  <｜latest_reminder｜>{content}
    assistant        [{reasoning}</think>]{content}[\\n\\n{DSML tool-call block}]<｜end▁of▁sentence｜>

A user (or later system) message that is last, or is followed by an assistant / latest_reminder
message, is followed by the generation header ``<｜Assistant｜>`` plus ``<think>`` (thinking mode, at
or after the last turn) or ``</think>`` (chat mode, or an earlier turn whose reasoning is dropped).

The effort line ``Reasoning Effort: {b} (range 1-100, ...)\\n\\n`` appears in thinking mode only,
once, right after the leading ``<｜System｜>``; it is emitted even when there is no system message.

Tool calls are written in V4.1 DSML, whose tag names start with a space::

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

Token ids are not this module's concern (see ``model/tokenizer.py``).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

# ---------------------------------------------------------------------------------------------
# Special tokens (strings; each is one token in the V4.1 vocabulary)
# ---------------------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"

# Internal classification tasks: a message with ``task`` set is followed by the task's token.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

MODES = ("thinking", "chat")

# V4.1 DSML tag names carry a leading space (V4 wrote ``tool_calls``, ``invoke``, ``parameter``).
CALLS_TAG = " calls"
INVOKE_TAG = " invoke"
PARAMETER_TAG = " parameter"
CALLS_OPEN = f"<{DSML}{CALLS_TAG}>"
CALLS_CLOSE = f"</{DSML}{CALLS_TAG}>"

# ---------------------------------------------------------------------------------------------
# Reasoning effort
# ---------------------------------------------------------------------------------------------

EFFORT_PRESETS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = EFFORT_PRESETS["high"]
EFFORT_LINE = "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def parse_effort(value: int | str | None) -> int:
    """The reasoning-effort budget b in 1..100 for an int, a preset name or a decimal string, as the
    command line reads it: presets case-insensitive and stripped (" MAX "), decimal strings ("42").

    ``None`` means the default (``high`` = 75). Presets: low/high/max = 50/75/100. Anything else
    (0, 101, "medium", 7.5, True) raises ValueError with a one-line message. The encoder itself takes
    only the official forms (:func:`check_effort`); pass it the int this returns.
    """
    if value is None:
        return DEFAULT_EFFORT
    problem = f"invalid reasoning effort {value!r}: expected an integer 1-100 or one of low, high, max"
    if isinstance(value, bool):  # bool is an int subclass; True is not an effort
        raise ValueError(problem)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in EFFORT_PRESETS:
            return EFFORT_PRESETS[text]
        if not re.fullmatch(r"[+-]?\d+", text):
            raise ValueError(problem)
        value = int(text)
    if not isinstance(value, int) or not 1 <= value <= 100:
        raise ValueError(problem)
    return value


def check_effort(value: int | str | None) -> int:
    """The budget for an effort as the official encoder validates it: ``None`` (the default, high),
    an int 1..100, or exactly ``"low"``, ``"high"`` or ``"max"``. Anything else raises ValueError
    ("HIGH", " max", "42", 7.5, True); the CLI reads its ``--effort`` option with :func:`parse_effort`."""
    if value is None:
        return DEFAULT_EFFORT
    if isinstance(value, str) and value in EFFORT_PRESETS:
        return EFFORT_PRESETS[value]
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100:
        return value
    raise ValueError(
        f"invalid reasoning effort {value!r}: expected an integer 1-100 or one of low, high, max "
        "(lowercase, as the official encoder takes it)"
    )


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"invalid mode {mode!r}: expected 'thinking' or 'chat'")


# ---------------------------------------------------------------------------------------------
# Small renderers (also useful on their own, e.g. to build few-shot tool examples)
# ---------------------------------------------------------------------------------------------


def to_json(value: Any) -> str:
    """JSON as the official encoder writes it: default separators, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False)


TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}{CALLS_TAG}>" block like the following:

<{DSML}{CALLS_TAG}>
<{DSML}{INVOKE_TAG} name="$TOOL_NAME">
<{DSML}{PARAMETER_TAG} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}{PARAMETER_TAG}>
...
</{DSML}{INVOKE_TAG}>
<{DSML}{INVOKE_TAG} name="$TOOL_NAME2">
...
</{DSML}{INVOKE_TAG}>
</{DSML}{CALLS_TAG}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


def render_tools_section(tools: list[dict]) -> str:
    """The system-prompt section describing an OpenAI tool list (one JSON schema per line)."""
    schemas = [to_json(tool["function"]) for tool in tools]
    return TOOLS_SECTION.replace("{tool_schemas}", "\n".join(schemas))


def _call_arguments_as_dict(arguments: Any) -> dict:
    """An OpenAI call's ``arguments`` as a dict: a dict, a JSON object string (even one encoded
    twice), or else wrapped as ``{"arguments": <the original value>}`` as the official encoder does."""
    value = arguments
    for _ in range(2):  # a JSON string, possibly of a JSON string
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(tool_calls: list[dict]) -> str:
    """The DSML block for OpenAI-format calls, without the ``\\n\\n`` that precedes it in a turn.

    Strings are written raw with ``string="true"``; every other value as JSON with ``string="false"``.
    """
    invokes = []
    for number, call in enumerate(tool_calls):
        function = call.get("function")
        if not isinstance(function, dict) or "name" not in function or "arguments" not in function:
            raise ValueError(f"tool call #{number} needs function.name and function.arguments (OpenAI format)")
        parameters = []
        for key, value in _call_arguments_as_dict(function["arguments"]).items():
            is_string = isinstance(value, str)
            text = value if is_string else to_json(value)
            parameters.append(
                f'<{DSML}{PARAMETER_TAG} name="{key}" string="{"true" if is_string else "false"}">'
                f"{text}</{DSML}{PARAMETER_TAG}>"
            )
        invokes.append(
            f'<{DSML}{INVOKE_TAG} name="{function["name"]}">\n' + "\n".join(parameters) + f"\n</{DSML}{INVOKE_TAG}>"
        )
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------

_IMAGE_TAG = re.compile(r"<image>(.*?)</image>", re.DOTALL)


def parse_image_tags(text: str) -> str | list[dict]:
    """``"look <image>a.png</image>"`` -> content blocks ``[text, image_url]``; text without tags
    is returned unchanged. An empty path or an unpaired tag raises ValueError."""
    matches = list(_IMAGE_TAG.finditer(text))
    leftover = _IMAGE_TAG.sub("", text)
    if "<image>" in leftover or "</image>" in leftover:
        raise ValueError("malformed <image>path</image> tag")
    if not matches:
        return text
    blocks: list[dict] = []
    cursor = 0
    for match in matches:
        if match.start() > cursor:
            blocks.append({"type": "text", "text": text[cursor : match.start()]})
        if not match.group(1):
            raise ValueError("empty image path in <image></image>")
        blocks.append({"type": "image_url", "image_url": {"url": match.group(1)}})
        cursor = match.end()
    if cursor < len(text):
        blocks.append({"type": "text", "text": text[cursor:]})
    return blocks


def _image_record(block: dict) -> dict:
    """What the vision front end needs to load one image: ``{"type": "image", "url"|"source"|"data": ...}``."""
    record: dict[str, Any] = {"type": "image"}
    if block["type"] == "image_url":
        image_url = block.get("image_url")
        record["url"] = image_url if isinstance(image_url, str) else (image_url or {}).get("url", "")
    else:
        record.update({key: block[key] for key in ("source", "url", "data") if key in block})
    if not any(record.get(key) for key in ("source", "url", "data")):
        raise ValueError("image block has no url, source or data")
    return record


def _replace_images(blocks: list, images: list[dict]) -> list:
    """Blocks with each image block replaced by a placeholder text block (records appended to
    ``images`` in prompt order); images inside tool-result blocks are replaced too."""
    replaced = []
    for block in blocks:
        if not isinstance(block, dict):
            replaced.append(block)
        elif block.get("type") in ("image", "image_url"):
            images.append(_image_record(block))
            replaced.append({"type": "text", "text": IMAGE_PLACEHOLDER})
        elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            replaced.append({**block, "content": _replace_images(block["content"], images)})
        else:
            if block.get("type") == "text" and IMAGE_PLACEHOLDER in (block.get("text") or ""):
                raise ValueError(f"text block contains the image placeholder {IMAGE_PLACEHOLDER}; pass images as image blocks")
            replaced.append(block)
    return replaced


# ---------------------------------------------------------------------------------------------
# Message preparation: images -> placeholders, tool messages -> user blocks in call order
# ---------------------------------------------------------------------------------------------


_MISSING = object()


def _check_messages(messages: list, what: str = "message") -> None:
    """Each message is an object whose ``content`` is a string or a list of content blocks. ``None``
    (or no content) is allowed on assistant messages only (OpenAI writes ``null`` beside
    ``tool_calls``), and on user messages that carry the internal ``content_blocks`` instead. Raises
    ValueError naming the message (its index in the list and its role)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{what}s must be a list of message objects, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{what} {index} must be a JSON object, got {type(message).__name__}")
        role = message.get("role")
        content = message.get("content", _MISSING)
        allowed_empty = role == "assistant" or (role == "user" and isinstance(message.get("content_blocks"), list))
        if not isinstance(content, (str, list)) and not (allowed_empty and content in (None, _MISSING)):
            found = "missing" if content is _MISSING else f"{type(content).__name__} {_short(repr(content), 40)}"
            raise ValueError(
                f"{what} {index} (role {role!r}): content must be a string or a list of content blocks, "
                f"not {found}"
            )
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(
                f"{what} {index} (role {role!r}): reasoning_content must be a string, not {type(reasoning).__name__}"
            )


def _prepare_images(messages: list[dict], image_tags: bool) -> tuple[list[dict], list[dict]]:
    """Deep copies of the messages with list contents turned into ``content_blocks`` and images into
    placeholders; returns the image records in prompt order."""
    prepared, images = [], []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"each message must be a JSON object, got {type(message).__name__}")
        message = copy.deepcopy(message)
        for key in ("content", "reasoning_content"):
            if isinstance(message.get(key), str) and IMAGE_PLACEHOLDER in message[key]:
                raise ValueError(f"message {key} contains the image placeholder {IMAGE_PLACEHOLDER}; pass images as image blocks")
        if image_tags and message.get("role") == "user" and isinstance(message.get("content"), str):
            message["content"] = parse_image_tags(message["content"])
        if isinstance(message.get("content"), list) and "content_blocks" not in message:
            message["content_blocks"] = message.pop("content")
        if message.get("content_blocks"):
            message["content_blocks"] = _replace_images(message["content_blocks"], images)
            if not isinstance(message.get("content"), str):
                # Roles other than user render ``content``: the text blocks joined by blank lines.
                message["content"] = "\n\n".join(
                    block.get("text", "")
                    for block in message["content_blocks"]
                    if isinstance(block, dict) and block.get("type") == "text"
                )
        prepared.append(message)
    return prepared, images


def _fold_tool_messages(messages: list[dict]) -> list[dict]:
    """V4.1 has no tool role: each tool message becomes a ``tool_result`` block of a user turn.

    Every user message carries ``content_blocks``; consecutive user turns (and tool results) are
    merged into one, unless the earlier user message is a task message.
    """
    folded: list[dict] = []
    for message in messages:
        role = message.get("role")
        previous = folded[-1] if folded and folded[-1].get("role") == "user" else None
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": message.get("tool_call_id", ""), "content": message.get("content", "")}
            if previous is not None:
                previous["content_blocks"].append(block)
            else:
                folded.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = message.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": message.get("content", "")}]
            if previous is not None and previous.get("task") is None:
                previous["content_blocks"].extend(blocks)
            else:
                message["content_blocks"] = blocks
                folded.append(message)
        else:
            folded.append(message)
    return folded


def _sort_tool_results(messages: list[dict]) -> None:
    """Reorder tool-result blocks of each user turn into the order of the most recent assistant
    message's calls (by id; unknown ids rank first, ties keep their order). In place."""
    call_rank: dict[str, int] = {}
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            call_rank = {}
            for rank, call in enumerate(message["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    call_rank[call_id] = rank
        elif message.get("role") == "user" and message.get("content_blocks"):
            blocks = message["content_blocks"]
            is_result = [isinstance(block, dict) and block.get("type") == "tool_result" for block in blocks]
            results = [block for block, result in zip(blocks, is_result) if result]
            if len(results) > 1 and call_rank:
                in_call_order = iter(sorted(results, key=lambda block: call_rank.get(block.get("tool_use_id", ""), 0)))
                message["content_blocks"] = [next(in_call_order) if result else block for block, result in zip(blocks, is_result)]


def _last_turn_index(messages: list[dict]) -> int:
    """Index of the last message that opens a turn: a user message, or a system message after the first."""
    for index in range(len(messages) - 1, -1, -1):
        role = messages[index].get("role")
        if role == "user" or (role == "system" and index > 0):
            return index
    return -1


_KEPT_BEFORE_LAST_TURN = {"user", "system", "tool", "latest_reminder", "direct_search_results"}


def _drop_earlier_turn_extras(messages: list[dict]) -> list[dict]:
    """Thinking mode with dropped reasoning: before the last turn, assistant messages lose their
    reasoning and messages of other roles are left out (as the official encoder does)."""
    last_turn = _last_turn_index(messages)
    kept = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role in _KEPT_BEFORE_LAST_TURN or index >= last_turn:
            kept.append(message)
        elif role == "assistant":
            kept.append({key: value for key, value in message.items() if key != "reasoning_content"})
    return kept


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _render_user_body(message: dict) -> str:
    blocks = message.get("content_blocks")
    if not blocks:
        return message.get("content") or ""
    parts = []
    for block in blocks:
        if not isinstance(block, dict):
            raise ValueError(f"content blocks must be JSON objects, got {type(block).__name__}")
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text") or "")
        elif kind == "tool_result":
            result = block.get("content", "")
            if isinstance(result, list):
                result = "\n\n".join(
                    (part.get("text") or "") if part.get("type") == "text" else f"[Unsupported {part.get('type')}]"
                    for part in result
                )
            parts.append(f"<tool_result>{result}</tool_result>")
        else:
            parts.append(f"[Unsupported {kind}]")
    return "\n\n".join(parts)


def _render_message(index: int, messages: list[dict], mode: str, budget: int, keep_reasoning: bool, last_turn: int) -> str:
    """One message, plus the generation header when a turn ends here.

    ``keep_reasoning`` is False when reasoning of turns before the last one is dropped (the default,
    unless a tool list is present anywhere); ``last_turn`` is ``_last_turn_index(messages)``.
    """
    message = messages[index]
    role = message.get("role")
    content = message.get("content")
    thinking = mode == "thinking"

    out = ""
    if index == 0 and (thinking or role == "system"):
        out += SYSTEM
        if thinking:
            out += EFFORT_LINE.format(budget=budget)

    if role == "system":
        if index > 0:
            out += SYSTEM
        out += content or ""
        if message.get("tools"):
            out += "\n\n" + render_tools_section(message["tools"])
        if message.get("response_format"):
            out += "\n\n" + RESPONSE_FORMAT_SECTION.format(schema=to_json(message["response_format"]))
    elif role == "user":
        out += USER + _render_user_body(message)
    elif role == "latest_reminder":
        out += f"{LATEST_REMINDER}{content}"
    elif role == "assistant":
        # A reply to a task message is the task's output: it has no reasoning part.
        answers_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not answers_task and (keep_reasoning or index > last_turn):
            out += (message.get("reasoning_content") or "") + THINK_END
        out += content or ""
        if message.get("tool_calls"):
            out += "\n\n" + render_tool_calls(message["tool_calls"])
        if not message.get("wo_eos", False):
            out += EOS
    elif role == "tool":
        raise ValueError("tool messages must follow an assistant message's tool calls (they are folded into the next user turn)")
    else:
        raise ValueError(f"unknown message role {role!r}: expected system, user, assistant, tool or latest_reminder")

    # The next message continues the prompt on its own unless it is the model's (or a reminder).
    if index + 1 < len(messages) and messages[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return out

    task = message.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASK_TOKENS)}")
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role == "user" or (role == "system" and index > 0):
        opens_reasoning = thinking and (keep_reasoning or index >= last_turn)
        out += ASSISTANT + (THINK_START if opens_reasoning else THINK_END)
    return out


def encode_messages_with_images(
    messages: list[dict],
    mode: str = "thinking",
    effort: int | str | None = "high",
    *,
    context: list[dict] | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
    image_tags: bool = False,
) -> tuple[str, list[dict]]:
    """The V4.1 prompt for ``messages`` and the image records its placeholders stand for.

    messages: OpenAI-style dicts. Roles ``system`` (optional ``tools``: an OpenAI tool list, and
        ``response_format``), ``user``, ``assistant`` (optional ``reasoning_content`` and OpenAI
        ``tool_calls``; ``wo_eos`` leaves the turn open), ``tool`` (``tool_call_id``), and
        ``latest_reminder``. ``content`` is a string or a list of blocks (``text``, ``image_url``,
        ``image``, ``tool_result``); ``None`` only on assistant messages. Anything else raises
        ValueError naming the message.
    mode: "thinking" (reply opens with ``<think>``) or "chat" (reply opens after ``</think>``).
    effort: None (high), 1..100 or exactly "low"/"high"/"max", as the official encoder validates it;
        rendered only in thinking mode, but always validated.
    context: earlier messages already in the cache. Only ``messages`` are rendered, as they follow the
        context in the whole conversation: no BOS and no effort line, tool results sorted by the calls
        of the context's last assistant, earlier reasoning dropped as it would be in the whole list
        (official ``context``). A context and ``messages`` are folded separately: a tool or user
        message first in ``messages`` is not merged into a user message that ends the context.
    drop_thinking: drop the reasoning of turns before the last one (ignored when tools are present,
        as officially).
    add_bos: start with the BOS token (without a context).
    image_tags: also turn ``<image>path</image>`` tags in user string contents into image blocks.

    Returns (prompt, images): one ``{"type": "image", "url"|"source"|"data": ...}`` record per
    ``<｜deepseek_image｜>`` placeholder of the rendered messages, in prompt order (a context's images
    are already in the cache and are not returned).
    """
    _check_mode(mode)
    budget = check_effort(effort)
    context = list(context or [])
    _check_messages(context, "context message")
    _check_messages(messages)
    earlier, _ = _prepare_images(context, image_tags)
    prepared, images = _prepare_images(list(messages), image_tags)
    earlier, prepared = _fold_tool_messages(earlier), _fold_tool_messages(prepared)
    conversation = earlier + prepared
    _sort_tool_results(conversation)

    keep_reasoning = not drop_thinking or any(message.get("tools") for message in conversation)
    first = len(earlier)
    if mode == "thinking" and not keep_reasoning:
        # as officially: the context's length after its own drop (equal to its length for valid roles)
        first = len(_drop_earlier_turn_extras(earlier))
        conversation = _drop_earlier_turn_extras(conversation)

    last_turn = _last_turn_index(conversation)
    prompt = BOS if add_bos and not earlier else ""
    prompt += "".join(
        _render_message(index, conversation, mode, budget, keep_reasoning, last_turn)
        for index in range(first, len(conversation))
    )
    return prompt, images


def encode_messages(
    messages: list[dict],
    mode: str = "thinking",
    effort: int | str | None = "high",
    *,
    context: list[dict] | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
    image_tags: bool = False,
) -> str:
    """The V4.1 prompt text for ``messages`` (see :func:`encode_messages_with_images`)."""
    return encode_messages_with_images(
        messages, mode, effort, context=context, drop_thinking=drop_thinking, add_bos=add_bos, image_tags=image_tags
    )[0]


def attach_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A copy of ``messages`` whose first system message carries ``tools`` (an empty system message
    is put first when there is none), as ``dsv41 generate --tools`` does."""
    messages = copy.deepcopy(list(messages))
    if not messages or messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": ""})
    messages[0]["tools"] = copy.deepcopy(tools)
    return messages


# ---------------------------------------------------------------------------------------------
# Parsing a completion
# ---------------------------------------------------------------------------------------------


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


def _short(text: str, limit: int = 60) -> str:
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return json.dumps(text, ensure_ascii=False)


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
            marker = _next_marker(text, position)
            if marker != position:
                if implicit:  # ordinary text ends a block that was never opened
                    return position
                end = len(text) if marker < 0 else marker
                self.errors.append(f"text inside the tool-call block dropped: {_short(text[position:end].strip())}")
                position = end
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
            marker = _next_marker(text, position)
            if marker != position:
                end = len(text) if marker < 0 else marker
                self.errors.append(f"text inside {label} dropped: {_short(text[position:end].strip())}")
                position = end
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


def assistant_completion(message: dict, mode: str = "thinking") -> str:
    """The completion text the model would produce for an assistant message (what follows the
    generation header), e.g. to test the parser or to prefill a turn."""
    _check_mode(mode)
    prompt = encode_messages([{"role": "user", "content": ""}, message], mode, add_bos=False)
    return prompt[len(encode_messages([{"role": "user", "content": ""}], mode, add_bos=False)) :]


def iter_special_tokens() -> Iterable[str]:
    """Every special-token string this module writes."""
    yield from (BOS, EOS, SYSTEM, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML, IMAGE_PLACEHOLDER)
    yield from TASK_TOKENS.values()
