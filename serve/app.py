"""The Starlette application of `dsv41 serve`: the routes of docs/serve.md over one `Worker`.

Every handler validates the whole request first (serve/protocol.py; a 400 changes nothing), then asks
for room: a request holds one unit per prompt from admission to its last byte, and past
`max_batch_size + max_queue` units the answer is 429 with Retry-After. The engine thread then accepts
the request (or refuses it with the engine's own error, still before any work), and the handler
streams what the engine hands it. A client that goes away cancels its request (`Worker.cancel`, which
frees its row at the next step): for a stream, Starlette cancels the response when the connection
closes; for a plain answer the handler watches the connection while it waits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from dsv41.serve.protocol import APIError, Usage, bad, parse_chat, parse_completion_request
from dsv41.serve.stream import ChatReply, TextReply
from dsv41.serve.worker import Channel, Job, ScoreJob, Worker

RETRY_AFTER_SECONDS = 1


class ClientGone(Exception):
    """The client closed the connection while its answer was being computed."""


class ServeState:
    """What the handlers share (all on the event loop's thread: no locks)."""

    def __init__(self, worker: Worker, tokenizer, model_name: str, api_key: str | None, max_queue: int):
        self.worker, self.tok, self.model_name, self.api_key = worker, tokenizer, model_name, api_key
        self.capacity = worker.max_batch_size + max_queue
        self.inflight = 0
        self.draining = False
        self.created = int(time.time())
        self.served = self.refused_busy = 0

    def admit(self, units: int) -> None:
        if self.draining:
            raise APIError("the server is shutting down", 503, code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if self.inflight + units > self.capacity:
            self.refused_busy += 1
            raise APIError(f"the server is busy: {self.inflight} requests in flight, at most {self.capacity} "
                           "(--max-batch-size + --max-queue); retry later", 429, code="rate_limit_exceeded",
                           type="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.inflight += units

    def release(self, units: int) -> None:
        self.inflight -= units
        self.served += units


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _endpoint(fn, authenticated: bool = True):
    """A handler with the bearer check and OpenAI-style errors."""

    async def handler(request: Request):
        state: ServeState = request.app.state.serve
        try:
            if authenticated and state.api_key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                    raise APIError("invalid or missing API key (Authorization: Bearer KEY)", 401,
                                   code="invalid_api_key")
            return await fn(request, state)
        except APIError as e:
            return _error_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nobody reads it

    return handler


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _accepted(state: ServeState, job) -> None:
    """Submit and wait for the engine thread to take it (or refuse it before any work)."""
    state.worker.submit(job)
    kind, value = await job.channel.get()
    if kind == "error":
        raise value


async def _results(job, request: Request, state: ServeState):
    """Every item of a job up to its last ("done", "scored"), watching the connection meanwhile."""
    async def drain():
        items = []
        while True:
            kind, value = await job.channel.get()
            if kind == "error":
                raise value
            items.append((kind, value))
            if kind in ("done", "scored"):
                return items

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            state.worker.cancel(job.key)
        gone.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone()
    return work.result()


def _hold(state: ServeState, units: int):
    """Take `units` places of the bounded queue (429 past it); returns the function that gives them back,
    once however often it is called (a stream's clean-up and a failed submission may both call it)."""
    state.admit(units)
    released = False

    def release():
        nonlocal released
        if not released:
            released = True
            state.release(units)

    return release


def _stream(state: ServeState, job, release, opening: list[str], deltas, done) -> "_CleanStream":
    """The SSE answer of one submitted job: the `opening` chunks, then `deltas(value)`'s chunks for every
    hand-over of the engine and `done(value)`'s at its end; an engine error ends the stream with its error
    object. However the stream ends, its places are given back, and a stream closed before the job's end
    (the client gone) cancels the job."""
    finished = False

    def cleanup():
        if not finished:
            state.worker.cancel(job.key)
        release()

    async def events():
        nonlocal finished
        for chunk in opening:
            yield chunk
        while True:
            kind, value = await job.channel.get()
            if kind == "error":
                finished = True
                yield _sse(value.body())
                return
            if kind == "deltas":
                for chunk in deltas(value):
                    yield chunk
            elif kind == "done":
                finished = True
                for chunk in done(value):
                    yield chunk
                return

    return _CleanStream(events(), cleanup)


class _CleanStream(StreamingResponse):
    """A streamed answer whose clean-up runs however it ends: finished, failed, or its client gone
    (Starlette cancels the body when the connection closes, maybe before the body ever started)."""

    def __init__(self, body, cleanup):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def _sse(doc) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


def _merge(items: list[dict]) -> list[dict]:
    """Neighbouring deltas of one channel joined (a hand-over can hold several)."""
    out: list[dict] = []
    for item in items:
        (channel, value), = item.items()
        if out and channel != "tool_call" and channel in out[-1]:
            out[-1][channel] += value
        else:
            out.append({channel: value})
    return out


def _clamp_max_tokens(state: ServeState, prompt_len: int, asked: int | None) -> int:
    """max_tokens as asked, or what the context and the token budget leave the prompt."""
    if asked is not None:
        return asked  # the scheduler refuses what cannot fit, with its own message
    room = min(state.worker.max_len, state.worker.max_batch_tokens_effective) - prompt_len
    if room < 1:
        raise bad(f"the prompt ({prompt_len} tokens) leaves no room in the model's context of "
                  f"{state.worker.max_len} tokens", "messages", "context_length_exceeded")
    return room


# ------------------------------------------------------------------------------------------- chat
async def chat_completions(request: Request, state: ServeState):
    params = parse_chat(await _json(request), state.model_name)
    tok = state.tok
    prompt_ids = tok.encode(params.prompt(), allow_special=True)
    max_tokens = _clamp_max_tokens(state, len(prompt_ids), params.max_tokens)
    loop = asyncio.get_running_loop()
    reply = ChatReply(tok, params.mode, params.stop, tools_allowed=params.tools is not None)
    job = Job(prompt_ids, params.sampling, max_tokens, reply, Channel(loop), (tok.eos_id,))
    release = _hold(state, 1)
    try:
        await _accepted(state, job)
    except BaseException:
        release()
        raise
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "created": created, "model": state.model_name}

    def usage() -> Usage:
        return Usage(len(prompt_ids), reply.tokens, reply.reasoning_tokens)

    if params.stream:
        chunk = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if params.include_usage else {}

        def delta(d: dict, finish=None) -> str:
            return _sse({**chunk, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}],
                         **extra})

        # one write per delta (a step's deltas of one channel are merged): measured against one write per
        # stream and step, no difference in the loop's CPU or the rate (cpu-serve/NOTES.md)
        def deltas(value):
            return [delta({"tool_calls": [item["tool_call"]]} if "tool_call" in item else item) for item in _merge(value)]

        def done(value):
            usage_chunk = [_sse({**chunk, "choices": [], "usage": usage().body()})] if params.include_usage else []
            return [delta({}, value["finish_reason"]), *usage_chunk, "data: [DONE]\n\n"]

        return _stream(state, job, release, [delta({"role": "assistant", "content": ""})], deltas, done)

    try:
        items = await _results(job, request, state)
    finally:
        release()
    done = items[-1][1]
    message = {"role": "assistant", "content": "".join(reply.content),
               "reasoning_content": "".join(reply.reasoning) if params.mode == "thinking" else None}
    if reply.tool_calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in reply.tool_calls]
        message["content"] = message["content"] or None
    return JSONResponse({**head, "object": "chat.completion",
                         "choices": [{"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": done["finish_reason"]}],
                         "usage": usage().body()})


