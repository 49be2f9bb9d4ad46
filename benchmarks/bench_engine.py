"""The generation engine against a git revision, on the CPU, with the bundled model (issue #21's numbers).

Both trees run in fresh processes with this same Python: the current working tree and a `git archive` of
--rev (default HEAD), each from its own folder first on sys.path (as benchmarks/bench_startup.py does), each at one
torch intra-op thread (--threads, default 1, as `dsv41` runs the bundled model; until 2026-12-06 the workers ran
at torch's default, the machine's cores, which --threads 0 gives).

    single       one sequence, greedy, 40-token prompt, 96 new tokens: decode tokens/s (median of --runs)
    concurrent   32 requests, prompts of 8..400 tokens, 16..96 new tokens each (fixed seed): aggregate
                 tokens/s (all generated tokens / wall). The revision runs them one after another (it has
                 no engine for mixed lengths); the current tree submits them at once (continuous
                 batching, 32 rows) and also runs each alone, to check that every row's greedy tokens
                 are the ones it gets alone (batch invariance). --pool: the current tree also runs them over
                 an EnginePool of one engine per core (worker processes, started and warmed before the
                 timing), what `dsv41 generate --input-file` does with them on the CPU.
    concurrency  the current tree only: aggregate tokens/s of 64 requests against the number of rows in
                 flight (1, 2, 4, ..., 64); the plot of docs/generation.md (--plot PATH)
    commands     wall time of `dsv41 effort-sweep tiny-reasoning --limit 50`, `dsv41 eval --suite smoke --limit 20`
                 (the suite's documented run) and `dsv41 bpb` (docs/architecture.md as the corpus) in each tree

    python benchmarks/bench_engine.py --rev 26ff6f6 --json benchmarks/results/cpu-engine/engine.json \
        --plot docs/img/concurrency.png
    python -m benchmarks engine --rev 26ff6f6 --json ...   (--quick: fewer requests, shorter outputs)
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
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import env_for, export_revision, probe  # noqa: E402

# The worker runs inside one tree (its folder first on sys.path) and prints one JSON document. It uses only
# the API both trees share (load_model, Generator.generate, GenerationConfig), plus generate_many where the
# tree has it.
WORKER = r'''
import json, os, random, statistics, sys, time
import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator
what, runs, n_req, scale, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
# a CUDA graph capture that failed leaves the engine eager with one warning on stderr, which the parent drops: keep
# it in the JSON, so that a graph row that ran eagerly says so
import warnings
graph_warnings = []
_show = warnings.showwarning
def _keep(message, *rest, **kw):
    if "CUDA graph" in str(message):
        graph_warnings.append(str(message))
    _show(message, *rest, **kw)
warnings.showwarning = _keep
# the intra-op threads `dsv41` gives the bundled model (DSV41_THREADS: 1, as env_for sets it for either tree; unset
# with --threads 0, torch's default, as the workers ran until 2026-12-06)
if os.environ.get("DSV41_THREADS"):
    torch.set_num_threads(int(os.environ["DSV41_THREADS"]))
model, args, tok = load_model(bundled_model_dir(), device=device)
gen = Generator(model, tok)
rng = random.Random(0)
def workload(n):
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(n)]
    lengths = [max(4, int(rng.randint(16, 96) * scale)) for _ in range(n)]
    return prompts, lengths
def cfg(n):
    return GenerationConfig(max_new_tokens=n, stop_ids=())
out = {}
with torch.inference_mode():
    prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
    gen.generate(prompt, cfg(8))  # warm-up
    if what == "single":
        results = [gen.generate(prompt, cfg(int(96 * scale))) for _ in range(runs)]
        out = {"decode_tokens_per_s": [r.decode_tokens_per_s for r in results], "output_ids": results[-1].output_ids}
    elif what in ("sequential", "batched"):
        prompts, lengths = workload(n_req)
        if what == "batched":  # outside the timed runs (this tree's engine; the sequential revision may lack it)
            from dsv41.model.engine import Request
        walls = []
        for _ in range(runs):  # runs > 1 (the GPU runs): the first pays Triton's compiles and the graphs' captures
            t0 = time.perf_counter()
            if what == "sequential":
                ids = [gen.generate(p, cfg(n)).output_ids for p, n in zip(prompts, lengths)]
            else:
                ids = [r.output_ids for r in gen.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)],
                                                               max_batch_size=n_req)]
            walls.append(time.perf_counter() - t0)
        out = {"wall_s": statistics.median(walls[1:] or walls), "walls_s": walls, "tokens": sum(map(len, ids)),
               "output_ids": ids, "prompt_tokens": [len(p) for p in prompts], "new_tokens": lengths}
    elif what == "pool":
        # the same requests over an EnginePool (evals/engine_pool.py): this process's engine and one worker process
        # per other core, each at one thread, as `dsv41 generate --input-file` runs them on the CPU; the workers
        # load the checkpoint and run a small warm-up batch before the timing (a server's pool, started once)
        from dsv41.evals.engine_pool import EnginePool, default_engines
        from dsv41.model.engine import Request
        prompts, lengths = workload(n_req)
        engines = default_engines(device)
        with EnginePool(gen, bundled_model_dir(), engines=engines, batch_size=n_req) as pool:
            pool.wait_ready()
            pool.generate_many([Request(p[:16], cfg(4)) for p in prompts[:16]])
            before = pool.from_workers
            t0 = time.perf_counter()
            ids = [r.output_ids for r in pool.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)])]
            wall = time.perf_counter() - t0
            from_workers = pool.from_workers - before  # the timed run's requests that a worker finished
        out = {"wall_s": wall, "tokens": sum(map(len, ids)), "output_ids": ids, "engines": engines,
               "from_workers": from_workers}
    elif what == "concurrency":
        from dsv41.model.engine import Request
        prompts, lengths = workload(n_req)
        points = []
        for rows in [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= n_req]:
            t0 = time.perf_counter()
            res = gen.generate_many([Request(p, cfg(n)) for p, n in zip(prompts, lengths)], max_batch_size=rows)
            wall = time.perf_counter() - t0
            points.append({"rows": rows, "wall_s": wall, "tokens": sum(len(r.output_ids) for r in res)})
        out = {"points": points}
out["graph_warnings"] = graph_warnings
print(json.dumps(out))
'''


WORKER_THREADS = 1  # --threads


def worker(tree: Path, what: str, runs: int = 1, n_req: int = 32, scale: float = 1.0, device: str = "cpu",
           graphs: bool = True, compiled: bool = False) -> dict:
    env = {**env_for(tree), "DSV41_CUDA_GRAPHS": "1" if graphs else "0", "DSV41_COMPILE_DECODE": "1" if compiled else "0"}
    if WORKER_THREADS:
        env["DSV41_THREADS"] = str(WORKER_THREADS)
    else:
        env.pop("DSV41_THREADS", None)
    if device != "cpu" and os.environ.get("PYTHONPATH"):  # the device machine's extra packages stay reachable
        env["PYTHONPATH"] = str(tree) + os.pathsep + os.environ["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-c", WORKER, what, str(runs), str(n_req), str(scale), device], cwd=tree,
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_engine: {what} failed in {tree}: {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def command_wall(tree: Path, args: list[str], work: Path) -> float:
    """Wall seconds of `dsv41 ARGS` in `tree`, run as a user runs it: with the tree's own thread defaults (both
    trees' `tune_threads` run a small model at one torch thread; what a tree does with the other cores, its
    engines or scoring threads, is part of what is measured), so DSV41_THREADS is not set."""
    env = env_for(tree)
    env.pop("DSV41_THREADS", None)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", *args], cwd=work, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"bench_engine: `dsv41 {' '.join(args)}` failed in {tree}: {r.stderr.strip()[-500:]}")
    return wall


COMMANDS = {
    "effort-sweep tiny-reasoning --limit 50": ["effort-sweep", "tiny-reasoning", "--limit", "50", "--fresh",
                                               "--no-plot", "--output", "{out}/sweep"],
    "eval --suite smoke --limit 20": ["eval", "--suite", "smoke", "--limit", "20", "--output", "{out}/eval",
                                      "--confirm-run-unsafe-code"],
    "bpb docs/architecture.md": ["bpb", str(REPO / "docs" / "architecture.md"), "--no-plot"],
}


def plot_concurrency(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [p["rows"] for p in points]
    rate = [p["tokens"] / p["wall_s"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(rows, rate, "o-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.set_xlabel("sequences in flight (max_batch_size)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("dsv41-tiny, greedy, 2-core CPU\n64 requests, prompts of 8-400 tokens", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_main(a) -> int:
    """The bundled model on a GPU, current tree: CUDA graphs on and off in the same run (--compiled: also the
    graphs of the torch.compile'd step, DSV41_COMPILE_DECODE=1)."""
    n_req, scale = (8, 0.25) if a.quick else (32, 1.0)
    doc: dict = {"benchmark": "engine-gpu", "device": a.device}
    for label in ("eager", "graph") + (("compiled",) if a.compiled else ()):
        graphs, compiled = label != "eager", label == "compiled"
        t0 = time.perf_counter()
        single = worker(REPO, "single", a.runs, scale=scale, device=a.device, graphs=graphs, compiled=compiled)
        doc[label] = {"single_decode_tokens_per_s": single["decode_tokens_per_s"],
                      "single_output_ids": single["output_ids"], "graph_warnings": single["graph_warnings"]}
        if compiled:  # one sequence only: each batch shape of the concurrent run would compile once more
            doc[label]["wall_s_with_compile"] = time.perf_counter() - t0
            print(f"{label}: one sequence {statistics.median(single['decode_tokens_per_s']):.1f} tok/s")
            continue
        # the same 32 requests 1 + --runs times in one process: the first run pays Triton's compiles (each prompt
        # length's prefill shapes) and each batch size's graph capture, so the rate is that of the later runs
        batched = worker(REPO, "batched", 1 + a.runs, n_req=n_req, scale=scale, device=a.device, graphs=graphs)
        doc[label].update(concurrent_tokens_per_s=batched["tokens"] / batched["wall_s"], requests=n_req,
                          concurrent_walls_s=batched["walls_s"], output_ids=batched["output_ids"])
        doc[label]["graph_warnings"] += batched["graph_warnings"]
        for w in doc[label]["graph_warnings"]:
            print(f"{label}: {w}")
        print(f"{label}: one sequence {statistics.median(single['decode_tokens_per_s']):.1f} tok/s; {n_req} "
              f"concurrent {doc[label]['concurrent_tokens_per_s']:.1f} tok/s (median of the {a.runs} runs after the "
              f"first; walls {', '.join(f'{w:.2f}' for w in batched['walls_s'])} s)")
    doc["graph_over_eager_single"] = (statistics.median(doc["graph"]["single_decode_tokens_per_s"])
                                      / statistics.median(doc["eager"]["single_decode_tokens_per_s"]))
    doc["graph_over_eager_concurrent"] = doc["graph"]["concurrent_tokens_per_s"] / doc["eager"]["concurrent_tokens_per_s"]
    if "compiled" in doc:
        doc["compiled_over_graph_single"] = (statistics.median(doc["compiled"]["single_decode_tokens_per_s"])
                                             / statistics.median(doc["graph"]["single_decode_tokens_per_s"]))
        doc["single_tokens_equal_compiled_graph"] = sum(
            x == y for x, y in zip(doc["compiled"]["single_output_ids"], doc["graph"]["single_output_ids"]))
        print(f"compiled / graph: one sequence {doc['compiled_over_graph_single']:.2f}x; greedy tokens equal "
              f"{doc['single_tokens_equal_compiled_graph']}/{len(doc['graph']['single_output_ids'])} (first "
              f"compile included: {doc['compiled']['wall_s_with_compile']:.0f} s)")
    doc["rows_equal_graph_eager"] = sum(x == y for x, y in zip(doc["graph"].pop("output_ids"),
                                                               doc["eager"].pop("output_ids")))
    print(f"graph / eager: one sequence {doc['graph_over_eager_single']:.2f}x, concurrent "
          f"{doc['graph_over_eager_concurrent']:.2f}x; greedy rows equal {doc['rows_equal_graph_eager']}/{n_req}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def replot(json_path: str, png_path: str) -> None:
    """Draw the concurrency curve again from a run's JSON."""
    plot_concurrency(json.loads(Path(json_path).read_text())["concurrency"], png_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--runs", type=int, default=3,
                    help="single-sequence runs per tree (median); on a GPU also the 32 concurrent requests' runs after "
                         "a first one, which pays the compiles and graph captures")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate the trees this many times (single: --runs each; the concurrent pair, the revision "
                         "batched or, without an engine, one request after another: one run each), "
                         "medians over all; on a shared machine, whose speed drifts, 3 or more")
    ap.add_argument("--only", nargs="+", choices=["single", "concurrent", "concurrency", "commands"])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads of every worker (default 1, as `dsv41` runs the bundled model; 0: "
                         "torch's default, the machine's cores, as the workers ran until 2026-12-06)")
    ap.add_argument("--plot", metavar="PATH", help="the concurrency curve as a PNG")
    ap.add_argument("--quick", action="store_true", help="8 requests, outputs a quarter as long, no commands")
    ap.add_argument("--pool", action="store_true",
                    help="with the concurrent part: also the current tree's 32 requests over an EnginePool of one "
                         "engine per core (processes; warm), once per round, as `dsv41 generate --input-file` runs "
                         "them on the CPU")
    ap.add_argument("--engines", type=int, default=None,
                    help="the current tree's effort-sweep and eval with --engines N (default: its own default, one "
                         "engine per CPU core; the revision runs as it is)")
    ap.add_argument("--commands", nargs="+", choices=["effort-sweep", "eval", "bpb"], default=None,
                    help="with the commands part: only these commands (default: all)")
    ap.add_argument("--command-runs", type=int, default=1, help="runs of each command per tree, interleaved")
    ap.add_argument("--compiled", action="store_true",
                    help="with --device cuda: also the CUDA graphs of the torch.compile'd step (DSV41_COMPILE_DECODE=1)")
    ap.add_argument("--device", default="cpu", help="cuda: the current tree only, the decode step from CUDA "
                    "graphs against eager (one sequence, 32 concurrent requests)")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.runs < 1:
        ap.error("--rounds and --runs must be at least 1")
    if a.threads < 0:
        ap.error("--threads must be 0 (torch's default) or more")
    global WORKER_THREADS
    WORKER_THREADS = a.threads
    if a.device != "cpu":
        return gpu_main(a)
    parts = a.only or (["single", "concurrent", "concurrency"] + ([] if a.quick else ["commands"]))
    n_req, scale = (8, 0.25) if a.quick else (32, 1.0)
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-engine-"))
    doc: dict = {"benchmark": "engine", "revision": a.rev, "python": platform.python_version(), "cpus": os.cpu_count(),
                 "torch_threads": a.threads or "torch's default"}
    try:
        rev_tree = tmp / "tree"
        rev_tree.mkdir()
        doc["revision_commit"] = export_revision(a.rev, rev_tree)
        trees = {"current": REPO, "revision": rev_tree}
        for tree in trees.values():
            probe(tree)
        if "single" in parts:
            # --rounds: the trees alternate round by round (and which goes first), so that a slow spell of a shared
            # machine does not fall on one tree's runs only
            single = {label: {"decode_tokens_per_s": []} for label in trees}
            for r in range(a.rounds):
                for label, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
                    single[label]["decode_tokens_per_s"] += worker(tree, "single", a.runs,
                                                                   scale=scale)["decode_tokens_per_s"]
            med = {k: statistics.median(v["decode_tokens_per_s"]) for k, v in single.items()}
            doc["single"] = {**{f"{k}_decode_tokens_per_s": v["decode_tokens_per_s"] for k, v in single.items()},
                             "ratio": med["current"] / med["revision"]}
            print(f"single sequence decode: revision {med['revision']:.1f} tok/s, current {med['current']:.1f} "
                  f"tok/s, {doc['single']['ratio']:.2f}x", flush=True)
        write(a.json, doc)
        if "concurrent" in parts:
            seq_rev = worker(rev_tree, "sequential", n_req=n_req, scale=scale)
            batched = worker(REPO, "batched", n_req=n_req, scale=scale)
            alone = worker(REPO, "sequential", n_req=n_req, scale=scale)
            # a revision that has the engine (generate_many) also runs the requests at once: the like-for-like
            # comparison of two engines; one without it fails there and keeps the one-by-one comparison only
            try:
                batched_rev = worker(rev_tree, "batched", n_req=n_req, scale=scale)
            except SystemExit:
                batched_rev = None
            # more rounds of the pair, alternating: this tree batched against the revision batched (like for like)
            # or, without its engine, one request after another
            rev_side, rev_what = (seq_rev, "sequential") if batched_rev is None else (batched_rev, "batched")
            pooled = [worker(REPO, "pool", n_req=n_req, scale=scale)] if a.pool else []
            if a.rounds > 1:
                walls = {"current": [batched["wall_s"]], "revision": [rev_side["wall_s"]]}
                for r in range(1, a.rounds):
                    for label, tree, what in ((("revision", rev_tree, rev_what), ("current", REPO, "batched")) if r % 2
                                              else (("current", REPO, "batched"), ("revision", rev_tree, rev_what))):
                        walls[label].append(worker(tree, what, n_req=n_req, scale=scale)["wall_s"])
                    if a.pool:
                        pooled.append(worker(REPO, "pool", n_req=n_req, scale=scale))
                batched["wall_s"] = statistics.median(walls["current"])
                rev_side["wall_s"] = statistics.median(walls["revision"])
                batched["walls_s"], rev_side["walls_s"] = walls["current"], walls["revision"]
            same = [x == y for x, y in zip(batched["output_ids"], alone["output_ids"])]
            rate = {k: v["tokens"] / v["wall_s"] for k, v in (("revision_sequential", seq_rev),
                                                              ("current_batched", batched),
                                                              ("current_sequential", alone))}
            doc["concurrent"] = {"requests": n_req, "prompt_tokens": batched["prompt_tokens"],
                                 "new_tokens": batched["new_tokens"],
                                 **{f"{k}_tokens_per_s": round(v, 2) for k, v in rate.items()},
                                 **{f"{k}_wall_s": round(w["wall_s"], 2) for k, w in (("revision_sequential", seq_rev),
                                    ("current_batched", batched), ("current_sequential", alone))},
                                 "ratio_vs_revision": rate["current_batched"] / rate["revision_sequential"],
                                 "rows_identical_to_alone": sum(same),
                                 "revision_tokens_equal_current": sum(x == y for x, y in zip(seq_rev["output_ids"],
                                                                                              alone["output_ids"]))}
            if "walls_s" in seq_rev:
                doc["concurrent"].update(current_batched_walls_s=batched["walls_s"],
                                         revision_sequential_walls_s=seq_rev["walls_s"])
            if pooled:
                pool_wall = statistics.median(p["wall_s"] for p in pooled)
                pool_rate = pooled[0]["tokens"] / pool_wall
                doc["concurrent"].update(
                    pool_engines=pooled[0]["engines"], pool_walls_s=[round(p["wall_s"], 3) for p in pooled],
                    pool_requests_from_workers=[p["from_workers"] for p in pooled],
                    current_pool_tokens_per_s=round(pool_rate, 2),
                    ratio_pool_vs_revision=pool_rate / rate["revision_sequential"],
                    pool_rows_identical_to_alone=min(sum(x == y for x, y in zip(p["output_ids"], alone["output_ids"]))
                                                     for p in pooled))
                print(f"{n_req} concurrent requests over an EnginePool of {pooled[0]['engines']} engines: "
                      f"{pool_rate:.1f} tok/s ({doc['concurrent']['ratio_pool_vs_revision']:.1f}x the revision one "
                      f"by one); rows identical to alone: {doc['concurrent']['pool_rows_identical_to_alone']}/{n_req}",
                      flush=True)
            if batched_rev is not None:
                rate_rev = batched_rev["tokens"] / batched_rev["wall_s"]
                if "walls_s" in batched:
                    doc["concurrent"].update(current_batched_walls_s=batched["walls_s"],
                                             revision_batched_walls_s=batched_rev["walls_s"])
                doc["concurrent"].update(revision_batched_tokens_per_s=round(rate_rev, 2),
                                         revision_batched_wall_s=round(batched_rev["wall_s"], 2),
                                         ratio_batched_vs_revision_batched=rate["current_batched"] / rate_rev,
                                         revision_batched_rows_equal_current=sum(
                                             x == y for x, y in zip(batched_rev["output_ids"], batched["output_ids"])))
                print(f"{n_req} concurrent requests, both engines batched: revision {rate_rev:.1f} tok/s, current "
                      f"{rate['current_batched']:.1f} tok/s "
                      f"({doc['concurrent']['ratio_batched_vs_revision_batched']:.2f}x); rows equal "
                      f"{doc['concurrent']['revision_batched_rows_equal_current']}/{n_req}", flush=True)
            print(f"{n_req} concurrent requests: revision one by one {rate['revision_sequential']:.1f} tok/s, current "
                  f"batched {rate['current_batched']:.1f} tok/s ({doc['concurrent']['ratio_vs_revision']:.1f}x); rows "
                  f"identical to alone: {sum(same)}/{n_req}")
        write(a.json, doc)
        if "concurrency" in parts:
            points = worker(REPO, "concurrency", n_req=2 * n_req, scale=scale)["points"]
            doc["concurrency"] = [{**p, "tokens_per_s": round(p["tokens"] / p["wall_s"], 2)} for p in points]
            for p in doc["concurrency"]:
                print(f"  rows {p['rows']:3d}: {p['tokens_per_s']:8.1f} tok/s")
            if a.plot:
                plot_concurrency(points, a.plot)
        write(a.json, doc)
        if "commands" in parts:
            doc["commands"] = {}
            for name, args in COMMANDS.items():
                if a.commands and name.split()[0] not in a.commands:
                    continue
                runs: dict[str, list[float]] = {label: [] for label in trees}
                for _ in range(a.command_runs):  # the trees alternate run by run: drifting load hits both
                    for label, tree in trees.items():
                        out = tmp / f"out-{label}"
                        out.mkdir(exist_ok=True)
                        extra = (["--engines", str(a.engines)] if a.engines and label == "current"
                                 and name.split()[0] in ("effort-sweep", "eval") else [])
                        runs[label].append(command_wall(tree, [x.format(out=out) for x in args] + extra, out))
                walls = {label: statistics.median(w) for label, w in runs.items()}
                doc["commands"][name] = {"current_engines": a.engines or "default",
                                         "revision_s": round(walls["revision"], 1), "current_s": round(walls["current"], 1),
                                         "ratio": round(walls["revision"] / walls["current"], 2),
                                         "runs_s": {label: [round(w, 2) for w in ws] for label, ws in runs.items()}}
                print(f"dsv41 {name}: revision {walls['revision']:.1f} s, current {walls['current']:.1f} s, "
                      f"{walls['revision'] / walls['current']:.2f}x", flush=True)
                write(a.json, doc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        doc["load_average_1min_at_end"] = os.getloadavg()[0]
    except OSError:
        pass
    write(a.json, doc)
    return 0


def write(path: str | None, doc: dict) -> None:
    """The results so far (after every part: an interrupted run keeps what it measured)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
