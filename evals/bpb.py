"""Scoring text with the model: token log-probabilities, rolling windows, bits per byte.

The quantity (report Figure 6, toolkit-anchors §3)::

    BPB(corpus) = sum over documents, over tokens  -ln p(t_i | t_<i)   /   (ln 2 * UTF-8 bytes of the text)

aggregated as a ratio of sums over the whole corpus (not a mean of per-document values), which makes
it independent of the tokenizer. Every document is scored separately, conditioned on BOS, and every
token of it is scored exactly once. Long documents are cut into windows of at most `max_ctx` input
tokens:

    disjoint     consecutive blocks of max_ctx tokens; the first token of a block is conditioned on
                 the last token of the previous one only. The last, shorter block is given the full
                 max_ctx of earlier tokens as context. This is lm-eval's `loglikelihood_rolling`
                 (get_rolling_token_windows with context_len=1), so the numbers match lm-eval's.
    strided:S    a window of max_ctx tokens advances S tokens at a time and scores only its S new
                 tokens, so every token after the first window sees at least max_ctx - S tokens of
                 context (the Hugging Face perplexity recipe). Costs about max_ctx/S times more.

`score_sequences` is the one scoring primitive; the lm-eval adapter (evals/lm_eval_model.py) uses it
for `loglikelihood` and `loglikelihood_rolling` as well. It batches sequences (right-padded: the
model is causal, so padding never reaches a scored position) and runs long inputs through the KV
cache in chunks, so the fp32 logits held at once stay within a memory budget.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

LN2 = math.log(2.0)
DEFAULT_LOGITS_BYTES = 2**30  # sizes a scoring forward's chunk: as many positions as fit this many fp32 logits


# ============================================================================ the scoring primitive
@dataclass
class Scored:
    """Score of the last `n` tokens of one sequence, each predicted from all the tokens before it."""

    logprob: float  # sum of ln p over the scored tokens
    greedy: bool  # every scored token was the model's argmax
    n: int  # number of scored tokens


def plan_batches(sequences: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """The batches `score_sequences` runs: sequence indices sorted longest first, `batch_size` at a time."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    return [order[b:b + batch_size] for b in range(0, len(order), batch_size)]


def score_sequences(model, sequences: Sequence[Sequence[int]], n_scored: Sequence[int], *,
                    pad_id: int = 0, batch_size: int = 8, max_logits_bytes: int = DEFAULT_LOGITS_BYTES,
                    on_done: Callable[[int, Scored], None] | None = None, check_greedy: bool = True,
                    ctx=None, on_start: Callable[[list[int]], None] | None = None) -> list[Scored]:
    """For each token sequence s and count n, sum ln p(s[j] | s[:j]) over its last n tokens.

    The model reads s[:-1]; the logits at input positions len(s)-1-n .. len(s)-2 predict the scored
    tokens (lm-eval's indexing rule). Sequences are sorted longest first and scored in right-padded
    batches (`plan_batches`); a batch runs through the KV cache in chunks of as many positions as
    `max_logits_bytes` of fp32 logits would hold for its rows (no chunk's logits are built: the head runs on
    the scored positions, `score_positions`; the chunks keep the boundaries, and so the scores, they had
    when they were). on_done(i, score) is called as sequence i (original order) is scored. check_greedy
    False skips the argmax pass (the greedy flag is then meaningless).

    ctx: a `dsv41.model.parallel.ParallelContext` when running under torchrun. Every rank must call this
    with the same sequences. With several model copies (DSV41_TP) the batches are dealt out to the
    copies and the scores gathered, so every rank returns all of them; each batch is exactly the one
    a single process runs, so the scores are a single process's. Then on_done is called only for the
    sequences this copy scores, and on_start(indices), when given, is called first with their indices
    (all of them in one process or one copy).
    """
    if len(sequences) != len(n_scored):
        raise ValueError("one scored-token count per sequence")
    for seq, n in zip(sequences, n_scored):
        if not 1 <= n <= len(seq) - 1:
            raise ValueError(f"cannot score {n} tokens of a {len(seq)}-token sequence (the first token is context)")
    batches = plan_batches(sequences, batch_size)

    def run(share: list[list[int]]) -> list[list[Scored]]:
        if on_start:
            on_start([i for rows in share for i in rows])
        return in_threads(share, lambda rows, done: _score_batch(model, sequences, n_scored, rows, pad_id,
                                                                 max_logits_bytes, check_greedy, done),
                          scoring_threads(model, len(share)), on_done)

    per_batch = ctx.split_work(batches, run) if ctx is not None else run(batches)
    results: list[Scored | None] = [None] * len(sequences)
    for rows, scores in zip(batches, per_batch):
        for i, s in zip(rows, scores):
            results[i] = s
    return results  # type: ignore[return-value]


