"""The inference engine: prefill, one-token decode steps over the KV cache, sampling, the effort
thinking budget, continuous batching, and DSpark speculative decoding.

    prompt ids --prefill (chunked, one sequence)--> KVCache --load--> a row of the BatchCache
    rows in use --one decode step for all of them (Transformer.decode)--> tokens --> text

Read in gpt-fast's order: `Generator.prefill` (a prompt into a KVCache), `Scheduler.step` (admit waiting
requests, prefill one chunk, decode one token for every running row), `Generator.generate` /
`Generator.generate_many` (n tokens for one request / many at once). Every command that generates goes
through `Scheduler` (docs/generation.md: admission, chunking, row reuse, cancellation). A DSpark request
runs in the same scheduler beside the batch's rows: its own KVCache, one draft-and-verify step
(`Generator._speculate`) per scheduler step, accepting as many drafts as the target agrees with.

Everything runs under torch.inference_mode(). Batched scoring for evaluation uses the full forward.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv41.model import dspark
from dsv41.model.cache import KVCache
from dsv41.model.checkpoint import CheckpointError
from dsv41.model.kernels import host
from dsv41.model.kernels import reference as kernels_reference


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_ids: tuple[int, ...] = (1,)  # <｜end▁of▁sentence｜>
    prefill_chunk: int | None = None  # None = the whole prompt in one forward
    dspark: bool = False
    dspark_draft_len: int | None = None  # None: verify every drafted position
    dspark_min_survival: float | None = None  # choose the length from the confidence head's prefix survival
    thinking_budget: int | None = None  # max reasoning tokens before `</think>` is forced
    think_end_id: int | None = None  # id of `</think>` (needed for the budget)
    ced: str = "full"  # "replay": CED prefill, the decoder runs on the last window_size prompt tokens only
    prefix_cache: object | None = None  # a model.prefix_cache.PrefixCache


@dataclass
class GenerationResult:
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float
    peak_memory_bytes: int
    kv_bytes_per_token: float
    dspark: dict | None = None  # acceptance_per_position, mean_accepted_per_step, steps
    budget_forced: bool = False
    prefill: dict | None = None  # what the prompt cost: tokens through encoder and decoder, prefix-cache hit
    # this request's share of its engine's time: its prefill, plus each decode step's time divided among the
    # rows of that step (in a batch, decode_seconds is wall time the request shared with others)
    engine_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.output_ids)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


# ------------------------------------------------------------------------------------------- sampling
def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus), renormalized."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # a token stays if the mass before it is below top_p
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def token_distribution(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution the sampler draws from (temperature then top-p), fp32."""
    probs = torch.softmax(logits.float() / max(sampling.temperature, 1e-5), dim=-1)
    return filter_top_p(probs, sampling.top_p)


class NonFiniteLogits(CheckpointError):
    """The model produced NaN/inf logits: its weights hold non-finite values (a corrupt checkpoint) or
    overflow. The CLI prints the one-line message and exits 2."""


def _host_rows(logits: torch.Tensor) -> bool:
    """Whether host.argmax_rows takes these logits: fp32 CPU [V] or [R, V], contiguous rows, the C library loaded."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() in (1, 2)
            and logits.stride(-1) == 1 and host.available())


def checked_greedy_ids(logits: torch.Tensor, source: str | None = None) -> torch.Tensor:
    """check_finite(logits, source), then greedy_ids(logits): on the CPU one C pass a row gives both (the argmax
    and whether the row holds a NaN or an inf), where the check's sum was a second read of every logit (2.5% of a
    one-row step of the bundled model: benchmarks/results/cpu-engine-tiles); the error, when there is one, is
    check_finite's."""
    if not _host_rows(logits):
        check_finite(logits, source)
        return greedy_ids(logits)
    ids, nonfinite = host.argmax_rows(logits.view(-1, logits.size(-1)), count_nonfinite=True)
    if nonfinite:
        check_finite(logits, source)  # raises, naming the checkpoint and counting the values
    return ids.view(logits.shape[:-1])


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of [V] or [R, V] logits: on the CPU one C pass a row (host.argmax_rows, the same answer:
    the first index of the maximum), elsewhere torch's."""
    if _host_rows(logits):
        return host.argmax_rows(logits.view(-1, logits.size(-1))).view(logits.shape[:-1])
    return logits.argmax(dim=-1)


class Sampler:
    """Greedy at temperature 0, else multinomial from the tempered, top-p filtered distribution,
    drawn from a seeded generator so a run is reproducible. Every row of logits it picks from is
    checked first (`check`): non-finite logits are a `NonFiniteLogits` naming `source` (the
    checkpoint), not a NaN argmax or a failure inside torch.multinomial."""

    def __init__(self, sampling: SamplingConfig, device, source: str | None = None):
        self.sampling = sampling
        self.source = source
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed() % 2**63)

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature <= 0

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs.float().cpu(), 1, generator=self.gen).squeeze(-1).to(probs.device)

    def check(self, logits: torch.Tensor) -> None:
        """NaN/inf in the logits about to be sampled is an error naming the checkpoint (`check_finite`)."""
        check_finite(logits, self.source)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.check(logits)
        if self.greedy:
            return greedy_ids(logits)
        return self.draw(token_distribution(logits, self.sampling))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.gen))


