"""Which trace form a checkpoint writes at each effort, and where its long traces lose the answer.

    python -m dsv41.recipes.tiny.trace_forms --model DIR [--limit 100] [--efforts 1,25,50,75,100]

The held-out tiny-reasoning items, greedy (`dsv41.recipes.tiny.evaluate.greedy_generate`, 213 new tokens, scored by
`tiny_reasoning.score`). Per effort: mean reasoning tokens, accuracy, the count and the right answers of each
trace form (none; the "graded" style's "Pairs" shortcut; terse sums; one equation per line; or the second-pass word "Again", "Undo", "Check", with
"+both" when a "Both give" line follows), and how often the first line's last sum is right against the
final answer (first pass right / answer right), which says whether a two-pass trace loses a right first pass.
recipes/tiny/README.md quotes its output for the checkpoints of stages 11-14.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import torch

from dsv41.evals.tasks import tiny_reasoning as task
from dsv41.recipes.tiny import evaluate as E

REPO = Path(__file__).resolve().parents[2]


def trace_form(reasoning: str) -> str:
    for word in ("Check", "Undo", "Again"):
        if f"{word}:" in reasoning:
            return word.lower() + ("+both" if "Both give" in reasoning else "")
    if not reasoning:
        return "none"
    if reasoning.startswith("Pairs"):  # the "graded" style's shortcut
        return "pairs"
    return "lines" if "\n" in reasoning.strip() else "terse"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--efforts", default="1,25,50,75,100")
    ap.add_argument("--token-map", type=Path, default=REPO / ".tinydata" / "engram_token_map.i32.xz")
    a = ap.parse_args(argv)
    model, tok = E.load_bundled(a.model, "cpu", a.token_map)
    items = task.load_items(limit=a.limit)
    think_end = tok.token_to_id("</think>")
    report = {}
    for effort in (int(e) for e in a.efforts.split(",")):
        forms, right, passes, tokens = collections.Counter(), collections.Counter(), collections.Counter(), 0
        rows = [(tok.encode(task.prompt_text(it, effort)), it) for it in items]
        for _, group in sorted(E._groups_by_length(rows).items()):
            with torch.inference_mode():
                gens = E.greedy_generate(model, [p for p, _ in group], 213, stop_id=tok.eos_id)
            for (_, it), gen in zip(group, gens):
                body = gen[:-1] if gen and gen[-1] == tok.eos_id else gen
                text = tok.decode(body)
                tokens += body.index(think_end) if think_end in body else len(body)
                form, ok = trace_form(text.split("</think>")[0]), task.score(text, it)
                sums = re.findall(r"=(-?\d+)", text.split("\n")[0])
                first_ok = bool(sums) and int(sums[-1]) == sum(it["numbers"])
                forms[form] += 1
                right[form] += ok
                passes[f"first pass {'right' if first_ok else 'wrong'} / answer {'right' if ok else 'wrong'}"] += 1
        report[effort] = {"reasoning_tokens": tokens / len(items), "accuracy": sum(right.values()) / len(items),
                          "forms": {f: [forms[f], right[f]] for f in sorted(forms)}, "passes": dict(passes)}
        print(json.dumps({"effort": effort, **report[effort]}), flush=True)
    return report


if __name__ == "__main__":
    main()