# ------------------------------------------------------------------------------------------- completions
def _prompt_ids(state: ServeState, prompt) -> list[int]:
    ids = state.tok.encode(prompt, allow_special=True) if isinstance(prompt, str) else list(prompt)
    vocab = state.worker.gen.args.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise bad(f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
    return ids


async def completions(request: Request, state: ServeState):
    params = parse_completion_request(await _json(request), state.model_name)
    tok = state.tok
    prompts = [_prompt_ids(state, p) for p in params.prompts]
    contexts = []
    for ids in prompts:
        bos = [tok.bos_id] if params.add_special_tokens and (not ids or ids[0] != tok.bos_id) else []
        context = bos + ids
        if not context:
            raise bad("an empty prompt (with add_special_tokens false) has nothing to continue", "prompt")
        if len(context) + params.max_tokens > state.worker.max_len:
            raise bad(f"the prompt ({len(context)} tokens) and max_tokens ({params.max_tokens}) exceed the model's "
                      f"context of {state.worker.max_len} tokens", "prompt", "context_length_exceeded")
        contexts.append((context, len(bos)))
    loop = asyncio.get_running_loop()
    release = _hold(state, len(prompts))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if params.stream:
        (context, _), = contexts
        reply = TextReply(tok, params.stop, tok.eos_id)
        job = Job(context, params.sampling, params.max_tokens, reply, Channel(loop), (tok.eos_id,))
        try:
            if params.max_tokens == 0:
                raise bad("stream: true needs max_tokens >= 1", "max_tokens")
            await _accepted(state, job)
        except BaseException:
            release()
            raise
        chunk = {**head, "object": "text_completion"}
        extra = {"usage": None} if params.include_usage else {}

        def piece(text: str, finish=None) -> str:
            return _sse({**chunk, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                         **extra})

        def done(value):
            usage_chunk = ([_sse({**chunk, "choices": [], "usage": Usage(len(context), reply.tokens).body()})]
                           if params.include_usage else [])
            return [piece("", value["finish_reason"]), *usage_chunk, "data: [DONE]\n\n"]

        return _stream(state, job, release, [], lambda value: [piece("".join(item["text"] for item in value))], done)

    try:
        choices = await asyncio.gather(*(_one_completion(state, request, params, ids, context, added, index)
                                         for index, (ids, (context, added)) in enumerate(zip(prompts, contexts))))
    finally:
        release()
    usage = Usage()
    for _, u in choices:
        usage.add(u)
    return JSONResponse({**head, "object": "text_completion", "choices": [c for c, _ in choices], "usage": usage.body()})


async def _one_completion(state: ServeState, request: Request, params, ids: list[int], context: list[int],
                          added: int, index: int):
    tok = state.tok
    loop = asyncio.get_running_loop()
    output_ids: list[int] = []
    text, finish = "", "length"
    reply = TextReply(tok, params.stop, tok.eos_id)
    if params.max_tokens > 0:
        job = Job(context, params.sampling, params.max_tokens, reply, Channel(loop), (tok.eos_id,))
        await _accepted(state, job)
        items = await _results(job, request, state)
        done = items[-1][1]
        output_ids, finish, text = done["output_ids"], done["finish_reason"], "".join(reply.text)
    prompt_text = tok.decode(ids) if params.echo else ""
    choice = {"index": index, "text": prompt_text + text, "logprobs": None, "finish_reason": finish}
    if params.logprobs is not None:
        # The prompt's tokens are scored by a forward over the prompt alone, and the generated ones by a
        # forward over prompt and reply: the model's numbers at a position depend on how many tokens the
        # forward takes (its GEMM shapes; docs/serve.md), so this keeps a prompt's scores those of the lm-eval
        # adapter and bits per byte, whatever max_tokens is.
        scores = []
        for ids_scored in ([context] if params.echo else []) + ([context + output_ids] if output_ids else []):
            job = ScoreJob(ids_scored, params.logprobs, Channel(loop))
            state.worker.submit(job)
            (_, got), = await _results(job, request, state)
            scores.append(got)
        prompt_scores = scores[0] if params.echo else None
        reply_scores = scores[-1] if output_ids else None
        choice["logprobs"] = _logprobs_object(tok, ids if params.echo else [], output_ids, context, added,
                                              prompt_scores, reply_scores, params.logprobs)
    return choice, Usage(len(context), len(output_ids))


def _logprobs_object(tok, echoed: list[int], output_ids: list[int], context: list[int], added: int,
                     prompt_scores, reply_scores, top: int) -> dict:
    """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset. Position j of `context +
    output` (j >= 1) was scored (prompt positions by `prompt_scores`, reply positions by `reply_scores`);
    the first token of a prompt without BOS before it has no log-probability."""
    shown = [(added + i, t) for i, t in enumerate(echoed)] + [(len(context) + i, t) for i, t in enumerate(output_ids)]
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for position, token in shown:
        piece = tok.decode([token])
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        if position == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        scores = prompt_scores if position < len(context) else reply_scores
        token_logprobs.append(scores.logprobs[position - 1])
        best: dict[str, float] = {}
        for t, lp in scores.top[position - 1][:top]:
            best.setdefault(tok.decode([t]), lp)
        top_logprobs.append(best)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


# ------------------------------------------------------------------------------------------- the rest
async def models(request: Request, state: ServeState):
    return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                                     "owned_by": "dsv41", "max_model_len": state.worker.max_len}]})


