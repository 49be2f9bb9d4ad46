"""What the main-KV storage format costs: the same model and text with the compressed main KV stored
as FP4 (official: E2M1, one E4M3 scale per 16), FP8 (E4M3, one UE8M0 scale per 32) or bf16, the
window KV (FP8) and indexer keys (MXFP4) as the official formats in every run.

Per format (the layout of llama.cpp's KV-quantization tables, PR #7412):

    bytes_per_token   global KV (main entries + index keys) per token, measured from the packed cache
                      tensors (`KVCache.storage_bytes`, i.e. tensor.nbytes), summed over every window
                      and divided by the positions the caches held
    bpb               bits per byte of the corpus text (evals/bpb.py's convention: documents scored
                      separately from BOS, disjoint windows of max_ctx tokens, a ratio of sums)
    kld_mean, kld_p99 KL(P_bf16 || P_format) of the next-token distributions, per scored token, mean and
                      99th percentile (and max)
    top1_agreement    fraction of scored tokens where the argmax equals the bf16 run's
    mean_dp, rms_dp   change of the probability of the actual next token against bf16, mean and RMS

The bf16 run is the reference and always runs (listed only when asked for). Every run processes the
same windows in the same batches, each batch with a fresh cache, so the formats differ only in what
the cache stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from dsv41.evals.bpb import Corpus, bits_per_byte, rolling_windows, tokenize_corpus

REFERENCE = "bf16"
FORMATS = ("fp4", "fp8", "bf16")  # model.cache.MAIN_FORMATS (named here so that parsing needs no torch)
DEFAULT_FORMATS = ("bf16", "fp8", "fp4")
DEFAULT_LOGITS_BYTES = 256 * 2**20  # fp32 logits of one batch, per format held at once


def parse_formats(text: str) -> list[str]:
    """'bf16,fp8,fp4' -> ['bf16', 'fp8', 'fp4']; ValueError on an unknown or repeated name."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--formats is empty")
    for n in names:
        if n not in FORMATS:
            raise ValueError(f"unknown KV format {n!r}: choose from {', '.join(FORMATS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--formats repeats a format: {text!r}")
    return names


@dataclass
class FormatStats:
    """Sums over scored tokens for one format (within one corpus, or overall)."""

    nll: float = 0.0  # -sum ln p(actual next token), nats
    kld: list = field(default_factory=list)  # per-token KL(P_bf16 || P_format) tensors
    agree: int = 0
    dp_sum: float = 0.0
    dp_sq: float = 0.0
    tokens: int = 0
    kv_bytes: dict = field(default_factory=lambda: {"main": 0, "index_keys": 0, "window": 0})
    kv_positions: int = 0  # positions x sequences the measured caches held
    kv_windows: int = 0  # caches measured (for the per-layer window ring)

    def add(self, other: "FormatStats") -> None:
        self.nll += other.nll
        self.kld += other.kld
        self.agree += other.agree
        self.dp_sum += other.dp_sum
        self.dp_sq += other.dp_sq
        self.tokens += other.tokens
        for k in self.kv_bytes:
            self.kv_bytes[k] += other.kv_bytes[k]
        self.kv_positions += other.kv_positions
        self.kv_windows += other.kv_windows

    def summary(self, n_bytes: int) -> dict:
        import torch

        kld = torch.cat(self.kld).double() if self.kld else torch.zeros(1, dtype=torch.float64)
        n = max(self.tokens, 1)
        per_pos = max(self.kv_positions, 1)
        return {
            "bpb": bits_per_byte(self.nll, n_bytes) if n_bytes else 0.0,
            "kld_mean": float(kld.mean()),
            "kld_p99": float(torch.quantile(kld, 0.99)) if kld.numel() <= 16_000_000 else float(kld.kthvalue(
                max(1, int(round(0.99 * kld.numel())))).values),
            "kld_max": float(kld.max()),
            "top1_agreement": self.agree / n,
            "mean_dp": self.dp_sum / n,
            "rms_dp": (self.dp_sq / n) ** 0.5,
            "bytes_per_token": (self.kv_bytes["main"] + self.kv_bytes["index_keys"]) / per_pos,
            "main_bytes_per_token": self.kv_bytes["main"] / per_pos,
            "indexer_bytes_per_token": self.kv_bytes["index_keys"] / per_pos,
        }


