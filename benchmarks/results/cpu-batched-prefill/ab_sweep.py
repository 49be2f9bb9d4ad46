"""`dsv41 effort-sweep tiny-reasoning --limit 50 --engines E` wall time in this tree and in a git revision, the
two alternating run by run (the machine's speed drifts), each tree its own code and bundled checkpoint; both
trees' sweep JSONs are compared sample by sample (the same answers and token counts expected).

    python benchmarks/results/cpu-batched-prefill/ab_sweep.py --rev aa15de2 --engines 1 --runs 4
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_startup import env_for, export_revision  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rev", required=True)
ap.add_argument("--engines", type=int, default=1)
ap.add_argument("--runs", type=int, default=4)
ap.add_argument("--limit", type=int, default=50)
a = ap.parse_args()

with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    rev_tree = tmp / "rev"
    rev_tree.mkdir()
    commit = export_revision(a.rev, rev_tree)
    trees = {"revision": rev_tree, "current": REPO}
    walls = {k: [] for k in trees}
    samples = {}
    for run in range(a.runs):
        for label, tree in trees.items():
            out = tmp / f"{label}-{run}"
            cmd = [sys.executable, "-m", "dsv41_cli", "effort-sweep", "tiny-reasoning", "--limit", str(a.limit),
                   "--engines", str(a.engines), "--no-plot", "--output", str(out)]
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=tree, env=env_for(tree), check=True, capture_output=True)
            walls[label].append(round(time.perf_counter() - t0, 2))
            samples[label] = json.loads((out / "sweep.json").read_text())["samples"]
            print(label, walls[label][-1], file=sys.stderr)
    same = samples["revision"] == samples["current"]
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(json.dumps({"revision": commit, "engines": a.engines, "limit": a.limit, "runs_s": walls,
                      "median_s": med, "ratio": round(med["revision"] / med["current"], 3),
                      "samples_identical": same}, indent=1))
