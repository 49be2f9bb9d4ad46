"""The bundled model's decode step time by rows in flight: N prompts of 200 tokens, 60 new tokens each, one
scheduler (no prefill thread), the median of the steps with all N rows running, at T intra-op threads. Ad hoc
timing; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-decode-profile/step_by_rows.py T N
"""
import sys, time, random, torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
torch.set_num_threads(int(sys.argv[1])); rows = int(sys.argv[2])
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
times = []
dec = Scheduler._decode
def timed(self, *a):
    t = time.perf_counter(); out = dec(self, *a); times.append((len(self.running), time.perf_counter() - t)); return out
Scheduler._decode = timed
with torch.inference_mode():
    s = Scheduler(gen, rows, overlap_prefill=False)
    for i in range(rows):
        s.submit(Request([rng.randrange(1000, 60000) for _ in range(200)], GenerationConfig(max_new_tokens=60, stop_ids=())), key=i)
    list(s.run())
full = [t for n, t in times if n == rows]
print(rows, "rows, threads", torch.get_num_threads(), "steps", len(full), "median ms", sorted(full)[len(full)//2]*1e3)
