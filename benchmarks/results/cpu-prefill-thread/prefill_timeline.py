"""Where the 32-request workload of bench_engine.py (`concurrent`) spends its time with the second prefill thread:
how many prompts each thread prefilled, the seconds in each thread's prefills and in the decode steps, and when the
last prompt was in (seconds from the start). The current tree, the bundled model, torch's default threads (as
bench_engine.py's worker). Ad hoc timing: one run; its numbers are in NOTES.md beside this command.

    python benchmarks/results/cpu-prefill-thread/prefill_timeline.py
"""

import collections
import random
import threading
import time

import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler

model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)  # bench_engine.py's workload: the same seed, the same draws
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
lengths = [rng.randint(16, 96) for _ in range(32)]
spans: list[tuple[str, float, float]] = []
prompts_by_thread: collections.Counter = collections.Counter()


def timed(kind, fn):
    def wrapper(self, *a):
        t = time.perf_counter()
        out = fn(self, *a)
        spans.append((kind if kind != "decode" else f"decode{len(self.running)}", t, time.perf_counter()))
        return out
    return wrapper


whole, chunk, decode = Scheduler._prefill_whole, Scheduler._prefill, Scheduler._decode


def whole_counted(self, job):
    prompts_by_thread[threading.current_thread().name] += len(job)
    return whole(self, job)


Scheduler._prefill_whole = timed("thread", whole_counted)
Scheduler._prefill = timed("main", chunk)
Scheduler._decode = timed("decode", decode)
with torch.inference_mode():
    gen.generate(prompts[0][:40], GenerationConfig(max_new_tokens=8, stop_ids=()))  # warm-up
    spans.clear()
    prompts_by_thread.clear()
    scheduler = Scheduler(gen, 32)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        scheduler.submit(Request(p, GenerationConfig(max_new_tokens=n, stop_ids=())), key=i)
    t0 = time.perf_counter()
    results = dict(scheduler.run())
    wall = time.perf_counter() - t0
total = {k: sum(b - a for kind, a, b in spans if kind.startswith(k)) for k in ("thread", "main", "decode")}
print({"wall_s": round(wall, 3), "prompts_on_the_second_thread": prompts_by_thread["dsv41-prefill"],
       "prefill_s_second_thread": round(total["thread"], 3),
       "prefill_s_scheduler_thread (chunks)": round(total["main"], 3), "decode_steps_s": round(total["decode"], 3),
       "last_prompt_in_at_s": round(max(b for kind, a, b in spans if kind in ("thread", "main")) - t0, 3),
       "steps": scheduler.steps})
