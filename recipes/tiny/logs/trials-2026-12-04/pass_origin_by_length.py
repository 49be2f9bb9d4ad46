"""Stage 46: where each own effort-100 pass first goes wrong (check_repair.pass_origin), by list length:

    python recipes/tiny/logs/trials-2026-12-04/pass_origin_by_length.py MODEL
"""
import collections
import sys

import torch
from dsv41.evals.tasks import tiny_reasoning as task
from dsv41.recipes.tiny import check_repair as C
from dsv41.recipes.tiny import evaluate as E

model, tok = E.load_bundled(sys.argv[1], "cpu", None)
items = task.load_items(limit=300)
prompts = [tok.encode(task.prompt_text(it, 100)) for it in items]
with torch.inference_mode():
    outs = E.greedy_generate(model, prompts, 213, stop_id=tok.eos_id)
counts = collections.Counter()
for it, out in zip(items, outs):
    reasoning, _ = task.split_completion(tok.decode([t for t in out if t != tok.eos_id]))
    origin = C.pass_origin(reasoning or "", it["numbers"])
    if origin:
        counts[(origin, len(it["numbers"]))] += 1
print(sorted(counts.items()))
