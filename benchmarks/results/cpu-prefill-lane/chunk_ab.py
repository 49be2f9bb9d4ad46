"""The 32 concurrent requests on one engine with the CPU prefill chunk (`engine.PREFILL_CHUNK["cpu"]`) at each value given,
alternated over ROUNDS rounds in one process; prints each round and the medians. Ad hoc; its numbers are in NOTES.md.

    python benchmarks/results/cpu-prefill-lane/chunk_ab.py ROUNDS CHUNK...
"""
import statistics, sys, time
import torch
from batched_workload import setup
from dsv41.model import engine
gen, requests = setup()
chunks = [int(c) for c in sys.argv[2:]]
walls = {c: [] for c in chunks}
with torch.inference_mode():
    for r in range(int(sys.argv[1])):
        for c in (chunks if r % 2 == 0 else chunks[::-1]):
            engine.PREFILL_CHUNK["cpu"] = c
            t0 = time.perf_counter(); gen.generate_many(requests(), max_batch_size=32); walls[c].append(time.perf_counter() - t0)
        print(r, {c: round(w[-1], 3) for c, w in walls.items()}, flush=True)
print("medians", {c: round(statistics.median(w), 3) for c, w in walls.items()})
