"""Where the 32-request workload of bench_engine.py (`concurrent`) spends its wall time: prompt prefill against
decode steps, in the current tree, one torch thread, the bundled model.

    python benchmarks/results/cpu-prefill-share/prefill_share.py            # prints one JSON document

The engine prefills one request at a time (its own forward over the prompt, in chunks) between decode steps; each
GenerationResult carries its prefill_seconds. Summed over the requests, against the run's wall time, that is the
share of the run spent on prompts. Also: one sequence's prefill time against its prompt length (median of 3), and one
sequence's decode rate (bench_engine.py `single`: a 40-token prompt, 96 new tokens, median of 3)."""

import json
import random
import statistics
import time

import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request

torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)


def cfg(n):
    return GenerationConfig(max_new_tokens=n, stop_ids=())


out = {}
with torch.inference_mode():
    prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
    gen.generate(prompt, cfg(8))  # warm-up
    rng = random.Random(0)  # bench_engine.py's workload: the same seed, the same draws
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
    lengths = [rng.randint(16, 96) for _ in range(32)]
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        res = gen.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)], max_batch_size=32)
        wall = time.perf_counter() - t0
        prefill = sum(r.prefill_seconds for r in res)
        runs.append({"wall_s": wall, "prefill_s": prefill, "prefill_share": prefill / wall,
                     "generated_tokens": sum(len(r.output_ids) for r in res),
                     "prompt_tokens": sum(map(len, prompts))})
    out["workload"] = runs
    rng = random.Random(1)
    scale = []
    for n in (8, 64, 128, 256, 400):
        ts = [gen.generate([rng.randrange(1000, 60000) for _ in range(n)], cfg(1)).prefill_seconds for _ in range(3)]
        t = statistics.median(ts)
        scale.append({"prompt_tokens": n, "prefill_s": t, "tokens_per_s": n / t})
    out["prefill_by_length"] = scale
    out["one_sequence_decode_tokens_per_s"] = statistics.median([
        gen.generate(prompt, cfg(96)).decode_tokens_per_s for _ in range(3)])
print(json.dumps(out, indent=1))
