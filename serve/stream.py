"""The reply builders: generated token ids -> what the client receives, token by token.

`ChatReply` turns model/completion.py's `CompletionStream` events into chat-completion deltas
(`reasoning_content`, `content`, whole `tool_calls`). CompletionStream releases text only once it can no
longer become markup, so no delta ever holds a piece of a DSML marker or a special token, however the
tokens fall; its deltas concatenate to `parse_completion` of the whole text. Stop strings apply to the
answer (`content`) only, as the in-process lm-eval model applies `until` after `</think>`: the content
is held back by the longest tail that may still begin a stop string, and a stop string found ends the
request there (its text excluded, as OpenAI does). `TextReply` is the raw-text form for /v1/completions.

Both run on the engine thread inside the request's `on_token` hook (so that a stop string can end the
request at the token that completed it) and collect their deltas in `pending`, which the worker hands
to the request's HTTP handler after each scheduler step. The non-streamed answer is the concatenation
of the same deltas, so streamed and non-streamed replies are built by one path.
"""

from __future__ import annotations

from dsv41.model.completion import CompletionStream

STOPPED = "stop_string"  # the finish reason a stop string gives inside the engine (OpenAI's "stop" outside)


class StopFilter:
    """Streaming search for stop strings: `push(text)` returns the text that is certain (no stop string
    can begin in it) and whether a stop string was found (then nothing after it is ever released)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        text = self.held + text
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[:min(found)]
        keep = 0
        for s in self.stops:  # the longest tail of text that is a proper beginning of a stop string
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if s.startswith(text[-n:]):
                    keep = n
                    break
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of the reply: the held tail was no stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class ChatReply:
    """One chat completion as deltas. `pending` collects {"reasoning_content": str}, {"content": str} and
    {"tool_call": {index, id, type, function}} items; `close` adds the rest and returns the finish reason."""

    def __init__(self, tokenizer, mode: str, stop: list[str], tools_allowed: bool = True):
        self.parser = CompletionStream(tokenizer, mode)
        self.mode = mode
        self.stop = StopFilter(stop)
        self.tools_allowed = tools_allowed
        self.think_end_id = tokenizer.token_to_id("</think>")
        self.pending: list[dict] = []
        self.tokens = 0
        self.reasoning_tokens = 0
        self._in_reasoning = mode == "thinking"
        self.tool_calls: list[dict] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []

    def on_token(self, token: int) -> str | None:
        """The Request's hook: one committed token; returns STOPPED when a stop string completed."""
        self.tokens += 1
        if self._in_reasoning:
            if token == self.think_end_id:
                self._in_reasoning = False
            else:
                self.reasoning_tokens += 1
        if self.stop.stopped:
            return STOPPED
        self._events(self.parser.feed(token))
        return STOPPED if self.stop.stopped else None

    def close(self, finish_reason: str) -> str:
        """The held-back text and calls (from the parse of the whole completion); the OpenAI finish reason."""
        if not self.stop.stopped:
            self._events(self.parser.close("stop" if finish_reason == "stop" else "length"))
            self._emit("content", self.stop.flush())
        if self.stop.stopped or finish_reason == STOPPED:
            return "stop"
        if self.tool_calls:
            return "tool_calls"
        return finish_reason

    def _events(self, events) -> None:
        for event in events:
            if event.kind == "reasoning":
                self._emit("reasoning_content", event.text)
            elif event.kind == "content":
                self._emit("content", self.stop.push(event.text))
            elif event.kind == "tool_call" and self.tools_allowed and not self.stop.stopped:
                call = {"index": event.index, "id": event.id, "type": "function",
                        "function": {"name": event.name, "arguments": event.arguments}}
                self.tool_calls.append(call)
                self.pending.append({"tool_call": call})
            if self.stop.stopped:
                return

    def _emit(self, channel: str, text: str) -> None:
        if text:
            (self.content if channel == "content" else self.reasoning).append(text)
            self.pending.append({channel: text})


class TextReply:
    """One raw-text completion (/v1/completions): the decoded continuation, stop strings applied. The
    end-of-sentence token ends the text and is not part of it; other special tokens are text here."""

    def __init__(self, tokenizer, stop: list[str], eos_id: int):
        self.tok, self.eos_id = tokenizer, eos_id
        self.stop = StopFilter(stop)
        self.pending: list[dict] = []
        self.text: list[str] = []
        self.tokens = 0
        self.reasoning_tokens = 0
        self._undecoded: list[int] = []  # ids whose text ends inside a UTF-8 character

    def on_token(self, token: int) -> str | None:
        self.tokens += 1
        if self.stop.stopped:
            return STOPPED
        if token == self.eos_id:
            return None
        self._undecoded.append(token)
        text = self.tok.decode(self._undecoded)
        if text.endswith("\ufffd") and len(self._undecoded) < 8:
            return None
        self._undecoded = []
        self._emit(self.stop.push(text))
        return STOPPED if self.stop.stopped else None

    def close(self, finish_reason: str) -> str:
        if not self.stop.stopped:
            if self._undecoded:
                self._emit(self.stop.push(self.tok.decode(self._undecoded)))
            self._emit(self.stop.flush())
        return "stop" if self.stop.stopped or finish_reason == STOPPED else finish_reason

    def _emit(self, text: str) -> None:
        if text:
            self.text.append(text)
            self.pending.append({"text": text})
