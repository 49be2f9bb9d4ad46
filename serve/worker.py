"""The engine thread: the one owner of the model, stepping the continuous-batching `Scheduler`.

HTTP handlers never touch the model. They put commands on `Worker.inbox` (a thread-safe queue):
submit a generation, submit a scoring, cancel, stop. The engine thread drains the inbox between
scheduler steps, so a request joins the batch at the next step and a cancelled one leaves its row at
once (`Scheduler.cancel`). Each request answers on its own asyncio queue, fed from this thread with
`loop.call_soon_threadsafe`: "accepted" (or an error, before any work, such as the engine's
`RequestTooLarge`), its deltas after each step, and "done" with the finish reason and the usage.

Scoring (echo + logprobs) runs here too, one request between two steps, so decoding rows wait for one
prompt's forward at most. A failure inside a step (non-finite logits from a corrupt checkpoint) ends
every request in flight with a 500 and the worker goes on with a fresh scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from dsv41.model.engine import GenerationConfig, Request, RequestTooLarge, SamplingConfig, Scheduler
from dsv41.serve import memory
from dsv41.serve.protocol import APIError, Sampling
from dsv41.serve.scoring import score_tokens

log = logging.getLogger("dsv41.serve")

# glibc keeps what the engine frees in its arenas; the engine thread gives the free pages back to the kernel
# (malloc_trim, serve/memory.py) every TRIM_SECONDS while it works and once it has been idle (at least
# TRIM_SECONDS_IDLE after the last trim). A trim takes milliseconds: /health's "memory" counts them.
TRIM_SECONDS, TRIM_SECONDS_IDLE = 30.0, 2.0


class Channel:
    """The asyncio side of one request: the engine thread puts, the handler awaits `get`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            pass

    async def get(self):
        return await self.queue.get()



@dataclass
class Job:
    """A generation: prompt ids, settings, the reply builder (serve/stream.py), the channel."""

    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    reply: object  # ChatReply | TextReply
    channel: Channel
    stop_ids: tuple[int, ...]
    key: int = -1
    started: float = field(default_factory=time.perf_counter)


@dataclass
class ScoreJob:
    ids: list[int]
    top: int
    channel: Channel
    key: int = -1


