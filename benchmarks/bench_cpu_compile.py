"""torch.compile (inductor, CPU) of the engine's decode step against the eager step, bundled model (issue #21).

Each variant runs in fresh processes (current tree, one intra-op thread as `dsv41` uses for this model),
with TORCHINDUCTOR_CACHE_DIR under runs/cpu-compile/ (emptied before the first, "cold", process; a second,
"warm", process reuses it). In every process, for one sequence and for a batch of 8 (greedy, 32-token
random prompts, 64 new tokens each, the Scheduler as Generator.generate_many drives it):

    eager          the CPU's default step (Transformer.decode, shapes exact to the rows' lengths)
    eager-static   the same with BatchCache.static (the CUDA-graph shapes: power-of-two rows, whole
                   entry capacity, power-of-two RoPE table), which a dynamic=False compile needs
    compiled       Transformer.decode with decode_rows through torch.compile(dynamic=False, mode=...)
                   over the static cache (model/engine.py compiled_decode_rows' settings). The first run
                   compiles (its extra decode seconds = compile time); the next --runs are steady state.
                   Its greedy tokens and logits are compared with eager's (first differing step, max |dlogit|
                   up to it); torch._dynamo.explain of one step counts its graphs and graph breaks.

Variants: asis (decode_rows as it is) and traceable (benchmark-only monkeypatches, nothing in the tree
changes: the host-side weight caches return their cached tensors without the data_ptr/_version checks
that break graphs, the mHC scale spread is computed in the graph, and MoE.every_row runs every expert
on every row, weight 0 where unchosen, instead of reading the chosen set back with .tolist()).

    python benchmarks/bench_cpu_compile.py --json benchmarks/results/cpu-compile/compile.json
    python benchmarks/bench_cpu_compile.py --variants traceable --modes default max-autotune-no-cudagraphs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import env_for  # noqa: E402

CACHE_ROOT = REPO / "runs" / "cpu-compile"


# ---------------------------------------------------------------------------------- worker (one process)
def make_traceable(model) -> None:
    """Benchmark-only patches (inference, frozen weights, after one eager step filled the caches)."""
    import torch

    from dsv41.model import layers, moe, transformer
    from dsv41.model.kernels import reference

    for m in model.modules():
        if isinstance(m, layers.Linear):
            m._frozen_cached = layers.Linear._cached_weight(m) if m.kind != "dense" else None  # fills the cache
            m._frozen_host = layers.Linear._host_weight(m, torch.zeros(1))
        elif isinstance(m, transformer.Head):
            m.fp32_weight()
    layers.Linear._host_weight = lambda self, x: self._frozen_host
    layers.Linear._cached_weight = lambda self: self._frozen_cached
    transformer.Head.fp32_weight = lambda self: self._fp32[1]

    def mix_affine(scale, base, n):
        s = scale.detach().float()
        return torch.cat([s[0:1].expand(n), s[1:2].expand(n), s[2:3].expand(n * n)]), base.detach().float().clone()

    reference._mix_affine = mix_affine
    routed = moe.MoE.routed

    def routed_dense(self, x, weights, indices, every_row=None):
        if every_row is None or self._trainable():
            return routed(self, x, weights, indices, every_row)
        y = torch.zeros_like(x, dtype=torch.float32)
        dense = torch.zeros(x.size(0), self.n_routed, dtype=weights.dtype, device=x.device).scatter_(1, indices, weights)
        for e, expert in enumerate(self.experts):  # unchosen experts add exact zeros (weight 0)
            if expert is not None:
                y += expert(x, dense[:, e, None]).float()
        return y

    moe.MoE.routed = routed_dense
    moe.MoE.every_row = lambda self, x, rows_in_use=None: moe_every_row(self, x)

    def moe_every_row(self, x):
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x)
        y = self.routed(x, weights, indices, every_row=x.size(0))
        y += self.shared_experts(x).float()
        return y.to(x.dtype).reshape(shape)


def worker(cfg: dict) -> dict:
    import random

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)  # what dsv41_cli.common.tune_threads picks for this model
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model
    from dsv41.model.batch_cache import BatchCache
    from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler

    # BatchCache.rope_stop reads the host int `longest`, which changes every step: dynamo guards on it and
    # a dynamic=False compile recompiles at every step. The static value (a power of two) is set on the
    # cache before each step and read instead (same value; it changes only when the RoPE table doubles).
    rope_stop = BatchCache.rope_stop
    BatchCache.rope_stop = lambda self: self.__dict__.get("static_stop") or rope_stop(self) if self.static else rope_stop(self)

    t0 = time.perf_counter()
    model, args, tok = load_model(bundled_model_dir(), device="cpu")
    gen = Generator(model, tok)
    out: dict = {"load_s": time.perf_counter() - t0, "torch": torch.__version__, "variant": cfg["variant"],
                 "mode": cfg["mode"], "cache": cfg["cache"]}
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 60000) for _ in range(cfg["prompt"])] for _ in range(max(cfg["batches"]))]
    new = cfg["new_tokens"]

    def run(B: int, static: bool, rows_fn=None, record: bool = False) -> dict:
        sch = Scheduler(gen, max_batch_size=B, static_shapes=static)
        steps: list[tuple[int, float]] = []
        logits_seen: list = []

        def decode(ids):
            t = time.perf_counter()
            n = ids.size(0)
            R = sch.cache.prepare_step(n)
            sch.cache.static_stop = rope_stop(sch.cache)
            if R > n:
                ids = torch.cat([ids, ids.new_zeros(R - n)])
            logits = (rows_fn or model.decode_rows)(ids, sch.cache)
            sch.cache.advance()
            logits = logits[:n]
            steps.append((n, time.perf_counter() - t))
            if record:
                logits_seen.append(logits.clone())
            return logits

        sch.decode = decode
        for i in range(B):
            sch.submit(Request(prompts[i], GenerationConfig(max_new_tokens=new, stop_ids=())), key=i)
        res = {}
        t = time.perf_counter()
        with torch.inference_mode():
            for k, r in sch.run():
                res[k] = r.output_ids
        wall = time.perf_counter() - t
        dec_s = sum(s for _, s in steps)
        toks = sum(n for n, _ in steps)
        return {"wall_s": wall, "decode_s": dec_s, "decode_tokens": toks, "decode_tokens_per_s": toks / dec_s,
                "step_s": [s for _, s in steps], "ids": [res[i] for i in range(B)], "logits": logits_seen}

    def summary(r: dict) -> dict:
        return {k: round(r[k], 4) for k in ("wall_s", "decode_s", "decode_tokens_per_s")}

    def compare(ref: dict, got: dict) -> dict:
        """First step where any row's greedy token differs; max |logit difference| over the steps before."""
        first = None
        for b, (x, y) in enumerate(zip(ref["ids"], got["ids"])):
            d = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
            if d is not None and (first is None or d < first[1]):
                first = (b, d, x[d], y[d])
        upto = len(ref["logits"]) if first is None else first[1]  # token d+1 comes from decode step d
        diff = max((float((a - c).abs().max()) for a, c in zip(ref["logits"][:upto], got["logits"][:upto])),
                   default=0.0)
        return {"tokens_identical": first is None, "max_abs_logit_diff": diff, "steps_compared": upto,
                "first_difference": None if first is None else
                {"row": first[0], "token_index": first[1], "eager": first[2], "other": first[3]}}

    runs = cfg["runs"]
    refs: dict = {}
    for B in cfg["batches"]:  # eager first: the traceable variant's patches change the eager code too
        res: dict = {}
        refs[B] = run(B, False, record=True)
        res["eager"] = [summary(run(B, False)) for _ in range(runs)]
        st = run(B, True, record=True)
        res["eager_static"] = [summary(run(B, True)) for _ in range(runs)]
        res["eager_static_vs_eager"] = compare(refs[B], st)
        del st
        out[f"batch{B}"] = res
    if cfg["variant"] == "traceable":
        make_traceable(model)
    fn = None
    if cfg["variant"] != "eager":
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # explain: one static step on its own scheduler, traced (not compiled)
        sch = Scheduler(gen, max_batch_size=1, static_shapes=True)
        sch.submit(Request(prompts[0], GenerationConfig(max_new_tokens=new, stop_ids=())))
        with torch.inference_mode():
            sch.step()
            ids = torch.tensor([sch.running[0].token])
            R = sch.cache.prepare_step(1)
            sch.cache.static_stop = rope_stop(sch.cache)
            t = time.perf_counter()
            ex = torch._dynamo.explain(model.decode_rows)(torch.cat([ids, ids.new_zeros(R - 1)]), sch.cache)
        reasons: dict = {}
        for b in ex.break_reasons:
            where = b.user_stack[-1] if b.user_stack else None
            key = f"{b.reason.splitlines()[0][:90]} @ " + (f"{Path(where.filename).name}:{where.lineno} {where.name}"
                                                           if where else "?")
            reasons[key] = reasons.get(key, 0) + 1
        out["explain"] = {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count, "ops": ex.op_count,
                          "seconds": round(time.perf_counter() - t, 2), "break_reasons": reasons}
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model.decode_rows, dynamic=False, mode=None if cfg["mode"] == "default" else cfg["mode"])
    for B in cfg["batches"]:
        res = out[f"batch{B}"]
        if fn is not None:
            before = dict(counters["stats"])
            cold = run(B, True, rows_fn=fn, record=True)
            res["compiled_first"] = {**summary(cold), "compile_steps_s": [round(s, 3) for s in cold["step_s"]
                                                                        if s > 20 * statistics.median(cold["step_s"])]}
            res["compiled"] = [summary(run(B, True, rows_fn=fn)) for _ in range(runs)]
            res["compiled_vs_eager"] = compare(refs[B], cold)
            steady = statistics.median(r["decode_s"] for r in res["compiled"])
            res["compile_s"] = round(cold["decode_s"] - steady, 2)  # the first run's extra decode seconds
            res["dynamo_stats"] = {k: v - before.get(k, 0) for k, v in counters["stats"].items()}
            del cold
        med = {k: statistics.median(r["decode_tokens_per_s"] for r in res[k]) for k in ("eager", "eager_static", "compiled")
               if k in res}
        res["median_decode_tokens_per_s"] = {k: round(v, 2) for k, v in med.items()}
        res["ratio_vs_eager"] = {k: round(v / med["eager"], 3) for k, v in med.items()}
        refs.pop(B)
    out["graph_breaks_total"] = sum(counters["graph_break"].values())
    out["graph_break_reasons"] = {k[:160]: v for k, v in counters["graph_break"].items()}
    return out


