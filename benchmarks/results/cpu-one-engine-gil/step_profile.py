"""cProfile of the bundled model's decode steps with all 32 rows running (32 prompts of 200 tokens, 40 new tokens each,
one scheduler, no prefill thread, one torch thread), sorted by cumulative time. Ad hoc; quoted in NOTES.md.

    python benchmarks/results/cpu-one-engine-gil/step_profile.py
"""
import sys, time, random, torch, cProfile, pstats
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
torch.set_num_threads(1); rows = 32
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
dec = Scheduler._decode
pr = cProfile.Profile(); n=[0]
def timed(self, *a):
    if len(self.running) == rows:
        n[0]+=1; pr.enable(); out = dec(self, *a); pr.disable(); return out
    return dec(self, *a)
Scheduler._decode = timed
with torch.inference_mode():
    s = Scheduler(gen, rows, overlap_prefill=False)
    for i in range(rows):
        s.submit(Request([rng.randrange(1000, 60000) for _ in range(200)], GenerationConfig(max_new_tokens=40, stop_ids=())), key=i)
    list(s.run())
print("steps", n[0])
st = pstats.Stats(pr); st.sort_stats("cumtime").print_stats(60)