# ------------------------------------------------------------------------------------------- engine
class Generator:
    def __init__(self, model, tokenizer=None, source: str | None = None):
        """`source`: the checkpoint the model came from, named by the error on non-finite logits."""
        self.source = str(source) if source is not None else None
        self.model = model
        self.args = model.args
        self.tokenizer = tokenizer
        self.device = model.embed.weight.device

    # ---------------------------------------------------------------- building blocks
    def prefill(self, cache: KVCache, ids: list[int] | torch.Tensor, chunk: int | None = None,
                return_taps: bool = False, images: list | None = None, ced: str = "full"):
        """Run the prompt through the model, optionally in chunks; returns the last logits [1, V]
        (and the taps of the prompt positions the decoder ran on, when asked). `images`: the prompt's
        `vision.ImageInput`s (positions relative to `ids`); a chunk never ends inside an image span.
        ced="replay": CED prefill of each chunk (the decoder runs on its last window_size tokens)."""
        ids = torch.as_tensor(ids, device=self.device).view(1, -1)
        T = ids.size(1)
        chunk = chunk or T
        images = [img.shifted(cache.pos) for img in images or ()]
        logits, taps = None, []
        for s, e in _chunk_bounds(T, chunk, [(img.start - cache.pos, img.end - cache.pos) for img in images]):
            here = [img for img in images if img.start >= cache.pos and img.end <= cache.pos + e - s]
            out = self.model(ids[:, s:e], start_pos=cache.pos, cache=cache, return_taps=return_taps,
                             images=[here] if here else None, ced=ced)
            if return_taps:
                logits, t = out
                taps.append(t)
            else:
                logits = out
        if return_taps:
            return logits, torch.cat(taps, dim=1)
        return logits

    def step(self, cache: KVCache, token: int, return_taps: bool = False):
        ids = torch.tensor([[token]], device=self.device)
        return self.model(ids, start_pos=cache.pos, cache=cache, return_taps=return_taps)

    # ---------------------------------------------------------------- generation
    def check_request(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        if config.dspark and not self.args.dspark_enabled:
            raise ValueError("this checkpoint has no DSpark drafter (n_mtp_layers = 0)")
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max(prompt_ids) >= self.args.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"the prompt has token ids outside the model's vocabulary of {self.args.vocab_size}: "
                             "the tokenizer does not belong to this checkpoint")

    def generate(self, prompt_ids: list[int], config: GenerationConfig,
                 on_token: Callable[[int], str | None] | None = None, images: list | None = None) -> GenerationResult:
        """One request to its end. `images`: the `vision.ImageInput`s of an expanded prompt
        (`vision.expand_image_placeholders`). `on_token(token)` sees each token as it is committed."""
        return self.generate_many([Request(prompt_ids, config, images, on_token)], max_batch_size=1)[0]

    def stream(self, prompt_ids: list[int], config: GenerationConfig, mode: str = "thinking",
               images: list | None = None):
        """One request as a stream of events (mlx-lm's stream_generate): `StreamEvent`s of model/completion.py's
        CompletionStream, yielded as the tokens that make them certain are committed: reasoning and content
        text deltas (no marker split across two events, no markup in them), each tool call whole as its
        block closes, then one "finish" event with the finish reason, the parse of the whole completion
        and the GenerationResult (`event.result`). Needs the Generator's tokenizer."""
        from dsv41.model.completion import CompletionStream

        if self.tokenizer is None:
            raise ValueError("Generator.stream needs a Generator built with its tokenizer")
        parser = CompletionStream(self.tokenizer, mode)
        pending: list = []
        scheduler = Scheduler(self, max_batch_size=1)
        scheduler.submit(Request(prompt_ids, config, images, lambda t: pending.extend(parser.feed(t))))
        result = None
        with torch.inference_mode():
            while scheduler.busy:
                for _, result in scheduler.step():
                    pass
                yield from pending  # a DSpark step commits a run of accepted drafts at once
                pending.clear()
        for event in parser.close(result.finish_reason):
            if event.kind == "finish":
                event.result = result
            yield event

    @torch.inference_mode()
    def generate_many(self, requests: list["Request"], max_batch_size: int = 32, max_batch_tokens: int | None = None,
                      on_done: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Every request to its end, many at once (continuous batching, `Scheduler`); results in request
        order. on_done(i, result) as each finishes (in the order they finish)."""
        results: list[GenerationResult | None] = [None] * len(requests)

        def done(i, result):
            results[i] = result
            if on_done:
                on_done(i, result)

        scheduler = Scheduler(self, max_batch_size, max_batch_tokens)
        for i, r in enumerate(requests):
            scheduler.submit(r, key=i)
        for i, result in scheduler.run():
            done(i, result)
        return results  # type: ignore[return-value]

    def _prompt(self, ids: list[int], config: GenerationConfig, images=None):
        """Fill a cache with the prompt: a prefix-cache lookup (exact restore, or global KV plus SWA
        Bounded Replay of the last window_size cached tokens), then a full or CED-replay prefill of
        the rest. Returns (cache, last logits, [(taps, positions)] for the drafter, stats)."""
        want_taps = config.dspark
        pc = config.prefix_cache if not images else None  # image prompts always prefill in full
        hit = pc.lookup(ids, self.device) if pc is not None else None
        taps: list = []
        start, replayed = 0, 0
        if hit is not None and hit.cache is not None:
            cache, start = hit.cache, hit.tokens
        else:
            cache = self.model.new_cache(1)
            if hit is not None:
                cache.import_global(hit.global_kv)
                start = hit.tokens
                seg = max(0, start - self.args.window_size)
                cache.pos = seg
                cache.engram_history = _engram_history(self.model, ids[:seg]) if seg else None
                out = self.model(torch.tensor([ids[seg:start]], device=self.device), start_pos=seg, cache=cache,
                                 return_taps=want_taps, bounded_replay=True)
                if want_taps:
                    taps.append((out[1], torch.arange(seg, start, device=self.device)))
                replayed = start - seg
        rest = ids[start:]
        # with a prefix cache, stop at the longest storable prefix first, so that its entry can keep the
        # exact SWA state of that position in memory (a later hit on it is then exact)
        cut = pc.aligned(len(ids), self.args) if pc is not None else len(ids)
        bounds = [b for b in (start, cut, len(ids)) if b >= start]
        for a, b in zip(bounds, bounds[1:]):
            if b <= a:
                continue
            out = self.prefill(cache, ids[a:b], config.prefill_chunk, return_taps=want_taps, images=images,
                               ced=config.ced)
            logits = out[0] if want_taps else out
            if want_taps:
                n = out[1].size(1)
                taps.append((out[1], torch.arange(b - n, b, device=self.device)))
            if pc is not None and b == cut:
                pc.store(ids[:b], cache)
        decoder = len(rest)
        if config.ced == "replay":  # each chunk longer than the window sends only its tail to the decoder
            chunk = config.prefill_chunk or len(rest)
            decoder = sum(min(len(rest[s:s + chunk]), self.args.window_size) for s in range(0, len(rest), chunk))
        stats = {"cached_tokens": start, "replayed_tokens": replayed, "prefilled_tokens": len(rest),
                 "decoder_tokens": decoder + replayed,
                 "prefix_hit": None if hit is None else ("exact" if hit.cache is not None else "bounded_replay")}
        return cache, logits, taps, stats

    # ---------------------------------------------------------------- DSpark
    def _speculate(self, cache, logits, tap_segments, prompt_ids, config, sampler, budget, on_token, out: list[int]):
        """DSpark decoding as a generator the scheduler steps: each `next` drafts S tokens with the drafter,
        verifies them in one target forward and keeps the accepted prefix plus one token from the target
        (chain verification), committing them to `out` (and `on_token`); it returns (finish reason,
        stats) when the request ends. The first `next` also commits the token the prompt's logits give.
        Greedy: accept while the draft equals the argmax of the verification logits, so every emitted token
        is that argmax. It equals plain greedy decoding's token wherever plain's top-1 margin exceeds twice
        the logit difference between this k+1-row forward and one-token steps (not zero: row-count-dependent
        fp32 sums, Top-K ties broken per row length, and the KV this forward writes; docs/generation.md,
        DSpark; tests/test_dspark_greedy.py). Sampling: standard speculative rejection sampling, so the output
        distribution is the target's as the verification forward computes it."""
        args, model = self.args, self.model
        S = args.dspark_block_size
        history = list(prompt_ids)
        ring_ids = [args.n_layers + k for k in range(len(model.mtp))]  # the drafter's rings live in the cache
        for taps, positions in tap_segments:
            self._feed_drafter(cache, ring_ids, dspark.main_x(model, taps), positions)
        accepted_at = [0] * S  # how often draft position i was accepted
        proposed_at = [0] * S
        steps = accepted_total = 0
        anchor = budget.override(int(sampler(logits[0])))
        while True:
            history.append(anchor)
            finish = _emit(anchor, out, config, on_token)
            if finish:
                break
            P1 = cache.pos  # the anchor's position (not yet in the target cache)
            contexts = []
            for lid in ring_ids:
                kv = cache.window_before(lid, P1)
                contexts.append((kv, torch.arange(kv.size(1), device=self.device).unsqueeze(0)))
            hidden = dspark.block_hidden(model, torch.tensor([anchor], device=self.device),
                                         torch.tensor([P1], device=self.device), contexts)
            U = dspark.base_logits(model, hidden)
            drafts, draft_logits, conf = dspark.markov_draft(model, U, hidden, torch.tensor([anchor], device=self.device),
                                                             sampler)
            k = self._verify_length(conf[0], config, S)
            k = min(k, config.max_new_tokens - len(out))  # never draft past the length limit
            drafts = drafts[0, :k].tolist()
            # verify: the target scores [anchor, d_1..d_k] at positions P1..P1+k in one forward
            cache.checkpoint()
            verify_ids = torch.tensor([[anchor] + drafts], device=self.device)
            tlogits, vtaps = model(verify_ids, start_pos=P1, cache=cache, all_logits=True, return_taps=True)
            n, next_token = self._accept(tlogits[0], draft_logits[0, :k], drafts, sampler)
            for i in range(n):  # the thinking budget may cut the accepted run short
                forced = budget.override(drafts[i])
                if forced != drafts[i]:
                    n, next_token = i, forced
                    break
            else:
                next_token = budget.override(next_token)
            steps += 1
            accepted_total += n
            for i in range(k):
                proposed_at[i] += 1
                accepted_at[i] += int(i < n)
            kept = P1 + 1 + n  # anchor + accepted drafts are now committed
            new_tail = history + drafts[:n]
            cache.rollback(kept, _engram_history(model, new_tail))
            self._feed_drafter(cache, ring_ids, dspark.main_x(model, vtaps[:, :n + 1]),
                               torch.arange(P1, kept, device=self.device))
            stop = None
            for d in drafts[:n]:
                history.append(d)
                stop = _emit(d, out, config, on_token)
                if stop:
                    break
            if stop:
                finish = stop
                break
            anchor = next_token
            yield  # one verification step done: the scheduler's other rows take theirs
        stats = {
            "acceptance_per_position": [a / p if p else 0.0 for a, p in zip(accepted_at, proposed_at)],
            # tokens committed per verification step: the accepted drafts plus the target's own token
            "mean_accepted_per_step": (accepted_total + steps) / steps if steps else 0.0,
            "steps": steps,
        }
        return finish, stats

    def _feed_drafter(self, cache, ring_ids, main_x, positions):
        for lid, stage in zip(ring_ids, self.model.mtp):
            # the cache packs the window KV as FP8 itself: it takes the unrounded values
            latent = stage.attn.window_latent(main_x, stage.attn.freqs(positions, main_x.device))
            cache.write_window(lid, latent, int(positions[0]))

    def _verify_length(self, conf: torch.Tensor, config: GenerationConfig, S: int) -> int:
        k = config.dspark_draft_len or S
        if config.dspark_min_survival is not None:
            # prefix survival: P(first i drafts all accepted) = prod_{j<i} sigmoid(c_j)
            survival = torch.cumprod(torch.sigmoid(conf.float()), dim=0)
            k = min(k, max(1, int((survival >= config.dspark_min_survival).sum())))
        return k

    def _accept(self, target_logits, draft_logits, drafts, sampler):
        """Chain verification. target_logits [k+1, V]: the target's predictions after the anchor and
        after each draft. Returns (number accepted, the target's next token)."""
        sampler.check(target_logits)  # the greedy comparisons below take argmaxes outside the sampler
        n = 0
        for i, d in enumerate(drafts):
            if sampler.greedy:
                want = int(greedy_ids(target_logits[i]))
                if d != want:
                    return n, want
            else:
                p = token_distribution(target_logits[i], sampler.sampling)
                q = token_distribution(draft_logits[i], sampler.sampling)
                if sampler.uniform() >= min(1.0, float(p[d] / q[d].clamp_min(1e-20))):
                    residual = (p - q).clamp_min(0)
                    residual = residual / residual.sum() if residual.sum() > 0 else p
                    return n, int(sampler.draw(residual))
            n += 1
        return n, int(sampler(target_logits[len(drafts)]))


# ------------------------------------------------------------------------------------------- scheduler
@dataclass
class Request:
    """One generation: a prompt, its settings (sampling, stop ids, length, thinking budget, CED, prefix
    cache), the images of its prompt, and `on_token(token)`, called as each token is committed, which may
    return a finish reason to end the request there (a stop string it saw)."""

    prompt_ids: list[int]
    config: GenerationConfig = field(default_factory=GenerationConfig)
    images: list | None = None
    on_token: Callable[[int], str | None] | None = None


class RequestTooLarge(ValueError):
    """A request that can never be served: its prompt and reply exceed the model's context or the
    scheduler's token budget."""


# Prompt tokens per scheduler step while other rows decode, and the size prompts are cut into (unless a
# request asks for its own --prefill-chunk): short on the CPU, where a chunk's time is host work and stalls
# the running rows; longer on a GPU, where one forward of 2048 tokens costs little more than one of 256.
PREFILL_CHUNK = {"cpu": 256, "cuda": 2048}
# Prompts handed to the second prefill thread and not yet entered as rows (`Scheduler._admit`): one it runs,
# one queued for it to start at once.
PREFILL_THREAD_DEPTH = 2


class _Sequence:
    """A request in the scheduler: waiting, prefilling (its own KVCache), running (a BatchCache row), or
    speculating (DSpark: its own KVCache, stepped by `Generator._speculate`)."""

    def __init__(self, key, request: Request, generator: "Generator"):
        self.key, self.request, self.config = key, request, request.config
        self.sampler = Sampler(request.config.sampling, generator.device, generator.source)
        self.budget = _Budget(request.config, request.prompt_ids)
        self.out: list[int] = []
        self.cache: KVCache | None = None
        self.done_tokens = 0  # prompt tokens prefilled so far
        self.prefill_seconds = 0.0
        self.engine_seconds = 0.0  # decode steps' time shared with the step's other rows (GenerationResult)
        self.prefill_stats: dict | None = None
        self.started = self.finished_at = 0.0
        self.token = -1  # the next input token (the last one committed)
        self.finish: str | None = None
        self.kv_bytes_per_token: float | None = None  # measured as it finishes (its row, or its prefill's cache)
        self.spec = None  # DSpark: the `Generator._speculate` generator that steps it
        self.dspark_stats: dict | None = None

    @property
    def need(self) -> int:
        """Cache positions the request may reach: its prompt and its whole reply."""
        return len(self.request.prompt_ids) + self.config.max_new_tokens

    def chunked(self) -> bool:
        """Whether the prompt prefills chunk by chunk between decode steps (a plain prompt), or in one go
        (prefix-cache lookups, CED replay, images, DSpark's taps: `Generator._prompt`)."""
        c = self.config
        return c.prefix_cache is None and c.ced == "full" and not self.request.images and not c.dspark


class _PrefillThread:
    """Plain prompts prefilled on a second thread while the scheduler's thread decodes (the CPU, where a
    prefill and a decode step each keep one core busy: their operators release the GIL, the C kernels and
    ATen's alike). A job is a list of `_Sequence`s (one, or equal-length prompts that prefill in one forward,
    as `Scheduler._companions` groups them); `prefill(job)` fills their own KVCache, as the scheduler's thread
    would, chunk by chunk at the same cuts, so its numbers do not depend on which thread ran it. The thread
    starts when a job comes and ends when none is left; it takes the caller's grad and inference modes and
    intra-op thread count. A job's exception comes back with it and is raised on the scheduler's thread.

    `stop` drops the jobs not started and waits for the one running (`prefill` sees `stopping` between its
    chunks). Every thread still alive is stopped before the interpreter finalizes (`_stop_prefill_threads`):
    a daemon thread still inside a torch operator then would come back to a finalizing interpreter, which
    ends the thread by unwinding it through C++ frames that may not unwind, and the process aborts
    ("terminate called without an active exception", exit -6: seen 2026-12-05 when `dsv41 eval` was
    interrupted while a prompt prefilled here)."""

    def __init__(self, prefill: Callable):
        self._prefill = prefill
        self._jobs: collections.deque = collections.deque()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.stopping = False
        _PREFILL_THREADS.add(self)

    def submit(self, job: list) -> None:
        with self._lock:
            if self.stopping:
                raise RuntimeError("the prefill thread was stopped")
            self._jobs.append(job)
            if self._thread is None:
                modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_num_threads())
                self._thread = threading.Thread(target=self._loop, args=modes, name="dsv41-prefill", daemon=True)
                self._thread.start()

    def _run(self, job: list) -> None:
        try:
            self._done.put((job, self._prefill(job), None))
        except BaseException as e:  # noqa: BLE001 - raised again on the scheduler's thread
            self._done.put((job, None, e))

    def _loop(self, grad: bool, inference: bool, threads: int) -> None:
        torch.set_num_threads(threads)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            while True:
                with self._lock:
                    if not self._jobs:
                        self._thread = None
                        return
                    job = self._jobs.popleft()
                self._run(job)

    def results(self, wait: bool) -> list[tuple]:
        """(job, (cache, logits), exception or None) of every job done, at least one if `wait`."""
        out = []
        try:
            if wait:
                out.append(self._done.get())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            return out

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            self._jobs.clear()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class PrefillStopped(Exception):
    """A prefill given up between two chunks because its thread was stopped (`_PrefillThread.stop`)."""


