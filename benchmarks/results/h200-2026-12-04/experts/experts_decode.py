"""The routed FP4 experts of one V4.1-Flash MoE layer (bench_experts.py's inputs) with the weights decoded from
bits (dec16=True, the default before) and by the E4M3 conversion (dec16="e4m3"), alternating, graph-replayed GPU
time, and whether the outputs are the same bits.

    cd benchmarks && python3 ../benchmarks/results/h200-2026-12-04/experts/experts_decode.py > OUT.json
"""

import json
import sys

import torch

sys.path.insert(0, ".")
from bench_experts import LIMIT, make_experts, routed_inputs  # noqa: E402
from kernels_common import graph_bench  # noqa: E402

from dsv41.model.kernels import experts as ek  # noqa: E402

ew = make_experts()
g = torch.Generator(device="cuda").manual_seed(0)
rows = []
for T in (64, 4096):
    x, w, idx = routed_inputs(T, g)
    outs, times = {}, {"bits": [], "e4m3": []}
    for name, dec in (("bits", True), ("e4m3", "e4m3")):
        outs[name] = ek.routed_experts(x, w, idx, ew, LIMIT, config=dict(dec16=dec))
    for _ in range(2):
        for name, dec in (("bits", True), ("e4m3", "e4m3")):
            times[name].append(round(graph_bench(lambda: ek.routed_experts(x, w, idx, ew, LIMIT,
                                                                            config=dict(dec16=dec))) * 1e6, 1))
    rows.append({"tokens": T, "graph_us": times, "same_bits": bool(torch.equal(outs["bits"], outs["e4m3"]))})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
print(json.dumps({"rows": rows}, indent=1))
