"""The DeepSeek-V4.1 chat encoding: rendering messages to prompt text, on strings.

Encoding (messages -> prompt text) reproduces the official V4.1 encoder character for character
(spec/architecture.md §7; golden prompts in tests/fixtures/encoding/ were produced by running it):
``encode_messages`` (effort, tools, response format, ``context=``), ``encode_messages_with_images``,
the small renderers (tools section, DSML tool calls), the reasoning-effort presets, and the special
tokens and DSML tag names. Its inverse, the completion parser, is ``model/completion.py``; it imports
this module's tokens and helpers, and this module imports nothing from it.

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


def _short(text: str, limit: int = 60) -> str:
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return json.dumps(text, ensure_ascii=False)


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