_PREFILL_THREADS: "weakref.WeakSet[_PrefillThread]" = weakref.WeakSet()  # a running thread keeps its own alive


@atexit.register
def _stop_prefill_threads() -> None:
    """Before the interpreter finalizes (atexit runs while daemon threads still run): no prefill thread left
    inside a torch operator (`_PrefillThread`)."""
    for prefiller in list(_PREFILL_THREADS):
        prefiller.stop()


def _plain_prefill_stats(tokens: int) -> dict:
    """GenerationResult.prefill of a plain prompt: every token prefilled, through the decoder too."""
    return {"cached_tokens": 0, "replayed_tokens": 0, "prefilled_tokens": tokens, "decoder_tokens": tokens,
            "prefix_hit": None}


def overlap_prefill_default(device) -> bool:
    """Whether the scheduler prefills on a second thread (`_PrefillThread`): on the CPU with at least two cores
    this process may use, unless DSV41_PREFILL_THREAD=0. On CUDA a prefill and a decode step share one GPU;
    under torchrun each forward's collectives must come in the same order on every rank, which two threads
    issuing forwards at once would not keep."""
    if torch.device(device).type != "cpu" or os.environ.get("DSV41_PREFILL_THREAD", "1") == "0":
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or (
            torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return False
    # the cores this process may run on, as evals/engine_pool.usable_cores counts them (that module stays free of
    # torch and this one of evals/)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2


class Scheduler:
    """Continuous batching over one `BatchCache`.

    `submit` queues requests; each `step` (1) admits the next waiting request when a row is free and the
    token budget allows (the running rows' prompts plus replies, `max_batch_tokens`), (2) prefills one
    chunk of `prefill_chunk` tokens of the request being admitted (a whole prompt for a prefix-cache
    hit, CED replay or images), and when its prompt is done, samples its first token and loads it into
    the next free row, (3) decodes one token for every running row in one forward, (4) runs one DSpark
    draft-and-verify step for each speculative request (DSpark requests keep their own KVCache: a
    verification forward takes several tokens of one sequence, which the one-token batch step does not;
    each counts as a row against max_batch_size and its tokens against max_batch_tokens). A finished row is
    freed at once and the last row moves into its place (rows in use stay 0..B-1). `cancel` drops a
    request wherever it is. A request that can never fit (context or token budget) is refused at
    `submit` with RequestTooLarge, before any work. On CUDA the decode step replays from CUDA graphs
    (`GraphedDecode`; cuda_graphs=False or DSV41_CUDA_GRAPHS=0 runs it eagerly).

    static_shapes (the CUDA graphs' mode, BatchCache.static; default: with CUDA graphs): every step reads the
    rows in power-of-two buckets and the whole entry capacity, which grows at least twofold at a time (room
    for each admitted request's whole reply is reserved), so a long run sees a few step shapes instead of a
    new one at nearly every step. The same numbers (the rest is masked;
    tests/test_batch_engine.py). For a long-lived process on the CPU (`dsv41 serve`): the eager step's native
    state per distinct shape (oneDNN's primitive cache and the allocator's blocks) then stays bounded
    (benchmarks/results/cpu-serve/NOTES.md, "Memory")."""

    def __init__(self, generator: "Generator", max_batch_size: int = 32, max_batch_tokens: int | None = None,
                 prefill_chunk: int | None = None, cuda_graphs: bool | None = None,
                 static_shapes: bool | None = None, overlap_prefill: bool | None = None):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.gen, self.model, self.args = generator, generator.model, generator.args
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK.get(torch.device(generator.device).type, 256)
        self.max_len = self.args.max_position_embeddings  # the model's context: a row's positions at most
        self.max_batch_tokens = max_batch_tokens or max_batch_size * self.max_len
        self.cache = self.model.new_batch_cache(max_batch_size, self.max_len)
        if cuda_graphs is None:
            cuda_graphs = cuda_graphs_default(generator.device)
        self.decode = GraphedDecode(self.model, self.cache, compiled=compiled_decode_default()) if cuda_graphs else \
            (lambda ids: self.model.decode(ids, self.cache))
        if static_shapes is not None and not cuda_graphs:  # (a captured step needs them: GraphedDecode sets it)
            self.cache.static = static_shapes
        self.waiting: list[_Sequence] = []
        self.prefilling: _Sequence | None = None
        self.running: list[_Sequence] = []  # running[i] is in row i
        self.speculating: list[_Sequence] = []  # DSpark requests, each in its own KVCache
        # plain prompts prefilling on the second thread (overlap_prefill): each holds a row and its tokens
        if overlap_prefill is None:
            overlap_prefill = overlap_prefill_default(generator.device)
        self._prefiller = _PrefillThread(self._prefill_whole) if overlap_prefill else None
        self.handed: list[_Sequence] = []
        self._cancelled: set = set()
        self.steps = 0
        self._keys = itertools.count()
        _reset_peak_memory(generator.device)

    # ---------------------------------------------------------------- queue
    def submit(self, request: Request, key=None) -> object:
        """Queue a request; returns its key (`key`, default a running number), which `run` yields with it."""
        key = next(self._keys) if key is None else key
        self.gen.check_request(request.prompt_ids, request.config)
        seq = _Sequence(key, request, self.gen)
        if seq.need > self.max_len:
            raise RequestTooLarge(f"the prompt ({len(request.prompt_ids)} tokens) and max_new_tokens "
                                  f"({seq.config.max_new_tokens}) exceed the model's context of {self.max_len} tokens")
        if seq.need > self.max_batch_tokens:
            raise RequestTooLarge(f"the prompt ({len(request.prompt_ids)} tokens) and max_new_tokens "
                                  f"({seq.config.max_new_tokens}) exceed max_batch_tokens ({self.max_batch_tokens})")
        self.waiting.append(seq)
        return key

    def cancel(self, key) -> bool:
        """Drop a request wherever it is (its row is freed); False if it is not here (finished or unknown)."""
        for seq in self.waiting:
            if seq.key == key:
                self.waiting.remove(seq)
                return True
        if self.prefilling is not None and self.prefilling.key == key:
            self.prefilling = None
            return True
        if any(seq.key == key for seq in self.handed) and key not in self._cancelled:
            self._cancelled.add(key)  # its prefill's result is dropped as it comes back
            return True
        for seq in self.running:
            if seq.key == key:
                self._release(seq)
                return True
        for seq in self.speculating:
            if seq.key == key:
                self.speculating.remove(seq)
                seq.spec.close()
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.speculating or self.handed)

    def run(self):
        """Step until every request finished; yields (key, GenerationResult) as each finishes."""
        while self.busy:
            yield from self.step()

    # ---------------------------------------------------------------- one step
    def step(self) -> list[tuple[object, GenerationResult]]:
        finished: list[_Sequence] = []
        self._admit(finished)
        if self.running:
            self._decode(finished)
        if self.speculating:
            self._speculative_steps(finished)
        self.steps += 1
        return [(seq.key, self._result(seq)) for seq in finished]

    def _in_flight(self) -> list[_Sequence]:
        """Every admitted request that holds a row: running, speculating, handed to the prefill thread, and the
        one this thread is prefilling."""
        return [*self.running, *self.speculating, *self.handed, *([self.prefilling] if self.prefilling else [])]

    def _reserved(self) -> int:
        return sum(seq.need for seq in self._in_flight())

    def _rows_taken(self) -> int:
        return len(self._in_flight())

    def _admit(self, finished: list) -> None:
        if self._prefiller is None:
            self._admit_here(finished)
            return
        # With the second thread: take the prompts it has done, hand it the next plain ones (in order, two at a
        # time: each holds its row), then prefill here as without it (this step's prompt tokens), so that both
        # threads prefill while few rows decode; with nothing else to do, wait for the thread.
        self._collect(finished, wait=False)
        while (self.waiting and self.waiting[0].chunked()
               and len(self.handed) < PREFILL_THREAD_DEPTH and self._rows_taken() < self.max_batch_size
               and self._reserved() + self.waiting[0].need <= self.max_batch_tokens
               and (self.running or self.speculating or self.prefilling or self._rows_taken() + 1 < self.max_batch_size)):
            # (the last free row, with nothing to decode: this thread prefills it itself, no hand-over to wait on)
            seq = self.waiting.pop(0)
            seq.started = time.perf_counter()
            if self.cache.static:
                self.cache.reserve(seq.need)
            size = self._next_chunk(seq)
            job = [seq, *self._companions(seq, size, size)]
            self.handed += job
            self._prefiller.submit(job)
        self._admit_here(finished)
        if not (self.running or self.speculating or self.prefilling) and self.handed:
            self._collect(finished, wait=True)

    def _collect(self, finished: list, wait: bool) -> None:
        """Enter the prompts the second thread has prefilled (at least one if `wait`); a cancelled one is
        dropped, and a prefill's exception is raised here once the others are in."""
        error = None
        for job, out, exc in self._prefiller.results(wait):
            for src, seq in enumerate(job):
                self.handed.remove(seq)
                if seq.key in self._cancelled:
                    self._cancelled.discard(seq.key)
                elif exc is not None:
                    error = error or exc
                else:
                    self._enter(seq, out[1][src:src + 1], out[0], src, None, finished)
        if error is not None:
            raise error

    def _prefill_whole(self, job: list[_Sequence]) -> tuple[KVCache, torch.Tensor]:
        """The second thread's job: one plain prompt whole into its own KVCache, cut as `_next_chunk` cuts
        it, or a group of equal-length prompts each whole in one forward (`_group_forward`)."""
        if len(job) > 1:
            return self._group_forward(job, len(job[0].request.prompt_ids))
        seq, t0 = job[0], time.perf_counter()
        ids = seq.request.prompt_ids
        cache = self.model.new_cache(1)
        chunk = seq.config.prefill_chunk or self.prefill_chunk
        for start in range(0, len(ids), chunk):  # `_prefill`'s forwards (Generator.prefill's would add its options)
            if self._prefiller is not None and self._prefiller.stopping:
                raise PrefillStopped
            logits = self.model(torch.tensor([ids[start:start + chunk]], device=self.gen.device), start_pos=start,
                                cache=cache)
        seq.done_tokens = len(ids)
        seq.prefill_stats = _plain_prefill_stats(len(ids))
        seq.prefill_seconds += time.perf_counter() - t0
        return cache, logits

    def _admit_here(self, finished: list) -> None:
        """Prefill up to `prefill_chunk` prompt tokens this step (whole chunks, at least one), admitting
        waiting requests as rows and the token budget allow: several short prompts, or one chunk of a long one."""
        spent = 0
        while True:
            if self.prefilling is None:
                if not (self.waiting and self._rows_taken() < self.max_batch_size
                        and self._reserved() + self.waiting[0].need <= self.max_batch_tokens):
                    return
                self.prefilling = self.waiting.pop(0)
                self.prefilling.started = time.perf_counter()
                if self.cache.static:  # room for its whole reply now: no new shapes (CUDA graphs) while it runs
                    self.cache.reserve(self.prefilling.need)
            seq = self.prefilling
            size = self._next_chunk(seq)
            if spent and spent + size > self.prefill_chunk:
                return
            spent += size
            group = self._companions(seq, size, spent)
            if group:
                spent += size * len(group)
                self.prefilling = None
                self._prefill_group([seq, *group], size, finished)
            else:
                self._prefill(seq, size, finished)

    def _companions(self, seq: _Sequence, size: int, spent: int) -> list[_Sequence]:
        """Waiting requests to prefill in one forward with `seq` (a batched prefill): plain prompts of exactly its
        length, each whole in one chunk as seq's is, while rows, the token budget and this step's `prefill_chunk`
        prompt tokens allow (taken out of the queue). On the CPU with one intra-op thread only, where each
        sequence of the batch gets the bits of its prefill alone (tests/test_batch_engine.py): a forward's fixed
        cost (its few thousand operators) is then paid once for the group: on the bundled model a 64-token prompt
        took 68 ms alone and 35 ms a prompt in a group of four (docs/performance.md, `cpu-batched-prefill`)."""
        n = len(seq.request.prompt_ids)
        if not (self.groups_prefills and seq.chunked() and seq.done_tokens == 0 and size == n):
            return []
        admitted = seq is self.prefilling  # already counted in the rows and tokens in flight
        rows = self.max_batch_size - self._rows_taken() - (0 if admitted else 1)
        reserved = self._reserved() + (0 if admitted else seq.need)
        group = []
        for other in self.waiting:
            if len(group) == rows or spent + size * (len(group) + 1) > self.prefill_chunk:
                break
            if (len(other.request.prompt_ids) == n and other.chunked() and self._next_chunk(other) == n
                    and reserved + other.need <= self.max_batch_tokens):
                group.append(other)
                reserved += other.need
        for other in group:
            self.waiting.remove(other)
            other.started = time.perf_counter()
            if self.cache.static:
                self.cache.reserve(other.need)
        return group

    @property
    def groups_prefills(self) -> bool:
        """Whether equal-length prompts prefill together (`_companions`): on the CPU at one intra-op thread, where
        it is tested bit for bit against each prompt alone; ATen splits an elementwise operator's range between
        threads at places that depend on the tensor's size, and on CUDA the GEMMs' summation order depends on
        the row count."""
        return torch.device(self.gen.device).type == "cpu" and torch.get_num_threads() == 1

    def _prefill_group(self, seqs: list[_Sequence], size: int, finished: list) -> None:
        """Prefill the whole prompts of `seqs` (all `size` tokens long) in one forward, then enter each as
        `_prefill` does."""
        cache, logits = self._group_forward(seqs, size)
        for src, seq in enumerate(seqs):
            self._enter(seq, logits[src:src + 1], cache, src, None, finished)

    def _group_forward(self, seqs: list[_Sequence], size: int) -> tuple[KVCache, torch.Tensor]:
        """The whole prompts of `seqs` (all `size` tokens long) in one forward over a KVCache of len(seqs)
        sequences; the forward's time is shared among them."""
        t0 = time.perf_counter()
        cache = self.model.new_cache(len(seqs))
        ids = torch.tensor([seq.request.prompt_ids for seq in seqs], device=self.gen.device)
        with kernels_reference.sequences_apart(len(seqs)):  # each prompt's sigmoid/softplus bits as alone
            logits = self.model(ids, start_pos=0, cache=cache)
        _sync(self.gen.device)
        share = (time.perf_counter() - t0) / len(seqs)
        for seq in seqs:
            seq.done_tokens = size
            seq.prefill_seconds += share
            seq.prefill_stats = _plain_prefill_stats(size)
        return cache, logits

    def _next_chunk(self, seq: _Sequence) -> int:
        """The prompt tokens `seq`'s next prefill forward takes. A prompt is cut at fixed multiples of the
        chunk size from its start (never by what else runs), so its prefill computes the same numbers in
        any batch; a prefix-cache lookup, CED replay or images take the whole prompt in one go."""
        n = len(seq.request.prompt_ids)
        if not seq.chunked():
            return n
        return min(seq.config.prefill_chunk or self.prefill_chunk, n - seq.done_tokens)

    def _prefill(self, seq: _Sequence, size: int, finished: list) -> None:
        t0 = time.perf_counter()
        ids = seq.request.prompt_ids
        if seq.chunked():
            if seq.cache is None:
                seq.cache = self.model.new_cache(1)
            end = seq.done_tokens + size
            logits = self.model(torch.tensor([ids[seq.done_tokens:end]], device=self.gen.device),
                                start_pos=seq.done_tokens, cache=seq.cache)
            seq.done_tokens = end
            if end < len(ids):
                seq.prefill_seconds += time.perf_counter() - t0
                return
            seq.prefill_stats = _plain_prefill_stats(len(ids))
            taps = None
        else:
            seq.cache, logits, taps, seq.prefill_stats = self.gen._prompt(ids, seq.config, seq.request.images)
        _sync(self.gen.device)
        seq.prefill_seconds += time.perf_counter() - t0
        self.prefilling = None
        cache, seq.cache = seq.cache, None
        self._enter(seq, logits, cache, 0, taps, finished)

    def _enter(self, seq: _Sequence, logits: torch.Tensor, cache: KVCache, src: int, taps, finished: list) -> None:
        """A prompt just prefilled into sequence `src` of `cache` (logits [1, V]): commit its first token, then
        load it into the next free row, or finish it, or (DSpark) start its speculative steps."""
        seq.started = time.perf_counter()
        check_finite(logits, self.gen.source)
        if seq.config.dspark:  # its first step (next scheduler step) commits the prompt's next token
            seq.cache = cache
            seq.spec = self.gen._speculate(cache, logits, taps, seq.request.prompt_ids, seq.config, seq.sampler,
                                           seq.budget, seq.request.on_token, seq.out)
            self.speculating.append(seq)
            return
        self._commit(seq, int(greedy_ids(logits[0])) if seq.sampler.greedy else int(seq.sampler(logits[0])))
        if seq.finish:
            seq.kv_bytes_per_token = cache_bytes_per_token(cache)  # per token and sequence: any of a batch
            self._store_prefix(seq, cache)
            finished.append(seq)
            return
        self.cache.load(len(self.running), cache, src)
        self.running.append(seq)

    def _decode(self, finished: list) -> None:
        t0 = time.perf_counter()
        ids = torch.tensor([seq.token for seq in self.running], device=self.gen.device)
        # the prefill thread's core, while it has no prompt, takes half the head's columns (the same bits)
        with host.helper_core(self._prefiller is not None and not self.handed):
            logits = self.decode(ids)
        if any(seq.sampler.greedy for seq in self.running):
            greedy = checked_greedy_ids(logits, self.gen.source).tolist()
        else:
            check_finite(logits, self.gen.source)
            greedy = None
        done = []
        for row, seq in enumerate(self.running):
            self._commit(seq, greedy[row] if seq.sampler.greedy else int(seq.sampler(logits[row])))
            if seq.finish:
                done.append(seq)
        share = (time.perf_counter() - t0) / len(self.running)
        for seq in self.running:
            seq.engine_seconds += share
        for seq in done:
            row = self.running.index(seq)
            self._store_prefix(seq, None, row)
            seq.kv_bytes_per_token = self._kv_bytes_per_token(row)
            self._release(seq)
            finished.append(seq)

    def _speculative_steps(self, finished: list) -> None:
        """One DSpark draft-and-verify step for each speculative request."""
        for seq in list(self.speculating):
            try:
                next(seq.spec)
            except StopIteration as end:
                seq.finish, seq.dspark_stats = end.value
                _sync(self.gen.device)
                seq.finished_at = time.perf_counter()
                self._store_prefix(seq, seq.cache)
                seq.kv_bytes_per_token = cache_bytes_per_token(seq.cache)
                self.speculating.remove(seq)
                finished.append(seq)

    def _commit(self, seq: _Sequence, token: int) -> None:
        token = seq.budget.override(token)
        seq.token = token
        seq.finish = _emit(token, seq.out, seq.config, seq.request.on_token)
        if seq.finish:
            _sync(self.gen.device)
            seq.finished_at = time.perf_counter()

    def _release(self, seq: _Sequence) -> None:
        """Free seq's row; the last running row moves into it."""
        row, last = self.running.index(seq), len(self.running) - 1
        if row != last:
            self.cache.move(last, row)
            self.running[row] = self.running[last]
        self.running.pop()
        self.cache.free(last)

    def _store_prefix(self, seq: _Sequence, cache: KVCache | None, row: int | None = None) -> None:
        pc = seq.config.prefix_cache if not seq.request.images else None
        if pc is None:
            return
        # the conversation so far (prompt and reply): a next turn continued over it hits. The last token
        # was committed but never run through the model, so the cache holds the tokens before it.
        pc.store(list(seq.request.prompt_ids) + seq.out, cache if cache is not None else self.cache.unload(row))

    def _kv_bytes_per_token(self, row: int) -> float:
        b = self.cache.row_bytes(row)
        length = self.cache.lengths[row]
        return (b["main"] + b["index_keys"]) / length if length else 0.0

    def _result(self, seq: _Sequence) -> GenerationResult:
        return GenerationResult(len(seq.request.prompt_ids), seq.out, seq.finish, seq.prefill_seconds,
                                seq.finished_at - seq.started, _peak_memory(self.gen.device), seq.kv_bytes_per_token,
                                seq.dspark_stats,
                                seq.budget.forced, seq.prefill_stats,
                                seq.prefill_seconds + (seq.engine_seconds if seq.spec is None
                                                       else seq.finished_at - seq.started))