def _batches(windows: list[tuple[list[int], int]], max_batch: int) -> list[list[int]]:
    """Indices of windows grouped longest first into batches of at most max_batch."""
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
    return [order[i:i + max_batch] for i in range(0, len(order), max_batch)]


def compare_batch(model, windows: Sequence[tuple[list[int], int]], formats: Sequence[str], pad_id: int
                  ) -> dict[str, FormatStats]:
    """Run one right-padded batch of (sequence, n_scored) windows once per format (a fresh cache each)
    and compare every format's next-token distributions with the bf16 run's."""
    import torch

    from dsv41.model.cache import KVCache

    device = model.embed.weight.device
    T = max(len(seq) for seq, _ in windows) - 1
    ids = torch.full((len(windows), T), pad_id, dtype=torch.long)
    targets = torch.full((len(windows), T), -1, dtype=torch.long)  # -1: not scored
    for r, (seq, n) in enumerate(windows):
        ids[r, :len(seq) - 1] = torch.tensor(seq[:-1])
        targets[r, len(seq) - 1 - n:len(seq) - 1] = torch.tensor(seq[len(seq) - n:])
    ids, targets = ids.to(device), targets.to(device)
    scored = targets >= 0

    def run(fmt: str):
        """-> (log-probabilities [N, V] and argmax [N] at the scored positions, the cache)."""
        cache = KVCache(model.args, len(windows), device, main_format=fmt)
        logits = model(ids, cache=cache, all_logits=True)[scored]
        return torch.log_softmax(logits.float(), dim=-1), logits.argmax(-1), cache

    out = {}
    with torch.inference_mode():
        tgt = targets[scored].unsqueeze(-1)
        ref_logp, ref_top1, ref_cache = run(REFERENCE)
        ref_target = ref_logp.gather(-1, tgt).squeeze(-1)
        ref_p = ref_logp.exp()
        for fmt in dict.fromkeys([REFERENCE, *formats]):  # the reference first, each once
            logp, top1, cache = (ref_logp, ref_top1, ref_cache) if fmt == REFERENCE else run(fmt)
            lp_target = logp.gather(-1, tgt).squeeze(-1)
            if fmt == REFERENCE:
                kld = torch.zeros_like(lp_target)
            else:
                kld = (ref_p * (ref_logp - logp)).sum(-1)  # the difference first: no cancellation
            dp = (lp_target.exp() - ref_target.exp()).double()
            s = FormatStats()
            s.nll = float(-lp_target.double().sum())
            s.kld = [kld.cpu()]
            s.agree = int((top1 == ref_top1).sum())
            s.dp_sum, s.dp_sq = float(dp.sum()), float(dp.square().sum())
            s.tokens = int(lp_target.numel())
            b = cache.storage_bytes()
            s.kv_bytes = {"main": b["main"], "index_keys": b["index_keys"], "window": b["window"]}
            s.kv_positions = cache.pos * cache.batch_size
            s.kv_windows = cache.batch_size
            out[fmt] = s
            del logp
    return out


