"""Decode step and prefill of V4.1-Flash layers at full width with random weights (issue #9, item 5), on
the 8-layer stack of benchmarks/flash_stack.py (one layer of each CSA2 role per CED part; no Engram, no
DSpark), batch 1, at 8K, 128K and 1M context.

Cases:
- "prefill T from empty": one forward of a T-token prompt into an empty cache (T = --prefill-tokens,
  8K by default), warm-up run of the same shape first.
- "decode at ctx N": the cache holds N - steps tokens (fill_cache: random packed entries, as if consumed),
  then --warmup untimed and --steps timed one-token steps (wall clock between two synchronizations,
  mean per step); the context reaches N.
- "engine decode step at ctx N (eager | CUDA graph)": the engine's decode step (Transformer.decode over a
  BatchCache row loaded from the same filled cache), eager, and on CUDA replayed from a CUDA graph
  (model/engine.py GraphedDecode); --engine-only runs these cases alone. --profile S adds, after every other
  case, the eager step once more with S steps under torch.profiler: the kernels a step runs (those its CUDA
  graph replays), their count and device time per step, the 40 largest by device time.
- "prefill chunk C at ctx N": the next C tokens appended to a cache of N - C tokens (the marginal cost of
  prefilling at that depth; a whole 128K or 1M prompt would take far longer than a 10-minute run),
  after one untimed chunk of the same size. C = --chunk (256: at 1M the indexer's [C, 32 heads, 1M]
  bf16 score tensor takes 16 GB, twice while it is weighted).

Each row: time, tokens/s, the roofline floor of flash_stack.work (bytes and FLOPs counted there) over the
copy and matmul ceilings measured in this run, x floor, the per-layer times (CUDA events around each
block), and an estimate for all 40 layers composed from the per-layer times (flash_stack.compose_flash).

Usage (GPU):  python benchmarks/bench_flash_layers.py --json F [--quick]
      (CPU check of the code paths, tiny widths): python benchmarks/bench_flash_layers.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_stack as fs  # noqa: E402


def _ids(model, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.args.vocab_size, (1, n), generator=g).to(model.embed.weight.device)


def _layer_ms(timer: fs.LayerTimer, divide: int = 1) -> dict[str, float]:
    return {f"{i} {fs.REPRESENTS[i]}": t * 1e3 / divide for i, t in sorted(timer.seconds().items())}


def _finish(model, case: str, seconds: float, tokens: int, start: int, timer: fs.LayerTimer, divide: int,
            cuda: bool, **extra) -> dict:
    b, f = fs.work(model, start, tokens)
    per_layer = {i: t / divide for i, t in timer.seconds().items()}
    comp = fs.compose_flash(per_layer, seconds)
    return fs.row(case, seconds, b, f, cuda, tokens=tokens, tokens_per_s=tokens / seconds,
                  layer_ms=_layer_ms(timer, divide),
                  estimate_40_layers_ms=comp["estimate_40_layers_s"] * 1e3,
                  estimate_40_layers_tokens_per_s=tokens / comp["estimate_40_layers_s"], **extra, **fs.memory_note())


@torch.inference_mode()
def prefill_from_empty(model, tokens: int, cuda: bool) -> dict:
    ids = _ids(model, tokens, 0)
    model(ids, 0, model.new_cache(1))  # warm-up: the same shape (Triton compilation, allocator)
    cache = model.new_cache(1)
    dt, timer = fs.timed(model, lambda: model(ids, 0, cache))
    return _finish(model, f"prefill {fs.context_label(tokens)} from empty", dt, tokens, 0, timer, 1, cuda)


@torch.inference_mode()
def decode_at(model, ctx: int, steps: int, warmup: int, cuda: bool) -> dict:
    start = ctx - steps - warmup
    cache = fs.fill_cache(model, start)
    ids = _ids(model, steps + warmup, ctx)
    for i in range(warmup):
        model(ids[:, i:i + 1], cache.pos, cache)

    def decode_steps():
        for i in range(warmup, warmup + steps):
            model(ids[:, i:i + 1], cache.pos, cache)

    dt, timer = fs.timed(model, decode_steps)
    dt /= steps
    return _finish(model, f"decode step at ctx {fs.context_label(ctx)}", dt, 1, ctx - 1, timer, steps, cuda,
                   steps=steps)


@torch.inference_mode()
def kernel_profile(step, ids: torch.Tensor) -> dict:
    """The GPU kernels of len(ids) eager decode steps under torch.profiler (the kernels the step's CUDA graph
    replays): per step, the kernels' count, the sum of their device times, and the 40 kernels of largest total
    device time. The sum against the graph step's time says how much of a step is the kernels themselves and
    how much the gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(len(ids)):
            step(ids[i:i + 1])
        torch.cuda.synchronize()
    n = len(ids)
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels.setdefault(e.name, []).append(e.device_time_total)
    rows = sorted(((k, len(v) / n, sum(v) / n) for k, v in kernels.items()), key=lambda r: -r[2])
    return {"profiled_steps": n, "kernels_per_step": round(sum(r[1] for r in rows), 1),
            "kernel_us_per_step": round(sum(r[2] for r in rows), 1),
            "top_kernels": [{"name": k[:120], "per_step": round(c, 2), "us_per_step": round(t, 1)}
                            for k, c, t in rows[:40]]}


