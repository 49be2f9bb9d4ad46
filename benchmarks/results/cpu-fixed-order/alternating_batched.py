"""The 32-request batched workload of bench_engine.py, the two trees alternating (revision, current, twice), so
that drifting load on a shared 2-core machine hits both. Usage, from the repository root:
    python benchmarks/results/cpu-fixed-order/alternating_batched.py 7808fd5"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
import bench_engine as be  # noqa: E402
from bench_startup import export_revision  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    rev = Path(tmp)
    export_revision(sys.argv[1], rev)
    for _ in range(2):
        for name, tree in ((sys.argv[1], rev), ("current", be.REPO)):
            r = be.worker(tree, "batched", n_req=32)
            print(name, round(r["tokens"] / r["wall_s"], 1), "tok/s", round(r["wall_s"], 2), "s", flush=True)
