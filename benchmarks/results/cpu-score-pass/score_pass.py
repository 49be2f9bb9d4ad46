"""One scoring block of V4.1's vocabulary (32 x 129,280 fp32 logits): torch's three reductions (logsumexp, the
targets' gather, argmax) against the C scoring pass (host.score_logits), and the head GEMM that makes the block,
alternating, one torch thread; median of --rounds.

    python benchmarks/results/cpu-score-pass/score_pass.py --rounds 7
"""

import argparse
import json
import statistics
import time

import torch

from dsv41.model.kernels import host


def timed(fn, reps: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    wt = torch.randn(64, 129280, generator=g) * 0.05
    logits = host.head_logits(x, wt)
    t = torch.randint(0, 129280, (32,), generator=g)

    def torch_reductions():
        lse = torch.logsumexp(logits, -1)
        logits.gather(-1, t[:, None])[:, 0] - lse
        logits.argmax(-1)

    rows = {"head GEMM": [], "torch: logsumexp + gather + argmax": [], "C scoring pass": []}
    for _ in range(a.rounds):
        rows["head GEMM"].append(timed(lambda: host.head_logits(x, wt)))
        rows["torch: logsumexp + gather + argmax"].append(timed(torch_reductions))
        rows["C scoring pass"].append(timed(lambda: host.score_logits(logits, t)))
    out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    out["isa"] = host.head_isa()
    print(json.dumps({"ms_per_block_median": out, "runs_ms": {k: [round(x, 3) for x in v] for k, v in rows.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
