"""The 32 concurrent requests of bench_engine.py on one engine (one torch thread, the prefill thread on the second
core), with the prefill thread's queue depth (`engine.PREFILL_THREAD_DEPTH`) at each value of DEPTHS, alternated over
ROUNDS rounds in one process; prints each run's wall time and the medians, and checks that the tokens are the same
in every run. Ad hoc; its numbers are in NOTES.md.

    python benchmarks/results/cpu-prefill-lane/depth_ab.py ROUNDS DEPTH...
"""
import statistics, sys, time
import torch
from batched_workload import setup
from dsv41.model import engine

ROUNDS = int(sys.argv[1])
DEPTHS = [int(d) for d in sys.argv[2:]]
gen, requests = setup()
walls = {d: [] for d in DEPTHS}
ref = None
with torch.inference_mode():
    for r in range(ROUNDS):
        for d in (DEPTHS if r % 2 == 0 else DEPTHS[::-1]):
            engine.PREFILL_THREAD_DEPTH = d
            t0 = time.perf_counter()
            res = gen.generate_many(requests(), max_batch_size=32)
            walls[d].append(time.perf_counter() - t0)
            ids = [x.output_ids for x in res]
            ref = ref or ids
            assert ids == ref, "tokens differ"
        print(f"round {r + 1}: " + ", ".join(f"depth {d} {walls[d][-1]:.3f} s" for d in DEPTHS), flush=True)
print("medians: " + ", ".join(f"depth {d} {statistics.median(w):.3f} s" for d, w in walls.items()))