class GraphedDecode:
    """`Transformer.decode` replayed from CUDA graphs: the whole step (every layer, the head) as one graph per
    shape, so a step costs one launch instead of a few thousand. The cache runs static (BatchCache.static:
    row counts in powers of two, the whole entry capacity read, a power-of-two RoPE table), so a shape
    lasts until the entry capacity doubles. The first step of a shape runs eagerly (it compiles the kernels
    and allocates what the step keeps), then the same step is captured (capturing runs nothing) and
    replayed from the next step on. Same kernels, same numbers as the eager static step."""

    def __init__(self, model, cache, compiled: bool = False):
        self.model, self.cache = model, cache
        # compiled: the step's torch operators fused by torch.compile (inductor) before capture, so a replay
        # runs fewer, larger kernels (`compiled_decode_rows`); the graph removes the launches either way
        self.rows_fn = compiled_decode_rows(model) if compiled else model.decode_rows
        cache.static = True
        self.graphs: dict[tuple, tuple] = {}
        self.capacity = None
        self.pool = None
        self.captured = self.replays = 0
        self.failed: str | None = None  # why capturing failed (then every step runs eagerly)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if self.failed is not None:
            return self.model.decode(ids, cache)
        B = ids.size(0)
        R = cache.prepare_step(B)
        if cache.capacity != self.capacity:  # the entry stores were reallocated: the graphs read the old ones
            # Drop the graphs and their memory pool with them: once its graphs are all released, a pool cannot
            # take another capture (the caching allocator asserts `use_count > 0`), and the step would run
            # eagerly from there on (seen 2026-12-06, benchmarks/results/h200-2026-12-06)
            self.graphs.clear()
            self.pool = None
            self.capacity = cache.capacity
        key = cache.static_key()
        entry = self.graphs.get(key)
        if entry is None:
            buf = torch.zeros(R, dtype=torch.long, device=ids.device)
            buf[:B] = ids
            logits = self.rows_fn(buf, cache)
            cache.advance()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.rows_fn(buf, cache)
            except RuntimeError as e:  # an operator that cannot be captured: run eagerly from now on
                self.failed = f"{type(e).__name__}: {e}"
                import warnings

                warnings.warn(f"CUDA graph capture of the decode step failed, running it eagerly: {self.failed}")
                torch.cuda.synchronize()
                return logits[:B]
            self.pool = graph.pool()
            self.graphs[key] = (graph, buf, out)
            self.captured += 1
            return logits[:B]
        graph, buf, out = entry
        buf.zero_()
        buf[:B] = ids
        graph.replay()
        self.replays += 1
        cache.advance()
        return out[:B]