def scoring_threads(model, batches: int) -> int:
    """Threads `score_sequences` runs its batches in: on the CPU, the cores left over by torch's own intra-op
    threads (a small model runs at one, `dsv41_cli.common.tune_threads`, so on a 2-core machine two batches score
    at once), at most one per batch; on a GPU one. DSV41_THREADS, when set, is the whole budget; under torchrun
    the host's cores are divided among its processes."""
    import torch
    from dsv41.evals.engine_pool import usable_cores

    if model.embed.weight.device.type != "cpu" or batches < 2:
        return 1
    if "DSV41_THREADS" in os.environ:
        cores = int(os.environ["DSV41_THREADS"])
    else:  # torchrun's processes on this host share its cores
        cores = usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(batches, cores // max(1, torch.get_num_threads())))


def in_threads(batches: list, score: Callable, threads: int, on_done: Callable | None = None) -> list:
    """[score(batch, on_done) for batch in batches], the batches taken in order by `threads` threads.

    Why threads and not processes: a scoring batch spends its time in torch operators and the C head, which
    release the GIL, and the threads share the loaded model. Each batch is exactly the one a single thread
    runs (its rows and so its chunks), so every score is the single-threaded one, bit for bit; only the
    order of the on_done calls changes (they are serialized). The first error stops the other threads at
    their next batch and is raised here; an interrupt (Ctrl-C) is raised once the batches running end, and from
    then on no on_done call reaches the caller and no thread starts a batch."""
    if threads <= 1:
        return [score(batch, on_done) for batch in batches]
    import threading

    results: list = [None] * len(batches)
    todo, lock, stop, failed = iter(range(len(batches))), threading.Lock(), threading.Event(), []

    def done(i, scored):
        with lock:
            if not stop.is_set():
                on_done(i, scored)

    def worker():
        while True:
            with lock:
                k = None if stop.is_set() or failed else next(todo, None)
            if k is None:
                return
            try:
                results[k] = score(batches[k], done if on_done else None)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                with lock:
                    failed.append(e)
                return

    pool = [threading.Thread(target=worker, name=f"dsv41-score-{t}", daemon=True) for t in range(threads)]
    try:
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    except BaseException:  # Ctrl-C: no on_done after it (the caller is saving what finished), no new batch
        with lock:
            stop.set()
        for t in pool:  # the batches running end first: a thread still inside a torch operator when the
            t.join()    # interpreter finalizes aborts the process (model/engine.py `_PrefillThread`)
        raise
    if failed:
        raise failed[0]
    return results


HEAD_ROWS = 32  # positions per head block in `score_positions`


def score_positions(model, hidden, targets, check_greedy: bool = True, top: int = 0):
    """(ln p(target) fp32 [N], target is the argmax [N], the `top` most likely (ln p [N, top], ids [N, top])
    or None) from final-normed hidden states [N, dim] (`model(..., head=False)`).

    The head runs on blocks of exactly HEAD_ROWS positions (the last padded): the [N, vocab] logits are never
    materialized, and each block's logits (16.5 MB at V4.1's vocabulary) is reused memory rather than a fresh
    mapping the kernel must fault in, which cost more than the arithmetic (the CPU spent over half of a
    `dsv41 bpb` run in the kernel). One block size for every position also keeps a position's logits
    independent of how many others are scored with it (a GEMM of a few rows takes another code path).

    On the CPU a block's log-sum-exp, the targets' logits and the argmax come from one pass over each row
    (`host.score_logits`, or its torch reference where the C library is not loaded: the same bits), not from
    three torch reductions over the block (2.5 against 8.8 ms a block of V4.1's vocabulary, whose head GEMM is
    5.7 ms), with numbers that do not depend on the CPU's vector width (a fixed order; torch's logsumexp agrees
    within 1e-5). On a GPU the block keeps torch's reductions."""
    import torch

    from dsv41.model.kernels import host
    from dsv41.model.kernels import reference as kernels_reference

    on_host = hidden.device.type == "cpu"
    score_block = host.score_logits if host.available() else kernels_reference.score_logits
    n = hidden.size(0)
    logprob = torch.empty(n, dtype=torch.float32, device=hidden.device)
    hit = torch.ones(n, dtype=torch.bool, device=hidden.device)
    best = (torch.empty(n, top, dtype=torch.float32, device=hidden.device),
            torch.empty(n, top, dtype=torch.long, device=hidden.device)) if top > 0 else None
    for b in range(0, n, HEAD_ROWS):
        h, t = hidden[b:b + HEAD_ROWS], targets[b:b + HEAD_ROWS]
        k = h.size(0)
        if k < HEAD_ROWS:
            h = torch.cat([h, h.new_zeros(HEAD_ROWS - k, h.size(1))])
        logits = model.head(h)[:k].float()
        if on_host:
            logprob[b:b + k], lse, argmax = score_block(logits, t)
        else:
            lse = torch.logsumexp(logits, -1)
            logprob[b:b + k] = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse
            argmax = logits.argmax(-1) if check_greedy else None
        if check_greedy:
            hit[b:b + k] = argmax == t
        if best is not None:
            values, indices = logits.topk(top, dim=-1)
            best[0][b:b + k], best[1][b:b + k] = values - lse.unsqueeze(-1), indices
    return logprob, hit, best


def _score_batch(model, sequences, n_scored, rows: list[int], pad_id: int, max_logits_bytes: int,
                 check_greedy: bool, on_done) -> list[Scored]:
    """One right-padded batch of `score_sequences`: the Scored of each row, in the order of `rows`."""
    import torch

    device = model.embed.weight.device
    vocab = model.args.vocab_size
    with torch.inference_mode():
        T = len(sequences[rows[0]]) - 1  # input length of the longest row
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
        targets = torch.full((len(rows), T), -1, dtype=torch.long)  # -1: not scored
        for r, i in enumerate(rows):
            seq, n = sequences[i], n_scored[i]
            L = len(seq) - 1
            ids[r, :L] = torch.as_tensor(seq[:-1])
            targets[r, L - n:L] = torch.as_tensor(seq[L - n + 1:])
        ids, targets = ids.to(device), targets.to(device)
        chunk = max(1, max_logits_bytes // (4 * vocab * len(rows)))
        cache = model.new_cache(len(rows))
        logprob = torch.zeros(len(rows), dtype=torch.float64, device=device)
        greedy = torch.ones(len(rows), dtype=torch.bool, device=device)
        for s in range(0, T, chunk):
            tgt = targets[:, s:s + chunk]
            wanted = tgt >= 0
            if not bool(wanted.any()):  # nothing scored here: only fill the cache
                model(ids[:, s:s + chunk], start_pos=s, cache=cache)
                continue
            hidden = model(ids[:, s:s + chunk], start_pos=s, cache=cache, all_logits=True, head=False)
            # ln p(target) at the scored positions only, zeros elsewhere (as torch.where(wanted, ...) would)
            picked = torch.zeros(tgt.shape, dtype=torch.float32, device=device)
            hit = torch.ones(tgt.shape, dtype=torch.bool, device=device)
            picked[wanted], hit[wanted], _ = score_positions(model, hidden[wanted], tgt[wanted], check_greedy)
            logprob += picked.double().sum(-1)
            if check_greedy:
                greedy &= hit.all(-1)
        out = []
        for r, i in enumerate(rows):
            out.append(Scored(float(logprob[r]), bool(greedy[r]), n_scored[i]))
            if on_done:
                on_done(i, out[-1])
    return out


# ============================================================================ windows
def parse_window(window: str) -> int | None:
    """'disjoint' -> None; 'strided:S' -> S (a positive integer). ValueError otherwise."""
    if window == "disjoint":
        return None
    if window.startswith("strided:"):
        text = window.split(":", 1)[1]
        if text.isdigit() and int(text) > 0:
            return int(text)
    raise ValueError(f"--window must be 'disjoint' or 'strided:S' with S a positive integer, not {window!r}")


def rolling_windows(tokens: Sequence[int], prefix: int, max_ctx: int, stride: int | None = None
                    ) -> list[tuple[list[int], int]]:
    """Cut a document into (sequence, n_scored) windows that score every token exactly once.

    The document is read as [prefix] + tokens. A window's sequence holds at most max_ctx + 1 tokens
    (max_ctx model inputs); its last n_scored tokens are scored. stride None = disjoint blocks of
    max_ctx (lm-eval's loglikelihood_rolling); stride S = windows advancing S tokens."""
    if max_ctx < 1:
        raise ValueError("max_ctx must be at least 1")
    step = max_ctx if stride is None else stride
    if not 1 <= step <= max_ctx:
        raise ValueError(f"the stride must be in 1..max_ctx ({max_ctx}), not {step}")
    full = [prefix] + list(tokens)
    n = len(tokens)
    windows = []
    done = min(max_ctx, n)  # the first window scores tokens 1..done of `full`
    if n:
        windows.append((full[:done + 1], done))
    while done < n:
        end = min(done + step, n)  # score full[done+1 .. end]
        windows.append((full[max(0, end - max_ctx):end + 1], end - done))
        done = end
    return windows


# ============================================================================ corpora
@dataclass
class Document:
    name: str
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass
class Corpus:
    name: str
    documents: list[Document]
    skipped: list[str] = field(default_factory=list)  # files that were not UTF-8 text

    @property
    def n_bytes(self) -> int:
        return sum(d.n_bytes for d in self.documents)


class CorpusError(ValueError):
    """A corpus path that cannot be read as text (bad input)."""


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CorpusError(f"{path}: {e.strerror or e}") from None


def _documents_of_file(path: Path, label: str) -> list[Document]:
    """A .jsonl file holds one document per line (its "text" field); any other file is one document."""
    text = _read_text(path)
    if path.suffix != ".jsonl":
        return [Document(label, text)]
    docs = []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{k}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise CorpusError(f"{path}:{k}: expected an object with a string field \"text\"")
        docs.append(Document(str(row.get("name") or row.get("id") or f"{label}:{k}"), row["text"]))
    return docs


def load_corpus(path: str | os.PathLike) -> Corpus:
    """A file or a directory as a corpus.

    file: a .jsonl file is one document per line ({"text": ...}); any other file is one document.
    directory: every regular file below it (sorted, hidden ones skipped) contributes its documents;
    files that are not UTF-8 text are skipped and listed in `skipped`. Empty documents are dropped
    (they have no bytes to score)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusError(f"{path}: no such file or directory")
    if p.is_file():
        docs = _documents_of_file(p, p.name)
        corpus = Corpus(p.stem if p.suffix == ".jsonl" else p.name, docs)
    else:
        corpus = Corpus(p.resolve().name, [])
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            rel = f.relative_to(p)
            if any(part.startswith(".") for part in rel.parts):
                continue
            try:
                corpus.documents += _documents_of_file(f, str(rel))
            except CorpusError:
                corpus.skipped.append(str(rel))
    corpus.documents = [d for d in corpus.documents if d.text]
    if not corpus.documents:
        raise CorpusError(f"{path}: no text to score")
    return corpus


def unique_names(corpora: list[Corpus]) -> None:
    """Make corpus names unique (a/x and b/x both named x become x and x#2)."""
    seen: dict[str, int] = {}
    for c in corpora:
        seen[c.name] = seen.get(c.name, 0) + 1
        if seen[c.name] > 1:
            c.name = f"{c.name}#{seen[c.name]}"


# ============================================================================ bits per byte
@dataclass
class DocumentScore:
    nll: float  # -sum ln p, nats
    n_bytes: int
    n_tokens: int


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / (LN2 * n_bytes)


def bootstrap_ci(docs: Sequence[DocumentScore], iters: int = 1000, seed: int = 0, level: float = 0.95
                 ) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the corpus BPB (a ratio of sums) over documents; None with
    fewer than two documents (nothing to resample) or no resamples asked for."""
    import numpy as np

    if len(docs) < 2 or iters <= 0:
        return None
    nll = np.array([d.nll for d in docs])
    nbytes = np.array([d.n_bytes for d in docs], dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(docs), size=(iters, len(docs)))
    stats = nll[picks].sum(1) / (LN2 * nbytes[picks].sum(1))
    lo, hi = np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def tokenize_corpus(tokenizer, corpus: Corpus) -> list[list[int]]:
    """Token ids of every document: plain text, so a control token's spelling is just bytes."""
    return [tokenizer.encode(d.text, allow_special=False) for d in corpus.documents]


def score_corpus(model, tokenizer, corpus: Corpus, max_ctx: int, stride: int | None = None, *,
                 token_ids: list[list[int]] | None = None, batch_size: int = 8,
                 max_logits_bytes: int = DEFAULT_LOGITS_BYTES,
                 on_tokens: Callable[[int], None] | None = None,
                 on_start: Callable[[int], None] | None = None, ctx=None) -> list[DocumentScore]:
    """Score every document of the corpus; one DocumentScore per document, in order.

    on_start(n), when given, is called first with the number of tokens this process will score, then
    on_tokens(k) as each window's k tokens are scored. ctx: see `score_sequences` (model copies divide
    the windows)."""
    token_ids = token_ids if token_ids is not None else tokenize_corpus(tokenizer, corpus)
    sequences, n_scored, owner = [], [], []
    for k, ids in enumerate(token_ids):
        for seq, n in rolling_windows(ids, tokenizer.bos_id, max_ctx, stride):
            sequences.append(seq)
            n_scored.append(n)
            owner.append(k)
    scores = score_sequences(model, sequences, n_scored, pad_id=tokenizer.pad_id, batch_size=batch_size,
                             max_logits_bytes=max_logits_bytes,
                             on_done=(lambda i, s: on_tokens(s.n)) if on_tokens else None, check_greedy=False,
                             ctx=ctx, on_start=(lambda mine: on_start(sum(n_scored[i] for i in mine)))
                             if on_start else None)
    nll = [0.0] * len(corpus.documents)
    for k, s in zip(owner, scores):
        nll[k] -= s.logprob
    return [DocumentScore(nll[k], d.n_bytes, len(token_ids[k])) for k, d in enumerate(corpus.documents)]


def summarize(corpus: Corpus, docs: Sequence[DocumentScore], bootstrap_iters: int = 1000) -> dict:
    nll = sum(d.nll for d in docs)
    n_bytes = sum(d.n_bytes for d in docs)
    ci = bootstrap_ci(docs, bootstrap_iters)
    return {"name": corpus.name, "bytes": n_bytes, "documents": len(docs), "tokens": sum(d.n_tokens for d in docs),
            "bpb": bits_per_byte(nll, n_bytes), "ci95": list(ci) if ci else None, "nll_nats": nll}


# ============================================================================ compressor baselines
def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=19).compress(data)


COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": lambda b: gzip.compress(b, compresslevel=9, mtime=0),
    "bz2": lambda b: bz2.compress(b, compresslevel=9),
    "xz": lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME),
    "zstd": _zstd,
}


