"""The host kernels (model/kernels/host.py) against the torch references they replace, in one process.

The bundled model, greedy, on the CPU. Each round runs the same work twice, once with the C library loaded and
once with it switched off (`host.library` answering None, so every caller takes its torch reference), the two
alternating so that drifting load hits both. Reports median decode tokens/s of one sequence, aggregate tokens/s
of concurrent mixed-length requests through the continuous batch, and in how many sequences the greedy tokens of
the two runs are identical. Every kernel gives its reference's bits except the GEMMs: with the library they are
summed in a fixed order, without it they are MKL's (and the decode step pads its rows), so since 2026-12-03 the
two arms' tokens may part at a near-tie (docs/generation.md, "Batch invariance").

    python benchmarks/bench_host_kernels.py --rounds 5 --json benchmarks/results/cpu-host-kernels/ab.json
    python -m benchmarks host-kernels --json ...      (--quick: 2 rounds, 8 requests, shorter outputs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (with, without) per measurement")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests (prompts of 8-400 tokens)")
    ap.add_argument("--max-prompt", type=int, default=400, help="longest prompt of the concurrent requests")
    ap.add_argument("--new-tokens", type=int, default=96, help="decode length of the single sequence")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the measurement of docs/)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 8 requests, 32 new tokens")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.requests, a.new_tokens = 2, 8, 32

    import torch

    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model
    from dsv41.model.engine import GenerationConfig, Generator, Request
    from dsv41.model.kernels import host

    torch.set_num_threads(a.threads)
    if not host.available():
        print(f"bench_host_kernels: the host kernels are not available here ({host.status()})", file=sys.stderr)
        return 2
    library = host.library
    model, _, tok = load_model(bundled_model_dir(), device="cpu")
    gen = Generator(model, tok)
    prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
    rng = random.Random(0)
    work = [([rng.randrange(1000, 60000) for _ in range(rng.randint(8, a.max_prompt))], rng.randint(16, 96))
            for _ in range(a.requests)]

    def cfg(n):
        return GenerationConfig(max_new_tokens=n, stop_ids=())

    def single():
        r = gen.generate(prompt, cfg(a.new_tokens))
        return r.decode_tokens_per_s, [r.output_ids]

    def batched():
        t0 = time.perf_counter()
        res = gen.generate_many([Request(p, cfg(n)) for p, n in work], max_batch_size=a.requests)
        ids = [r.output_ids for r in res]
        return sum(map(len, ids)) / (time.perf_counter() - t0), ids

    doc: dict = {"benchmark": "host-kernels", "python": platform.python_version(), "torch": torch.__version__,
                 "threads": a.threads, "cpus": os.cpu_count(), "rounds": a.rounds, "requests": a.requests}
    with torch.inference_mode():
        gen.generate(prompt, cfg(8))  # warm-up: the weight caches, the library
        for name, fn in (("single_decode_tokens_per_s", single), ("concurrent_tokens_per_s", batched)):
            rates: dict[str, list[float]] = {"host": [], "torch": []}
            tokens: dict[str, list] = {}
            for _ in range(a.rounds):
                for label in ("host", "torch"):
                    host.library = library if label == "host" else (lambda: None)
                    try:
                        rate, ids = fn()
                    finally:
                        host.library = library
                    rates[label].append(round(rate, 2))
                    if tokens.setdefault(label, ids) != ids:
                        raise SystemExit(f"bench_host_kernels: {label} gave other tokens in another round")
            ratio = statistics.median(rates["host"]) / statistics.median(rates["torch"])
            same = sum(x == y for x, y in zip(tokens["host"], tokens["torch"]))
            doc[name] = {**rates, "ratio": round(ratio, 3), "sequences_token_identical": same,
                         "sequences": len(tokens["host"])}
            print(f"{name}: torch {statistics.median(rates['torch']):.1f}, host kernels "
                  f"{statistics.median(rates['host']):.1f} ({ratio:.2f}x); greedy tokens identical in {same} / "
                  f"{len(tokens['host'])}", flush=True)
    doc["load_average_1min_at_end"] = os.getloadavg()[0]
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
