"""bench_engine.py's one-sequence workload (the 40-token prompt, 96 new tokens, greedy) 12 times in one process, one
torch thread, printing each run's decode tokens/s; for a sampling profiler. Ad hoc; its numbers are in NOTES.md beside
the command.

    py-spy record -r 400 -f raw -o single.txt -- python benchmarks/results/cpu-engine-tiles/single_workload.py
"""
import time, torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
with torch.inference_mode():
    gen.generate(prompt, GenerationConfig(max_new_tokens=8, stop_ids=()))
    t0 = time.perf_counter()
    for _ in range(12):
        r = gen.generate(prompt, GenerationConfig(max_new_tokens=96, stop_ids=()))
        print(round(r.decode_tokens_per_s, 1), end=" ", flush=True)
    print()
