"""ATen calls of the bundled model's decode steps with all N rows running (N prompts of 200 tokens, 30 new tokens
each, one scheduler without the prefill thread, one torch thread): torch.profiler over steps 5 to 14, the calls a step
and their self CPU time by operator (the profiler's own cost included). Ad hoc; its numbers are in NOTES.md beside the
command.

    python benchmarks/results/cpu-engine-tiles/aten_ops.py N
"""
import random, sys, torch
from torch.profiler import profile, ProfilerActivity
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rows = int(sys.argv[1]); rng = random.Random(0)
dec = Scheduler._decode; n = {"k": 0}
prof = profile(activities=[ProfilerActivity.CPU])
def p(self, *a):
    if len(self.running) == rows:
        n["k"] += 1
        if n["k"] == 5: prof.__enter__()
        o = dec(self, *a)
        if n["k"] == 14: prof.__exit__(None, None, None)
        return o
    return dec(self, *a)
Scheduler._decode = p
with torch.inference_mode():
    s = Scheduler(gen, rows, overlap_prefill=False)
    for i in range(rows):
        s.submit(Request([rng.randrange(1000, 60000) for _ in range(200)], GenerationConfig(max_new_tokens=30, stop_ids=())), key=i)
    list(s.run())
ev = prof.key_averages()
tot = sum(e.self_cpu_time_total for e in ev)
print("steps 10, total self cpu ms", tot / 1e3, "ops", sum(e.count for e in ev))
for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:30]:
    print(f"{e.key:40s} {e.count/10:7.1f}/step {e.self_cpu_time_total/1e3/10:7.3f} ms/step")
