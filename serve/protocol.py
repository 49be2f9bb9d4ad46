"""Request bodies of the OpenAI schema -> validated parameters, and the OpenAI-style error object.

Everything here is plain Python (no web framework), so it is tested and reused without the `.[serve]`
extra. A request is read whole before anything reaches the engine: every problem is an `APIError` (400
with `{"error": {"message", "type", "param", "code"}}`) and nothing has changed. A field this server
does not implement is refused (400) unless docs/serve.md lists it as ignored; a field no OpenAI or
DeepSeek endpoint knows is refused as unknown, as OpenAI's own API does.

Effort (docs/serve.md, "Reasoning effort"): DeepSeek's API maps the requested `reasoning_effort` onto
three levels (minimal, low -> low; medium, high, xhigh -> high; max, ultra -> max); this project's
levels are the effort line's budgets low/high/max = 50/75/100 (model/encoding.py EFFORT_PRESETS). An
integer 1..100 is our extension: the budget itself.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from dsv41.model import encoding


class APIError(Exception):
    """An error answered as OpenAI answers it: `status` and `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param, code)


# DeepSeek's table (api-docs.deepseek.com/guides/thinking_mode): requested effort -> the level it runs at
DEEPSEEK_EFFORT_LEVELS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "high",
                          "max": "max", "ultra": "max"}
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.6, 0.95  # dsv41 generate's defaults (docs/generation.md)
MAX_STOP_STRINGS = 16

# Fields accepted and ignored (docs/serve.md says so): bookkeeping that changes no token.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier", "prompt_cache_key"}
# Fields refused unless they hold the value that changes nothing: {name: (is it neutral?, why refused)}
_NEUTRAL = {
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: not v,
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "functions": lambda v: v is None,
    "function_call": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
}


def _effort_from(value: Any, param: str) -> int:
    """A requested effort as the effort line's budget 1..100: DeepSeek's names, or our integer extension."""
    if isinstance(value, bool):
        raise bad(f"invalid {param} {value!r}: expected low, medium, high, max (or minimal, xhigh, ultra) "
                  "or an integer 1-100", param, "invalid_reasoning_effort")
    if isinstance(value, str) and value in DEEPSEEK_EFFORT_LEVELS:
        return encoding.EFFORT_PRESETS[DEEPSEEK_EFFORT_LEVELS[value]]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and 1 <= value <= 100:
        return value
    hint = " (to turn reasoning off send thinking: {\"type\": \"disabled\"})" if value == "none" else ""
    raise bad(f"invalid {param} {value!r}: expected low, medium, high, max (or minimal, xhigh, ultra) or an "
              f"integer 1-100{hint}", param, "invalid_reasoning_effort")


@dataclass
class Sampling:
    temperature: float
    top_p: float
    seed: int | None


@dataclass
class ChatParams:
    """A validated /v1/chat/completions request."""

    messages: list[dict]
    mode: str  # thinking | chat
    effort: int  # the effort line's budget (rendered in thinking mode only)
    tools: list[dict] | None  # None: no tool list in the prompt
    sampling: Sampling
    max_tokens: int | None  # None: what the context leaves
    stop: list[str]
    stream: bool
    include_usage: bool

    def prompt(self) -> str:
        """The V4.1 prompt text (model/encoding.py); a message the encoder refuses is a 400."""
        messages = self.messages
        if self.tools:
            messages = encoding.attach_tools(messages, self.tools)
        try:
            return encoding.encode_messages(messages, mode=self.mode, effort=self.effort)
        except (ValueError, TypeError, KeyError) as e:
            raise bad(f"messages: {e}", "messages") from None


@dataclass
class CompletionParams:
    """A validated /v1/completions request: one or more prompts (text or token ids)."""

    prompts: list[str | list[int]]
    sampling: Sampling
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # None: none returned; k: the k most likely tokens at each position too
    add_special_tokens: bool = True  # BOS first unless the prompt starts with it (vLLM's field name)


class _Body:
    """The request's JSON object, read field by field; what is left at the end is unknown."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        self.fields = dict(body)

    def pop(self, name: str, default=None):
        return self.fields.pop(name, default)

    def finish(self) -> None:
        for name in sorted(self.fields):
            value = self.fields.pop(name)
            if name in IGNORED:
                continue
            if name in _NEUTRAL:
                if not _NEUTRAL[name](value):
                    raise bad(f"{name}={json.dumps(value)[:80]} is not supported by this server (docs/serve.md, "
                              "\"Not supported\")", name, "unsupported_parameter")
                continue
            raise bad(f"unknown parameter {name!r}", name, "unknown_parameter")


def _number(body: _Body, name: str, default, low: float, high: float) -> float:
    value = body.pop(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad(f"{name} must be a number in [{low:g}, {high:g}], not {json.dumps(value)[:40]}", name)
    return float(value)


def _sampling(body: _Body) -> Sampling:
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0)
    top_p = _number(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p must be above 0", "top_p")
    seed = body.pop("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"seed must be an integer, not {json.dumps(seed)[:40]}", "seed")
    return Sampling(temperature, top_p, None if seed is None else seed % 2**63)


def _int_field(value, name: str, low: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(f"{name} must be an integer >= {low}, not {json.dumps(value)[:40]}", name)
    return value


def _stop(body: _Body) -> list[str]:
    stop = body.pop("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop must be a string or a list of strings", "stop")
    stop = [s for s in stop if s]
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return stop


def _n(body: _Body) -> None:
    n = body.pop("n")
    if n not in (None, 1):
        raise bad(f"n={json.dumps(n)[:20]}: this server returns one choice per prompt (n must be 1)", "n",
                  "unsupported_parameter")


def _stream(body: _Body) -> tuple[bool, bool]:
    stream = body.pop("stream")
    if stream not in (None, True, False):
        raise bad("stream must be a boolean", "stream")
    options = body.pop("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options takes include_usage only", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        include_usage = bool(options.get("include_usage"))
    return bool(stream), include_usage


def check_model(body: _Body, served: str) -> None:
    model = body.pop("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (GET /v1/models lists it)", "model")
    if model != served:
        raise bad(f"the model {model!r} does not exist here; this server serves {served!r}", "model",
                  "model_not_found")


# ------------------------------------------------------------------------------------------- chat
_ROLES = ("system", "user", "assistant", "tool")


def check_tools(tools: Any) -> list[dict]:
    """An OpenAI tool list (each a function with a name and a JSON Schema object of parameters)."""
    if not isinstance(tools, list):
        raise bad("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools", "invalid_tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad(f"{where}: each tool must be an object with type \"function\"", "tools", "invalid_tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where}: \"function\" must be an object", "tools", "invalid_tools")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise bad(f"{where}: function.name must be a non-empty string", "tools", "invalid_tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad(f"{where} ({fn['name']}): function.parameters must be a JSON Schema object", "tools",
                      "invalid_tools")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad(f"{where} ({fn['name']}): function.description must be a string", "tools", "invalid_tools")
    return tools


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad(f"messages[{i}]: each message needs a role of {', '.join(_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            for block in content:
                if not isinstance(block, dict) or block.get("type") != "text":
                    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                    raise bad(f"messages[{i}]: content blocks of type {kind!r} are not supported (text only)",
                              "messages", "unsupported_content")
            content = "\n\n".join(block.get("text") or "" for block in content)
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}]: content must be a string or a list of text blocks", "messages")
        m = copy.deepcopy(m)
        m["content"] = content
        if m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                    for c in calls):
                raise bad(f"messages[{i}]: tool_calls must be a list of OpenAI calls on an assistant message",
                          "messages", "invalid_tool_calls")
        out.append(m)
    if out[-1]["role"] == "assistant":
        raise bad("the last message is the assistant's: continuing an assistant turn is not supported", "messages")
    return out


def _thinking(body: _Body) -> tuple[str, int]:
    """(mode, effort) from DeepSeek's `thinking` and `reasoning_effort`, or vLLM/SGLang's
    `chat_template_kwargs` {thinking, reasoning_effort} (what scaffold-bench --endpoint sends)."""
    thinking, effort = body.pop("thinking"), body.pop("reasoning_effort")
    kwargs = body.pop("chat_template_kwargs")
    enabled: bool | None = None
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled") or set(thinking) - {"type"}:
            raise bad("thinking must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}", "thinking")
        enabled = thinking["type"] == "enabled"
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"thinking", "reasoning_effort"}:
            raise bad("chat_template_kwargs takes thinking (a boolean) and reasoning_effort only",
                      "chat_template_kwargs")
        if "thinking" in kwargs:
            if not isinstance(kwargs["thinking"], bool) or (enabled is not None and enabled != kwargs["thinking"]):
                raise bad("chat_template_kwargs.thinking must be a boolean that agrees with thinking.type",
                          "chat_template_kwargs")
            enabled = kwargs["thinking"]
        if kwargs.get("reasoning_effort") is not None:
            if effort is not None and effort != kwargs["reasoning_effort"]:
                raise bad("reasoning_effort given twice with different values", "reasoning_effort")
            effort = kwargs["reasoning_effort"]
    budget = encoding.DEFAULT_EFFORT if effort is None else _effort_from(effort, "reasoning_effort")
    return ("chat" if enabled is False else "thinking"), budget


def parse_chat(raw: Any, served: str) -> ChatParams:
    body = _Body(raw)
    check_model(body, served)
    messages = _check_messages(body.pop("messages"))
    mode, effort = _thinking(body)
    tools = body.pop("tools")
    tools = check_tools(tools) if tools is not None else None
    choice = body.pop("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad(f"tool_choice {json.dumps(choice)[:60]} is not supported: auto or none (docs/serve.md)",
                  "tool_choice", "unsupported_parameter")
    if choice == "none" or not tools:
        tools = None
    sampling = _sampling(body)
    max_tokens = _int_field(body.pop("max_tokens"), "max_tokens", 1)
    max_completion = _int_field(body.pop("max_completion_tokens"), "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad("max_tokens and max_completion_tokens disagree", "max_completion_tokens")
    stop = _stop(body)
    _n(body)
    stream, include_usage = _stream(body)
    body.finish()
    return ChatParams(messages, mode, effort, tools, sampling, max_completion or max_tokens, stop, stream,
                      include_usage)


# ------------------------------------------------------------------------------------------- completions
def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of ids, a list of id lists."""
    def ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if ids(value) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or (ids(p) and p) for p in value):
        return list(value)
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
              "prompt")


def parse_completion_request(raw: Any, served: str) -> CompletionParams:
    body = _Body(raw)
    check_model(body, served)
    prompts = _prompts(body.pop("prompt"))
    sampling = _sampling(body)
    max_tokens = _int_field(body.pop("max_tokens"), "max_tokens", 0)
    stop = _stop(body)
    _n(body)
    stream, include_usage = _stream(body)
    echo = body.pop("echo")
    if echo not in (None, True, False):
        raise bad("echo must be a boolean", "echo")
    logprobs = body.pop("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20):
        raise bad("logprobs must be an integer 0-20 (the most likely tokens returned at each position)", "logprobs")
    add_special = body.pop("add_special_tokens")
    if add_special not in (None, True, False):
        raise bad("add_special_tokens must be a boolean", "add_special_tokens")
    body.finish()
    if stream and (echo or logprobs is not None or len(prompts) > 1):
        raise bad("stream: true takes one prompt, without echo or logprobs", "stream", "unsupported_parameter")
    return CompletionParams(prompts, sampling, 16 if max_tokens is None else max_tokens, stop, stream,
                            include_usage, bool(echo), logprobs, add_special is not False)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.reasoning_tokens += other.reasoning_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}


__all__ = ["APIError", "ChatParams", "CompletionParams", "Usage", "parse_chat", "parse_completion_request",
           "check_tools", "DEEPSEEK_EFFORT_LEVELS"]
