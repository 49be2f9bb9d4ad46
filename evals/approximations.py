"""What the prefill approximations cost and save (issue: CED replay, SWA Bounded Replay).

For each document: the first P tokens are the prompt, the next K tokens a teacher-forced continuation.
The reference is the exact path (every layer on every prompt token). Each approximation builds its
cache differently, then the same K continuation tokens are fed one by one:

- `ced-replay`: CED prefill, the decoder runs only on the last window_size prompt tokens with
  truncated SWA (its global KV still comes from layer L/2 over the whole prompt);
- `bounded-replay`: a persistent prefix-cache hit without SWA state: the global KV of the first
  P - S tokens comes from disk, the last window_size of them are replayed through every layer with
  truncated SWA, then the S-token suffix is prefilled.

Reported per approximation: KL(reference || approximation) of the next-token distributions at the
K + 1 positions after the prompt (mean and 99th percentile, nats), top-1 agreement there, the length of
the identical prefix of 16 greedy tokens, and the prompt tokens run through the decoder (the saving).

    python -m dsv41.evals.approximations FILE_OR_DIR... [--model DIR] [--prompt-tokens 512] [--docs 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from dsv41.model.engine import GenerationConfig, Generator
from dsv41.model.prefix_cache import PrefixCache


def _texts(paths: list[str], min_chars: int) -> list[str]:
    out = []
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            if f.suffix == ".jsonl":
                for line in f.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        rec = json.loads(line)
                        t = rec.get("text") if isinstance(rec, dict) else None
                        if t and len(t) >= min_chars:
                            out.append(t)
            else:
                t = f.read_text(encoding="utf-8", errors="replace")
                if len(t) >= min_chars:
                    out.append(t)
    return out


@torch.inference_mode()
def _continue(model, cache, logits, cont: list[int]) -> torch.Tensor:
    """Log-probabilities at the prompt's end and after each continuation token: [K+1, V]."""
    rows = [torch.log_softmax(logits[0].float(), -1)]
    for tok in cont:
        logits = model(torch.tensor([[tok]], device=logits.device), start_pos=cache.pos, cache=cache)
        rows.append(torch.log_softmax(logits[0].float(), -1))
    return torch.stack(rows)


@torch.inference_mode()
def _greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = model(torch.tensor([[tok]], device=logits.device), start_pos=cache.pos, cache=cache)
    return out


def _copy_cache(cache):
    import copy

    c = copy.deepcopy(cache)
    c._checkpoint = None
    return c


@torch.inference_mode()
def measure(model, tokenizer, texts: list[str], prompt_tokens: int, cont_tokens: int = 16, suffix_tokens: int = 64,
            greedy_tokens: int = 16, max_docs: int = 16) -> dict:
    gen = Generator(model, tokenizer)
    args = model.args
    results = {"ced-replay": [], "bounded-replay": []}
    saved = {"ced-replay": [], "bounded-replay": []}
    n_docs = 0
    for text in texts:
        if n_docs >= max_docs:
            break
        ids = tokenizer.encode(text, allow_special=False)
        if len(ids) < prompt_tokens + cont_tokens:
            continue
        ids = [tokenizer.bos_id] + ids
        prompt, cont = ids[:prompt_tokens], ids[prompt_tokens:prompt_tokens + cont_tokens]
        n_docs += 1
        # the reference: every layer on every prompt token
        ref_cache = model.new_cache(1)
        ref_logits = gen.prefill(ref_cache, prompt)
        ref_greedy = _greedy(model, _copy_cache(ref_cache), ref_logits, greedy_tokens)
        ref_lp = _continue(model, ref_cache, ref_logits, cont)
        builds = {}
        c = model.new_cache(1)
        builds["ced-replay"] = (c, gen.prefill(c, prompt, ced="replay"),
                                min(len(prompt), args.window_size))
        with tempfile.TemporaryDirectory() as d:
            stored = PrefixCache(d)
            suffix = min(suffix_tokens, len(prompt) // 4)
            gen._prompt(prompt[:len(prompt) - suffix], GenerationConfig(prefix_cache=stored))
            cache, logits, _, st = gen._prompt(prompt, GenerationConfig(prefix_cache=PrefixCache(d)))
            assert st["prefix_hit"] == "bounded_replay", st
            builds["bounded-replay"] = (cache, logits, st["decoder_tokens"])
        for name, (cache, logits, decoder_tokens) in builds.items():
            g = _greedy(model, _copy_cache(cache), logits, greedy_tokens)
            lp = _continue(model, cache, logits, cont)
            kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
            same = next((i for i, (a, b) in enumerate(zip(ref_greedy, g)) if a != b), greedy_tokens)
            results[name].append({"kl": kl.tolist(), "top1": (ref_lp.argmax(-1) == lp.argmax(-1)).float().tolist(),
                                  "greedy_prefix": same})
            saved[name].append(decoder_tokens)
    out = {"prompt_tokens": prompt_tokens, "documents": n_docs, "continuation_tokens": cont_tokens,
           "window_size": args.window_size, "approximations": {}}
    for name, rows in results.items():
        if not rows:
            continue
        kl = torch.tensor([v for r in rows for v in r["kl"]])
        top1 = torch.tensor([v for r in rows for v in r["top1"]])
        out["approximations"][name] = {
            "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
            "top1_agreement": float(top1.mean()),
            "greedy_identical_prefix_mean": sum(r["greedy_prefix"] for r in rows) / len(rows),
            "greedy_tokens": greedy_tokens,
            "decoder_prompt_tokens": sum(saved[name]) / len(saved[name]),
            "decoder_prompt_tokens_full": prompt_tokens,
        }
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model

    torch.set_num_threads(1)
    model, _, tok = load_model(a.model or bundled_model_dir())
    texts = _texts(a.paths, min_chars=a.prompt_tokens * 5)[: a.docs * 3]
    res = measure(model, tok, texts, a.prompt_tokens, max_docs=a.docs)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"prompt {res['prompt_tokens']} tokens, {res['documents']} documents, window {res['window_size']}")
    print(f"{'approximation':16} {'KL mean':>9} {'KL p99':>9} {'top-1':>7} {'greedy same':>12} {'decoder tokens':>15}")
    for name, r in res["approximations"].items():
        print(f"{name:16} {r['kl_mean']:9.4f} {r['kl_p99']:9.4f} {r['top1_agreement']:7.3f} "
              f"{r['greedy_identical_prefix_mean']:9.1f}/{r['greedy_tokens']} "
              f"{r['decoder_prompt_tokens']:8.0f} of {r['decoder_prompt_tokens_full']}")


if __name__ == "__main__":
    main(sys.argv[1:])