def compressor_available(name: str) -> bool:
    if name != "zstd":
        return name in COMPRESSORS
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def compressor_bpb(name: str, corpus: Corpus) -> float:
    """8 x compressed bytes / raw bytes, each document compressed on its own (the model, too, scores
    every document without the others as context), container headers included."""
    compress = COMPRESSORS[name]
    packed = sum(len(compress(d.text.encode("utf-8"))) for d in corpus.documents)
    return 8.0 * packed / corpus.n_bytes


# ============================================================================ the whole run
@dataclass
class ModelSpec:
    """A model to score with: its display name, and a loader returning (model, args, tokenizer)."""

    name: str
    load: Callable[[], tuple]


def run_bpb(models: Iterable[ModelSpec], corpora: list[Corpus], *, window: str = "disjoint", max_ctx: int = 0,
            baselines: Sequence[str] = (), batch_size: int = 8, bootstrap_iters: int = 1000,
            max_logits_bytes: int = DEFAULT_LOGITS_BYTES, progress=None, ctx=None) -> dict:
    """Bits per byte of every model on every corpus, plus compressor baselines: the `dsv41 bpb` JSON.

    max_ctx 0 means each model's training context (`original_seq_len`), capped by `max_seq_len`.
    progress: an object with start(label, total_tokens) / advance(n) / stop(), or None.
    ctx: a `dsv41.model.parallel.ParallelContext` under torchrun (every rank calls this with the same
    arguments and gets the same document; model copies divide the windows)."""
    stride = parse_window(window)
    out = {"window": window, "max_ctx": max_ctx, "models": [], "baselines": {}}
    for spec in models:
        model, args, tokenizer = spec.load()
        window_ctx = max_ctx or min(args.original_seq_len, args.max_seq_len)
        if stride is not None and stride > window_ctx:
            raise ValueError(f"--window strided:{stride}: the stride exceeds the context ({window_ctx} tokens)")
        entry = {"model": spec.name, "max_ctx": window_ctx, "corpora": []}
        total_nll = total_bytes = 0.0
        for corpus in corpora:
            token_ids = tokenize_corpus(tokenizer, corpus)
            label = f"{spec.name} · {corpus.name}"
            docs = score_corpus(model, tokenizer, corpus, window_ctx, stride, token_ids=token_ids,
                                batch_size=batch_size, max_logits_bytes=max_logits_bytes,
                                on_tokens=progress.advance if progress else None,
                                on_start=(lambda n, label=label: progress.start(label, n)) if progress else None,
                                ctx=ctx)
            if progress:
                progress.stop()
            row = summarize(corpus, docs, bootstrap_iters)
            if corpus.skipped:
                row["skipped_files"] = corpus.skipped
            entry["corpora"].append(row)
            total_nll += row["nll_nats"]
            total_bytes += row["bytes"]
        entry["overall_bpb"] = bits_per_byte(total_nll, int(total_bytes))
        out["models"].append(entry)
        del model
    for name in baselines:
        out["baselines"][name] = {c.name: compressor_bpb(name, c) for c in corpora}
    return out