def compiled_decode_rows(model):
    """`model.decode_rows` through torch.compile (inductor, static shapes): elementwise chains and small
    reductions fused into generated kernels. Its compiled code is cached on disk (TORCHINDUCTOR_CACHE_DIR,
    default ~/.cache/dsv41/inductor), so a later process skips inductor's code generation. Every static
    step shape (rows, entry capacity, RoPE table) is one compilation: the recompile limit is raised to cover
    them."""
    import torch._dynamo

    from dsv41.model.kernels import keep_launches_opaque

    keep_launches_opaque()  # the Triton launches stay whole calls (model/kernels/__init__.py, `opaque`)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "dsv41",
                                                                  "inductor"))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model.decode_rows, dynamic=False)


def cuda_graphs_default(device) -> bool:
    """CUDA graphs for the decode step: on for a CUDA device unless DSV41_CUDA_GRAPHS=0."""
    return torch.device(device).type == "cuda" and os.environ.get("DSV41_CUDA_GRAPHS", "1") != "0"


def compiled_decode_default() -> bool:
    """The captured decode step compiled by torch.compile first (`GraphedDecode(compiled=True)`): off unless
    DSV41_COMPILE_DECODE=1. Opt-in: each step shape compiles once (tens of seconds, cached on disk), which a
    long run or a server earns back and a one-shot command does not (docs/generation.md, "CUDA graphs")."""
    return os.environ.get("DSV41_COMPILE_DECODE", "0") == "1"


