"""cProfile of the bundled model's decode steps with all N rows running: N prompts of 200 tokens, 40 new tokens
each, one scheduler (no prefill thread), one torch thread; steps 5 to 24 of those with every row running are
profiled (fewer when fewer exist). Ad hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-decode-profile/profile_step.py N
"""
import cProfile, pstats, random, sys, torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
torch.set_num_threads(1); rows = int(sys.argv[1])
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
prof = cProfile.Profile()
dec = Scheduler._decode
seen = {"full": 0, "profiled": 0}
def profiled(self, *a):
    if len(self.running) == rows:
        seen["full"] += 1
        if 5 <= seen["full"] < 25:
            seen["profiled"] += 1
            prof.enable(); out = dec(self, *a); prof.disable(); return out
    return dec(self, *a)
Scheduler._decode = profiled
with torch.inference_mode():
    s = Scheduler(gen, rows, overlap_prefill=False)
    for i in range(rows):
        s.submit(Request([rng.randrange(1000, 60000) for _ in range(200)], GenerationConfig(max_new_tokens=40, stop_ids=())), key=i)
    list(s.run())
print(rows, "rows; steps profiled:", seen["profiled"])
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
