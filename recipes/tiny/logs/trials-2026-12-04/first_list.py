"""Stages 44-46: where the effort-100 pass of the "checked-compared" traces goes wrong, by list length.

    python recipes/tiny/logs/trials-2026-12-04/first_list.py MODEL SWEEP_JSON [--form checked-compared]

1. Accuracy by list length at efforts 75 and 100, from an `effort-sweep --output` sweep.json of MODEL.
2. Teacher-forced, on the held-out items of each length (30 a length): the model's probability of ending the
   first carried list (",") when the right list has just been written, "Sum: 5+7=12 (12-7=5 vs 5 ok) left 3 8".
"""
import argparse
import collections
import json
import statistics
from pathlib import Path

import torch
from dsv41.evals.tasks import tiny_reasoning as task
from dsv41.recipes.tiny import evaluate as E

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("sweep")
ap.add_argument("--form", default="checked-compared")
ap.add_argument("--engram-off", action="store_true")
a = ap.parse_args()
items = {it["id"]: it for it in task.load_items()}
acc = collections.defaultdict(lambda: [0, 0])
for s in json.loads(Path(a.sweep).read_text())["samples"]:
    k = (s["effort"], len(items[s["id"]]["numbers"]))
    acc[k][0] += s["score"]
    acc[k][1] += 1
for effort in (75, 100):
    print(f"effort {effort}, right by list length:",
          "  ".join(f"{n}: {acc[(effort, n)][0]:.0f}/{acc[(effort, n)][1]}" for n in range(task.MIN_NUMBERS, task.MAX_NUMBERS + 1)))
model, tok = E.load_bundled(a.model, "cpu", None)
comma = tok.encode(",")[-1]


def first_list_ends(label: str) -> None:
    for n in range(task.MIN_NUMBERS, task.MAX_NUMBERS + 1):
        ps = []
        for it in [it for it in items.values() if len(it["numbers"]) == n][:30]:
            trace = task.reasoning_trace(it["numbers"], 100, a.form)
            ids = tok.encode(task.prompt_text(it, 100) + trace[:trace.index(",")])  # up to the end of the first list
            with torch.inference_mode():
                ps.append(torch.softmax(model(torch.tensor([ids]))[0].float(), -1)[comma].item())
        print(f"{label}{n} numbers: P(first list ends) mean {statistics.mean(ps):.3f}, "
              f"above 0.5 in {sum(p > 0.5 for p in ps)}/{len(ps)}")


first_list_ends("")
if a.engram_off:
    from dsv41.model import engram

    engram.Engram.forward = lambda self, x, rows, token_mask=None: x
    first_list_ends("Engram off, ")
