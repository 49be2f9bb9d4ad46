"""One row (max_batch_size 1) with and without the second prefill thread, alternating in one process: 16 requests of
bench_engine.py's workload, three rounds, wall seconds [without, with]. Ad hoc timing; its numbers are in NOTES.md.

    python benchmarks/results/cpu-prefill-thread/one_row.py
"""
import random, sys, time, torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(16)]
lengths = [rng.randint(16, 96) for _ in range(16)]
def run(ov):
    s = Scheduler(gen, 1, overlap_prefill=ov)
    for i,(p,n) in enumerate(zip(prompts,lengths)): s.submit(Request(p,GenerationConfig(max_new_tokens=n, stop_ids=())), key=i)
    t=time.perf_counter(); res=dict(s.run()); return time.perf_counter()-t
with torch.inference_mode():
    gen.generate(prompts[0][:40], GenerationConfig(max_new_tokens=8, stop_ids=()))
    for r in range(3):
        print([round(run(ov),3) for ov in (False, True)], flush=True)
