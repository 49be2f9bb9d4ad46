"""Where a prefill chunk of the V4.1-Flash-shaped stack spends its GPU time, by kernel (issue #24: "for every
target still missed, the measured cause"; the 32K stack prefill of bench_ced.py).

The 8-layer stack of benchmarks/flash_stack.py at full width (random weights) prefills `--tokens` tokens in
chunks of `--chunk` (CED `full`, the engine's chunked prefill, as bench_ced.py); one chunk is profiled with
torch.profiler after the others ran (Triton compiled, the cache holding the earlier chunks). Reported: the
GPU time of every kernel of that chunk, summed by kernel name and grouped into families (the model's Triton
kernels by name; cuBLAS GEMMs; torch's elementwise, reduction, copy, index and sort kernels), each with its
launches and share of the chunk's total GPU time, and the chunk's wall time.

Usage (GPU):  python benchmarks/profile_prefill.py --json F [--tokens 16384] [--chunk 4096] [--top 40]
      (CPU check, tiny widths): python benchmarks/profile_prefill.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_stack as fs  # noqa: E402
from dsv41.model.engine import Generator  # noqa: E402

# kernel name pattern -> family, first match wins (Triton kernels keep their Python names)
FAMILIES = (
    (r"^split_kernel|^split_combine_kernel|^tiles_kernel", "sparse attention (Triton)"),
    (r"^expert_up_kernel", "experts: up (Triton)"),
    (r"^expert_down_kernel", "experts: down (Triton)"),
    (r"^expert_combine_kernel", "experts: combine (Triton)"),
    (r"^gemm_kernel|^split_sum_kernel|^act_quant_kernel", "FP8/FP4 block GEMM (Triton)"),
    (r"^scores_kernel|^radix_pass_kernel|^radix_collect_kernel|^topk_finish_kernel", "indexer (Triton)"),
    (r"^residual_kernel|^coefficient_kernel", "mHC (Triton)"),
    (r"^pack_fp4_e4m3_kernel|^pack_fp8_ue8m0_kernel", "KV quantize-pack (Triton)"),
    (r"gemm|Gemm|cutlass|xmma|cublas|nvjet", "cuBLAS / CUTLASS GEMM"),
    (r"sort|Sort|radix|topk|TopK|scan|Scan", "torch sort / top-k / scan"),
    (r"gather|scatter|index|Index", "torch gather / scatter / index"),
    (r"reduce|Reduce|norm|Norm|softmax|Softmax", "torch reductions"),
    (r"copy|Copy|cat|Cat|memcpy|Memcpy|memset|Memset|fill|Fill", "torch copies / fills"),
    (r"elementwise|vectorized|unrolled|Elementwise", "torch elementwise"),
)


def family(name: str) -> str:
    for pattern, fam in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


@torch.inference_mode()
def profile_chunk(model, ids: torch.Tensor, chunk: int, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gen = Generator(model)
    gen.prefill(model.new_cache(1), ids[:, :chunk], chunk, ced="full")  # warm-up (Triton compilation)
    cache = model.new_cache(1)
    before = ids[:, :-chunk]
    if before.size(1):
        gen.prefill(cache, before, chunk, ced="full")
    fs.sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        gen.prefill(cache, ids[:, before.size(1):], chunk, ced="full")  # continues from cache.pos
        fs.sync(device)
        wall = time.perf_counter() - t0
    by_name = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if device == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = ev.time_range.elapsed_us()  # a kernel's own interval on the GPU
        else:
            if ev.cpu_parent is not None:  # top-level operators only on the CPU
                continue
            t = ev.self_cpu_time_total
        by_name[ev.name][0] += 1
        by_name[ev.name][1] += t
    total = sum(v[1] for v in by_name.values()) or 1.0
    kernels = sorted(({"name": n, "family": family(n), "launches": c, "ms": us / 1e3, "share": us / total}
                      for n, (c, us) in by_name.items()), key=lambda r: -r["ms"])
    fams = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        fams[k["family"]][0] += k["launches"]
        fams[k["family"]][1] += k["ms"]
    families = sorted(({"family": f, "launches": c, "ms": ms, "share": ms * 1e3 / total}
                       for f, (c, ms) in fams.items()), key=lambda r: -r["ms"])
    return {"chunk": chunk, "context_before": before.size(1), "wall_ms": wall * 1e3,
            "gpu_ms" if device == "cuda" else "cpu_ms": total / 1e3, "families": families, "kernels": kernels}


def run(json_path=None, device=None, tiny=False, tokens=None, chunk=None, top=40):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokens = tokens or (128 if tiny else 16384)
    chunk = chunk or (64 if tiny else 4096)
    args = fs.stack_args("tiny" if tiny else "v4.1-flash")
    model = fs.build(args, device)
    fs.sync(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab_size, (1, tokens), generator=g).to(device)
    r = profile_chunk(model, ids, chunk, device)
    unit = "gpu_ms" if device == "cuda" else "cpu_ms"
    print(f"\n== one {chunk}-token prefill chunk after {r['context_before']} tokens ({args.name}): wall "
          f"{r['wall_ms']:.1f} ms, {unit.split('_')[0].upper()} time {r[unit]:.1f} ms")
    print(f"{'family':40s} {'launches':>9s} {'ms':>9s} {'share':>7s}")
    for f in r["families"]:
        print(f"{f['family']:40s} {f['launches']:9d} {f['ms']:9.2f} {100 * f['share']:6.1f}%")
    print(f"\n{'kernel':80s} {'launches':>9s} {'ms':>9s} {'share':>7s}")
    for k in r["kernels"][:top]:
        print(f"{k['name'][:80]:80s} {k['launches']:9d} {k['ms']:9.2f} {100 * k['share']:6.1f}%")
    if json_path:
        from kernels_common import write_record

        write_record(json_path, {"benchmark": "profile_prefill", "config": args.name, "tokens": tokens,
                                 "omitted": fs.OMITTED, **r})
    return r


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--device")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU check of the code path)")
    ap.add_argument("--tokens", type=int, help="prompt tokens; the last chunk is profiled (default 16384)")
    ap.add_argument("--chunk", type=int, help="prefill chunk (default 4096)")
    ap.add_argument("--top", type=int, default=40, help="kernels listed")
    a = ap.parse_args()
    run(a.json, a.device, a.tiny, a.tokens, a.chunk, a.top)
