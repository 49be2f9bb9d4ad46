"""`dsv41 quantize-kv`: bytes per token and quality of each main-KV storage format (fp4, fp8, bf16)."""

from __future__ import annotations

import time
from typing import List, Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, load_on_ranks, resolve_model_dir, start_ranks
from dsv41_cli.console import err, fail, out, print_json


EPILOG = """Examples:

  dsv41 quantize-kv corpus.txt

  dsv41 quantize-kv docs/ notes.jsonl --formats bf16,fp8 --max-tokens 20000 --json

  dsv41 quantize-kv corpus.txt --model CKPT --max-ctx 1024 --device cuda
"""


def command(
    corpora: List[str] = typer.Argument(..., help="Corpus files or directories (.jsonl: one {\"text\"} per line; "
                                                  "any other file: one document)."),
    formats: str = typer.Option("bf16,fp8,fp4", "--formats", help="Main-KV storage formats to compare (bf16 is "
                                "the reference and always runs)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Score at most N tokens of each corpus."),
    max_ctx: Optional[int] = typer.Option(None, "--max-ctx", min=1, help="Tokens per window (default: the "
                                          "training context, original_seq_len); documents are cut into disjoint windows."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Windows per forward."),
    model: Optional[str] = ModelOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.evals.bpb import CorpusError, load_corpus, unique_names
    from dsv41.evals.quantize_kv import evaluate, parse_formats

    ctx = start_ranks(device)  # one process, or one rank under torchrun: rank 0 prints and shows progress
    try:
        names = parse_formats(formats)
    except ValueError as e:
        fail(str(e))
    try:
        loaded = [load_corpus(c) for c in corpora]
    except CorpusError as e:
        fail(str(e))
    unique_names(loaded)
    model_dir = resolve_model_dir(model)
    net, args, tokenizer = load_on_ranks(model_dir, ctx)  # this rank's part of the model under torchrun
    net.eval().requires_grad_(False)

    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        elapsed = time.monotonic() - started
        eta = elapsed / done * (total - done) if done else 0.0
        err.print(f"\rquantize-kv: {done:,}/{total:,} tokens, {elapsed:.0f} s, ETA {eta:.0f} s ", end="",
                  markup=False)

    doc = evaluate(net, tokenizer, loaded, names, max_ctx=max_ctx, max_tokens=max_tokens, batch_size=batch_size,
                   model_name=str(model_dir), progress=progress if ctx.is_main else None, ctx=ctx)
    if not ctx.is_main:  # every rank computed the same document; rank 0 reports it
        return
    err.print("", markup=False)
    if as_json:
        print_json(doc)
    else:
        render(doc)


def render(doc: dict) -> None:
    from rich.table import Table

    out.print(f"[bold]{doc['model']}[/]: {doc['tokens']:,} tokens, {doc['bytes']:,} bytes, windows of "
              f"{doc['max_ctx']} (reference: {doc['reference']} main KV; window KV FP8, index keys MXFP4 in every run)")
    for title, rows in [("all corpora", doc["formats"])] + [(c["name"], c["formats"]) for c in doc["corpora"]]:
        t = Table(title=title, title_justify="left")
        for col in ("main KV", "bytes/token", "BPB", "ΔBPB", "mean KLD", "99% KLD", "top-1 agree", "RMS Δp"):
            t.add_column(col, justify="left" if col == "main KV" else "right")
        for r in rows:
            t.add_row(r["format"], f"{r['bytes_per_token']:.1f}", f"{r['bpb']:.4f}", f"{r['delta_bpb']:+.4f}",
                      f"{r['kld_mean']:.2e}", f"{r['kld_p99']:.2e}", f"{100 * r['top1_agreement']:.2f}%",
                      f"{100 * r['rms_dp']:.3f}%")
        out.print(t)
    out.print("bytes/token: global KV (main entries + index keys) measured from the packed cache tensors.")
