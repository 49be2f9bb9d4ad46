"""Operator calls and host-device syncs of one training step of the dsv41-tiny recipe, counted on CPU.

    python benchmarks/count_train_ops.py --out benchmarks/results/count_train_ops.json
    python benchmarks/count_train_ops.py --device cuda --batch 64 --context 512 --out $OUT/ops.json   # on a GPU

A step of the dim-64 tiny model is host-bound on an H200 (docs/performance.md, "Training step"): every
aten operator is at least one kernel launch there, and every host read of a device value stalls the
stream. Neither number depends on the device much, so they can be measured on CPU: this builds the
recipe's trainable model (recipes.tiny.config.tiny_config(trainable=True), recipes.tiny.train
.build_trainable), warms it up with one step, then profiles one more `train_backbone` step (CPU activity)
and reports

* the number of aten operator calls (all of them, and those under the optimizer step),
* the top operators by count,
* the syncs a CUDA run would pay: `aten::_local_scalar_dense` (what `.item()`, `bool(t)`, `int(t)` and
  `float(t)` call), and data-dependent-shape operators that copy a count back to the host
  (`aten::nonzero`, `aten::_unique2`, `aten::masked_select`, `aten::repeat_interleave` with a tensor of
  repeats), plus `Tensor.tolist()` calls, which are no aten operator on CPU but a device-to-host copy on
  CUDA -- counted with a TorchFunctionMode,
* the Python call sites of those syncs.

The optimizer runs AdamW's per-tensor loop on CPU and the fused multi-tensor (foreach) one on CUDA, so its
share differs between devices; it is reported apart.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# aten operators that read a device value on the host (a stream sync on CUDA)
SCALAR_READS = ("aten::item", "aten::_local_scalar_dense")
SHAPE_SYNCS = ("aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
               "aten::masked_select")
# repeat_interleave syncs only with a tensor of repeats; with an int it is expand + clone (see _is_sync)
# Tensor methods that hand a value to Python (counted at the Python level, with their call site)
HOST_READ_METHODS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}


def _call_site(skip_files=("count_train_ops.py", "torch/")) -> str:
    """The innermost frame of this repository's code (not this script, not torch) that made the call."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if str(REPO) in name and not any(s in name for s in skip_files):
            return f"{Path(name).relative_to(REPO)}:{frame.lineno} {frame.line.strip() if frame.line else ''}"[:160]
    return "?"


