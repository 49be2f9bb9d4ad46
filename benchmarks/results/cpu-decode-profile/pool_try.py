"""bench_engine.py's 32-request workload (the same seed) on one engine (Generator.generate_many, 32 rows, the prefill
thread on) or on an EnginePool of two engines (this process and one worker, each at one thread, workers loaded
before the timing), three timed runs in one process after a warm-up. Ad hoc; its numbers are in NOTES.md beside the
command.

    python benchmarks/results/cpu-decode-profile/pool_try.py one|pool
"""
import json, os, random, sys, time
import torch
torch.set_num_threads(1)
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request
from dsv41.evals.engine_pool import EnginePool
def main():
    mode = sys.argv[1]
    model, args, tok = load_model(bundled_model_dir(), device="cpu")
    gen = Generator(model, tok)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
    lengths = [max(4, int(rng.randint(16, 96))) for _ in range(32)]
    cfg = lambda n: GenerationConfig(max_new_tokens=n, stop_ids=())
    with torch.inference_mode():
        gen.generate(prompts[0][:40], cfg(8))
        if mode == "one":
            for _ in range(3):
                t0 = time.perf_counter()
                res = gen.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)], max_batch_size=32)
                w = time.perf_counter() - t0
                print("one", w, sum(len(r.output_ids) for r in res) / w, flush=True)
        else:
            with EnginePool(gen, bundled_model_dir(), engines=2, batch_size=32) as pool:
                pool.wait_ready()
                for _ in range(3):
                    t0 = time.perf_counter()
                    res = pool.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)])
                    w = time.perf_counter() - t0
                    print("pool", w, sum(len(r.output_ids) for r in res) / w, pool.from_workers, flush=True)
if __name__ == '__main__':
    main()
