"""Where one engine's `dsv41 effort-sweep tiny-reasoning --limit 50` spends its time, with the scheduler's batched
prefill on and off (`Scheduler.groups_prefills` forced False), alternating in fresh processes: the seconds inside
`Scheduler._prefill_group`, `_prefill` and `_decode`, the wall time, and how many prompts were prefilled in groups.

    python benchmarks/results/cpu-batched-prefill/prefill_share_sweep.py --runs 2 > prefill_share_sweep.json
"""

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import collections, json, sys, time
from dsv41.model import engine
seconds, grouped = collections.Counter(), collections.Counter()
def timed(name, fn):
    def wrapper(self, *a):
        if name == "_prefill_group":
            grouped[len(a[0])] += 1
        t0 = time.perf_counter()
        try:
            return fn(self, *a)
        finally:
            seconds[name] += time.perf_counter() - t0
    return wrapper
for name in ("_prefill_group", "_prefill", "_decode"):
    setattr(engine.Scheduler, name, timed(name, getattr(engine.Scheduler, name)))
if sys.argv[1] == "off":
    engine.Scheduler.groups_prefills = property(lambda self: False)
from dsv41_cli.app import main
out = sys.argv[2]
sys.argv = ["dsv41", "effort-sweep", "tiny-reasoning", "--limit", "50", "--engines", "1", "--no-plot", "--output", out]
t0 = time.perf_counter()
try:
    main()
except SystemExit:
    pass
print(json.dumps({"seconds": {k: round(v, 2) for k, v in seconds.items()}, "wall_s": round(time.perf_counter() - t0, 2),
                  "groups_by_size": dict(sorted(grouped.items()))}))
'''

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=2)
a = ap.parse_args()
runs = []
for _ in range(a.runs):
    for mode in ("on", "off"):
        out = tempfile.mkdtemp()
        r = subprocess.run([sys.executable, "-c", CHILD, mode, out], capture_output=True, text=True, check=True)
        shutil.rmtree(out)
        runs.append({"batched_prefill": mode, **json.loads(r.stdout.strip().splitlines()[-1])})
        print(json.dumps(runs[-1]), file=sys.stderr)
print(json.dumps({"runs": runs}, indent=1))
