"""Where the bundled model's 32 concurrent requests spend their time on a GPU (`bench_engine.py --device cuda`'s
workload, the same prompts and lengths): the whole run against its prompts' prefill alone (the same requests at
one new token each), eager and from CUDA graphs, each timed over RUNS runs after a first one that pays the
compiles and captures.

    PYTHONPATH=.:benchmarks/.device_deps python benchmarks/results/h200-2026-12-06/prefill_share.py [RUNS]
"""

import os
import random
import statistics
import sys
import time

import torch

from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
DEVICE = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu: a check of the script itself


def workload(n: int = 32):
    rng = random.Random(0)  # bench_engine.py's WORKER: the same seed, drawn in the same order
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(n)]
    lengths = [max(4, rng.randint(16, 96)) for _ in range(n)]
    return prompts, lengths


def timed(gen: Generator, prompts, lengths) -> dict:
    walls, results = [], None
    for _ in range(1 + RUNS):
        t0 = time.perf_counter()
        results = gen.generate_many([Request(p, GenerationConfig(max_new_tokens=n, stop_ids=()))
                                     for p, n in zip(prompts, lengths)], max_batch_size=len(prompts))
        walls.append(time.perf_counter() - t0)
    return {"wall_s": statistics.median(walls[1:]), "walls_s": [round(w, 3) for w in walls],
            "tokens": sum(len(r.output_ids) for r in results),
            "prefill_s": round(sum(r.prefill_seconds for r in results), 3)}


def main() -> None:
    prompts, lengths = workload()
    for label, graphs in (("eager", "0"), ("graph", "1")):
        os.environ["DSV41_CUDA_GRAPHS"] = graphs
        model, _, tok = load_model(bundled_model_dir(), device=DEVICE)
        gen = Generator(model, tok)
        with torch.inference_mode():
            whole = timed(gen, prompts, lengths)
            prefill = timed(gen, prompts, [1] * len(prompts))
        print(f"{label}: {sum(map(len, prompts))} prompt tokens, {whole['tokens']} new; whole run "
              f"{whole['wall_s']:.3f} s (walls {whole['walls_s']}, {whole['tokens'] / whole['wall_s']:.1f} tok/s), "
              f"the prompts at one new token {prefill['wall_s']:.3f} s (walls {prefill['walls_s']}): prefill "
              f"{prefill['wall_s'] / whole['wall_s']:.0%} of the run; the rest {whole['wall_s'] - prefill['wall_s']:.3f} s "
              f"for {whole['tokens'] - len(prompts)} tokens ({(whole['tokens'] - len(prompts)) / (whole['wall_s'] - prefill['wall_s']):.1f} tok/s)",
              flush=True)
        del gen, model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
