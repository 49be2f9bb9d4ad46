"""The head's time inside one-sequence decode steps (bundled model, one torch thread), on one thread and split on
two (host.head_logits_bf16's `threads`), alternated six times in one process, with each run's decode tokens/s.
Ad hoc timing; its numbers are in NOTES.md beside this command.

    python benchmarks/results/cpu-head-helper/head_in_step.py
"""
import time

import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator
from dsv41.model.kernels import host
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
orig = host.head_logits_bf16
for mode in (1, 2) * 6:
    ts = []
    def spy(*a, **k):
        t = time.perf_counter(); out = orig(*a, threads=mode); ts.append(time.perf_counter() - t); return out
    host.head_logits_bf16 = spy
    with torch.inference_mode():
        r = gen.generate(tok.encode('hello there')[:40], GenerationConfig(max_new_tokens=96, stop_ids=()))
    ts.sort()
    print(mode, "head median ms", round(ts[len(ts)//2]*1e3, 3), "decode tok/s", round(r.decode_tokens_per_s, 1))