@torch.inference_mode()  # as the engine runs: without it the MoE takes the reference loop (its kernels want no grad)
def engine_decode_at(model, ctx: int, steps: int, warmup: int, cuda: bool, graphs: bool,
                     compiled: bool = False, profile_steps: int = 0) -> dict:
    """The engine's decode step (Transformer.decode over a BatchCache row, model/batch_cache.py) at ctx, one
    sequence: eagerly, or replayed from a CUDA graph (model/engine.py GraphedDecode). No per-layer times
    (a graph replays as one launch). profile_steps > 0 (CUDA): that many more steps under the profiler
    (kernel_profile), after the timed ones."""
    from dsv41.model.engine import GraphedDecode

    profile_steps = profile_steps if cuda else 0
    start = ctx - steps - warmup - profile_steps
    kv = fs.fill_cache(model, start, spare=0)
    cache = model.new_batch_cache(1, ctx + 1)
    if graphs:
        step = GraphedDecode(model, cache, compiled=compiled)
    else:
        step = lambda ids: model.decode(ids, cache)  # noqa: E731
    cache.reserve(ctx + 1)
    cache.load(0, kv)
    del kv
    ids = _ids(model, steps + warmup + profile_steps, ctx)[0]
    for i in range(warmup):
        step(ids[i:i + 1])
    fs.sync(model.embed.weight.device)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        logits = step(ids[i:i + 1])
    fs.sync(model.embed.weight.device)
    dt = (time.perf_counter() - t0) / steps
    prof = kernel_profile(step, ids[warmup + steps:]) if profile_steps else {}
    # the last timed step's logits (the same cache and inputs in every mode): top tokens and a few values, so that
    # the modes of one run can be compared
    top = logits[0].float().topk(5)
    extra_out = {"last_top5_ids": top.indices.tolist(), "last_top5_logits": [round(v, 4) for v in top.values.tolist()],
                 "last_logits_abs_mean": round(float(logits[0].float().abs().mean()), 6)}
    b, f = fs.work(model, ctx - 1, 1)
    extra = {"graph_replays": step.replays, "graphs_captured": step.captured, "graph_failed": step.failed} \
        if graphs else {}
    mode = ("CUDA graph of the compiled step" if compiled else "CUDA graph") if graphs else \
        ("eager, then profiled" if profile_steps else "eager")
    return fs.row(f"engine decode step at ctx {fs.context_label(ctx)} ({mode})",
                  dt, b, f, cuda, tokens=1, tokens_per_s=1 / dt, steps=steps, **extra, **extra_out, **prof,
                  **fs.memory_note())


@torch.inference_mode()
def prefill_chunk_at(model, ctx: int, chunk: int, cuda: bool) -> dict:
    cache = fs.fill_cache(model, ctx - 2 * chunk)
    ids = _ids(model, 2 * chunk, ctx + 1)
    model(ids[:, :chunk], cache.pos, cache)  # warm-up chunk, same shape
    dt, timer = fs.timed(model, lambda: model(ids[:, chunk:], cache.pos, cache))
    return _finish(model, f"prefill chunk {chunk} at ctx {fs.context_label(ctx)}", dt, chunk, ctx - chunk, timer,
                   1, cuda)


def apply_settings(settings) -> dict:
    """--set MODULE.NAME=VALUE (a Python literal): a launch rule's module constant of dsv41.model.kernels set for
    this run, e.g. experts.SPLIT_PROGRAMS_PER_SM=2 or gemm.DECODE_GEMV=dict(...) written as a dict literal (None
    turns a rule off), so that a launch rule is timed inside the step against the default, one process each."""
    import ast
    import importlib

    out = {}
    for item in settings or ():
        target, sep, literal = item.partition("=")
        module, _, name = target.rpartition(".")
        if not sep or not module:
            raise SystemExit(f"--set {item!r}: expected MODULE.NAME=VALUE")
        mod = importlib.import_module(f"dsv41.model.kernels.{module}")
        if not hasattr(mod, name):
            raise SystemExit(f"--set {item!r}: dsv41.model.kernels.{module} has no {name}")
        value = ast.literal_eval(literal)
        setattr(mod, name, value)
        out[target] = value
    return out


