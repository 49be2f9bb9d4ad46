"""Single-pass mHC step at V4.1-Flash width (n = 4 streams, d = 5120), bf16 residual.

bytes (floor) per step = M * (X read 2nd + y read 2d + X' written 2nd + collapse written 2d + coefficients
(n + n + n n) * 4 * 2) + W_fn once (24 * n d * 4); FLOPs = 2 * 24 * n d * M (the projection).
Compared with the torch path (model/mhc.py functions, as Block.mix runs them). Each row records the residual
kernel's tiling (mhc.launch_config: tokens x channels per step, channel blocks per program, grid).
Schedules of the residual kernel (mhc.TUNE: tile, warps, stream tiles loaded once) are replayed from CUDA
graphs at 4096 and 16384 tokens (from --sweep-min on) against the default in the same run ("sweep" rows,
graph_us, graph_x_floor), each checked against the torch reference (max_rel_err: the largest relative error over
X', the collapse and the coefficients). --sweep-set old: only the previous default (mhc.OLD_DEFAULT) beside the default; all: every
schedule of SWEEP too; xonce: OLD_DEFAULT and XONCE_SWEEP (x_once tiles, warps, stages and residual-kernel
programs per SM around the default); ranges: the channel ranges by the rule before h200-2026-12-04 (mhc.RANGE_RULE
"fill") beside the default ("waves"). --repeat R times the sweep R times in one run (rows of pass r > 1 end in
"#r"); each pass times the default first and again last ("default (end)"), so the spread of one schedule within
the run is in the output.
Usage: python benchmarks/bench_mhc.py [--json F] [--quick] [--no-sweep] [--sweep-set all|old|xonce|ranges]
       [--repeat R] [--sweep-min M] [--tokens M ...] [--no-ref]
"""

from __future__ import annotations

import argparse

import torch

from kernels_common import bench, graph_bench, print_table, record, set_quick, write_json

N_S, DIM = 4, 5120


# Each entry complete (tile, warps, x_once), so it names the same schedule whatever the default is.
SWEEP = [dict(tile=(64, 16, 2), num_warps=4, x_once=False),          # the default before 64 x 32
         dict(tile=(64, 16, 2), num_warps=4, x_once=True),           # the x_once fallback where d % 64 != 0
         dict(tile=(64, 32, 2), num_warps=4, x_once=True),
         dict(tile=(64, 32, 3), num_warps=4, x_once=True),
         dict(tile=(128, 32, 2), num_warps=8, x_once=True),
         dict(tile=(64, 64, 2), num_warps=8, x_once=True)]
# x_once tiles, warps, stages, and "per_sm" (not a TUNE key: the residual-kernel programs per SM that
# mhc._target_programs aims for, 4 in the model; the bench patches it for that row only), issue #24's remaining
# levers after h200-2026-12-02-f. The first row is the default of -f (32 x 64, 2 stages, 4 warps); the rows after it
# up to per_sm=8 are those of h200-2026-12-02-g's first run, the rest its second (around 16 x 64, the default since).
XONCE_SWEEP = [dict(tile=(32, 64, 2), num_warps=4, x_once=True),
               dict(tile=(32, 64, 2), num_warps=2, x_once=True),
               dict(tile=(32, 64, 2), num_warps=8, x_once=True),
               dict(tile=(32, 64, 1), num_warps=4, x_once=True),
               dict(tile=(32, 64, 3), num_warps=4, x_once=True),
               dict(tile=(16, 64, 2), num_warps=2, x_once=True),
               dict(tile=(16, 64, 2), num_warps=4, x_once=True),
               dict(tile=(16, 64, 3), num_warps=4, x_once=True),
               dict(tile=(16, 128, 2), num_warps=4, x_once=True),
               dict(tile=(32, 128, 2), num_warps=4, x_once=True),
               dict(tile=(32, 128, 2), num_warps=8, x_once=True),
               dict(tile=(64, 64, 2), num_warps=4, x_once=True),
               dict(tile=(64, 64, 2), num_warps=8, x_once=True),
               dict(tile=(32, 64, 2), num_warps=4, x_once=True, per_sm=2),
               dict(tile=(32, 64, 2), num_warps=4, x_once=True, per_sm=8),
               dict(tile=(16, 64, 2), num_warps=1, x_once=True),
               dict(tile=(16, 64, 3), num_warps=2, x_once=True),
               dict(tile=(16, 64, 4), num_warps=2, x_once=True),
               dict(tile=(16, 32, 2), num_warps=2, x_once=True),
               dict(tile=(16, 128, 2), num_warps=2, x_once=True),
               dict(tile=(16, 128, 3), num_warps=4, x_once=True),
               dict(tile=(32, 64, 4), num_warps=4, x_once=True),
               dict(tile=(16, 64, 2), num_warps=2, x_once=True, per_sm=8),
               dict(tile=(16, 64, 2), num_warps=2, x_once=True, per_sm=16),
               dict(tile=(16, 64, 2), num_warps=4, x_once=True, per_sm=8),
               dict(tile=(32, 64, 3), num_warps=4, x_once=True, per_sm=8)]


# The residual kernel's channel ranges by the rule before h200-2026-12-04 ("fill": as many ranges as fill the
# machine, whatever waves they make) against the default ("waves"), same tile.
RANGES_SWEEP = [dict(ranges="fill")]