def check_finite(logits: torch.Tensor, source: str | None = None) -> None:
    """NonFiniteLogits, naming the checkpoint, when a logit about to be sampled is NaN or infinite.

    The test is the sum's finiteness: one read of the logits and no [rows, vocab] mask (isfinite + all took
    2.7 ms per step on the CPU for 16 x 129K logits, the sum 0.17 ms). A NaN or inf makes the sum non-finite;
    a sum that overflows from finite logits only sends it on to the exact elementwise check."""
    if bool(torch.isfinite(logits.sum())):
        return
    finite = torch.isfinite(logits)
    if not bool(finite.all()):
        where = source or "the checkpoint"
        raise NonFiniteLogits(
            f"{where}: the model's logits hold {int((~finite).sum()):,} NaN/inf of {logits.numel():,} values: "
            f"its weights are corrupt or overflow (`dsv41 convert {where} --verify` scans every tensor)")


def _emit(token: int, out: list[int], config: GenerationConfig, on_token) -> str | None:
    """Commit one generated token; return the finish reason if generation ends with it (`on_token` may end
    it too, returning its own reason: a stop string it saw, say)."""
    out.append(token)
    reason = on_token(token) if on_token else None
    if token in config.stop_ids:
        return "stop"
    if reason:
        return reason
    if len(out) >= config.max_new_tokens:
        return "length"
    return None