# ---------------------------------------------------------------------------------- orchestration
def spawn(cfg: dict) -> dict:
    env = env_for(REPO)
    env["TORCHINDUCTOR_CACHE_DIR"] = cfg["cache_dir"]
    t = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_cpu_compile: worker {cfg['variant']}/{cfg['mode']} failed: {r.stderr.strip()[-3000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    doc["process_s"] = round(time.perf_counter() - t, 1)
    return doc


def write(path: str | None, doc: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--variants", nargs="+", default=["asis", "traceable"], choices=["asis", "traceable"])
    ap.add_argument("--modes", nargs="+", default=["default"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each step kind (median)")
    ap.add_argument("--no-warm", action="store_true", help="skip the second (warm-cache) process")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return 0
    doc: dict = {"benchmark": "cpu-compile", "python": platform.python_version(), "cpus": os.cpu_count(),
                 "workload": {"prompt_tokens": a.prompt, "new_tokens": a.new_tokens, "batches": a.batches,
                              "runs": a.runs}, "processes": []}
    for variant in a.variants:
        for mode in a.modes:
            cache = CACHE_ROOT / f"inductor-{variant}-{mode}"
            shutil.rmtree(cache, ignore_errors=True)
            for phase in ["cold"] + ([] if a.no_warm else ["warm"]):
                cfg = {"variant": variant, "mode": mode, "cache": phase, "cache_dir": str(cache),
                       "batches": a.batches, "prompt": a.prompt, "new_tokens": a.new_tokens, "runs": a.runs}
                r = spawn(cfg)
                doc["processes"].append(r)
                for B in a.batches:
                    x = r[f"batch{B}"]
                    print(f"{variant}/{mode} {phase} batch {B}: tok/s {x['median_decode_tokens_per_s']} "
                          f"ratio {x['ratio_vs_eager']} compile {x.get('compile_s')} s; identical "
                          f"{x.get('compiled_vs_eager', {}).get('tokens_identical')} "
                          f"max|dlogit| {x.get('compiled_vs_eager', {}).get('max_abs_logit_diff')}", flush=True)
                if "explain" in r:
                    print(f"  explain: {r['explain']['graphs']} graphs, {r['explain']['graph_breaks']} breaks",
                          flush=True)
                write(a.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
