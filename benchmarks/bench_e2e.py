"""End-to-end: the tiny random model (preset 'tiny', init_random_, ~650K parameters) decoding, on the GPU
(with the Triton sparse attention, and with DSV41_DISABLE_TRITON=1) and on the CPU; and the device work a
Reuse layer launches per decode step and per prefill, counted with the PyTorch profiler (runtime launch
calls: kernels, memsets and copies issued inside the layer's forward).

What this does NOT measure (see docs/performance.md): full-width V4.1-Flash layers at 8K / 128K / 1M
(bench_flash_layers.py), CED replay against full (bench_ced.py), launches at full width and under CUDA
graphs (bench_launches.py), the bundled checkpoint (the `model` step of device_batch.sh runs all of these in
one call).
Usage: python benchmarks/bench_e2e.py [--json F] [--device cuda|cpu] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def is_launch(name: str) -> bool:
    """Runtime / driver calls that put work on the device (kernel launches, memsets, copies)."""
    return "LaunchKernel" in name or "Memset" in name or "Memcpy" in name


def build(device):
    from dsv41.model.config import preset
    from dsv41.model.transformer import Transformer, init_random_

    model = Transformer(preset("tiny"))
    init_random_(model, 0)
    return model.to(device).eval()


def decode_rate(model, device, prompt=64, steps=32, batch=1):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (batch, prompt), generator=g).to(device)
    with torch.no_grad():
        cache = model.new_cache(batch)
        model(ids, 0, cache)
        nxt = ids[:, -1:]
        pos = prompt
        for _ in range(3):  # warm-up (compilation)
            model(nxt, pos, cache)
            pos += 1
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            model(nxt, pos, cache)
            pos += 1
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return batch * steps / dt


def launches_per_layer(model, layer_id, seqlen, prompt=64):
    """Runtime launch calls inside layers[layer_id].forward: one decode step (seqlen=1) or a prefill."""
    from torch.profiler import ProfilerActivity, profile, record_function

    block = model.layers[layer_id]
    orig = block.forward

    def wrapped(*a, **k):
        with record_function("measured_layer"):
            return orig(*a, **k)

    ids = torch.randint(0, 500, (1, prompt + seqlen), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        cache = model.new_cache(1)
        if seqlen == 1:
            model(ids[:, :prompt], 0, cache)
        for _ in range(2):  # warm-up
            c = model.new_cache(1)
            model(ids[:, :prompt], 0, c)
            model(ids[:, prompt:prompt + 1], prompt, c)
        block.forward = wrapped
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                if seqlen == 1:
                    model(ids[:, prompt:prompt + 1], prompt, cache)
                else:
                    model(ids[:, :seqlen], 0, cache)
                torch.cuda.synchronize()
        finally:
            block.forward = orig
    events = prof.events()
    ranges = [e.time_range for e in events if e.name == "measured_layer"]
    r = ranges[0]
    inside = [e for e in events if is_launch(e.name) and r.start <= e.time_range.start <= r.end]
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return len(inside), kernels


def run(json_path=None, device=None, quick=False):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    steps = 8 if quick else 32
    rows = []
    model = build(device)
    if device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows.append({"case": f"tiny random model decode tokens/s ({device})",
                 "value": decode_rate(model, device, steps=steps)})
    if device == "cuda":
        os.environ["DSV41_DISABLE_TRITON"] = "1"
        try:
            rows.append({"case": "tiny random model decode tokens/s (cuda, torch sparse attention)",
                         "value": decode_rate(model, device, steps=steps)})
            reuse = next(s.id for s in model.plan.layers if s.mode == "reuse")
            n, total = launches_per_layer(model, reuse, 1)
            rows.append({"case": f"launches, Reuse layer {reuse}, decode step (torch attention)", "value": n,
                         "device_events_whole_step": total})
        finally:
            del os.environ["DSV41_DISABLE_TRITON"]
        reuse = next(s.id for s in model.plan.layers if s.mode == "reuse")
        n, total = launches_per_layer(model, reuse, 1)
        rows.append({"case": f"launches, Reuse layer {reuse}, decode step (Triton attention)", "value": n,
                     "device_events_whole_step": total})
        n, total = launches_per_layer(model, reuse, 64)
        rows.append({"case": f"launches, Reuse layer {reuse}, prefill 64 tokens (Triton attention)", "value": n,
                     "device_events_whole_step": total})
    print("\n== end to end (tiny random model)")
    for r in rows:
        print(f"{r['case']:70s} {r['value']:12.1f}")
    if json_path:
        from kernels_common import machine

        Path(json_path).write_text(json.dumps({"benchmark": "e2e", "machine": machine(), "rows": rows,
                                               "command": " ".join(sys.argv)}, indent=1))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device")
    ap.add_argument("--quick", action="store_true", help="8 timed decode steps instead of 32")
    a = ap.parse_args()
    run(a.json, a.device, a.quick)
