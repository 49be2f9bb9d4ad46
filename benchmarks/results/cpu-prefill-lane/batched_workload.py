"""bench_engine.py's 32 concurrent requests (the same seed) on one engine, one torch thread (the prefill thread takes
the second core), RUNS times in one process after a warm-up, printing each wall time; for a sampling profiler.
`setup()` is shared with depth_ab.py. Ad hoc; its numbers are in NOTES.md.

    py-spy record -r 400 --threads --idle -f raw -o batched.txt -- python benchmarks/results/cpu-prefill-lane/batched_workload.py
"""
import random, sys, time
import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request


def setup():
    """(the bundled model's Generator at one torch thread, warmed; a function making the 32 requests)."""
    torch.set_num_threads(1)
    model, args, tok = load_model(bundled_model_dir())
    gen = Generator(model, tok)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
    lengths = [max(4, rng.randint(16, 96)) for _ in range(32)]
    with torch.inference_mode():
        gen.generate(prompts[0][:40], GenerationConfig(max_new_tokens=8, stop_ids=()))
    return gen, lambda: [Request(p, GenerationConfig(max_new_tokens=n, stop_ids=())) for p, n in zip(prompts, lengths)]


if __name__ == "__main__":
    RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    gen, requests = setup()
    with torch.inference_mode():
        for _ in range(RUNS):
            t0 = time.perf_counter()
            res = gen.generate_many(requests(), max_batch_size=32)
            wall = time.perf_counter() - t0
            print(f"wall {wall:.3f} s, prefill (sum) {sum(r.prefill_seconds for r in res):.3f} s", flush=True)
