"""Backends: what answers the agent loop's chat requests.

The contract (:class:`Backend`) is one call::

    chat(messages, tools, effort) -> (text, output_tokens)

``messages`` is an OpenAI-format message list (system / user / assistant with optional
``reasoning_content`` and ``tool_calls`` / tool with ``tool_call_id``), which is also the schema of the
V4.1 chat encoder (model/encoding.py). ``tools`` is an OpenAI tool list when the scaffold passes tools
natively, else None. ``effort`` is 1..100 for thinking mode or None for chat mode.

``text`` is the completion as the V4.1 model writes it after the generation prompt, special tokens
included: in thinking mode ``{reasoning}</think>{content}``, then ``\\n\\n`` and a DSML calls block when
there are native tool calls, then ``<｜end▁of▁sentence｜>`` when generation stopped by itself (not at
a length limit). Every scaffold reads actions out of this text with the one completion parser,
:func:`dsv41.model.completion.parse_completion`. ``output_tokens`` is the number of generated tokens (None when
the backend cannot tell).

A backend may also have ``begin(task, scaffold)``, called before each episode (the oracle uses it).

Backends here:

* :class:`OracleBackend` replays each task's reference solution (and each function-calling item's
  ground truth) in the scaffold's own action format. It must pass every task: that checks the tasks,
  the parsers and the loop, not a model.
* :class:`EndpointBackend` talks to any OpenAI-compatible ``/chat/completions`` URL (key from an
  environment variable, retries with exponential backoff, a per-request timeout).
* :class:`LocalBackend` runs the dsv41 engine in-process (``dsv41.model.engine.generate_chat``) on a
  checkpoint directory, with effort through the chat encoding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Protocol, runtime_checkable

from dsv41.evals.scaffolds.actions import ToolCall, write_action
from dsv41.model.encoding import EFFORT_PRESETS, EOS, THINK_END, render_tool_calls


class BackendError(RuntimeError):
    """A request failed after all retries (the episode fails; the bench goes on)."""


class BackendFatal(RuntimeError):
    """A request the server will never accept (bad URL, key or request): the bench stops."""


@runtime_checkable
class Backend(Protocol):
    name: str

    def chat(self, messages: list[dict], tools: list[dict] | None, effort: int | None) -> tuple[str, int | None]:
        ...


def mode_of(effort: int | None) -> str:
    """Thinking mode carries an effort; chat mode has none."""
    return "chat" if effort is None else "thinking"


class TokenCounter:
    """Counts tokens of completion text with the DeepSeek tokenizer (loaded on first use)."""

    def __init__(self, path=None):
        self.path = path
        self._tokenizer = None
        self._failed = False
        self._lock = threading.Lock()

    def __call__(self, text: str) -> int | None:
        with self._lock:
            if self._tokenizer is None and not self._failed:
                try:
                    from dsv41.model.tokenizer import load_tokenizer

                    self._tokenizer = load_tokenizer(self.path)
                except Exception:  # noqa: BLE001 - token counts are optional, the bench is not
                    self._failed = True
        if self._tokenizer is None:
            return None
        return len(self._tokenizer.encode(text))


# ---------------------------------------------------------------------------------------------
# Oracle
# ---------------------------------------------------------------------------------------------


class OracleBackend:
    """Replays the reference: for an agent task, each step of ``solution/solve.sh`` as one bash action
    and then the submit command; for a function-calling item, the ground-truth calls (first acceptable
    value of each argument; optional ones left out) or, for irrelevance items, a plain answer."""

    name = "oracle"

    def __init__(self, count_tokens: TokenCounter | None = None):
        self.count_tokens = count_tokens or TokenCounter()
        self._state = threading.local()  # the episode being replayed, per thread (run_bench jobs > 1)

    def begin(self, task, scaffold) -> None:
        state = self._state
        state.scaffold = scaffold
        if task.kind == "agent":
            steps = task.solution_steps()
            state.plan = [([ToolCall("bash", {"command": c})], f"Step {i + 1} of {len(steps)} of the reference solution.")
                          for i, c in enumerate(steps)]
            state.submit = [ToolCall("bash", {"command": f"echo {scaffold.submit_sentinel}"})]
            state.plan.append((state.submit, "The reference solution is complete; submitting."))
        else:
            calls = [ToolCall(name, {k: v[0] for k, v in params.items() if v[0] != ""})
                     for name, params in (next(iter(c.items())) for c in task.ground_truth)]
            state.plan = [(calls, "Answering with the reference calls.")]
            state.submit = []

    def chat(self, messages, tools, effort):
        state = self._state
        scaffold = getattr(state, "scaffold", None)
        if scaffold is None:
            raise RuntimeError("OracleBackend.chat called before begin(task, scaffold)")
        calls, thought = state.plan.pop(0) if state.plan else (state.submit, "Submitting again.")
        calls = [ToolCall(c.name, dict(c.arguments), f"call_{number}") for number, c in enumerate(calls)]
        answer = None if calls else "None of the available functions can answer this request."
        text = write_action(scaffold.action_format, calls, mode_of(effort), thought=thought,
                            answer=answer, options=scaffold.action_options)
        return text, self.count_tokens(text)


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible endpoint
# ---------------------------------------------------------------------------------------------

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
EFFORT_STYLES = ("deepseek", "openai", "none")


class EndpointBackend:
    """Any OpenAI-compatible chat-completions server.

    url: the server's base URL (``http://host:8000/v1``) or the full ``.../chat/completions`` URL.
    model: the served model name (default: the first id listed by ``GET {base}/models``).
    api_key_env: environment variable holding the key (sent as ``Authorization: Bearer``; none if unset).
    timeout: seconds per request; retries: extra attempts on connection errors, timeouts, 408/409/425/429
    and 5xx, waiting backoff * 2**attempt seconds (capped at max_backoff, or the server's Retry-After).
    effort_style: how effort reaches the server: ``deepseek`` sends
    ``chat_template_kwargs = {"thinking": bool, "reasoning_effort": effort}`` (vLLM and SGLang pass these
    to the chat template); ``openai`` sends ``reasoning_effort`` = low (<= 50) | medium | high (>= 75) in
    thinking mode; ``none`` sends nothing.
    extra_body: fields merged into every request (e.g. temperature, max_tokens).
    """

    name = "endpoint"

    def __init__(self, url: str, model: str | None = None, *, api_key_env: str = "OPENAI_API_KEY",
                 timeout: float = 120.0, retries: int = 4, backoff: float = 1.0, max_backoff: float = 30.0,
                 effort_style: str = "deepseek", extra_body: dict | None = None, sleep=time.sleep,
                 count_tokens: TokenCounter | None = None):
        if effort_style not in EFFORT_STYLES:
            raise ValueError(f"effort_style must be one of {', '.join(EFFORT_STYLES)}")
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint URL must start with http:// or https://, got {url!r}")
        self.chat_url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.base_url = self.chat_url[: -len("/chat/completions")]
        self.model = model
        self.api_key_env = api_key_env
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.effort_style = effort_style
        self.extra_body = dict(extra_body or {})
        self.sleep = sleep
        self.count_tokens = count_tokens or TokenCounter()
        self.requests_made = 0

    # -------------------------------------------------------------- HTTP
    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _request(self, method: str, url: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        last_error, wait_hint = "no attempt made", None
        for attempt in range(self.retries + 1):
            if attempt:  # exponential backoff, or what the server asked for
                delay = wait_hint if wait_hint is not None else self.backoff * 2 ** (attempt - 1)
                self.sleep(min(self.max_backoff, delay))
            wait_hint = None
            request = urllib.request.Request(url, data=data, method=method, headers=self._headers())
            self.requests_made += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as e:
                detail = " ".join(e.read()[:300].decode("utf-8", "replace").split())
                if e.code not in _RETRY_STATUS:
                    raise BackendFatal(f"{method} {url}: HTTP {e.code}: {detail}") from None
                last_error = f"HTTP {e.code}: {detail}"
                retry_after = (e.headers.get("Retry-After") or "").strip() if e.headers else ""
                wait_hint = float(retry_after) if retry_after.isdigit() else None
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                last_error = f"{type(reason).__name__}: {reason}"
                continue
            try:
                return json.loads(raw)
            except ValueError:
                last_error = f"the reply is not JSON: {raw[:120]!r}"
        raise BackendError(f"{method} {url} failed after {self.retries + 1} attempts: {last_error}")

    def resolve_model(self) -> str:
        if self.model is None:
            listing = self._request("GET", self.base_url + "/models")
            try:
                self.model = str(listing["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise BackendFatal(f"GET {self.base_url}/models lists no model; pass the model name") from None
        return self.model

    # -------------------------------------------------------------- chat
    def request_body(self, messages: list[dict], tools: list[dict] | None, effort: int | None) -> dict:
        body: dict = {"model": self.resolve_model(), "messages": [_wire_message(m) for m in messages]}
        if tools:
            body["tools"] = tools
        if self.effort_style == "deepseek":
            kwargs = {"thinking": effort is not None}
            if effort is not None:
                kwargs["reasoning_effort"] = effort
            body["chat_template_kwargs"] = kwargs
        elif self.effort_style == "openai" and effort is not None:
            body["reasoning_effort"] = "low" if effort <= 50 else ("high" if effort >= 75 else "medium")
        body.update(self.extra_body)
        return body

    def chat(self, messages, tools, effort):
        reply = self._request("POST", self.chat_url, self.request_body(messages, tools, effort))
        try:
            choice = reply["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise BackendError(f"the server's reply has no choices[0].message: {json.dumps(reply)[:200]}") from None
        text = completion_text(message, choice.get("finish_reason"), mode_of(effort))
        usage = reply.get("usage") or {}
        tokens = usage.get("completion_tokens")
        return text, int(tokens) if isinstance(tokens, (int, float)) else self.count_tokens(text)


def _wire_message(message: dict) -> dict:
    """A history message as sent to a server: reasoning passed back only on assistant turns that made
    tool calls (as the official V4 serializer does), tool-call arguments as JSON strings."""
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if message.get("role") == "assistant" and message.get("tool_calls"):
        if message.get("reasoning_content"):
            out["reasoning_content"] = message["reasoning_content"]
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function", {}))
            if not isinstance(function.get("arguments"), str):
                function["arguments"] = json.dumps(function.get("arguments", {}), ensure_ascii=False)
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    if out.get("content") is None:
        out["content"] = ""
    return out


def completion_text(message: dict, finish_reason: str | None, mode: str) -> str:
    """The V4.1 completion text of a chat-completions reply message (see the module docstring).

    Structured ``tool_calls`` are written back as the DSML block the model would have produced, so the
    same parser reads them; DSML that leaked into ``content`` (a server without the tool parser) is
    still read. A server without a reasoning parser leaves ``...</think>`` inside the content: then no
    second ``</think>`` is added."""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    content = message.get("content") or ""
    if isinstance(content, list):  # content blocks
        content = "".join(block.get("text", "") for block in content if isinstance(block, dict))
    if mode == "thinking" and not (THINK_END in content and not reasoning):
        text = f"{reasoning}{THINK_END}{content}"
    else:
        text = content
    tool_calls = message.get("tool_calls") or []
    if tool_calls:
        try:
            text += "\n\n" + render_tool_calls(tool_calls)
        except (ValueError, TypeError, AttributeError):
            # Calls the server sent in a shape we cannot write back: leave an unterminated calls block,
            # which the parser reports as a format error instead of dropping the calls silently.
            text += "\n\n<｜DSML｜ calls>"
    if finish_reason != "length":
        text += EOS
    return text


# ---------------------------------------------------------------------------------------------
# The local dsv41 engine
# ---------------------------------------------------------------------------------------------


class LocalBackend:
    """The dsv41 engine in this process: the checkpoint at `model_dir` (official or runtime layout),
    greedy decoding, effort through the V4.1 chat encoding's effort line."""

    name = "local"

    def __init__(self, model_dir, device: str = "cpu", max_new_tokens: int = 512):
        from dsv41.model.checkpoint import load_model
        from dsv41.model.engine import Generator

        model, self.args, self.tokenizer = load_model(model_dir, device=device)
        self.generator = Generator(model, self.tokenizer)
        self.max_new_tokens = max_new_tokens
        self._lock = threading.Lock()  # one model, one forward at a time (run_bench may use threads)

    def chat(self, messages, tools, effort):
        from dsv41.model.engine import generate_chat

        with self._lock:
            return generate_chat(self.generator, messages, tools, effort, self.max_new_tokens)


def local_backend_available() -> bool:
    """Whether the ``local`` backend can run: its adapter here, ``LocalBackend(model_dir, device)``, and torch,
    which the inference engine (model/engine.py) runs on. Asked without importing torch: every scaffold-bench
    run asks (for its --backend choices), the oracle and endpoint runs included, which never load it, and the
    import alone takes seconds."""
    return "LocalBackend" in globals() and importlib.util.find_spec("torch") is not None


def effort_label(effort: int | None) -> str:
    if effort is None:
        return "chat"
    names = {v: k for k, v in EFFORT_PRESETS.items()}
    return f"{effort} ({names[effort]})" if effort in names else str(effort)


__all__ = [
    "Backend", "BackendError", "BackendFatal", "EndpointBackend", "LocalBackend", "OracleBackend", "TokenCounter",
    "completion_text", "effort_label", "local_backend_available", "mode_of",
]