class HostReads(TorchFunctionMode):
    """Counts Tensor.tolist/item/bool/int/float calls and where they come from."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            self.sites[f"{name}: {_call_site()}"] += 1
        return func(*args, **(kwargs or {}))


def _random_sampler(vocab: int, seed: int = 0):
    from dsv41.recipes.tiny.train import WindowSampler

    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(3, vocab, (200_000,), generator=g)
    return WindowSampler({"prose": stream}, {"prose": 1.0}, seed=seed)


def _step(model, sampler, device, batch: int, context: int) -> None:
    from dsv41.recipes.tiny.train import train_backbone

    train_backbone(model, sampler, device, 1e9, batch, context, 1e-4, max_steps=1, log=lambda _: None)


def _under(event, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


_REPO_FRAME = re.compile(r"(^|/)(model|recipes)/[\w/]+\.py\(\d+\)")


def _site_of(event) -> str:
    """The innermost Python frame of model/ or recipes/ above an operator (with_stack records Python
    calls as parent events named "path(line): function")."""
    parent = event.cpu_parent
    while parent is not None:
        if _REPO_FRAME.search(parent.name):
            return parent.name[parent.name.find(_REPO_FRAME.search(parent.name).group(2)):]
        parent = parent.cpu_parent
    return "?"


def _is_sync(event) -> bool:
    if event.name == "aten::_local_scalar_dense" or event.name in SHAPE_SYNCS:
        return True
    return event.name == "aten::repeat_interleave" and not any(c.name == "aten::expand" for c in event.cpu_children)


def count(device: str, batch: int, context: int, seed: int = 0) -> dict:
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.config import tiny_config
    from dsv41.recipes.tiny.train import build_trainable

    torch.manual_seed(seed)
    args = tiny_config(trainable=True)
    token_map, _ = build_compressed_token_map(load_tokenizer())
    model = build_trainable(args, token_map, device, seed=seed)
    sampler = _random_sampler(args.vocab_size, seed)
    _step(model, sampler, device, batch, context)  # warm-up: lazily built tables, allocator

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    reads = HostReads()
    with profile(activities=activities, with_stack=True) as prof, reads:
        _step(model, sampler, device, batch, context)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    # an operator called from Python, not from inside another operator (aten::to -> _to_copy -> copy_)
    outer = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    by_name = collections.Counter(e.name for e in events)
    optimizer_ops = sum(1 for e in events if _under(e, "Optimizer.step"))
    sync_events = [e for e in events if _is_sync(e)]
    syncs = dict(collections.Counter(e.name for e in sync_events))
    sync_sites = collections.Counter(f"{e.name}: {_site_of(e)}" for e in sync_events)
    sync_sites_outside_optimizer = sum(1 for e in sync_events if not _under(e, "Optimizer.step"))
    result = {
        "device": device, "torch": torch.__version__, "batch": batch, "context": context,
        "aten_ops_total": len(events),
        "aten_ops_outer": len(outer),
        "aten_ops_optimizer_step": optimizer_ops,
        "aten_ops_forward_backward_and_rest": len(events) - optimizer_ops,
        "top_ops": [{"name": n, "calls": c} for n, c in by_name.most_common(25)],
        # where the operators come from: the innermost model/ or recipes/ line above each outer operator
        # (the backward's operators run from the autograd engine and show as "?")
        "top_op_sites": [{"site": s, "outer_ops": c}
                         for s, c in collections.Counter(_site_of(e) for e in outer).most_common(30)],
        "sync_ops": syncs,
        "local_scalar_dense": by_name["aten::_local_scalar_dense"],
        "sync_ops_total": len(sync_events),
        "sync_ops_outside_optimizer": sync_sites_outside_optimizer,
        "sync_sites": [{"site": s, "calls": c} for s, c in sync_sites.most_common(40)],
        "host_reads_python": sum(reads.sites.values()),
        "host_read_sites": [{"site": s, "calls": c} for s, c in reads.sites.most_common(40)],
    }
    if device == "cuda":
        kernel_events = prof.key_averages()
        result["kernel_launches"] = sum(e.count for e in kernel_events
                                        if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
        result["cuda_syncs"] = {e.key: e.count for e in kernel_events if "Synchronize" in e.key}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the counts as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    r = count(a.device, a.batch, a.context)
    print(f"device {r['device']}, batch {r['batch']} x {r['context']} tokens, one train_backbone step")
    print(f"aten op calls: {r['aten_ops_total']} (called from Python, not nested in another op: "
          f"{r['aten_ops_outer']}; optimizer step {r['aten_ops_optimizer_step']}, "
          f"forward + backward + rest {r['aten_ops_forward_backward_and_rest']})")
    print("top ops by count:")
    for row in r["top_ops"]:
        print(f"  {row['calls']:7d}  {row['name']}")
    print("top call sites by outer op count (backward ops show as '?'):")
    for row in r["top_op_sites"]:
        print(f"  {row['outer_ops']:7d}  {row['site']}")
    print(f"aten::_local_scalar_dense (item/bool/int/float): {r['local_scalar_dense']}; "
          f"all syncing ops: {r['sync_ops_total']} {r['sync_ops']}, "
          f"outside the optimizer step: {r['sync_ops_outside_optimizer']}")
    print("sync call sites:")
    for row in r["sync_sites"]:
        print(f"  {row['calls']:6d}  {row['site']}")
    print(f"Python-level host reads (tolist/item/bool/int/float): {r['host_reads_python']}")
    for row in r["host_read_sites"]:
        print(f"  {row['calls']:6d}  {row['site']}")
    if "kernel_launches" in r:
        print(f"CUDA kernel launches: {r['kernel_launches']}, syncs: {r['cuda_syncs']}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
