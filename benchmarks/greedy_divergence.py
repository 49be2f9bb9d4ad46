"""Where two greedy runs of the same prompts part, and how close the model was to a tie there.

Two greedy decodes of one checkpoint that differ only in floating-point summation order (1 GPU against 2
GPUs with NCCL all-reduces, or GPU against CPU) must agree until the model meets a near-tie between its two
best tokens; after that they are different, equally valid, continuations. This reads two `dsv41 generate
--json` outputs of the same prompts (one JSON line per prompt, in order), finds the first differing output
token of each pair, and scores the shared prefix once more on the CPU (teacher-forced) to print
the log-probabilities of the two tokens the runs chose at that position.

    python benchmarks/greedy_divergence.py A.jsonl B.jsonl --prompts P.txt [--model DIR] [--effort high]

P.txt holds the prompts as `generate --input-file` read them (blank-line separated); the chat encoding
and effort must match those of the runs (thinking mode, default effort "high").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv=None) -> int:
    from dsv41_cli.commands.generate import input_file_prompts
    from dsv41.model import encoding
    from dsv41.model.checkpoint import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--model", default="model/assets/dsv41-tiny")
    ap.add_argument("--effort", default="high")
    args = ap.parse_args(argv)
    runs = [[json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in (args.a, args.b)]
    prompts = input_file_prompts(args.prompts.read_text(encoding="utf-8"))
    if not len(prompts) == len(runs[0]) == len(runs[1]):
        raise SystemExit(f"{len(prompts)} prompts but {len(runs[0])} and {len(runs[1])} results")
    model, _, tok = load_model(args.model)
    for text, ra, rb in zip(prompts, *runs):
        a, b = ra["output_ids"], rb["output_ids"]
        k = first_difference(a, b)
        row = {"prompt": text, "tokens": [len(a), len(b)], "identical": a == b, "first_difference": k}
        if k is not None:
            prompt = encoding.encode_messages([{"role": "user", "content": text}], mode="thinking",
                                              effort=encoding.parse_effort(args.effort))
            ids = tok.encode(prompt, allow_special=True)
            if len(ids) != ra["prompt_tokens"]:
                raise SystemExit(f"the prompt encodes to {len(ids)} tokens, the run had {ra['prompt_tokens']}")
            with torch.inference_mode():
                logits = model(torch.tensor([ids + a[:k]]), start_pos=0, cache=model.new_cache(1))
            logp = torch.log_softmax(logits[0].float(), -1)
            row.update({"token_a": tok.decode([a[k]]), "token_b": tok.decode([b[k]]),
                        "logprob_a": round(float(logp[a[k]]), 4), "logprob_b": round(float(logp[b[k]]), 4),
                        "gap_nats": round(abs(float(logp[a[k]] - logp[b[k]])), 4),
                        "cpu_top2": [(tok.decode([int(i)]), round(float(v), 4)) for v, i in zip(*logp.topk(2))]})
        print(json.dumps(row, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
