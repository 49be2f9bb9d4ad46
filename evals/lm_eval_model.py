"""The lm-evaluation-harness model `dsv41`: a `TemplateLM` over our model, tokenizer and engine.

    from dsv41.evals.lm_eval_model import DSV41LM          # importing registers the name "dsv41"
    lm = DSV41LM(pretrained="path/to/checkpoint", mode="thinking", effort=75)
    lm_eval.simple_evaluate(model=lm, tasks=[...])

or, from lm-eval's own command line (the module must be imported first, which `-m` does not do)::

    python -c "import dsv41.evals.lm_eval_model, sys; from lm_eval.__main__ import cli_evaluate; \\
               sys.argv[0] = 'lm-eval'; cli_evaluate()" run --model dsv41 \\
        --model_args pretrained=CKPT,mode=thinking,effort=75 --tasks gsm8k --apply_chat_template

What each request type does
    loglikelihood          context + continuation scored in right-padded batches (longest first);
                           returns (sum ln p(continuation | context), continuation is greedy).
                           Contexts start with BOS; an empty context is BOS alone.
    loglikelihood_rolling  the document cut into lm-eval's disjoint windows of `max_length` tokens
                           (evals/bpb.py `rolling_windows`), every token scored once, conditioned on BOS.
    generate_until         evals/effort.py `generate`: batched decoding over the KV cache. In thinking
                           mode the `until` strings apply only after `</think>` and the reasoning is
                           stripped, so lm-eval's filters and metrics see the answer only.

Chat and effort
    mode None (the default) scores and generates on raw text, as a base model (Table 1). With
    mode "thinking" or "chat", `apply_chat_template` renders lm-eval's message list with the V4.1
    chat encoding at `effort`; run lm-eval with `apply_chat_template=True` (`dsv41 eval --mode ...`
    does). `tokenizer_name` includes mode, effort and thinking budget, so lm-eval's caches never mix
    requests made under different settings.

Under torchrun (docs/parallel.md)
    Every rank builds the same lm-eval run and calls the same request methods; the model is split
    across the ranks of a model copy, so those ranks run every forward together. With several model
    copies (DSV41_TP < world) the work is dealt out to the copies and the answers gathered, so every
    rank returns every answer: loglikelihood and loglikelihood_rolling divide `score_sequences`'
    batches (each batch is one a single process runs, so the numbers are a single process's),
    generate_until divides the requests (longest prompts dealt first). lm-eval itself sees one
    process (rank 0 of 1, as its HF model in tensor-parallel mode): it neither splits the documents
    nor pads the ranks' request lists with repeats, and its results equal a one-process run's. The
    request cache (`open_request_cache`, which `run_tasks` opens for `cache_path`) is one file that
    rank 0 reads and writes, so all ranks always agree on which requests are left to run.
    `run_tasks` returns rank 0's results on every rank.

lm-eval is imported here at module level: import this module only where lm-eval is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM, hash_args
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C held back until the block ends, then raised. The request cache (a SqliteDict) hands each read and
    write to its own thread through queues; a KeyboardInterrupt raised inside one of those queue operations
    could leave a request the thread never served, and the final commit then waited for it forever (seen
    2026-12-03: `dsv41 eval` interrupted at the wrong moment hung in `close`). Outside the main thread, or
    with a handler other than Python's default, nothing changes."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


class InterruptSafeCache:
    """The request cache's SqliteDict with each call under sigint_deferred (the operations DSV41LM uses)."""

    def __init__(self, db):
        self.db = db

    def __getitem__(self, key):
        with sigint_deferred():
            return self.db[key]

    def __setitem__(self, key, value) -> None:
        with sigint_deferred():
            self.db[key] = value

    def __contains__(self, key) -> bool:
        with sigint_deferred():
            return key in self.db

    def commit(self) -> None:
        with sigint_deferred():
            self.db.commit()

    def close(self) -> None:
        with sigint_deferred():
            self.db.close()

from dsv41.evals.bpb import DEFAULT_LOGITS_BYTES, plan_batches, score_sequences
from dsv41.evals.batch_generate import GenRequest, generate
from dsv41.model import encoding

GENERATION_ROWS = 32  # the least number of generate_until requests the engine decodes together

log = logging.getLogger(__name__)


