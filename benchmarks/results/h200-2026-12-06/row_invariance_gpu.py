"""How far a row's logits in a batch are from its logits alone on a GPU, where batch invariance is not claimed
(docs/generation.md, "Batch invariance"): the bundled model, the 32 prompts of `bench_engine.py`'s concurrent
workload (same seed), each prefilled alone and then decoded teacher-forced for STEPS steps alone and in batches of
2, 8 and 32 rows (the Triton launch rules change at 1, 2-16 and 17-64 rows), eagerly and from CUDA graphs.

For each batch size: the largest |logit difference| over every row and step, the median of the rows' largest, and
the steps whose greedy pick differs from the pick alone (with the pick's margin alone: its top-1 minus top-2 logit).
Then the end-to-end count `bench_engine.py` makes on the CPU: the 32 requests (greedy, 16-96 new tokens) through the
engine at once against each alone, rows token-identical.
On the CPU (DEVICE=cpu, eager only) every difference must be 0: a check of the script.

    PYTHONPATH=.:benchmarks/.device_deps [FIXED_ROWS=64] python benchmarks/results/h200-2026-12-06/row_invariance_gpu.py [STEPS]
"""

import os
import random
import statistics
import sys

import torch

from dsv41.model.assets import bundled_model_dir
from dsv41.model.batch_cache import BatchCache
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, GraphedDecode, Request

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 24
DEVICE = os.environ.get("DEVICE", "cuda")
if os.environ.get("FIXED_ROWS"):  # (added 2026-12-07) the decode step's fp32 GEMMs on a fixed row count: host.py
    from dsv41.model.kernels import host
    host.FIXED_ROWS = int(os.environ["FIXED_ROWS"])
BATCHES = (2, 8, 32)


def workload(n: int = 32):
    rng = random.Random(0)  # bench_engine.py's WORKER: the same seed, drawn in the same order
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(n)]
    return prompts, [max(4, rng.randint(16, 96)) for _ in range(n)]


def fed(step: int, seq: list[int]) -> int:
    """The token fed to `seq` at decode step `step`: fixed, whatever else runs."""
    return (7919 * step + 13 * len(seq) + seq[0]) % 60000 + 1000


@torch.inference_mode()
def decode_rows(model, seqs: list[list[int]], graphs: bool) -> list[torch.Tensor]:
    """fp32 logits [STEPS, V] of each sequence, all decoded in one batch from their own prefills."""
    dev = model.embed.weight.device
    cache = BatchCache(model.args, len(seqs), model.args.max_seq_len, dev)
    step = GraphedDecode(model, cache) if graphs else (lambda ids: model.decode(ids, cache))
    for row, seq in enumerate(seqs):
        kv = model.new_cache(1)
        model(torch.tensor([seq], device=dev), 0, kv)
        cache.load(row, kv)
    out = [[] for _ in seqs]
    for s in range(STEPS):
        logits = step(torch.tensor([fed(s, seq) for seq in seqs], device=dev))
        for r in range(len(seqs)):
            out[r].append(logits[r].float().cpu())
    if graphs and step.failed:
        raise SystemExit(f"the graph capture failed: {step.failed}")
    return [torch.stack(o) for o in out]


def main() -> None:
    model, _, tok = load_model(bundled_model_dir(), device=DEVICE)
    seqs, lengths = workload()
    for graphs in ((False, True) if DEVICE == "cuda" else (False,)):
        alone = [decode_rows(model, [seq], graphs)[0] for seq in seqs]
        print(f"{'CUDA graphs' if graphs else 'eager'}, {len(seqs)} prompts of {min(map(len, seqs))}-"
              f"{max(map(len, seqs))} tokens, {STEPS} teacher-forced steps, each row against itself alone:", flush=True)
        for n in BATCHES:
            worst, flips, parted = [], [], []
            for first in range(0, len(seqs), n):
                together = decode_rows(model, seqs[first:first + n], graphs)
                for i, got in enumerate(together):
                    want = alone[first + i]
                    worst.append(float((got - want).abs().max()))
                    apart = torch.nonzero((got != want).any(-1)).flatten().tolist()
                    if apart:  # (added after the 2026-12-06 run: which row, from which step)
                        parted.append(f"row {first + i} ({len(seqs[first + i])} prompt tokens) from step {apart[0]}")
                    top2 = want.topk(2, dim=-1).values
                    for s in torch.nonzero(got.argmax(-1) != want.argmax(-1)).flatten().tolist():
                        flips.append((first + i, s, float(top2[s, 0] - top2[s, 1])))
            print(f"  batches of {n:2d}: largest |logit difference| {max(worst):.4g} (median of the rows' largest "
                  f"{statistics.median(worst):.3g}; rows with any difference {sum(w > 0 for w in worst)}/{len(worst)}); "
                  f"greedy picks that differ {len(flips)}/{len(seqs) * STEPS}"
                  + (f", margins alone {', '.join(f'{m:.3g}' for _, _, m in flips[:8])}" if flips else ""), flush=True)
            if parted:
                print(f"    rows that part: {'; '.join(parted[:8])}", flush=True)

    gen = Generator(model, tok)  # the engine's own path: CUDA graphs on a GPU (DSV41_CUDA_GRAPHS unset)
    with torch.inference_mode():
        requests = [Request(p, GenerationConfig(max_new_tokens=n, stop_ids=())) for p, n in zip(seqs, lengths)]
        together = [r.output_ids for r in gen.generate_many(requests, max_batch_size=len(requests))]
        alone = [gen.generate(p, GenerationConfig(max_new_tokens=n, stop_ids=())).output_ids
                 for p, n in zip(seqs, lengths)]
    same = sum(a == b for a, b in zip(alone, together))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(alone, together)]
    print(f"the engine, {len(seqs)} requests at once against each alone: rows token-identical {same}/{len(seqs)}"
          + (f"; the others part at new token {', '.join(str(i) for i in first if i is not None)}" if same < len(seqs)
             else ""), flush=True)


if __name__ == "__main__":
    main()
