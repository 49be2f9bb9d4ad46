"""Three probes of what a checkpoint's predictions depend on: the effort line, distant context, the
picture (recipes/tiny/README.md, "Measurements", quotes them).

    python -m dsv41.recipes.tiny.diagnose [--model model/assets/dsv41-tiny] [--output F.json]

1. effort: the next-token distribution right after `<think>` (the token the effort tier decides:
   `</think>` at 1-19, a running sum at 20-69, at 70-100 the style's first word: "Numbers" in the
   reverse-check style, "First" / "Sum" in the labelled and undo styles) for held-out items at several
   efforts; if the model read the effort line, the top tokens would change with it.
2. reach: for one tiny-reasoning prompt, each earlier token in turn replaced by another; the KL between
   the next-token distributions at the prompt's end before and after, by distance. Large near the end,
   ~0 far back = the model does not use that context.
3. image: for colour questions, how much zeroing the picture's pixels moves the logits at the first
   reply position, and whether the top token is the right colour.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
EFFORTS = (1, 10, 30, 55, 80, 95, 100)


@torch.inference_mode()
def effort_probe(model, tok, items: list[dict], efforts=EFFORTS, top: int = 3) -> list[dict]:
    from dsv41.evals.tasks import tiny_reasoning as task

    out = []
    for item in items:
        for effort in efforts:
            ids = tok.encode(task.prompt_text(item, effort))
            p = model(torch.tensor([ids]))[0].float().softmax(-1)
            best = p.topk(top)
            out.append({"numbers": item["numbers"], "effort": effort, "tier": task.effort_tier(effort),
                        "top": [[tok.decode([int(i)]), round(float(v), 3)] for v, i in zip(best.values, best.indices)],
                        "p_think_end": round(float(p[tok.token_to_id("</think>")]), 3)})
    return out


@torch.inference_mode()
def reach_probe(model, tok, item: dict, effort: int = 100) -> list[dict]:
    from dsv41.evals.tasks import tiny_reasoning as task

    ids = tok.encode(task.prompt_text(item, effort))
    base = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    one, seven = tok.encode("1")[0], tok.encode("7")[0]
    out = []
    for j in range(1, len(ids) - 1):
        changed = list(ids)
        changed[j] = seven if ids[j] == one else one
        lp = model(torch.tensor([changed]))[0].float().log_softmax(-1)
        out.append({"distance": len(ids) - 1 - j, "token": tok.decode([ids[j]]),
                    "kl": round(float((base.exp() * (base - lp)).sum()), 5)})
    return out


@torch.inference_mode()
def image_probe(model, args, tok, n: int = 8, seed: int = 5) -> list[dict]:
    from dsv41.model.vision import ImageInput
    from dsv41.recipes.tiny.vision import data as D
    from dsv41.recipes.tiny.vision.train import encode_example

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        example = D.make_example(rng, kind="shape", question_type="colour", size=(98, 98))
        ids, _, inputs, reply_at = encode_example(example, "chat", 50, tok, args)
        blank = [ImageInput(i.start, torch.zeros_like(i.patches), i.vit_h, i.vit_w, i.types) for i in inputs]
        seen = model(torch.tensor([ids]), all_logits=True, images=[inputs])[0, reply_at - 1].float()
        unseen = model(torch.tensor([ids]), all_logits=True, images=[blank])[0, reply_at - 1].float()
        out.append({"answer": example.answer, "predicted": tok.decode([int(seen.argmax())]),
                    "max_logit_change_without_pixels": round(float((seen - unseen).abs().max()), 3)})
    return out


def summarize_reach(rows: list[dict]) -> dict:
    near = [r["kl"] for r in rows if r["distance"] <= 30]
    far = [r["kl"] for r in rows if r["distance"] > 30]
    return {"mean_kl_distance_1_30": sum(near) / len(near), "mean_kl_distance_31_plus": sum(far) / len(far),
            "max_kl_distance_31_plus": max(far)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--items", type=int, default=3, help="held-out tiny-reasoning items for the effort probe")
    ap.add_argument("--output", type=Path, default=None)
    a = ap.parse_args(argv)
    from dsv41.evals.tasks import tiny_reasoning as task
    from dsv41.model.checkpoint import load_model

    torch.set_num_threads(1)
    model, args, tok = load_model(a.model)
    items = task.load_items(limit=a.items)
    reach = reach_probe(model, tok, items[0])
    report = {"model": str(a.model), "effort": effort_probe(model, tok, items), "reach": reach,
              "reach_summary": summarize_reach(reach),
              "image": image_probe(model, args, tok) if args.vision_enabled else None}
    text = json.dumps(report, indent=1)
    if a.output:
        a.output.write_text(text + "\n")
    print(json.dumps({"reach_summary": report["reach_summary"],
                      "effort_top1": {f"{r['numbers']} e={r['effort']}": r["top"][0] for r in report["effort"]},
                      "image": report["image"]}, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