async def health(request: Request, state: ServeState):
    status = "draining" if state.draining else ("failed" if state.worker.failed else "ok")
    return JSONResponse({"status": status, "model": state.model_name, "inflight": state.inflight,
                         "capacity": state.capacity, **state.worker.load},
                        status_code=503 if state.draining else 200)


# vLLM's tokenizer routes, which lm-eval's local-completions uses (tokenizer_backend=remote) to count and
# cut requests with this model's own tokenizer, offline
async def tokenizer_info(request: Request, state: ServeState):
    tok = state.tok
    return JSONResponse({"eos_token": tok.decode([tok.eos_id]), "bos_token": tok.decode([tok.bos_id]),
                         "pad_token": tok.decode([tok.pad_id]), "model_max_length": state.worker.max_len,
                         "tokenizer_class": "DeepSeek-V4.1 (model/tokenizer.py)"})


async def tokenize(request: Request, state: ServeState):
    body = await _json(request)
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise bad("tokenize takes {\"prompt\": str, \"add_special_tokens\": bool}", "prompt")
    ids = state.tok.encode(body["prompt"], allow_special=True)
    if body.get("add_special_tokens", True) and (not ids or ids[0] != state.tok.bos_id):
        ids = [state.tok.bos_id] + ids
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.worker.max_len})