def run(json_path=None, device=None, tiny=False, contexts=None, chunk=None, prefill_tokens=None, steps=None,
        warmup=2, experts=None, quick=False, engine_only=False, compiled=False, profile_steps=0, settings=None):
    settings = apply_settings(settings)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if tiny:
        contexts, chunk = contexts or [64, 256, 1024], chunk or 16
        prefill_tokens, steps = prefill_tokens or 128, steps or 3
    else:
        contexts, chunk = contexts or [8192, 131072, 1048576], chunk or 256
        prefill_tokens, steps = prefill_tokens or 8192, steps or (5 if quick else 20)
    if cuda:
        from kernels_common import ceilings, set_quick

        set_quick(quick)
        c = ceilings()
        print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    args = fs.stack_args("tiny" if tiny else "v4.1-flash", experts)
    t0 = time.perf_counter()
    model = fs.build(args, device)
    fs.sync(device)
    info = {"config": args.name, "layers": {i: fs.REPRESENTS[i] for i in range(args.n_layers)},
            "routed_experts": args.n_routed_experts, "dim": args.dim, "omitted": fs.OMITTED,
            "weights_GiB": fs.gib(fs.weight_bytes(model)), "build_s": round(time.perf_counter() - t0, 1),
            "flash_layer_types": fs.flash_layer_types(), "chunk": chunk, "decode_steps": steps, "settings": settings,
            **fs.memory_note()}
    print(f"model: {info}", flush=True)
    rows, failures = [], []
    kinds = ("decode", "engine", "graph", "chunk") if cuda else ("decode", "engine", "chunk")
    if engine_only:
        kinds = ("engine", "graph") if cuda else ("engine",)
        if cuda and compiled:
            kinds += ("compiled",)
    cases = ([] if engine_only else [("prefill", prefill_tokens)]) + [(kind, n) for n in contexts for kind in kinds]
    if cuda and profile_steps:  # last: a CUDA graph captured after the profiler has run fails (h200-2026-12-05-b)
        cases += [("profile", n) for n in contexts]
    for kind, n in cases:
        try:
            t = time.perf_counter()
            if kind == "prefill":
                r = prefill_from_empty(model, n, cuda)
            elif kind == "decode":
                r = decode_at(model, n, steps, warmup, cuda)
            elif kind in ("engine", "graph", "compiled"):
                r = engine_decode_at(model, n, steps, warmup, cuda, graphs=kind != "engine", compiled=kind == "compiled")
            elif kind == "profile":  # the eager step's kernels: the ones its CUDA graph replays
                r = engine_decode_at(model, n, steps, warmup, cuda, graphs=False, profile_steps=profile_steps)
            else:
                r = prefill_chunk_at(model, n, chunk, cuda)
            r["case_wall_s"] = round(time.perf_counter() - t, 1)
            rows.append(r)
            fs.print_rows([r], f"{kind} {fs.context_label(n)} (case took {r['case_wall_s']} s)")
        except Exception as e:  # one failing case (e.g. out of memory at 1M) keeps the others
            failures.append({"case": f"{kind} {fs.context_label(n)}", "error": f"{type(e).__name__}: {e}"[:2000],
                             "oom": fs.is_oom(e)})
            print(f"!! {kind} {n}: {type(e).__name__}: {str(e)[:500]}", flush=True)
            traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
        if json_path:  # written after every case: a timeout later still leaves these
            _write(json_path, info, rows, failures)
    fs.print_rows(rows, f"V4.1-Flash layers at full width, random weights ({args.name}, {args.n_routed_experts} "
                        f"experts; estimate_40 = composed for all 40 layers, see flash_stack.compose_flash)")
    for r in (r for r in rows if "estimate_40_layers_ms" in r):
        print(f"  {r['case']:44s} 40-layer estimate: {r['estimate_40_layers_ms']:.2f} ms, "
              f"{r['estimate_40_layers_tokens_per_s']:.2f} tokens/s")
    for f in failures:
        print(f"  FAILED {f['case']}: {f['error'][:200]}")
    return rows


def _write(path, info, rows, failures):
    from kernels_common import write_record

    write_record(path, {"benchmark": "flash_layers", "model": info, "rows": rows, "failures": failures},
                 with_ceilings=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--device")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU check of the code paths)")
    ap.add_argument("--contexts", type=int, nargs="*")
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--prefill-tokens", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--experts", type=int, help="routed experts per layer (default: all of the config)")
    ap.add_argument("--quick", action="store_true", help="fewer decode steps, short ceiling windows")
    ap.add_argument("--engine-only", action="store_true",
                    help="only the engine's decode step (eager, and from a CUDA graph on CUDA)")
    ap.add_argument("--compiled", action="store_true",
                    help="with --engine-only on CUDA: also the CUDA graph of the torch.compile'd step")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="on CUDA, after the other cases: the eager engine step again, then STEPS more steps under "
                         "torch.profiler (the kernels' count and device time per step, the 40 largest)")
    ap.add_argument("--set", action="append", metavar="MODULE.NAME=VALUE",
                    help="set a launch rule's constant of dsv41.model.kernels for this run (repeatable), e.g. "
                         "experts.SPLIT_PROGRAMS_PER_SM=2")
    a = ap.parse_args()
    run(a.json, a.device, a.tiny, a.contexts, a.chunk, a.prefill_tokens, a.steps, a.warmup, a.experts, a.quick,
        a.engine_only, a.compiled, a.profile, a.set)
