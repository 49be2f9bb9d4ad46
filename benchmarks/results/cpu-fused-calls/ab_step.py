"""One process, one torch thread, the bundled model: one sequence's greedy decode (the 40-token prompt, 64 new tokens)
with one of this tree's fused host calls on (B) and replaced by the calls it fuses (A), alternating run by run, so
the machine's drift falls on both alike. Prints the medians, the paired ratios and whether the tokens are equal.
Ad hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-fused-calls/ab_step.py gate|inputs|output|mhc|engram|indexer [RUNS]
"""
import statistics
import sys

import torch

from dsv41.model import attention, engram, indexer
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator
from dsv41.model.kernels import host, mhc, routing


def swap(owner, name, old):
    real = getattr(owner, name)
    return (lambda: setattr(owner, name, old)), (lambda: setattr(owner, name, real))


def unfused_mhc(real):
    return lambda *a: mhc._normed(real(*a[:11], None), a[11] if len(a) > 11 else None)


VARIANTS = {  # name -> (off, on): off puts back the calls the fused one replaced
    "gate": lambda: swap(routing, "gate_route", lambda x, w, bias, k, *a: routing.route(host.fixed_order_linear(x, w),
                                                                                       bias, k, *a)),
    "inputs": lambda: swap(attention.Attention, "decode_inputs",
                           lambda self, x, f: (*self.query(x, f), self.window_latent(x, f))),
    "output": lambda: swap(attention.Attention, "decode_output", attention.Attention.output),
    "mhc": lambda: swap(host, "mhc_step", unfused_mhc(host.mhc_step)),
    "engram": lambda: swap(engram.Engram, "_host_gate", lambda *a: False),
    "indexer": lambda: swap(indexer.Indexer, "_host_select", lambda *a: None),
}

torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
off, on = VARIANTS[sys.argv[1]]()
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 15
rates, tokens = {"A": [], "B": []}, {}
with torch.inference_mode():
    gen.generate(prompt, GenerationConfig(max_new_tokens=8, stop_ids=()))
    for i in range(runs):
        for v in ("A", "B") if i % 2 == 0 else ("B", "A"):
            (off if v == "A" else on)()
            r = gen.generate(prompt, GenerationConfig(max_new_tokens=64, stop_ids=()))
            rates[v].append(r.decode_tokens_per_s)
            tokens.setdefault(v, r.output_ids)
on()
a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
paired = sorted(y / x for x, y in zip(rates["A"], rates["B"]))
print(f"{sys.argv[1]}: apart {a:.1f} tok/s, fused {b:.1f} tok/s, ratio of medians {b / a:.3f}; paired ratios: median "
      f"{statistics.median(paired):.3f}, {paired[0]:.3f}-{paired[-1]:.3f}; tokens equal: {tokens['A'] == tokens['B']}")
