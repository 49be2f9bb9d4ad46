"""A batched prefill's cost against its group size: the bundled model's forward over B prompts of T tokens at once
(one KVCache of B sequences, the scheduler's `_prefill_group`) against B forwards of one prompt, one torch thread.
Also checks what the scheduler relies on: each prompt's last logits in the group are the bits of its forward alone.

    python benchmarks/results/cpu-batched-prefill/prefill_groups.py > benchmarks/results/cpu-batched-prefill/prefill_groups.json
"""

import json
import random
import statistics
import time

import torch

from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.kernels import reference

torch.set_num_threads(1)
model, args, _ = load_model(bundled_model_dir(), device="cpu")
rng = random.Random(0)


def forward_s(ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    cache = model.new_cache(ids.size(0))
    t0 = time.perf_counter()
    with reference.sequences_apart(ids.size(0)):
        logits = model(ids, start_pos=0, cache=cache)
    return time.perf_counter() - t0, logits


rows = []
with torch.inference_mode():
    forward_s(torch.tensor([[rng.randrange(1000, 60000) for _ in range(16)]]))  # warm-up
    for T in (16, 64, 128):
        for B in (1, 2, 4, 8, 16):
            ids = torch.tensor([[rng.randrange(1000, 60000) for _ in range(T)] for _ in range(B)])
            group = [forward_s(ids) for _ in range(5)]
            alone = [[forward_s(ids[b:b + 1]) for b in range(B)] for _ in range(5)]
            same = all(torch.equal(group[0][1][b], alone[0][b][1][0]) for b in range(B))
            g = statistics.median(t for t, _ in group)
            a = statistics.median(sum(t for t, _ in run) for run in alone)
            rows.append({"tokens": T, "prompts": B, "group_ms": round(1e3 * g, 2), "alone_ms": round(1e3 * a, 2),
                         "ms_per_prompt_group": round(1e3 * g / B, 2), "speedup": round(a / g, 3),
                         "last_logits_bit_identical": same})
            print(json.dumps(rows[-1]), file=__import__("sys").stderr)
print(json.dumps({"threads": 1, "median_of": 5, "rows": rows}, indent=1))