class _Budget:
    """Effort as a decode-time thinking budget: once `thinking_budget` reasoning tokens were emitted
    without `</think>`, the next token is forced to `</think>` and the model goes on to answer."""

    def __init__(self, config: GenerationConfig, prompt_ids: list[int]):
        self.limit, self.end_id = config.thinking_budget, config.think_end_id
        self.count, self.closed, self.forced = 0, self.limit is None or self.end_id is None, False

    def override(self, token: int) -> int:
        if self.closed:
            return token
        if token == self.end_id:
            self.closed = True
            return token
        if self.count >= self.limit:
            self.closed, self.forced = True, True
            return self.end_id
        self.count += 1
        return token


def _chunk_bounds(total: int, chunk: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[s, e) prefill chunks of about `chunk` tokens; a chunk that would end inside an image span
    [a, b) runs on to b (an image is encoded and attends to itself within one forward)."""
    bounds, s = [], 0
    while s < total:
        e = min(s + chunk, total)
        for a, b in spans:
            if a < e < b:
                e = b
        bounds.append((s, e))
        s = e
    return bounds


def _engram_history(model, ids: list[int]) -> torch.Tensor | None:
    hasher = model.hasher
    if hasher is None:
        return None
    tail = torch.tensor([ids[-(hasher.max_ngram_size - 1):]], device=model.embed.weight.device)
    return hasher(tail)[1]


def cache_bytes_per_token(cache: KVCache) -> float:
    """Bytes the cache holds per token for the global KV (compressed main KV + indexer keys) as
    stored now (packed), measured from the tensors (nbytes of the used rows), not from a formula."""
    return cache.global_bytes_per_token()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device) -> int:
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
    except Exception:  # pragma: no cover - non-POSIX
        return 0


def generate_chat(generator: Generator, messages: list[dict], tools: list[dict] | None = None,
                  effort: int | None = None, max_new_tokens: int = 512,
                  sampling: SamplingConfig | None = None) -> tuple[str, int]:
    """One assistant turn for a message list (OpenAI schema, as agent scaffolds keep it): encoded with
    the V4.1 chat encoding (thinking mode with `effort`, chat mode when effort is None), generated,
    and returned as the completion text the model wrote, special tokens included (reasoning,
    `</think>`, content, any DSML block, end-of-sentence unless cut), with its token count."""
    from dsv41.model import encoding

    tok = generator.tokenizer
    if tok is None:
        raise ValueError("generate_chat needs a Generator built with its tokenizer")
    mode = "chat" if effort is None else "thinking"
    if tools:
        messages = encoding.attach_tools(messages, tools)
    prompt = encoding.encode_messages(messages, mode=mode, effort=effort if effort is not None else "high")
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling or SamplingConfig(),
                              stop_ids=(tok.eos_id,), think_end_id=tok.token_to_id(encoding.THINK_END))
    result = generator.generate(tok.encode(prompt, allow_special=True), config)
    return tok.decode(result.output_ids, skip_special=False), len(result.output_ids)
