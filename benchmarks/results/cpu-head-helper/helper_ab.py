"""The head's helper core (host.helper_core) on and off (DSV41_HEAD_HELPER=0), in fresh processes alternated over
rounds, the current tree, the bundled model, torch at one intra-op thread (as `dsv41` runs it): one sequence's
decode tokens/s (bench_engine.py's `single`: 40-token prompt, 96 new tokens, 3 runs a process) and the 32 requests
of bench_engine.py's `concurrent`, batched (wall seconds, and whether the tokens are the same with it off).
Ad hoc timing; its numbers are in NOTES.md beside this command.

    python benchmarks/results/cpu-head-helper/helper_ab.py [ROUNDS]
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time

if len(sys.argv) > 1 and sys.argv[1] == "--one":
    import torch
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model
    from dsv41.model.engine import GenerationConfig, Generator, Request

    torch.set_num_threads(1)
    model, args, tok = load_model(bundled_model_dir())
    gen = Generator(model, tok)
    cfg = lambda n: GenerationConfig(max_new_tokens=n, stop_ids=())  # noqa: E731
    prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
    rng = random.Random(0)  # bench_engine.py's workload: the same seed, the same draws
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
    lengths = [rng.randint(16, 96) for _ in range(32)]
    with torch.inference_mode():
        gen.generate(prompt, cfg(8))  # warm-up
        single = [gen.generate(prompt, cfg(96)).decode_tokens_per_s for _ in range(3)]
        t0 = time.perf_counter()
        results = gen.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)], max_batch_size=32)
        wall = time.perf_counter() - t0
    print(json.dumps({"single": single, "concurrent_wall_s": wall, "ids": [r.output_ids for r in results]}))
    sys.exit(0)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
runs: dict = {"0": [], "1": []}
for r in range(rounds):
    for helper in (("0", "1") if r % 2 == 0 else ("1", "0")):
        out = subprocess.run([sys.executable, __file__, "--one"], capture_output=True, text=True, check=True,
                             env={**os.environ, "DSV41_HEAD_HELPER": helper}).stdout
        runs[helper].append(json.loads(out.strip().splitlines()[-1]))
        last = runs[helper][-1]
        print(f"round {r + 1}, helper {'on' if helper == '1' else 'off'}: one sequence "
              f"{[round(x, 1) for x in last['single']]} tokens/s, 32 requests {last['concurrent_wall_s']:.3f} s",
              flush=True)
med = {h: (statistics.median(x for run in v for x in run["single"]),
           statistics.median(run["concurrent_wall_s"] for run in v)) for h, v in runs.items()}
same = all(run["ids"] == runs["0"][0]["ids"] for v in runs.values() for run in v)
print(f"one sequence: off {med['0'][0]:.1f}, on {med['1'][0]:.1f} tokens/s ({med['1'][0] / med['0'][0]:.3f}x); "
      f"32 requests: off {med['0'][1]:.3f}, on {med['1'][1]:.3f} s ({med['0'][1] / med['1'][1]:.3f}x); "
      f"tokens the same in every run: {same}")
