"""One sequence's prefill forward time by prompt length (1-256 tokens, median of 7), one torch thread, the bundled model.
Ad hoc; its numbers are in NOTES.md.

    python benchmarks/results/cpu-prefill-lane/prefill_by_length.py
"""
import time, torch, statistics
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
with torch.inference_mode():
    for n in (1, 8, 32, 64, 128, 256):
        ids = torch.randint(1000, 60000, (1, n))
        ts = []
        for _ in range(7):
            kv = model.new_cache(1); t0 = time.perf_counter(); model(ids, 0, kv); ts.append(time.perf_counter() - t0)
        print(n, f"{statistics.median(ts)*1e3:.1f} ms", f"{n/statistics.median(ts):.0f} tok/s", flush=True)
