"""lm-eval's add_env_info (torch's collect_env) timed three times in one process, torch already imported:
.venv/bin/python benchmarks/results/cpu-ci-time/env_info.py"""
import time

import torch  # noqa: F401  (imported first, as in `dsv41 eval`)
from lm_eval.loggers.utils import add_env_info

for _ in range(3):
    t = time.perf_counter()
    add_env_info({})
    print(f"add_env_info {time.perf_counter() - t:.2f} s")