def evaluate(model, tokenizer, corpora: Sequence[Corpus], formats: Sequence[str] = DEFAULT_FORMATS, *,
             max_ctx: int | None = None, max_tokens: int | None = None, batch_size: int = 8,
             max_logits_bytes: int = DEFAULT_LOGITS_BYTES, model_name: str = "",
             progress: Callable[[int, int], None] | None = None, ctx=None) -> dict:
    """The `dsv41 quantize-kv` document (spec/cli.md): per format overall and per corpus.

    max_ctx: model inputs per window (default, as `dsv41 bpb`: the training context original_seq_len,
    capped by max_seq_len). max_tokens: score at most
    this many tokens of each corpus (whole documents in order, the last one cut; its bytes are those of
    the decoded kept tokens). progress(tokens_done, tokens_total) is called after every batch.
    ctx: a `dsv41.model.parallel.ParallelContext` under torchrun; every rank calls this with the same
    arguments and gets the same document. Model copies (DSV41_TP) divide the batches; the statistics
    are summed in batch order, so the document is a single process's. progress then counts this
    copy's share."""
    from dsv41.model.ledger import kv_ledger

    args = model.args
    max_ctx = max_ctx or min(args.original_seq_len, args.max_seq_len)
    plans = []
    for corpus in corpora:
        token_ids = tokenize_corpus(tokenizer, corpus)
        windows, n_bytes, n_docs, n_tokens = [], 0, 0, 0
        for doc, ids in zip(corpus.documents, token_ids):
            if max_tokens is not None and n_tokens >= max_tokens:
                break
            if max_tokens is not None and n_tokens + len(ids) > max_tokens:
                ids = ids[:max_tokens - n_tokens]
                n_bytes += len(tokenizer.decode(ids).encode("utf-8"))
            else:
                n_bytes += doc.n_bytes
            if not ids:
                continue
            windows += rolling_windows(ids, tokenizer.bos_id, max_ctx)
            n_docs += 1
            n_tokens += len(ids)
        plans.append((corpus, windows, n_bytes, n_docs, n_tokens))

    vocab = args.vocab_size
    rows = max(1, min(batch_size, max_logits_bytes // max(1, max_ctx * vocab * 4)))
    batches = [_batches(windows, rows) for _, windows, *_ in plans]
    share = [ctx.share(b) if ctx is not None else b for b in batches]
    total = sum(windows[i][1] for (_, windows, *_), mine in zip(plans, share) for batch in mine for i in batch)
    done = 0
    overall = {f: FormatStats() for f in dict.fromkeys([REFERENCE, *formats])}
    overall_bytes = 0
    corpora_out = []
    for (corpus, windows, n_bytes, n_docs, n_tokens), corpus_batches in zip(plans, batches):
        def run(mine: list[list[int]], windows=windows) -> list[dict[str, FormatStats]]:
            nonlocal done
            out = []
            for batch in mine:
                out.append(compare_batch(model, [windows[i] for i in batch], formats, tokenizer.pad_id))
                done += out[-1][REFERENCE].tokens
                if progress:
                    progress(done, total)
            return out

        per_batch = ctx.split_work(corpus_batches, run) if ctx is not None else run(corpus_batches)
        per = {f: FormatStats() for f in overall}
        for stats in per_batch:  # in batch order, as one process sums them
            for f, s in stats.items():
                per[f].add(s)
        for f, s in per.items():
            overall[f].add(s)
        overall_bytes += n_bytes
        ref_bpb = bits_per_byte(per[REFERENCE].nll, n_bytes) if n_bytes else 0.0
        rows_out = []
        for f in formats:
            row = {"format": f, **per[f].summary(n_bytes)}
            row["delta_bpb"] = row["bpb"] - ref_bpb
            rows_out.append(row)
        corpora_out.append({"name": corpus.name, "documents": n_docs, "bytes": n_bytes, "tokens": n_tokens,
                            "formats": rows_out})

    ledger = kv_ledger(args)
    ref_bpb = bits_per_byte(overall[REFERENCE].nll, overall_bytes) if overall_bytes else 0.0
    formats_out = []
    for f in formats:
        s = overall[f]
        row = {"format": f, **s.summary(overall_bytes)}
        row["delta_bpb"] = row["bpb"] - ref_bpb
        row["window_bytes_per_layer"] = s.kv_bytes["window"] / max(1, s.kv_windows * args.n_layers)
        row["ledger_bytes_per_token"] = kv_ledger(args, f)["global_bytes_per_token"]  # main entries in f
        formats_out.append(row)
    return {"model": model_name, "tokens": sum(p[4] for p in plans), "bytes": overall_bytes, "reference": REFERENCE,
            "max_ctx": max_ctx, "window": "disjoint",
            "ledger": {"global_bytes_per_token_fp4": ledger["global_bytes_per_token"],
                       "swa_bytes_per_layer_window": ledger["swa_bytes_per_layer_window"]},
            "formats": formats_out, "corpora": corpora_out}


def render_markdown(doc: dict) -> str:
    """The overall table as Markdown (docs/kv-cache.md uses it)."""
    lines = ["| main KV | bytes/token | BPB | ΔBPB | mean KLD | 99% KLD | top-1 agree | RMS Δp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["formats"]:
        lines.append(f"| {r['format']} | {r['bytes_per_token']:.1f} | {r['bpb']:.4f} | {r['delta_bpb']:+.4f} | "
                     f"{r['kld_mean']:.2e} | {r['kld_p99']:.2e} | {100 * r['top1_agreement']:.2f}% | "
                     f"{100 * r['rms_dp']:.3f}% |")
    return "\n".join(lines)
