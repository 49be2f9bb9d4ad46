"""Measure the bundled model against the issue's "must show" list.

    python -m dsv41.recipes.tiny.evaluate [--model model/assets/dsv41-tiny] [--output results.json]

1. Bits per byte on the held-out split of each corpus family (recipes/tiny/heldout/*.jsonl): every
   document is BOS + its tokens; windows of 512 tokens advance by 256 and score only the tokens not
   scored before (the first window scores all), so each token is predicted once with 256-511 tokens
   of context; bpb = sum of -log2 p over the document tokens / UTF-8 bytes of the documents. The
   compressors (xz -9e, gzip -9, bz2 -9) compress the same bytes, the family's documents
   concatenated into one stream (which only helps them: they can match across documents).
2. `tiny-reasoning` in thinking mode at efforts 1, 25, 50, 75, 100: greedy decoding with the KV
   cache (the prompt in one call, then one token per call) until EOS; reasoning tokens are those
   generated before `</think>` (all of them when it never comes); accuracy by the task's scorer.
3. DSpark on held-out prose with greedy decoding: the target's greedy continuation of prose prompts
   is generated with the cache; then the speculative loop runs over it: at each verification step
   the drafter (context = its stage window KV of the target's taps at committed positions) drafts 5
   tokens after the anchor, greedy through the Markov head, and a step commits the drafts that match
   the target's greedy tokens plus one token of the target. With greedy verification this is exactly
   what speculative decoding commits, so the mean tokens per verification step is the acceptance length.
4. Samples: greedy and temperature-0.8 continuations of the first 48 tokens of each family's first
   held-out document, and one tiny-reasoning answer at effort 100.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
import math
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
HELDOUT = Path(__file__).resolve().parent / "heldout"
FAMILIES = ("prose", "code", "literature")
SAMPLE_PROMPT_TOKENS = 48  # samples continue the opening of each family's first held-out document


def load_documents(family: str, path: Path = HELDOUT) -> list[dict]:
    return [json.loads(line) for line in (path / f"{family}.jsonl").read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------------------ bits per byte
def compressor_bpb(data: bytes) -> dict[str, float]:
    n = len(data)
    return {"xz": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n,
            "gzip": 8 * len(gzip.compress(data, compresslevel=9, mtime=0)) / n,
            "bz2": 8 * len(bz2.compress(data, 9)) / n}


@torch.inference_mode()
def document_bits(model, tok, texts: list[str], ctx: int = 512, stride: int = 256, batch: int = 16) -> list[dict]:
    """Per document: bytes, tokens, total bits (-log2 p of every document token after BOS)."""
    device = model.embed.weight.device
    jobs = []  # (doc index, window ids, first scored target index inside the window)
    docs = []
    for d, text in enumerate(texts):
        ids = [tok.bos_id] + tok.encode(text, allow_special=False)
        if tok.decode(ids[1:]) != text:
            raise ValueError(f"document {d} does not round-trip through the tokenizer")
        docs.append({"bytes": len(text.encode()), "tokens": len(ids) - 1, "bits": 0.0})
        scored = 0  # targets ids[1..scored] are done
        begin = 0
        while scored < len(ids) - 1:
            window = ids[begin:begin + ctx + 1]  # inputs window[:-1], targets window[1:]
            first = scored - begin  # target index (0-based within window targets) to start scoring
            jobs.append((d, window, first))
            scored = begin + len(window) - 1
            begin += stride
    jobs.sort(key=lambda j: len(j[1]))
    i = 0
    while i < len(jobs):
        same = [j for j in jobs[i:i + batch] if len(j[1]) == len(jobs[i][1])]
        i += len(same)
        x = torch.tensor([j[1] for j in same], device=device)
        logits = model(x[:, :-1], all_logits=True).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
        for row, (d, _, first) in enumerate(same):
            docs[d]["bits"] += float(-logp[row, first:].sum()) / math.log(2)
    return docs


def bootstrap_ci(docs: list[dict], n: int = 1000, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    vals = []
    for _ in range(n):
        pick = [docs[rng.randrange(len(docs))] for _ in docs]
        vals.append(sum(p["bits"] for p in pick) / sum(p["bytes"] for p in pick))
    vals.sort()
    return [vals[int(0.025 * n)], vals[int(0.975 * n) - 1]]


def evaluate_bpb(model, tok, families=FAMILIES, heldout: Path = HELDOUT) -> dict:
    out = {}
    for fam in families:
        texts = [d["text"] for d in load_documents(fam, heldout)]
        docs = document_bits(model, tok, texts)
        total_bits, total_bytes = sum(d["bits"] for d in docs), sum(d["bytes"] for d in docs)
        out[fam] = {"documents": len(docs), "bytes": total_bytes, "tokens": sum(d["tokens"] for d in docs),
                    "bpb": total_bits / total_bytes, "ci95": bootstrap_ci(docs),
                    "baselines": compressor_bpb("".join(texts).encode())}
    return out


# ------------------------------------------------------------------------------------ generation
def greedy_generate(model, prompts: list[list[int]], max_new: int, stop_id: int | None = None,
                    temperature: float = 0.0, seed: int = 0, batch: int = 64) -> list[list[int]]:
    """The new tokens of each prompt (any lengths), cut after `stop_id` when given, through the engine's
    scheduler (model/engine.py: continuous batching, `batch` sequences at once). Sampling (temperature >
    0) draws row i from its own generator seeded seed + i."""
    from dsv41.model.engine import GenerationConfig, Generator, Request, SamplingConfig

    stops = (stop_id,) if stop_id is not None else ()
    requests = [Request(list(p), GenerationConfig(max_new_tokens=max_new, stop_ids=stops,
                                                  sampling=SamplingConfig(temperature, 1.0, seed + i)))
                for i, p in enumerate(prompts)]
    return [r.output_ids for r in Generator(model).generate_many(requests, max_batch_size=batch)]


def wilson_interval(p: float, n: int, z: float = 1.96) -> list[float]:
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def reasoning_sweep(model, tok, items: list[dict], efforts=(1, 25, 50, 75, 100), max_new: int | None = None,
                    batch: int = 512) -> dict:
    from dsv41.evals.tasks import tiny_reasoning as task

    think_end = tok.token_to_id("</think>")
    if max_new is None:  # room for the longest gold trace at the highest effort, plus the answer
        longest = max(len(tok.encode(task.reasoning_trace(it["numbers"], 100, style)))
                      for it in items for style in task.TRACE_STYLES)
        max_new = longest + 24
    rows = [(tok.encode(task.prompt_text(it, e)), e, it) for e in efforts for it in items]
    results = {e: [] for e in efforts}
    gens = greedy_generate(model, [r[0] for r in rows], max_new, stop_id=tok.eos_id, batch=batch)
    for (prompt, e, it), gen in zip(rows, gens):
        body = gen[:-1] if gen and gen[-1] == tok.eos_id else gen
        n_reason = body.index(think_end) if think_end in body else len(body)
        text = tok.decode(body)
        results[e].append({"id": it["id"], "correct": task.score(text, it), "reasoning_tokens": n_reason,
                           "output_tokens": len(gen), "finished": bool(gen) and gen[-1] == tok.eos_id,
                           "completion": text})
    points = []
    for e in efforts:
        r = results[e]
        n = len(r)
        acc = sum(x["correct"] for x in r) / n
        points.append({"effort": e, "n": n, "accuracy": acc, "ci95": wilson_interval(acc, n),
                       "mean_reasoning_tokens": sum(x["reasoning_tokens"] for x in r) / n,
                       "mean_output_tokens": sum(x["output_tokens"] for x in r) / n,
                       "finished": sum(x["finished"] for x in r) / n,
                       "examples": [x["completion"] for x in r[:2]]})
    return {"task": task.TASK_NAME, "max_new_tokens": max_new, "points": points}


# ------------------------------------------------------------------------------------ DSpark
@torch.inference_mode()
def dspark_acceptance(model, tok, texts: list[str], prompts_per_doc: int = 4, prompt_len: int = 48,
                      gen_len: int = 128) -> dict:
    """Mean tokens committed per verification step when the drafter's blocks are verified greedily."""
    from dsv41.model.dspark import base_logits, block_hidden, main_x, markov_draft

    device = model.embed.weight.device
    args = model.args
    S, W = args.dspark_block_size, args.window_size
    prompts = []
    for text in texts:
        ids = tok.encode(text, allow_special=False)
        span = max(1, (len(ids) - prompt_len) // prompts_per_doc)
        for k in range(prompts_per_doc):
            chunk = ids[k * span: k * span + prompt_len - 1]
            if len(chunk) == prompt_len - 1:
                prompts.append([tok.bos_id] + chunk)
    gens = greedy_generate(model, prompts, gen_len)
    seq = torch.tensor([p + g for p, g in zip(prompts, gens)], device=device)  # [B, L]
    B, L = seq.shape
    _, taps = model(seq, all_logits=False, return_taps=True)
    mx = main_x(model, taps)
    positions = torch.arange(L, device=device)
    stage_kv = [stage.context_kv(mx, positions) for stage in model.mtp]
    # P = last committed position; the target has decided the token at P+1 (the anchor)
    P = torch.full((B,), prompt_len - 1, device=device)
    steps = torch.zeros(B, device=device)
    committed = torch.zeros(B, device=device)
    drafts_accepted = torch.zeros(B, device=device)
    per_position = torch.zeros(S, device=device)
    per_position_n = 0
    rows = torch.arange(B, device=device)
    while True:
        live = P + 1 + S < L  # the whole block's targets (P+2..P+S+1) lie inside the generated text
        if not bool(live.any()):
            break
        r, p = rows[live], P[live]
        ctx_pos = p.view(-1, 1) - W + 1 + torch.arange(W, device=device)
        ctx_idx = torch.where(ctx_pos >= 0, torch.arange(W, device=device).expand_as(ctx_pos), -1)
        contexts = [(kv[r.view(-1, 1), ctx_pos.clamp_min(0)], ctx_idx) for kv in stage_kv]
        anchors = seq[r, p + 1]
        hidden = block_hidden(model, anchors, p + 1, contexts)
        drafts, _, _ = markov_draft(model, base_logits(model, hidden), hidden, anchors, lambda l: l.argmax(-1))
        truth = seq[r.view(-1, 1), p.view(-1, 1) + 2 + torch.arange(S, device=device)]
        match = (drafts == truth).long().cumprod(dim=1)  # accepted prefix
        k = match.sum(1)
        per_position += match.float().sum(0)
        per_position_n += len(r)
        steps[live] += 1
        drafts_accepted[live] += k.float()
        committed[live] += k.float() + 1  # the accepted drafts plus the target's own next token
        P[live] = p + k + 1
    total_steps = float(steps.sum())
    return {"prompts": B, "prompt_tokens": prompt_len, "generated_tokens": gen_len, "block_size": S,
            "verification_steps": int(total_steps),
            "mean_accepted_tokens_per_step": float(committed.sum()) / total_steps,
            "mean_accepted_drafts_per_step": float(drafts_accepted.sum()) / total_steps,
            "draft_position_acceptance": (per_position / max(per_position_n, 1)).tolist()}


# ------------------------------------------------------------------------------------ samples
def samples(model, tok, max_new: int = 80) -> dict:
    from dsv41.evals.tasks import tiny_reasoning as task

    out = {}
    for name in FAMILIES:  # a tiny model needs some context to settle into a domain: a few words drift
        ids = [tok.bos_id] + tok.encode(load_documents(name)[0]["text"], allow_special=False)[:SAMPLE_PROMPT_TOKENS]
        prompt = tok.decode(ids[1:])
        greedy = greedy_generate(model, [ids], max_new, stop_id=tok.eos_id)[0]
        sampled = greedy_generate(model, [ids], max_new, stop_id=tok.eos_id, temperature=0.8, seed=1)[0]
        out[name] = {"prompt": prompt, "greedy": tok.decode(greedy), "temperature_0.8": tok.decode(sampled)}
    item = {"messages": task.messages([3, 8, 1, 6, 2])}
    ids = tok.encode(task.prompt_text(item, 100))
    out["reasoning_effort_100"] = {"prompt": task.question([3, 8, 1, 6, 2]),
                                   "greedy": tok.decode(greedy_generate(model, [ids], 160, stop_id=tok.eos_id)[0])}
    return out


# ------------------------------------------------------------------------------------ main
def load_bundled(path: Path, device: str, token_map_file: Path | None = None):
    """(model, tokenizer) through the project's checkpoint loader; the Engram hasher from a
    precomputed token map when one is given (else it is built from the checkpoint's tokenizer)."""
    from dsv41.model.checkpoint import load_model

    model, args, tok = load_model(path, device=device)
    if token_map_file is not None and token_map_file.is_file():
        from dsv41.model.engram import NgramHasher
        from dsv41.recipes.tiny.build_data import load_tokens
        import numpy as np

        token_map = torch.from_numpy(load_tokens(token_map_file, np.int32).astype(np.int64))
        model._hasher = NgramHasher(args, token_map).to(device)
    return model, tok


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Evaluate dsv41-tiny: bpb vs compressors, effort sweep, DSpark, samples.")
    ap.add_argument("--model", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--token-map", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=None, help="reasoning items (default all 300)")
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run of every part")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: bpb,reasoning,dspark,samples")
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    from dsv41.evals.tasks import tiny_reasoning as task

    skip = set(filter(None, a.skip.split(",")))
    t0 = time.time()
    model, tok = load_bundled(a.model, a.device, a.token_map)
    report: dict = {"model": str(a.model), "device": a.device, "timings_s": {}}
    prose = [d["text"] for d in load_documents("prose")]
    if a.quick:
        parts = {
            "bpb": lambda: {"prose": document_bits(model, tok, [t[:2000] for t in prose[:2]])},
            "reasoning": lambda: reasoning_sweep(model, tok, task.load_items(limit=3), max_new=8),
            "dspark": lambda: dspark_acceptance(model, tok, prose[:2], prompts_per_doc=2, gen_len=24),
            "samples": lambda: samples(model, tok, max_new=8),
        }
    else:
        parts = {
            "reasoning": lambda: reasoning_sweep(model, tok, task.load_items(limit=a.limit)),
            "bpb": lambda: evaluate_bpb(model, tok),
            "dspark": lambda: dspark_acceptance(model, tok, prose),
            "samples": lambda: samples(model, tok),
        }
    for name, fn in parts.items():
        if name in skip:
            continue
        t = time.time()
        try:
            report[name] = fn()
        except Exception as e:  # one failing part must not lose the others' numbers
            import traceback

            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["timings_s"][name] = round(time.time() - t, 1)
        print(json.dumps({name: _brief(report[name])}), flush=True)
        if a.output:  # after every part, so a run cut short keeps what it measured
            a.output.write_text(json.dumps(report, indent=1) + "\n")
    report["timings_s"]["total"] = round(time.time() - t0, 1)
    if a.output:
        a.output.write_text(json.dumps(report, indent=1) + "\n")
    failed = [n for n in parts if isinstance(report.get(n), dict) and "error" in report[n]]
    if failed:
        print(f"failed parts: {failed}", file=sys.stderr)
        for n in failed:
            print(report[n]["traceback"], file=sys.stderr)
        if a.quick:
            raise SystemExit(1)
    return report


def _brief(part):
    if isinstance(part, dict) and "points" in part:
        return [{k: p[k] for k in ("effort", "accuracy", "mean_reasoning_tokens")} for p in part["points"]]
    if isinstance(part, dict) and "prose" in part and "bpb" in part.get("prose", {}):
        return {f: {"bpb": round(v["bpb"], 3), **{k: round(x, 3) for k, x in v["baselines"].items()}}
                for f, v in part.items()}
    return part


if __name__ == "__main__":
    main()
