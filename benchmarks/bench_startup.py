"""Start-up time of the command line: `dsv41 --help`, `dsv41 info --json` and `dsv41 generate --print-prompt`,
each run N times in a fresh process, for the current tree and for a git revision (--rev, default HEAD: the
last commit, against the working tree's changes), interleaved run by run so that both trees see the same machine load. Reports the median wall time
of each command per tree and the ratio (revision / current: how many times faster the current tree starts).

    python benchmarks/bench_startup.py --rev d3141f9 --runs 7 [--json PATH]
    python -m benchmarks startup --json PATH --rev d3141f9 --runs 7

The revision is exported with `git archive` into a temporary directory and run from there with this same
Python (the same virtual environment): the working directory comes first on sys.path, so `dsv41_cli` and
the `dsv41` package (whose __init__ adds its checkout's folders, model/ evals/ recipes/, to its __path__)
load from that tree, not from the editable install. Every timed command checks this first: a probe run in
each tree prints the files that `dsv41_cli.app` and `dsv41.model.config` were loaded from.
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

CASES = {  # name (for --only): the arguments of `dsv41`
    "help": ["--help"],
    "info": ["info", "--json"],
    "print-prompt": ["generate", "--print-prompt", "Add: 7 3 9 2 5"],
}
SHOWN = {"help": "dsv41 --help", "info": "dsv41 info --json", "print-prompt": "dsv41 generate --print-prompt"}

FLOORS = {"python -c pass": "pass", "python -c 'import torch'": "import torch"}

PROBE = ("import sys, dsv41_cli.app, dsv41.model.config as c; "
         "print(dsv41_cli.app.__file__); print(c.__file__)")


def export_revision(rev: str, dest: Path) -> str:
    """`git archive REV` unpacked into dest; returns the full commit id."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def env_for(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "DSV41_THREADS": "1"}
    env.pop("DSV41_MODEL", None)  # each tree's own bundled model
    return env


def probe(tree: Path) -> list[str]:
    """The files the tree's command line and model package load from (must lie inside the tree)."""
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, env=env_for(tree), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_startup: cannot import the tree at {tree}: {r.stderr.strip().splitlines()[-1:]}")
    files = r.stdout.split()
    outside = [f for f in files if not Path(f).resolve().is_relative_to(tree.resolve())]
    if outside:
        raise SystemExit(f"bench_startup: the tree at {tree} loads code from elsewhere: {outside}")
    return files


def run_once(tree: Path, args: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", *args], cwd=tree, env=env_for(tree),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"bench_startup: `dsv41 {' '.join(args)}` failed in {tree} "
                         f"(exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return elapsed


def time_python(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return time.perf_counter() - t0


def measure(trees: dict[str, Path], runs: int, cases: dict[str, list[str]]) -> tuple[dict, dict]:
    """Per tree and case, the wall times; and the floors, timed in the same rounds: the interpreter alone
    and `import torch` alone (what any command that needs torch pays at least)."""
    times = {label: {case: [] for case in cases} for label in trees}
    floors = {name: [] for name in FLOORS}
    for label, tree in trees.items():  # one warm-up each: the page cache, .pyc files of the exported tree
        for args in cases.values():
            run_once(tree, args)
    for _ in range(runs):
        for case, args in cases.items():
            for label, tree in trees.items():  # interleaved: both trees under the same load
                times[label][case].append(run_once(tree, args))
        for name, code in FLOORS.items():
            floors[name].append(time_python(code))
    return times, floors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision to compare with (default HEAD: the last commit)")
    ap.add_argument("--runs", type=int, default=7, help="timed runs per command and tree (default 7)")
    ap.add_argument("--only", nargs="+", choices=list(CASES), help="time only these commands")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--quick", action="store_true", help="3 runs")
    a = ap.parse_args(argv)
    runs = 3 if a.quick else a.runs
    cases = {k: v for k, v in CASES.items() if not a.only or k in a.only}
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-startup-"))
    try:
        commit = export_revision(a.rev, tmp)
        trees = {"current": REPO, "revision": tmp}
        loaded = {label: probe(tree) for label, tree in trees.items()}
        times, floors = measure(trees, runs, cases)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for case in cases:
        cur, old = statistics.median(times["current"][case]), statistics.median(times["revision"][case])
        rows.append({"command": SHOWN[case], "current_median_s": round(cur, 3),
                     "revision_median_s": round(old, 3), "speedup": round(old / cur, 2),
                     "current_s": [round(t, 3) for t in times["current"][case]],
                     "revision_s": [round(t, 3) for t in times["revision"][case]]})
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    doc = {"benchmark": "startup", "revision": a.rev, "revision_commit": commit, "runs": runs,
           "python": platform.python_version(), "cpus": os.cpu_count(), "load_average_1min_at_end": load,
           "loaded_from": {k: [str(Path(f).resolve()) for f in v] for k, v in loaded.items()}, "rows": rows,
           "floors": {k: {"median_s": round(statistics.median(v), 3), "s": [round(t, 3) for t in v]}
                      for k, v in floors.items()}}

    width = max(len(r["command"]) for r in rows)
    print(f"start-up, median of {runs} runs each, interleaved; revision {a.rev} = {commit[:10]} "
          f"(run from a git archive of it)")
    print(f"{'command':{width}s}  {'revision':>9s}  {'current':>9s}  {'speedup':>7s}")
    for r in rows:
        print(f"{r['command']:{width}s}  {r['revision_median_s']:8.3f}s  {r['current_median_s']:8.3f}s  "
              f"{r['speedup']:6.2f}x")
    for name, f in doc["floors"].items():
        print(f"floor, same rounds: {name} {f['median_s']:.3f}s")
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
