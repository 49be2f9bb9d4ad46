"""Which operator parts a row alone from the same row in a batch of 2 on the GPU (eager), for
../h200-2026-12-06/row_invariance_gpu.py's workload: find the first (row, step) whose logits differ, then hook every
module (and host.fixed_order_linear, the fp32 GEMMs of the router and the compressor) at that step and list, in
call order, the first outputs whose row differs. Ad hoc; its output is rowdiag.txt.

    PYTHONPATH=.:benchmarks/.device_deps python benchmarks/results/h100-2026-12-07/row_parting_gpu.py [STEPS]
"""
import importlib.util
import os
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "row_invariance_gpu", Path(__file__).parent.parent / "h200-2026-12-06" / "row_invariance_gpu.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)
from dsv41.model.assets import bundled_model_dir
from dsv41.model.batch_cache import BatchCache
from dsv41.model.checkpoint import load_model
from dsv41.model.kernels import host

R.STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 24
DEVICE = os.environ.get("DEVICE", "cuda")


@torch.inference_mode()
def run(model, seqs, stop_step, which):
    """decode seqs eagerly up to stop_step; at stop_step record outputs of row `which` in call order."""
    dev = model.embed.weight.device
    cache = BatchCache(model.args, len(seqs), model.args.max_seq_len, dev)
    for row, seq in enumerate(seqs):
        kv = model.new_cache(1)
        model(torch.tensor([seq], device=dev), 0, kv)
        cache.load(row, kv)
    rec, hooks, on = [], [], [False]
    B = len(seqs)

    def grab(name, out):
        if not on[0]:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for j, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.size(0) == B and t.is_floating_point():
                rec.append((f"{name}[{j}]", tuple(t.shape), t[which].detach().float().cpu().clone()))

    for name, mod in model.named_modules():
        hooks.append(mod.register_forward_hook(lambda m, i, o, name=name: grab(name or "model", o)))
    orig = host.fixed_order_linear

    def fol(x, w, fixed_rows=False):  # (the run of rowdiag.txt, at 519cbe3: fol(x, w), orig(x, w))
        y = orig(x, w, fixed_rows)
        if on[0] and y.size(0) == B:
            rec.append((f"fixed_order_linear{tuple(w.shape)}", tuple(y.shape), y[which].float().cpu().clone()))
        return y
    host.fixed_order_linear = fol
    try:
        for s in range(stop_step + 1):
            on[0] = s == stop_step
            ids = torch.tensor([R.fed(s, seq) for seq in seqs], device=dev)
            logits = model.decode(ids, cache)
        rec.append(("logits", tuple(logits.shape), logits[which].float().cpu()))
    finally:
        host.fixed_order_linear = orig
        for h in hooks:
            h.remove()
    return rec


def main():
    model, _, _ = load_model(bundled_model_dir(), device=DEVICE)
    seqs, _ = R.workload()
    alone = [R.decode_rows(model, [s], False)[0] for s in seqs]
    found = []
    for first in range(0, len(seqs), 2):
        pair = R.decode_rows(model, seqs[first:first + 2], False)
        for i, got in enumerate(pair):
            apart = torch.nonzero((got != alone[first + i]).any(-1)).flatten().tolist()
            if apart:
                found.append((first + i, apart[0], float((got - alone[first + i]).abs().max())))
    print("rows apart in pairs (row, first step, largest diff):", found, flush=True)
    for row, step, _ in found[:2]:
        mate = row ^ 1
        a = run(model, [seqs[row]], step, 0)
        b = run(model, [seqs[min(row, mate)], seqs[max(row, mate)]], step, 0 if row < mate else 1)
        print(f"row {row} ({len(seqs[row])} prompt tokens), step {step}: {len(a)} / {len(b)} records", flush=True)
        n = 0
        for (na, sa, ta), (nb, sb, tb) in zip(a, b):
            if na != nb:
                print("  call order differs:", na, nb); break
            if ta.shape != tb.shape or not torch.equal(ta, tb):
                d = float((ta - tb).abs().max()) if ta.shape == tb.shape else float("nan")
                print(f"  differs: {na} shape alone {sa} pair {sb}: max |d| {d:.4g}", flush=True)
                n += 1
                if n >= 25:
                    break
        if n == 0:
            print("  no hooked output differs")


if __name__ == "__main__":
    main()