class Worker:
    def __init__(self, generator, max_batch_size: int = 32, max_batch_tokens: int | None = None):
        self.gen = generator
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.scheduler: Scheduler | None = None  # built on the engine thread, inside its inference mode
        self.max_len = generator.args.max_position_embeddings  # a request's prompt and reply at most
        self.max_batch_tokens_effective = max_batch_tokens or max_batch_size * self.max_len
        self.ready = threading.Event()
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # engine thread only
        self.scoring: list[ScoreJob] = []  # engine thread only
        self._keys = itertools.count()
        self._key_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)
        self.steps = 0
        self.trims, self.trim_seconds = 0, 0.0
        self.tokens = 0  # tokens committed, all requests (/health: the load benchmark's rate)
        self.failed: str | None = None

    def _new_scheduler(self) -> Scheduler:
        # static shapes (a few step shapes for the whole life of the server, not a new one nearly every step):
        # the eager CPU step's native per-shape state (oneDNN primitives, allocator blocks) then stays bounded
        # (benchmarks/results/cpu-serve/NOTES.md, "Memory"); on CUDA the graphs run static anyway
        return Scheduler(self.gen, self.max_batch_size, self.max_batch_tokens, static_shapes=True)

    # ---------------------------------------------------------------- called from the HTTP side
    def start(self) -> None:
        self.thread.start()
        self.ready.wait()
        if self.scheduler is None:
            raise RuntimeError(f"the engine could not start: {self.failed}")

    def next_key(self) -> int:
        with self._key_lock:
            return next(self._keys)

    def submit(self, job: Job | ScoreJob) -> int:
        job.key = self.next_key()
        self.inbox.put(("submit", job))
        return job.key

    def cancel(self, key: int) -> None:
        self.inbox.put(("cancel", key))

    def stop(self, timeout: float = 30.0) -> None:
        self.inbox.put(("stop", None))
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        with torch.inference_mode():
            try:
                self.scheduler = self._new_scheduler()
            except Exception as e:  # noqa: BLE001 - reported by start(), in the thread that can say it
                self.failed = f"{type(e).__name__}: {e}"
                return
            finally:
                self.ready.set()
            dirty, last_trim = False, time.monotonic()  # dirty: the engine worked since the last trim
            while True:
                idle = not (self.scheduler.busy or self.scoring)
                if dirty and time.monotonic() - last_trim > (TRIM_SECONDS_IDLE if idle else TRIM_SECONDS):
                    self._trim()
                    dirty, last_trim = False, time.monotonic()
                try:
                    command = self.inbox.get(timeout=0.5) if idle else self.inbox.get_nowait()
                except queue.Empty:
                    command = None
                while command is not None:
                    if not self._handle(command):
                        self._abort_all(APIError("the server is shutting down", 503, code="shutting_down"))
                        return
                    try:
                        command = self.inbox.get_nowait()
                    except queue.Empty:
                        command = None
                if self.scoring:
                    self._score(self.scoring.pop(0))
                    dirty = True
                if self.scheduler.busy:
                    self._step()
                    dirty = True

    def _handle(self, command) -> bool:
        kind, arg = command
        if kind == "stop":
            return False
        if kind == "cancel":
            if self.jobs.pop(arg, None) is not None:
                self.scheduler.cancel(arg)
            self.scoring = [j for j in self.scoring if j.key != arg]
        elif isinstance(arg, ScoreJob):
            self.scoring.append(arg)
        else:
            self._admit(arg)
        return True

    def _admit(self, job: Job) -> None:
        s = job.sampling
        config = GenerationConfig(max_new_tokens=job.max_tokens, sampling=SamplingConfig(s.temperature, s.top_p, s.seed),
                                  stop_ids=job.stop_ids)
        hook = job.reply.on_token

        def on_token(token: int):
            self.tokens += 1
            return hook(token)

        try:
            self.scheduler.submit(Request(job.prompt_ids, config, None, on_token), key=job.key)
        except ValueError as e:  # RequestTooLarge, ids outside the vocabulary: refused before any work
            job.channel.put(("error", APIError(str(e), 400, "messages", "context_length_exceeded"
                                               if isinstance(e, RequestTooLarge) else None)))
            return
        self.jobs[job.key] = job
        job.channel.put(("accepted", None))

    def _step(self) -> None:
        try:
            finished = self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
            log.exception("the engine step failed")
            self.failed = f"{type(e).__name__}: {e}"
            self._abort_all(APIError(f"the engine failed: {' '.join(str(e).split())}", 500, code="engine_error"))
            self.scheduler = self._new_scheduler()
            return
        self.steps += 1
        # What this step made certain, one hand-over (one call_soon_threadsafe) per request. Measured against one
        # wake-up of the loop per step for all requests: the event loop's CPU was 0.4 s per 45 s either way, 1%
        # of the engine thread's (benchmarks/results/cpu-serve/NOTES.md), so the simpler form stays.
        for job in self.jobs.values():
            if job.reply.pending:
                job.channel.put(("deltas", job.reply.pending))
                job.reply.pending = []
        for key, result in finished:
            job = self.jobs.pop(key, None)
            if job is None:
                continue
            reason = job.reply.close(result.finish_reason)
            if job.reply.pending:
                job.channel.put(("deltas", job.reply.pending))
                job.reply.pending = []
            job.channel.put(("done", {"finish_reason": reason, "output_ids": result.output_ids,
                                      "prompt_tokens": result.prompt_tokens}))

    def _trim(self) -> None:
        t0 = time.perf_counter()
        memory.malloc_trim()
        self.trims += 1
        self.trim_seconds += time.perf_counter() - t0

    def _score(self, job: ScoreJob) -> None:
        try:
            job.channel.put(("scored", score_tokens(self.gen.model, job.ids, job.top)))
        except Exception as e:  # noqa: BLE001
            log.exception("scoring failed")
            job.channel.put(("error", APIError(f"scoring failed: {' '.join(str(e).split())}", 500, code="engine_error")))

    def _abort_all(self, error: APIError) -> None:
        for job in list(self.jobs.values()) + list(self.scoring):
            job.channel.put(("error", error))
        self.jobs.clear()
        self.scoring.clear()

    @property
    def load(self) -> dict:
        """Approximate (read from another thread without a lock): for /health."""
        s = self.scheduler
        if s is None:
            return {"running": 0, "waiting": 0, "steps": 0, "tokens": 0}
        return {"running": len(s.running), "waiting": len(s.waiting) + (s.prefilling is not None),
                "steps": self.steps, "tokens": self.tokens,
                "memory": {"rss_mib": round(memory.rss_mib(), 1), **(memory.mallinfo() or {}),
                           "trims": self.trims, "trim_s": round(self.trim_seconds, 3)}}
