"""One prefill forward of the bundled model at 64, 200 and 400 tokens (median of 7 after 2 warm-ups, one torch
thread), in the tree first on PYTHONPATH. Ad hoc timing; its numbers are in NOTES.md beside this command.

    PYTHONPATH=TREE python benchmarks/results/cpu-window-in-place/prefill_by_length.py
"""
import torch, random, time, sys
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
import dsv41; print(dsv41.__file__, file=sys.stderr)  # which tree ran
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
rng = random.Random(0)
out = []
with torch.inference_mode():
    for T in (64, 200, 400):
        ids = torch.tensor([[rng.randrange(1000, 60000) for _ in range(T)]])
        for _ in range(2): model(ids, start_pos=0, cache=model.new_cache(1))
        ts = []
        for _ in range(7):
            t = time.perf_counter(); model(ids, start_pos=0, cache=model.new_cache(1)); ts.append(time.perf_counter() - t)
        out.append(f"T={T} {sorted(ts)[3]*1e3:.1f}ms")
print(" ".join(out))
