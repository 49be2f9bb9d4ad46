"""One sequence's decode tokens/s through bench_engine.py's worker at torch's default intra-op threads, the head's
helper on and off (DSV41_HEAD_HELPER), three alternated pairs. Ad hoc timing; its numbers are in NOTES.md.

It ran (2026-12-06 01:40 UTC) on the working tree before `host.helper_core` got its one-thread condition, when the
helper was lent at any thread count; that finding is why the condition exists. At the committed tree the helper
stays off at torch's default threads, so this script now shows both settings alike.

    python benchmarks/results/cpu-head-helper/helper_at_default_threads.py
"""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_engine  # noqa: E402

bench_engine.WORKER_THREADS = 0  # torch's default, as the workers ran then
for _ in range(3):
    for helper in ("0", "1"):
        os.environ["DSV41_HEAD_HELPER"] = helper
        r = bench_engine.worker(REPO, "single", 3)
        print(helper, [round(x, 1) for x in r["decode_tokens_per_s"]], flush=True)
