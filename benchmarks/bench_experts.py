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
With --sweep, the launch configurations of SWEEP are timed at the SWEEP_T token counts after the cases,
each against the default in the same run (stages up and down alone, graph µs of the whole path), with
whether its output equals the default's bit for bit (dec16 decodes the same values; a weight tile of fewer
than 64 rows takes other matrix instructions on sm_90, whose sums may round differently).
Usage: python benchmarks/bench_experts.py [--json F] [--quick] [--sweep]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, graph_bench, print_table, record, set_quick, write_json

DEVICE = "cuda"  # a module constant so that a CPU smoke run (interpreter, tiny shapes) can change it

DIM, INTER, N_EXPERTS, TOPK, LIMIT = 5120, 2304, 384, 6, 10.0
T_LIST = (1, 16, 64, 512, 4096)
REF_MAX_T = 64
SWEEP_T = (64, 512, 4096)
# (name, overrides of experts.launch_config) against the default: dec16 = the FP4 weights decoded straight to bf16
# (False: through fp32, the default before h200-2026-12-02-h); BM rows per tile (one expert), BN output channels,
# BK the K step, w warps, s software-pipeline stages
SWEEP = (
    ("previous default (fp32 decode, BN64)", dict(BN=64, dec16=False)),
    ("BN64", dict(BN=64)),
    ("BN128", dict(BN=128)),
    ("BN256", dict(BN=256)),
    ("w4", dict(num_warps=4)),
    ("w8", dict(num_warps=8)),
    ("w4 s2", dict(num_warps=4, num_stages=2)),
    ("w4 s4", dict(num_warps=4, num_stages=4)),
    ("s2", dict(num_stages=2)),
    ("s4", dict(num_stages=4)),
    ("BK128", dict(BK=128)),
    ("BM32 BN128 w4", dict(BM=32, BN=128, num_warps=4)),
    ("BM64 BN128 w4", dict(BM=64, BN=128, num_warps=4)),
)


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


def routed_inputs(T: int, g: torch.Generator):
    """T tokens' activations, routing weights and top-TOPK expert indices (uniform routing)."""
    x = torch.randn(T, DIM, device=DEVICE, dtype=torch.bfloat16)
    idx = torch.rand(T, N_EXPERTS, device=DEVICE, generator=g).topk(TOPK, dim=-1).indices
    w = torch.rand(T, TOPK, device=DEVICE, generator=g)
    return x, w, idx


def run(json_path=None, quick=False, sweep=False):
    from dsv41.model.kernels import experts as ek
    from dsv41.model.kernels import reference

    ew = make_experts()
    per_expert = 3 * INTER * DIM * (1 / 2 + 1 / 32)
    rows = []
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for T in T_LIST:
        x, w, idx = routed_inputs(T, g)
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
    if sweep:
        rows += run_sweep(ew, g)
        write_json(json_path, "experts", rows)
    return rows


def run_sweep(ew, g) -> list[dict]:
    """SWEEP's configurations against the default at each of SWEEP_T, in this run: up and down alone (µs)
    and the whole path from a CUDA graph, each with its ratio to the default's."""
    from dsv41.model.kernels import experts as ek

    rows = []
    for T in SWEEP_T:
        x, w, idx = routed_inputs(T, g)
        base = None
        for name, over in (("default", {}),) + SWEEP:
            label = str(over)
            try:
                prep = ek.prepare(x, w, idx, ew, over)
                label = " ".join(f"{k}={v}" for k, v in prep["cfg"].items())  # the launch it runs
                h = ek.up(x, prep, ew, LIMIT)
                out = ek.down(h, prep, ew, x.dtype)
                y = ek.combine(out, prep)
                up_t = bench(lambda: ek.up(x, prep, ew, LIMIT))
                down_t = bench(lambda: ek.down(h, prep, ew, x.dtype))
                graph_t = graph_bench(lambda: ek.routed_experts(x, w, idx, ew, LIMIT, config=over))
            except Exception as e:  # a configuration the compiler refuses (shared memory, registers)
                print(f"  T={T} {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append({"kernel": "routed_experts_sweep", "case": f"T={T} {name}", "config": label,
                             "error": f"{type(e).__name__}: {str(e)[:500]}"})
                continue
            r = {"kernel": "routed_experts_sweep", "case": f"T={T} {name}", "config": label, "T": T,
                 "up_us": up_t * 1e6, "down_us": down_t * 1e6, "graph_us": graph_t * 1e6}
            if base is None:
                base = (r, y)
            else:
                r["same_values_as_default"] = bool(torch.equal(y, base[1]))
                r["up_over_default"] = r["up_us"] / base[0]["up_us"]
                r["down_over_default"] = r["down_us"] / base[0]["down_us"]
                r["graph_over_default"] = r["graph_us"] / base[0]["graph_us"]
            rows.append(r)
            print(f"  T={T:5d} {name:30s} up {r['up_us']:9.1f}  down {r['down_us']:9.1f}  graph {r['graph_us']:9.1f}"
                  + (f"  ({r['graph_over_default']:.3f} of default, same values: {r['same_values_as_default']})"
                     if "graph_over_default" in r else "  (default: " + label + ")"), flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    ap.add_argument("--sweep", action="store_true", help="time SWEEP's launch configurations against the default")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, a.quick, a.sweep)
