"""The routed experts of one MoE layer (model/kernels/experts.py) at V4.1-Flash shapes: 384 experts of
dim 5120 -> 2304 -> 5120 in packed FP4 (E2M1 + one UE8M0 per 32), top-6 routing, bf16 activations.

T tokens routed uniformly at random (R = 6 T rows); A = the experts that receive at least one token.
    bytes (floor) = A * 3 * 2304 * 5120 * (1/2 + 1/32) (the active experts' weights and scales, read once)
                    + 2 T 5120 (x) + 4 T 5120 (y, fp32);      FLOPs = 2 R * 3 * 5120 * 2304.
Cases: decode T = 1, 16, 64 (a few rows per expert, bound by the weight bytes) and prefill T = 512, 4096
(~64 rows per expert at 4096). Each case also times
  * graph_us: the whole path replayed from a CUDA graph (GPU time without the launch cost; the capture
    itself checks that the path never synchronises with the host),
  * stage_us: routing + activation quantization, up (w1, w3, SwiGLU), down (w2), combine, each alone,
  * ref_us (T <= 64): the reference, MoE.routed's loop over experts with the weights dequantized per call.
Usage: python benchmarks/bench_experts.py [--json F] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, graph_bench, print_table, record, set_quick, write_json

DEVICE = "cuda"  # a module constant so that a CPU smoke run (interpreter, tiny shapes) can change it

DIM, INTER, N_EXPERTS, TOPK, LIMIT = 5120, 2304, 384, 6, 10.0
T_LIST = (1, 16, 64, 512, 4096)
REF_MAX_T = 64


def make_experts(device=None):
    """384 experts' stored tensors, each its own allocation as a checkpoint loads them."""
    from dsv41.model.kernels.experts import ExpertWeights

    device = device or DEVICE
    lists = {n: [] for n in ("w1", "s1", "w3", "s3", "w2", "s2")}
    for _ in range(N_EXPERTS):
        for name, (n_out, n_in) in (("1", (INTER, DIM)), ("3", (INTER, DIM)), ("2", (DIM, INTER))):
            lists["w" + name].append(torch.randint(-128, 128, (n_out, n_in // 2), dtype=torch.int8, device=device))
            lists["s" + name].append(torch.randint(120, 128, (n_out, n_in // 32), dtype=torch.uint8,
                                                   device=device).view(torch.float8_e8m0fnu))
    return ExpertWeights("fp4", 32, DIM, INTER, **lists)


def run(json_path=None, quick=False):
    from dsv41.model.kernels import experts as ek
    from dsv41.model.kernels import reference

    ew = make_experts()
    per_expert = 3 * INTER * DIM * (1 / 2 + 1 / 32)
    rows = []
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for T in T_LIST:
        x = torch.randn(T, DIM, device=DEVICE, dtype=torch.bfloat16)
        idx = torch.rand(T, N_EXPERTS, device=DEVICE, generator=g).topk(TOPK, dim=-1).indices
        w = torch.rand(T, TOPK, device=DEVICE, generator=g)
        active = int(torch.unique(idx).numel())
        call = lambda: ek.routed_experts(x, w, idx, ew, LIMIT)  # noqa: E731
        t = bench(call)
        extra = {"active_experts": active, "rows_per_active": T * TOPK / active,
                 "graph_us": graph_bench(call) * 1e6}
        prep = ek.prepare(x, w, idx, ew)
        h = ek.up(x, prep, ew, LIMIT)
        out = ek.down(h, prep, ew, x.dtype)
        extra["stage_us"] = " / ".join(f"{bench(f) * 1e6:.1f}" for f in (
            lambda: ek.prepare(x, w, idx, ew), lambda: ek.up(x, prep, ew, LIMIT),
            lambda: ek.down(h, prep, ew, x.dtype), lambda: ek.combine(out, prep)))
        extra["BM"] = prep["cfg"]["BM"]
        if T <= REF_MAX_T:
            extra["ref_us"] = bench(lambda: reference.routed_experts(x, w, idx, ew, LIMIT), warmup_ms=1,
                                    rep_ms=50) * 1e6
        nbytes = active * per_expert + 2 * T * DIM + 4 * T * DIM
        flops = 2 * T * TOPK * 3 * DIM * INTER
        rows.append(record("routed_experts", f"T={T} ({'decode' if T <= 64 else 'prefill'})", t, nbytes, flops,
                           **extra))
        print(f"  {rows[-1]['case']}: {t * 1e6:.1f} us", flush=True)
    print_table(rows, "routed experts, FP4 (384 x 5120->2304->5120, top-6); stage_us = route / up / down / combine")
    write_json(json_path, "experts", rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, a.quick)
