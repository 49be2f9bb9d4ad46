"""The weight-streaming products of one decode step (one token) at V4.1-Flash shapes, and their launch
configurations (issue #21: the engine's decode step within 5x of its bytes floor at 128K).

A profile of the 8-layer stack's step at 128K (`bench_flash_layers.py --engine-only --profile 3`,
h200-2026-12-05-b) put most of its GPU time in these products, far from their bytes: the FP8 projections'
GEMMs, the routed experts' up and down kernels, and the head's fp32 GEMV. Each case here is one of them alone,
timed as a decode step runs it (cold_graph: one CUDA graph of calls on different weights, far more than the L2
cache holds, so every call reads its weights from HBM and no host time counts), against its floor (the bytes
it must read over the copy ceiling measured in this run):

* fp8 N x K: model/kernels/gemm.py fp8_block_gemm at M = 1, for each FP8 projection of a Flash layer (wq_a,
  wq_b, wkv, wo_b, the shared expert's w1 / w3 / w2, the indexer's wq_b); bytes N K + N K / 32^2 scales.
* experts up / down / all: model/kernels/experts.py at T = 1 (top-6 of 384 FP4 experts, bench_experts'
  weights, another routing each call): the up stage (w1, w3 of 6 experts), the down stage (w2 of 6), and
  the whole path (routing, up, down, combine); bytes the 6 experts' packed weights and scales.
* head: the vocabulary projection of one row, fp32 logits: F.linear on the weight widened to fp32 (what
  Head does on CUDA) against a bf16 x bf16 GEMM with fp32 output (the same exact products, another fp32
  summation order), with the largest difference between the two.

With --sweep, launch configurations (tile rows BN, K step BK, K split as programs per SM, warps, stages; for
the FP8 projections also the one-token GEMV variant, for the experts their split K ranges) are timed against
the default in the same run, each with the largest difference of its output from the default's (0 where the
same bits), and the fastest variant of each product is listed last.

Usage (GPU): python benchmarks/bench_decode_gemms.py [--json F] [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import traceback

import torch

from kernels_common import graph_bench, print_table, record, set_quick, write_json

DIM = 5120
# (name, N, K): the FP8 projections of a V4.1-Flash layer (attention, shared expert, indexer)
FP8_SHAPES = (("wq_a", 1280, DIM), ("wq_b", 32768, 1280), ("wkv", 512, DIM), ("wo_b", DIM, 8192),
              ("shared w1/w3", 2304, DIM), ("shared w2", DIM, 2304), ("indexer wq_b", 4096, 1280))
VOCAB = 129280
DEVICE = "cuda"  # module constants, so that benchmarks/smoke_cpu.py can run the script at tiny shapes on the CPU
BLOCK = 32  # V4.1's FP8 weight blocks (32 x 32) and activation groups
COLD_BYTES = 256 << 20  # weights per timed graph: five times the H200's L2 cache
EXPERT_CALLS = 16  # routings per timed graph (6 of 384 experts each)


def fp8_configs(N: int, K: int) -> list[tuple[str, dict]]:
    """Tile rows x K step x programs per SM (the K split that gives about that many), 4 warps; a few warps /
    stages variants; and the one-token kernel without matrix units (gemm.launch_config's `gemv`)."""
    from dsv41.model.kernels.gemm import k_split

    def split(BN, BK, per_sm):  # gemm.launch_config's rule at another target
        return k_split(-(-N // BN), -(-K // BK), per_sm, torch.device(DEVICE))

    out = []
    for BN, BK, per_sm in itertools.product((16, 32, 64), (128, 256), (2, 8)):
        if -(-K // BK) >= 2:
            out.append((f"BN{BN} BK{BK} {per_sm}/SM", dict(BN=BN, BK=BK, split=split(BN, BK, per_sm))))
    for BN, BK, per_sm in ((16, 256, 4), (32, 256, 4), (64, 128, 2)):
        for w, s in ((2, 4), (4, 2), (4, 6), (8, 4)):
            out.append((f"BN{BN} BK{BK} {per_sm}/SM w{w} s{s}", dict(BN=BN, BK=BK, split=split(BN, BK, per_sm),
                                                                    num_warps=w, num_stages=s)))
    for BN, BK, per_sm in itertools.product((8, 16, 32), (256, 512), (4, 16)):  # GEMV: no matrix units
        out.append((f"gemv BN{BN} BK{BK} {per_sm}/SM", dict(gemv=True, BN=BN, BK=BK, split=split(BN, BK, per_sm))))
    seen, unique = set(), []
    for name, cfg in out:  # per_sm values that give the same split are one launch
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            unique.append((name, cfg))
    return unique


# K ranges of up / down (split_up, split_down) at the default tiles (BN 64, BK 64), and at BN 32 / BK 128; the
# up kernel quantizes its output in groups of the activation block (32) within its BN channels: BN >= 32
EXPERT_CONFIGS = [(f"split {su}/{sd}", dict(split_up=su, split_down=sd))
                  for su, sd in ((1, 1), (2, 2), (3, 2), (4, 3), (6, 4), (8, 6), (12, 8))]
EXPERT_CONFIGS += [(f"BN{BN} BK{BK} split {su}/{sd}", dict(BN=BN, BK=BK, split_up=su, split_down=sd))
                   for BN, BK, su, sd in ((32, 64, 2, 2), (32, 128, 2, 2), (64, 128, 4, 3), (32, 64, 4, 3))]
EXPERT_CONFIGS += [(f"split {su}/{sd} w{w} s{s}", dict(split_up=su, split_down=sd, num_warps=w, num_stages=s))
                   for su, sd, w, s in ((4, 3, 2, 3), (4, 3, 4, 4), (4, 3, 8, 3), (4, 3, 4, 2))]


def cold_graph(fns) -> float:
    """Seconds per call of fns (callables reading different weights, together far more than the L2 cache)
    captured in order into one CUDA graph (kernels_common.graph_bench): each call's weights come from HBM, as
    in a decode step, and no host work or launch cost is timed."""
    return graph_bench(lambda: [f() for f in fns]) / len(fns)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:  # e.g. the down stage split (fp32 partial sums) against unsplit
        return float("nan")
    return float((a.float() - b.float()).abs().max())


def _sweep(rows, kernel, case, make_calls, configs, base_t, base_out) -> None:
    """Time make_calls(config) (cold_graph) for each configuration against the default (base_t, base_out:
    the default's time and its first call's output)."""
    for name, cfg in configs:
        try:
            calls = make_calls(cfg)
            y = calls[0]()
            t = cold_graph(calls)
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses: a row with the reason
            rows.append({"kernel": kernel, "case": f"{case} {name}", "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {case} {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        rows.append({"kernel": kernel, "case": f"{case} {name}", "group": case, "variant": name, "config": cfg,
                     "us": t * 1e6, "over_default": t / base_t, "max_diff_from_default": _diff(y, base_out)})
        print(f"  {case:22s} {name:30s} {t * 1e6:8.2f} us  {t / base_t:6.3f} of default  "
              f"diff {rows[-1]['max_diff_from_default']:.3g}", flush=True)


def fp8_cases(rows, sweep: bool, save=lambda: None) -> None:
    from dsv41.model.kernels import gemm

    g = torch.Generator(device=DEVICE).manual_seed(0)
    for name, N, K in FP8_SHAPES:
        x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
        nbytes = N * K + -(-N // BLOCK) * -(-K // BLOCK)
        copies = max(4, min(64, -(-COLD_BYTES // nbytes)))
        ws = [((torch.randn(N, K, device=DEVICE, generator=g) * 0.5).to(torch.float8_e4m3fn),
               torch.randint(120, 128, (-(-N // BLOCK), -(-K // BLOCK)), device=DEVICE, dtype=torch.uint8,
                             generator=g).view(torch.float8_e8m0fnu)) for _ in range(copies)]

        def calls(cfg=None):
            return [lambda w=w, s=s: gemm.fp8_block_gemm(x, w, s, BLOCK, config=cfg) for w, s in ws]

        y = calls()[0]()
        t = cold_graph(calls())
        cfg = gemm.launch_config(1, N, K, BLOCK, BLOCK, x.device)
        rows.append(record("decode_fp8_gemm", f"fp8 {name} {N}x{K}", t, nbytes + 2 * K + 2 * N, 2 * N * K,
                           default=f"BN{cfg['BN']} BK{cfg['BK']} split{cfg['split']}", copies=copies))
        print(f"  {rows[-1]['case']}: {t * 1e6:.2f} us, {rows[-1]['x_floor']:.2f}x floor", flush=True)
        if sweep:
            _sweep(rows, "decode_fp8_gemm_sweep", f"fp8 {name}", calls, fp8_configs(N, K), t, y)
        save()  # after every shape: a time limit later keeps these


def expert_cases(rows, sweep: bool) -> None:
    import bench_experts as be

    from dsv41.model.kernels import experts as ek

    ew = be.make_experts()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    inputs = [be.routed_inputs(1, g) for _ in range(EXPERT_CALLS)]  # other experts each call: cold weights
    per_mat = be.INTER * be.DIM * (1 / 2 + 1 / 32)
    k = be.TOPK

    def stage_calls(stage, cfg=None):
        out = []
        for x, w, idx in inputs:
            prep = ek.prepare(x, w, idx, ew, cfg)
            if stage == "up":
                out.append(lambda x=x, prep=prep: ek.up(x, prep, ew, be.LIMIT))
            elif stage == "down":  # the up stage's output, computed once outside the timed call
                h = ek.up(x, prep, ew, be.LIMIT)
                out.append(lambda h=h, prep=prep, x=x: ek.down(h, prep, ew, x.dtype))
            else:  # the whole path: routing, up, down, combine
                out.append(lambda x=x, w=w, idx=idx: ek.routed_experts(x, w, idx, ew, be.LIMIT, config=cfg))
        return out

    for stage, mats in (("up", 2), ("down", 1), ("all", 3)):
        calls = stage_calls(stage)
        y = calls[0]()
        t = cold_graph(calls)
        cfg = ek.prepare(*inputs[0], ew)["cfg"]
        rows.append(record("decode_experts", f"experts {stage} T=1", t, k * mats * per_mat,
                           2 * k * mats * be.DIM * be.INTER,
                           default=str({kk: cfg[kk] for kk in ("BM", "BN", "BK", "split_up", "split_down",
                                                               "num_warps", "num_stages")})))
        print(f"  {rows[-1]['case']}: {t * 1e6:.2f} us, {rows[-1]['x_floor']:.2f}x floor", flush=True)
        if sweep:
            _sweep(rows, "decode_experts_sweep", f"experts {stage}", lambda cfg, stage=stage: stage_calls(stage, cfg),
                   EXPERT_CONFIGS, t, y)


def head_cases(rows) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = (torch.randn(VOCAB, DIM, device=DEVICE, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, DIM, device=DEVICE, generator=g).to(torch.bfloat16)
    w32 = w.float()
    fp32 = lambda: torch.nn.functional.linear(x.float(), w32)  # noqa: E731
    bf16 = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)  # noqa: E731
    a, b = fp32(), bf16()
    for name, fn, nbytes in (("head fp32 weight (F.linear)", fp32, 4 * VOCAB * DIM),
                             ("head bf16 weight, fp32 out", bf16, 2 * VOCAB * DIM)):
        t = cold_graph([fn, fn])  # 1.3 / 2.6 GB: far more than the L2 cache
        # the floor is the bf16 weight's bytes for both: what the head must read
        rows.append(record("decode_head", name, t, 2 * VOCAB * DIM, 2 * VOCAB * DIM, bytes_read=nbytes,
                           max_diff_between=_diff(a, b), max_abs_logit=float(a.abs().max())))
        print(f"  {name}: {t * 1e6:.2f} us, {rows[-1]['x_floor']:.2f}x floor; max diff {_diff(a, b):.3g}", flush=True)


def run(json_path=None, sweep=False, only=("fp8", "experts", "head")):
    rows: list[dict] = []
    save = lambda: write_json(json_path, "decode_gemms", rows)  # noqa: E731
    for part, fn in (("head", lambda: head_cases(rows)), ("experts", lambda: expert_cases(rows, sweep)),
                     ("fp8", lambda: fp8_cases(rows, sweep, save))):
        if part not in only:
            continue
        try:
            fn()
        except Exception:  # one failing part keeps the others
            traceback.print_exc()
        save()
    print_table([r for r in rows if "floor_us" in r],
                "a decode step's products at one token (cold weights, from CUDA graphs)")
    if sweep:
        best = best_variants(rows)
        rows += best
        save()
        print("\n== the fastest variant of each product, its time over the default's in this run "
              "(above 1: keep the default)")
        for b in best:
            print(f"  {b['group']:24s} {b['variant']:34s} {b['over_default']:6.3f}  {b['config']}")
    return rows


def best_variants(rows: list[dict]) -> list[dict]:
    """Per swept product, its fastest variant (rows with a time, none that failed): what a launch rule could
    take, with its ratio to the default and its largest difference from the default's output."""
    groups: dict[str, dict] = {}
    for r in rows:
        if "group" in r and "us" in r and (r["group"] not in groups or r["us"] < groups[r["group"]]["us"]):
            groups[r["group"]] = r
    return [{"kernel": "decode_best", "case": f"best {g}", "group": g, "variant": r["variant"], "config": r["config"],
             "us": r["us"], "over_default": r["over_default"], "max_diff_from_default": r["max_diff_from_default"]}
            for g, r in groups.items()]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", nargs="*", default=["fp8", "experts", "head"])
    a = ap.parse_args()
    set_quick(a.quick)
    run(a.json, a.sweep, tuple(a.only))