@register_model("dsv41")
class DSV41LM(TemplateLM):
    """DeepSeek-V4.1 (any checkpoint this toolkit loads) as an lm-eval model."""

    backend = "causal"

    def __init__(self, pretrained: str | None = None, device: str = "cpu", batch_size: int | str = 8,
                 max_length: int | None = None, mode: str | None = None, effort: int | str = "high",
                 max_gen_toks: int | None = None, thinking_budget: int | None = None,
                 max_logits_bytes: int = DEFAULT_LOGITS_BYTES, model=None, tokenizer=None, progress=None,
                 ctx=None, pool=None, **unused: Any):
        """pretrained: checkpoint directory (None: the bundled dsv41-tiny). model/tokenizer: an
        already loaded pair instead (tests, `dsv41 eval`). mode: None (raw text), "thinking" or
        "chat". effort: 1..100 or low/high/max. max_gen_toks: overrides every task's generation
        length. progress: an object with start(label, total)/advance(n)/stop() for long calls.
        ctx: the `dsv41.model.parallel.ParallelContext` the model was loaded under (default: the current
        one; loading from `pretrained` under torchrun starts it and loads this rank's part). pool: an
        evals.engine_pool.EnginePool over the same checkpoint that generate_until spreads its requests over
        (one process's model copy only; the same results)."""
        super().__init__()
        from dsv41.model import parallel

        if mode in ("", "none", "None"):
            mode = None
        if mode is not None and mode not in encoding.MODES:
            raise ValueError(f"mode must be thinking, chat or none, not {mode!r}")
        self.mode = mode
        self.effort = encoding.parse_effort(effort)
        if model is None:
            from dsv41.model.assets import bundled_model_dir

            path = Path(pretrained) if pretrained else bundled_model_dir()
            if path is None:
                raise ValueError("no checkpoint given (pretrained=PATH) and no bundled dsv41-tiny model")
            ctx = ctx or parallel.init_from_env(_usable_device(device))  # one process, or this rank's part
            model, _, tokenizer = parallel.load_model_parallel(path, ctx.device, ctx)
            self.model_name = path.name
        else:
            if tokenizer is None:
                raise ValueError("pass the tokenizer with the model")
            self.model_name = getattr(model.args, "name", "dsv41")
        self.ctx = ctx or parallel.current()
        self.model, self.tok, self.args = model, tokenizer, model.args
        self._device = model.embed.weight.device
        self.batch_size = 8 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        # generation keeps at least GENERATION_ROWS requests in flight: a request's tokens do not depend on what
        # else is in the engine's batch (batch invariance, docs/generation.md), so more rows only make it faster
        # (the smoke suite 1.9x from 8 to 32). Scoring keeps batch_size: a padded batch's length moves the
        # log-likelihoods by up to 0.13 nat on the bundled model (docs/evaluation.md).
        self.generation_rows = max(self.batch_size, GENERATION_ROWS)
        self._max_length = int(max_length) if max_length else min(self.args.original_seq_len, self.args.max_seq_len)
        self.max_gen_toks = int(max_gen_toks) if max_gen_toks else None
        self.thinking_budget = int(thinking_budget) if thinking_budget not in (None, "") else None
        self.max_logits_bytes = int(max_logits_bytes)
        self.progress = progress
        self.pool = pool
        self.generation_log: list[dict] = []  # one record per generate_until request, in call order
        self._cache, self._caching = None, False  # the request cache (open_request_cache)
        # requests handed to us, answered (from the cache or the model) and answered from the cache
        # (the interrupt message and the "reused" line of `dsv41 eval`)
        self.asked = self.answered = self.reused = 0

    # ------------------------------------------------------------------ tokenization
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and every rolling document are conditioned on: BOS, as documents
        start in pre-training."""
        return self.tok.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids; control tokens written in the text (chat-encoded prompts) become their ids.
        BOS is put first unless add_special_tokens is False or the text already starts with it."""
        ids = self.tok.encode(string, allow_special=True)
        if add_special_tokens is False or (ids and ids[0] == self.tok.bos_id):
            return ids
        return [self.tok.bos_id] + ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    # ------------------------------------------------------------------ chat
    @property
    def tokenizer_name(self) -> str:
        budget = f"-budget{self.thinking_budget}" if self.thinking_budget is not None else ""
        return f"dsv41-{self.tok.fingerprint[:12]}-{self.mode or 'raw'}-effort{self.effort}{budget}"

    def chat_template(self, chat_template: bool | str = False) -> str:
        return (f"DeepSeek-V4.1 chat encoding (model/encoding.py), mode={self.mode or 'chat'}, "
                f"effort={self.effort}")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's message list in the V4.1 encoding. Without a generation prompt (a task's
        `gen_prefix`), the last, assistant message is left open so the model continues it."""
        messages = [dict(m) for m in chat_history]
        if not add_generation_prompt and messages and messages[-1].get("role") == "assistant":
            messages[-1]["wo_eos"] = True
        return encoding.encode_messages(messages, mode=self.mode or "chat", effort=self.effort)

    # ------------------------------------------------------------------ scoring
    def _score(self, sequences, n_scored, label: str, on_done=None):
        """score_sequences with progress; on_done(i, Scored) as each sequence is scored, so that
        lm-eval's request cache (resume after an interruption) fills as the work goes. Model copies
        divide the batches (progress and on_done then cover this copy's share)."""

        def start(mine):
            if self.progress:
                self.progress.start(label, sum(len(sequences[i]) - 1 for i in mine))

        def done(i, scored):
            if on_done:
                on_done(i, scored)
            if self.progress:
                self.progress.advance(len(sequences[i]) - 1)

        try:
            return score_sequences(self.model, sequences, n_scored, pad_id=self.tok.pad_id,
                                   batch_size=self.batch_size, max_logits_bytes=self.max_logits_bytes, on_done=done,
                                   ctx=self.ctx, on_start=start)
        finally:
            if self.progress:
                self.progress.stop()

    # ------------------------------------------------------------------ the request methods lm-eval calls
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._answer("loglikelihood", requests,
                            lambda reqs: TemplateLM.loglikelihood(self, reqs,
                                                                  disable_tqdm=disable_tqdm or not self.ctx.is_main))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self._answer("loglikelihood_rolling", requests, self._loglikelihood_rolling)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._answer("generate_until", requests, self._generate_until)

    def _answer(self, kind: str, requests, run) -> list:
        """run(the requests the request cache does not answer), merged with the cached answers.

        Under torchrun the ranks run the model together, so they must be handed the same requests:
        lm-eval builds them alike on every rank, and a digest of each rank's list checks it (if they
        differ, every rank raises, rather than waiting in mismatched collectives). The cache is read
        on rank 0 and its answers handed to all ranks, so all of them run the same misses."""
        keys = [hash_args(kind, r.args) for r in requests]
        if self.ctx.distributed:
            digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()
            if len(set(self.ctx.all_gather_object(digest))) > 1:
                raise RuntimeError(f"the ranks were handed different {kind} requests; lm-eval must build the "
                                   "same requests on every rank")
        answers: list = [None] * len(requests)
        # sampled generations are never answered from the cache (repeats must differ), as in lm-eval
        sampled = [kind == "generate_until" and bool(r.args[1].get("do_sample")) for r in requests]
        cached: dict[int, Any] = {}
        if self._caching:
            cached = self.ctx.on_main(lambda: {i: self._cache[k] for i, k in enumerate(keys)
                                               if not sampled[i] and k in self._cache})
        for i, a in cached.items():
            answers[i] = a
        self.asked += len(requests)
        self.answered += len(cached)
        self.reused += len(cached)
        todo = [i for i in range(len(requests)) if i not in cached]
        if todo:
            for i, a in zip(todo, run([requests[i] for i in todo])):
                answers[i] = a
                if self._cache is not None and not sampled[i]:
                    self._cache[keys[i]] = a
            if self._cache is not None:
                self._cache.commit()
        return answers

    # ------------------------------------------------------------------ the request cache
    def open_request_cache(self, path: str | None) -> None:
        """Answer requests from, and record every answer in, the sqlite file `path`_rank0.db (the file
        and keys lm-eval's own `use_cache` writes in one process, so either reads the other's), so that
        an interrupted run resumes where it stopped. Under torchrun rank 0 alone reads and writes it and
        hands the cached answers to all ranks: one file, whatever the ranks' number. None: no cache."""
        self.close_request_cache()
        self._caching = path is not None
        if self._caching and self.ctx.is_main:
            from sqlitedict import SqliteDict

            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._cache = InterruptSafeCache(SqliteDict(f"{path}_rank0.db", autocommit=True))

    def close_request_cache(self) -> None:
        if self._cache is not None:
            self._cache.close()
        self._cache, self._caching = None, False

    def _remember(self, kind: str, args: tuple, answer) -> None:
        """Record one answer as soon as it is known (rank 0's cache, and lm-eval's when it wraps us)."""
        self.cache_hook.add_partial(kind, args, answer)
        self.answered += 1
        if self._cache is not None:
            self._cache[hash_args(kind, args)] = answer

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        sequences, n_scored = [], []
        for _, context_enc, continuation_enc in requests:
            if not continuation_enc:
                raise ValueError("an empty continuation cannot be scored")
            # keep the last max_length inputs (+1 for the final target), as lm-eval's HF model does
            seq = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            sequences.append(seq)
            n_scored.append(min(len(continuation_enc), len(seq) - 1))

        def cache(i, s):
            key = requests[i][0]
            if key is not None:
                self._remember("loglikelihood", key, (s.logprob, s.greedy))

        return [(s.logprob, s.greedy) for s in self._score(sequences, n_scored, "loglikelihood", cache)]

    def _loglikelihood_rolling(self, requests) -> list[float]:
        sequences, n_scored, owner = [], [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            windows = get_rolling_token_windows(self.tok_encode(text, add_special_tokens=False),
                                                self.prefix_token_id, self.max_length, 1)
            for context, pred in map(make_disjoint_window, windows):
                sequences.append((context + pred)[-(self.max_length + 1):])
                n_scored.append(len(pred))
                owner.append(k)
        totals = [0.0] * len(requests)
        left = [owner.count(k) for k in range(len(requests))]  # windows still to score per document

        def collect(i, s):
            k = owner[i]
            totals[k] += s.logprob
            left[k] -= 1
            if left[k] == 0:
                self._remember("loglikelihood_rolling", requests[k].args, totals[k])

        if sequences:
            scores = self._score(sequences, n_scored, "loglikelihood_rolling", collect)
            if self.ctx.dp > 1:  # `collect` saw this copy's windows only: sum them all, in one process's order
                totals = [0.0] * len(requests)
                for i in (i for rows in plan_batches(sequences, self.batch_size) for i in rows):
                    totals[owner[i]] += scores[i].logprob
        return totals

    # ------------------------------------------------------------------ generation
    def _generate_until(self, requests) -> list[str]:
        gen_requests = []
        for k, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=256)
            max_new = self.max_gen_toks or kw["max_gen_toks"]
            until = tuple(kw.get("until") or ())
            ids = self.tok_encode(context)
            # fit prompt + generation into the model's positions: cut the prompt from the left
            # (keeping at least half the positions for it), then cap the generation to what is left
            limit = self.args.max_seq_len
            keep = limit - min(max_new, limit // 2)
            if len(ids) > keep:
                log.warning("prompt of %d tokens cut to its last %d", len(ids), keep)
                ids = ids[-keep:]
            if max_new > limit - len(ids):
                log.warning("max_gen_toks %d capped to %d (max_seq_len %d)", max_new, limit - len(ids), limit)
                max_new = limit - len(ids)
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            gen_requests.append(GenRequest(ids, max_new_tokens=max_new, until=until, temperature=temperature,
                                           top_p=float(kw.get("top_p", 1.0) or 1.0), seed=int(kw.get("seed", k) or 0),
                                           thinking_budget=self.thinking_budget))
        def done(i, o):
            self._remember("generate_until", requests[i].args, o.answer)
            if self.progress:
                self.progress.advance(1)

        # model copies divide the requests, the longest prompts dealt first so that the loads match
        order = list(range(len(gen_requests)))
        if self.ctx.dp > 1:
            order.sort(key=lambda i: -len(gen_requests[i].prompt_ids))

        def run(share: list[int]):
            return generate(self.model, self.tok, [gen_requests[i] for i in share], batch_size=self.generation_rows,
                            on_done=lambda j, o: done(share[j], o), pool=self.pool if self.ctx.dp == 1 else None)

        if self.progress:
            self.progress.start("generate_until", len(self.ctx.share(order)))
        t0 = time.perf_counter()
        try:
            outputs = [None] * len(gen_requests)
            for i, o in zip(order, self.ctx.split_work(order, run)):
                outputs[i] = o
        finally:
            if self.progress:
                self.progress.stop()
        for req, g, o in zip(requests, gen_requests, outputs):
            self.generation_log.append({
                "context_sha": hashlib.sha256(req.args[0].encode()).hexdigest()[:16],
                "prompt_tokens": len(g.prompt_ids), "reasoning_tokens": o.reasoning_tokens,
                "output_tokens": o.output_tokens, "finish_reason": o.finish_reason, "answered": o.answered,
                "budget_forced": o.budget_forced})
        log.info("generated %d answers in %.1f s", len(outputs), time.perf_counter() - t0)
        return [o.answer for o in outputs]


def _usable_device(device: str | None) -> str:
    """lm-eval's command line asks for "cuda" by default; run on the CPU when there is no GPU."""
    import torch

    device = str(device or "auto")
    if device == "auto" or (device.startswith("cuda") and not torch.cuda.is_available()):
        if device != "auto":
            log.warning("device %s is not available; running on the CPU", device)
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ============================================================================ running tasks
class UnknownTask(ValueError):
    """A task name that neither our aliases, our task files, the --include-path directories nor
    lm-eval's bundled tasks know."""


def make_task_manager(tasks: list[str], generated_dir, include_path: list[str] | None = None):
    """A TaskManager that knows `tasks`. lm-eval's ~14,000 bundled tasks are indexed (about 6 s)
    only when a task is not ours or the user's."""
    from lm_eval.tasks import TaskManager

    from dsv41.evals.tasks import include_paths, write_generated_tasks

    write_generated_tasks(generated_dir)
    paths = include_paths(generated_dir, include_path, tasks)
    tm = TaskManager(include_path=paths, include_defaults=False)
    if any(t not in tm.all_tasks for t in tasks):
        tm = TaskManager(include_path=paths, include_defaults=True)
    missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:
        raise UnknownTask(f"unknown task {missing[0]!r} (not an alias, not in lm-eval, not in --include-path)")
    return tm


def run_tasks(lm: DSV41LM, tasks: list[str], task_manager, *, limit: int | float | None = None,
              num_fewshot: int | None = None, data_dir=None, cache_path: str | None = None,
              confirm_run_unsafe_code: bool = False, bootstrap_iters: int = 1000, offline: bool = False) -> dict:
    """lm_eval.simple_evaluate over our model, with --data-dir's local datasets served. The chat
    template is applied exactly when the model has a mode. Returns lm-eval's results dict (samples
    included) with `served_locally` added. Under torchrun every rank calls this; lm-eval returns the
    results on local rank 0 only, and every rank gets rank 0's. offline: a dataset that is neither
    local nor cached raises `dsv41.evals.tasks.offline.DataUnavailable` naming the files it needs."""
    import lm_eval

    from dsv41.evals.tasks import serve_local_data

    lm.open_request_cache(cache_path)  # ours, not lm-eval's use_cache: one file rank 0 keeps (see _answer)
    _quiet_git_hash()
    _env_info_once()
    try:
        with serve_local_data(data_dir, offline=offline) as served:
            results = lm_eval.simple_evaluate(
                model=lm, tasks=tasks, task_manager=task_manager, num_fewshot=num_fewshot, limit=limit,
                batch_size=lm.batch_size, log_samples=True, apply_chat_template=lm.mode is not None,
                fewshot_as_multiturn=lm.mode is not None, bootstrap_iters=bootstrap_iters,
                confirm_run_unsafe_code=confirm_run_unsafe_code)
    finally:
        lm.close_request_cache()
    if results is not None:
        results["served_locally"] = served
    return lm.ctx.broadcast_object(results)


def _quiet_git_hash() -> None:
    """lm-eval records `git describe` of the current directory and lets git print `fatal: not a git
    repository` outside one: ask git quietly instead (None outside a repository)."""
    import subprocess

    import lm_eval.evaluator as ev

    def git_hash():
        try:
            r = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() or None if r.returncode == 0 else None

    ev.get_git_commit_hash = git_hash


_ENV_INFO: dict = {}


def _env_info_once() -> None:
    """lm-eval adds the environment to every result (`add_env_info`: torch's collect_env, which runs `pip list`,
    lscpu and more in subprocesses, about 1 s on this project's 2-core CPU) on each simple_evaluate call, and a
    suite calls it once a row: gather it on the first call of this process and give later calls a copy."""
    import lm_eval.evaluator as ev
    from lm_eval.loggers.utils import add_env_info

    def once(storage: dict) -> None:
        if not _ENV_INFO:
            add_env_info(_ENV_INFO)
        storage.update(_ENV_INFO)

    ev.add_env_info = once


SUMMARY_SKIP = {"alias", "name", "sample_len", " "}


def metrics_of(results: dict) -> dict:
    """{task or group: {"metric,filter": value}} with the numbers only (stderr included)."""
    out = {}
    for section in ("results", "groups"):
        for task, row in (results.get(section) or {}).items():
            vals = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in row.items()
                    if k not in SUMMARY_SKIP and not isinstance(v, str)}
            out.setdefault(task, {}).update(vals)
    return out
