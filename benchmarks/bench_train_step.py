"""Training-step throughput of the dsv41-tiny recipe (recipes/tiny/train.py) against the batch size,
plus one profiled step: where a step of a dim-64 model spends its time on a GPU.

    python benchmarks/bench_train_step.py --data .tinydata --out $OUT/train_step.json

Prints one line per batch size (seconds per step, tokens per second, peak memory) and the top CUDA
kernels and CPU-side operators of one profiled step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed_steps(model, sampler, device, batch: int, steps: int, vision=None) -> float:
    from dsv41.recipes.tiny.train import train_backbone

    torch.cuda.synchronize()
    t = time.time()
    train_backbone(model, sampler, device, 1e9, batch, 512, 1e-4, max_steps=steps, log=lambda _: None,
                   vision=vision)
    torch.cuda.synchronize()
    return (time.time() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=REPO / ".tinydata")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--batches", default="32,64,128,256")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    from dsv41.recipes.tiny.config import tiny_config
    from dsv41.recipes.tiny.train import (FAMILY_WEIGHTS, VisionJob, WindowSampler, build_trainable, load_streams,
                                    load_token_map)

    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cuda"
    args = tiny_config(trainable=True, vision=True)
    model = build_trainable(args, load_token_map(a.data), device)
    sampler = WindowSampler(load_streams(a.data), FAMILY_WEIGHTS)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "text": [], "vision": None}
    for b in [int(x) for x in a.batches.split(",")]:
        torch.cuda.reset_peak_memory_stats()
        timed_steps(model, sampler, device, b, 1)  # warm-up
        try:
            s = timed_steps(model, sampler, device, b, a.steps)
        except torch.cuda.OutOfMemoryError:
            print(f"batch {b}: out of memory", flush=True)
            break
        row = {"batch": b, "s_per_step": round(s, 4), "tok_per_s": round(b * 512 / s),
               "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
        results["text"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    vision = VisionJob(a.tokenizer, args, 128, 1, 0.5, workers=4)
    timed_steps(model, sampler, device, 64, 1, vision)
    s_both = timed_steps(model, sampler, device, 64, a.steps, vision)
    s_text = timed_steps(model, sampler, device, 64, a.steps)
    results["vision"] = {"text_batch": 64, "vision_batch": 128, "s_per_step_text_only": round(s_text, 4),
                         "s_per_step_with_images": round(s_both, 4)}
    print(json.dumps(results["vision"]), flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(model, sampler, device, 64, 1)
    events = prof.key_averages()
    cuda_top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:30]
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
    results["profile_batch"] = 64
    results["cuda_top"] = [{"name": e.key[:90], "calls": e.count, "self_cuda_ms": round(e.self_device_time_total / 1e3, 2)}
                           for e in cuda_top]
    results["cpu_top"] = [{"name": e.key[:90], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
                          for e in cpu_top]
    results["kernel_launches"] = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    results["syncs"] = {e.key: e.count for e in events if "Synchronize" in e.key or e.key == "aten::item"
                        or e.key == "aten::_local_scalar_dense"}
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