async def detokenize(request: Request, state: ServeState):
    body = await _json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("detokenize takes {\"tokens\": [int, ...]}", "tokens")
    return JSONResponse({"prompt": state.tok.decode(_prompt_ids(state, tokens))})


async def debug_memory(request: Request, state: ServeState):
    return JSONResponse(state.memory_probe.report(trim=request.query_params.get("trim") == "1"))


async def _http_error(request: Request, exc: HTTPException):
    return _error_response(APIError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code,
                                    code="not_found" if exc.status_code == 404 else None))


def build_app(worker: Worker, tokenizer, model_name: str, *, api_key: str | None = None, max_queue: int = 64,
              on_shutdown=None) -> Starlette:
    """The application; `worker` must be started. `on_shutdown` runs at the lifespan's end (uvicorn calls
    it after the in-flight requests finished or the grace period passed)."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    routes = [
        Route("/v1/chat/completions", _endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", _endpoint(completions), methods=["POST"]),
        Route("/v1/models", _endpoint(models), methods=["GET"]),
        Route("/health", _endpoint(health, authenticated=False), methods=["GET"]),
        Route("/tokenizer_info", _endpoint(tokenizer_info), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(detokenize), methods=["POST"]),
    ]
    probe = None
    if os.environ.get("DSV41_SERVE_DEBUG_MEMORY") == "1":  # off by default: tracemalloc slows every allocation
        from dsv41.serve.memory import MemoryProbe

        probe = MemoryProbe()
        routes.append(Route("/debug/memory", _endpoint(debug_memory), methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.serve = ServeState(worker, tokenizer, model_name, api_key, max_queue)
    app.state.serve.memory_probe = probe
    return app