def _rel_err(out, ref) -> float:
    """The largest relative error (Frobenius) over the step's five outputs."""
    return max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(out, ref))


def run(json_path=None, do_sweep=True, sweep_set="all", tokens=(1, 64, 4096, 16384), with_ref=True, repeat=1,
        sweep_min=4096):
    from dsv41.model.kernels import mhc, reference
    from dsv41.model.kernels.mhc import launch_config, mhc_step

    sweep = {"old": [mhc.OLD_DEFAULT], "all": [mhc.OLD_DEFAULT] + SWEEP,
             "xonce": [mhc.OLD_DEFAULT] + XONCE_SWEEP, "ranges": RANGES_SWEEP}[sweep_set]
    rows = []
    n_mix = (N_S + 2) * N_S
    fn = torch.randn(n_mix, N_S * DIM, device="cuda") * (N_S * DIM) ** -0.5
    scale, base = torch.rand(3, device="cuda"), torch.randn(n_mix, device="cuda") * 0.1
    target_programs, range_rule = mhc._target_programs, mhc.RANGE_RULE
    for M in tokens:
        x = torch.randn(M, 1, N_S, DIM, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(M, 1, DIM, device="cuda", dtype=torch.bfloat16)
        pre = torch.rand(M, 1, N_S, device="cuda")
        post = torch.rand(M, 1, N_S, device="cuda")
        comb = torch.rand(M, 1, N_S, N_S, device="cuda")
        args = (x, pre, fn, scale, base, 20, 1e-6, 1e-6, y, post, comb)
        bytes_ = M * (2 * N_S * DIM * 2 + 2 * DIM * 2 + (2 * N_S + N_S * N_S) * 4 * 2) + n_mix * N_S * DIM * 4
        flops = 2 * n_mix * N_S * DIM * M
        ref = reference.mhc_step(*args)
        t = bench(lambda: mhc_step(*args))
        g = graph_bench(lambda: mhc_step(*args))
        extra = dict(torch_ref_us=bench(lambda: reference.mhc_step(*args), rep_ms=50) * 1e6) if with_ref else {}
        rows.append(record("mhc_step", f"M={M} tokens", t, bytes_, flops, graph_us=g * 1e6, **extra,
                           max_rel_err=_rel_err(mhc_step(*args), ref), tune=dict(mhc.TUNE),
                           launch=launch_config(M, DIM, x.device)))
        if do_sweep and M >= sweep_min:
            saved = dict(mhc.TUNE)
            for r in range(repeat):
                schedules = [{}] + sweep + [{}]
                for i, change in enumerate(schedules):
                    change = dict(change)
                    per_sm = change.pop("per_sm", None)
                    mhc.RANGE_RULE = change.pop("ranges", range_rule)
                    mhc.TUNE.update(saved, **change)
                    if per_sm:
                        mhc._target_programs = lambda device, k=per_sm: (
                            k * torch.cuda.get_device_properties(device).multi_processor_count)
                    try:
                        g = graph_bench(lambda: mhc_step(*args))
                        name = ("default" if i == 0 else "default (end)" if i == len(schedules) - 1
                                else "old default" if change == mhc.OLD_DEFAULT
                                else f"ranges={mhc.RANGE_RULE}" if mhc.RANGE_RULE != range_rule
                                else dict(change, per_sm=per_sm) if per_sm else change)
                        rows.append(record("mhc_sweep", f"sweep M={M} {name}{f' #{r + 1}' if r else ''}", g, bytes_,
                                           flops, graph_us=g * 1e6, max_rel_err=_rel_err(mhc_step(*args), ref),
                                           tune=dict(mhc.TUNE), per_sm=per_sm or 4,
                                           launch=launch_config(M, DIM, x.device)))
                    except Exception as e:  # a schedule that does not compile or fit: keep the others
                        print(f"!! sweep {change} per_sm={per_sm}: {type(e).__name__}: {e}")
                    finally:
                        mhc._target_programs = target_programs
                        mhc.RANGE_RULE = range_rule
            mhc.TUNE.clear()
            mhc.TUNE.update(saved)
    for r in rows:
        r["graph_x_floor"] = r["graph_us"] / r["floor_us"]
    print_table(rows, "single-pass mHC (n=4, d=5120, bf16 residual)")
    write_json(json_path, "mhc", rows)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="short timing windows (one short GPU run)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the residual kernel's schedule sweep")
    ap.add_argument("--sweep-set", choices=("all", "old", "xonce", "ranges"), default="all",
                    help="old: only the previous default (mhc.OLD_DEFAULT) beside the default; all: SWEEP too; "
                         "xonce: XONCE_SWEEP (x_once tiles, warps, stages, programs per SM) beside OLD_DEFAULT")
    ap.add_argument("--repeat", type=int, default=1, help="time the sweep this many times in the run")
    ap.add_argument("--sweep-min", type=int, default=4096, help="sweep at token counts from this one on")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096, 16384], help="token counts (M)")
    ap.add_argument("--no-ref", action="store_true", help="do not time the torch path")
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, not a.no_sweep, a.sweep_set, a.tokens, not a.no_ref, a.repeat, a.sweep_min)
