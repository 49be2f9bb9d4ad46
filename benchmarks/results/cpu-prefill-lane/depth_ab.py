"""The 32 concurrent requests of bench_engine.py on one engine (one torch thread, the prefill thread on the second
core), with the prefill thread's queue depth (`engine.PREFILL_THREAD_DEPTH`) at each value of DEPTHS, alternated over
ROUNDS rounds in one process; prints each run's wall time and the medians. Ad hoc.

    python benchmarks/results/cpu-prefill-lane/depth_ab.py ROUNDS DEPTH...
"""
import random, statistics, sys, time
import torch
from dsv41.model import engine
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request

ROUNDS = int(sys.argv[1])
DEPTHS = [int(d) for d in sys.argv[2:]]
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
lengths = [max(4, rng.randint(16, 96)) for _ in range(32)]
walls = {d: [] for d in DEPTHS}
ref = None
with torch.inference_mode():
    gen.generate(prompts[0][:40], GenerationConfig(max_new_tokens=8, stop_ids=()))
    for r in range(ROUNDS):
        for d in (DEPTHS if r % 2 == 0 else DEPTHS[::-1]):
            engine.PREFILL_THREAD_DEPTH = d
            t0 = time.perf_counter()
            res = gen.generate_many([Request(p, GenerationConfig(max_new_tokens=n, stop_ids=()))
                                     for p, n in zip(prompts, lengths)], max_batch_size=32)
            walls[d].append(time.perf_counter() - t0)
            ids = [x.output_ids for x in res]
            ref = ref or ids
            assert ids == ref, "tokens differ"
        print(f"round {r + 1}: " + ", ".join(f"depth {d} {walls[d][-1]:.3f} s" for d in DEPTHS), flush=True)
print("medians: " + ", ".join(f"depth {d} {statistics.median(w):.3f} s" for d, w in walls.items()))
