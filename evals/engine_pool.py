"""Several engines on several CPU cores: batched generation for evaluation, spread over processes.

Why: on the CPU a small model's decode step is host work in one Python thread (the bundled model runs at one
torch thread, `dsv41_cli.common.tune_threads`), so a run of hundreds of requests (`dsv41 effort-sweep`,
`dsv41 eval`'s generate_until) uses one core of the machine. An `EnginePool` of N engines is this process's
engine plus N-1 worker processes, each loading the same checkpoint and running its own scheduler at one
thread. Requests go into one shared queue and each engine takes the next one when a row of its batch frees,
so the engines stay busy to the end of the run whatever the requests' lengths. `generate` takes evaluation
requests (GenRequest -> GenOutput: `dsv41 effort-sweep`, `dsv41 eval`), `generate_many` the engine's own
Requests (-> GenerationResult: `dsv41 generate --input-file`).

A request's tokens do not depend on the engine or the batch it decodes in (batch invariance,
docs/generation.md), so the results are those of one engine, token for token (tests/test_engine_pool.py);
only the order in which requests finish changes. Results are reported as they finish, in this process
(`on_done`), so an interrupted run keeps what finished.

Workers start with the "spawn" method (a fresh interpreter: no forked OpenMP or torch state) and live until
`close()` (a context manager closes them), so a sweep's efforts share them. A worker that fails sends its
error; the run stops with it. Ctrl-C stops the workers with this process.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import traceback
from typing import Callable, Sequence

from dsv41.evals.batch_generate import GenOutput, GenRequest

# Below this many requests per engine a run stays in this process: a worker's start (a fresh interpreter,
# torch and the checkpoint, about 3 s on the 2-core CI machine) would cost more than it saves.
MIN_REQUESTS_PER_ENGINE = 8


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_engines(device: str) -> int:
    """The engines a run uses by default: one per CPU core (at most 8) on the CPU, one on a GPU."""
    if device != "cpu":
        return 1
    return max(1, min(usable_cores(), 8))


class WorkerFailed(RuntimeError):
    """A worker process stopped with an error, or died."""


class EnginePool:
    """`engines` engines over the checkpoint in `model_dir`, each keeping up to `batch_size` requests in flight:
    this process's (`generator`, already loaded) and engines - 1 worker processes, started at the first
    `generate` that is large enough, or earlier by `start()`. A pool may be made before this process loads the
    checkpoint (generator None, its device given) and its workers started at once, so that they load theirs
    while this process loads its own (`attach` then hands it the generator): a worker takes about as long to
    start as the command that starts it."""

    def __init__(self, generator, model_dir: str | os.PathLike, engines: int, batch_size: int,
                 device: str | None = None):
        if engines < 1 or batch_size < 1:
            raise ValueError("engines and batch_size must be at least 1")
        if engines > 1 and str(device or generator.device) != "cpu":
            raise ValueError("several engines run on the CPU only (each worker loads the checkpoint there)")
        self.generator, self.model_dir = generator, str(model_dir)
        self.engines, self.batch_size = engines, batch_size
        self._ctx = multiprocessing.get_context("spawn")
        self._tasks = self._results = None
        self._procs: list = []
        self._ready: set[int] = set()  # workers that loaded the checkpoint
        self.from_workers = 0  # requests the workers finished, over the pool's runs

    # ---------------------------------------------------------------- life cycle
    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def attach(self, generator) -> None:
        """This process's engine, for a pool made before the checkpoint was loaded."""
        self.generator = generator

    def start(self) -> None:
        """Start the worker processes now (at most once; nothing with one engine)."""
        if self.engines > 1 and not self._procs:
            self._start()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Start the workers if they are not, and wait until each has loaded the checkpoint (WorkerFailed if one
        fails, dies or takes longer than `timeout` s). A run does not wait for them (this process starts on the
        requests at once), so a small one may end before a worker takes any: this makes them all take part."""
        import time

        self.start()
        poll = self._poll(lambda i, out: None)  # no run is in progress: only "ready" or an error can come
        deadline = time.monotonic() + timeout
        while len(self._ready) < len(self._procs):
            if time.monotonic() > deadline:
                raise WorkerFailed(f"engine workers not ready after {timeout:g} s")
            poll(True)

    def _start(self) -> None:
        from dsv41.model.kernels.gemm import GEMM_MODE

        self._tasks, self._results = self._ctx.Queue(), self._ctx.Queue()
        settings = {"gemm_mode": GEMM_MODE["mode"], "batch_size": self.batch_size}
        for w in range(1, self.engines):
            p = self._ctx.Process(target=_worker_main, args=(w, self.model_dir, settings, self._tasks, self._results),
                                  daemon=True, name=f"dsv41-engine-{w}")
            p.start()
            self._procs.append(p)

    def close(self) -> None:
        """Stop the workers (at once: a run in progress is abandoned)."""
        for _ in self._procs:
            try:
                self._tasks.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._procs, self._ready = [], set()
        for q in (self._tasks, self._results):
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._tasks = self._results = None

    # ---------------------------------------------------------------- one run
    def generate(self, requests: Sequence[GenRequest], tokenizer,
                 on_done: Callable[[int, GenOutput], None] | None = None) -> list[GenOutput]:
        """batch_generate.generate over the pool: every request to its end; results in request order,
        on_done(i, output) as each finishes (in this process)."""
        from dsv41.evals.batch_generate import generate

        if not self.spreads(requests):
            return generate(self.generator.model, tokenizer, requests, batch_size=self.batch_size, on_done=on_done,
                            generator=self.generator)
        return self._run(requests, tokenizer, on_done)

    def generate_many(self, requests: Sequence, on_done=None) -> list:
        """Generator.generate_many over the pool for engine Requests (model/engine.py) that a worker can take:
        no `on_token` hook and no prefix cache (objects of this process); GenerationResults in request order,
        on_done(i, result) as each finishes. Other requests, or too few, run in this process."""
        if not self.spreads(requests) or any(r.on_token is not None or r.config.prefix_cache is not None
                                              for r in requests):
            return self.generator.generate_many(list(requests), max_batch_size=self.batch_size, on_done=on_done)
        return self._run(requests, self.generator.tokenizer, on_done)

    def spreads(self, requests: Sequence | int) -> bool:
        """Whether a run of these requests (or of this many) goes to several engines (else it stays in this
        process)."""
        n = requests if isinstance(requests, int) else len(requests)
        return self.engines > 1 and n >= MIN_REQUESTS_PER_ENGINE * 2

    def _run(self, requests, tokenizer, on_done):
        self.start()
        results: list[GenOutput | None] = [None] * len(requests)
        left = [len(requests)]

        def finished(i, out):
            results[i] = out
            left[0] -= 1
            if on_done:
                on_done(i, out)

        # each engine keeps at most its share of the run in flight: the first engine to reach the queue must not
        # take batch_size requests of a run that would fill every engine's rows only in part
        share = min(self.batch_size, -(-len(requests) // self.engines))
        for i, r in enumerate(requests):
            self._tasks.put((i, r, share))
        try:
            # done when every request is, and every worker has started: a worker that cannot load the checkpoint
            # stops the run with its error even when this process did all the work
            _serve(self.generator, tokenizer, self._tasks, self.batch_size, finished, self._poll(finished),
                   lambda: left[0] == 0 and len(self._ready) == len(self._procs), share)
        except BaseException:
            self.close()  # queued requests and workers in the middle of a run cannot be reused
            raise
        return results  # type: ignore[return-value]

    def _poll(self, finished):
        """A function that reports what the workers finished since its last call (block: wait up to 50 ms for
        something) and raises WorkerFailed when one failed or died."""

        def poll(block: bool) -> None:
            while True:
                try:
                    item = self._results.get(timeout=0.05) if block else self._results.get_nowait()
                except queue.Empty:
                    dead = [p for p in self._procs if p.exitcode is not None]
                    if dead:
                        raise WorkerFailed(f"engine worker {dead[0].name} exited (code {dead[0].exitcode})")
                    return
                block = False
                if item[0] == "error":
                    raise WorkerFailed(f"engine worker {item[1]} failed: {item[2]}")
                if item[0] == "ready":
                    self._ready.add(item[1])
                else:
                    self.from_workers += 1
                    finished(item[1], item[2])

        return poll


def _serve(generator, tokenizer, tasks, batch_size, report, poll=None, complete=None, share=None) -> None:
    """One engine's loop: take requests (i, request, share) from `tasks` while fewer than `share` (the run's
    share of an engine, at most batch_size) are in flight, step, report what finished (report(i, GenOutput)
    for a GenRequest, report(i, GenerationResult) for an engine Request). The parent process passes poll(block), called between steps (the workers' results), and
    complete(), which ends the loop; a worker passes neither, waits for requests when idle and ends on None."""
    import torch

    from dsv41.evals.batch_generate import engine_request
    from dsv41.model.engine import Scheduler

    # no second prefill thread (model/engine.py `_PrefillThread`): the pool's engines already use the cores
    scheduler = Scheduler(generator, batch_size, overlap_prefill=False)
    rows: dict[int, object] = {}
    with torch.inference_mode():
        while complete is None or not complete():
            while len(rows) < (share or batch_size):
                try:
                    item = tasks.get() if complete is None and not rows else tasks.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # a worker's stop
                    return
                i, request, share = item
                if isinstance(request, GenRequest):  # evaluation: its row reads the answer out of the tokens
                    rows[i], request = engine_request(request, tokenizer)
                else:  # an engine Request as it is: its GenerationResult comes back
                    rows[i] = None
                scheduler.submit(request, key=i)
            if rows:
                for i, result in scheduler.step():
                    row = rows.pop(i)
                    report(i, result if row is None else
                           row.result(result.finish_reason, result.budget_forced, result.engine_seconds))
            if poll is not None:
                poll(not rows)


def _worker_main(worker: int, model_dir: str, settings: dict, tasks, results) -> None:
    """A worker process: load the checkpoint, then serve requests until told to stop."""
    try:
        import torch

        torch.set_num_threads(1)
        from dsv41.model.checkpoint import load_model
        from dsv41.model.engine import Generator
        from dsv41.model.kernels.gemm import set_gemm_mode

        set_gemm_mode(settings["gemm_mode"])
        model, _, tokenizer = load_model(model_dir, device="cpu")
        generator = Generator(model, tokenizer, source=model_dir)
        results.put(("ready", worker))
        _serve(generator, tokenizer, tasks, settings["batch_size"], lambda i, out: results.put(("done", i, out)))
    except KeyboardInterrupt:
        return
    except BaseException:  # noqa: BLE001 - sent to the parent, which stops the run with it
        results.put(("error", worker, traceback.format_exc(limit=3).strip().splitlines()[-1]))
