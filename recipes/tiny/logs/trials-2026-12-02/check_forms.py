"""Greedy tiny-reasoning at one effort: right answers by whether the first pass was right and whether a "Left N"
check line said 0 (stage 25's effort-100 form). python check_forms.py MODEL EFFORT N [show]"""
import json, re, sys, collections, torch
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request
from dsv41.evals.tasks import tiny_reasoning as task
model, args, tok = load_model(sys.argv[1], device="cpu")
gen = Generator(model, tok)
effort = int(sys.argv[2]); n = int(sys.argv[3])
items = task.load_items(limit=n)
reqs = [Request(tok.encode(task.prompt_text(it, effort)), GenerationConfig(max_new_tokens=256, stop_ids=(tok.eos_id,))) for it in items]
with torch.inference_mode():
    outs = gen.generate_many(reqs, max_batch_size=64)
cats = collections.Counter()
for it, o in zip(items, outs):
    text = tok.decode([t for t in o.output_ids if t != tok.eos_id])
    ok = task.score(text, it)
    reasoning = text.split("</think>")[0]
    lines = reasoning.splitlines()
    S = sum(it["numbers"])
    first = re.findall(r"=(-?\d+)", lines[0]) if lines else []
    first_right = bool(first) and int(first[-1]) == S
    left = re.search(r"Left (-?\d+)", reasoning)
    key = (ok, first_right, left.group(1) if left else None)
    cats[(ok, first_right, (left.group(1)=="0") if left else None)] += 1
    if not ok and len(sys.argv) > 4:
        print(it["numbers"], S, repr(text[:400]))
print(cats)
