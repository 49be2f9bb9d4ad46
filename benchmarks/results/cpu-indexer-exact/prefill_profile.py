"""cProfile of the prefills of bench_engine.py's 32-request workload (the same seed: 32 prompts of 8-400 tokens,
6,490 prompt tokens), one scheduler without the prefill thread, one torch thread; each request decodes one token, so
the run is its prefills. Prints the wall time and the functions by time inside them (the first N, default 30). Ad
hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-indexer-exact/prefill_profile.py [N]
"""
import random, time, torch, cProfile, pstats, sys
torch.set_num_threads(1)
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
prof = cProfile.Profile()
orig = Scheduler._prefill
def p(*a, **k):
    prof.enable(); r = orig(*a, **k); prof.disable(); return r
Scheduler._prefill = p
with torch.inference_mode():
    gen.generate(prompts[0][:40], GenerationConfig(max_new_tokens=2, stop_ids=()))
    prof = cProfile.Profile()
    s = Scheduler(gen, 32, overlap_prefill=False)
    for i, pr in enumerate(prompts):
        s.submit(Request(pr, GenerationConfig(max_new_tokens=1, stop_ids=())), key=i)
    t0 = time.perf_counter(); list(s.run()); print("wall", time.perf_counter() - t0)
pstats.Stats(prof).sort_stats("tottime").print_stats(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
