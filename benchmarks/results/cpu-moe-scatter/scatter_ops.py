"""The routed MoE's sum of expert outputs into y, on the CPU: index_add_ against an accumulating index_put_ (both one
addition per element, the rows of one expert being distinct), at the bundled model's width (64) and the row counts
of a decode step and of a prefill chunk. Checks the two give the same bits, then times each (median of 5 rounds of
2,000 calls) at torch's default thread count and at one thread.

    python benchmarks/results/cpu-moe-scatter/scatter_ops.py [--json F]
"""

import argparse
import json
import statistics
import time

import torch


def per_call_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    threads = torch.get_num_threads()
    rows_out = []
    with torch.inference_mode():
        for n, r in [(1, 1), (32, 8), (400, 100)]:  # (rows of y, rows routed to one expert)
            g = torch.Generator().manual_seed(n)
            y0 = torch.randn(n, 64, generator=g)
            rows = torch.randperm(n, generator=g)[:r]
            src = torch.randn(r, 64, generator=g)
            same = torch.equal(y0.clone().index_add_(0, rows, src),
                               y0.clone().index_put_((rows,), src, accumulate=True))
            y = y0.clone()
            point = {"y_rows": n, "expert_rows": r, "bit_identical": same}
            for t in sorted({threads, 1}, reverse=True):
                torch.set_num_threads(t)
                point[f"index_add_us_{t}t"] = round(per_call_us(lambda: y.index_add_(0, rows, src)), 2)
                point[f"index_put_acc_us_{t}t"] = round(
                    per_call_us(lambda: y.index_put_((rows,), src, accumulate=True)), 2)
            torch.set_num_threads(threads)
            rows_out.append(point)
            print(json.dumps(point), flush=True)
    doc = {"torch": torch.__version__, "threads": threads, "points": rows_out}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
