"""What a second core gives this machine's prefill: the 32 prompts of bench_engine.py's `concurrent` workload
prefilled one after another on one thread, then split between two threads (every other prompt), one torch thread
each, the bundled model. Run it alone, then two copies at once (two processes) to see the cores' shared resources.
Ad hoc timing; its numbers are in NOTES.md beside this command.

    python benchmarks/results/cpu-prefill-thread/two_threads.py
"""

import random
import threading
import time

import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler, _Sequence

torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
gen = Generator(model, tok)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
scheduler = Scheduler(gen, 1, overlap_prefill=False)
with torch.inference_mode():
    seqs = [_Sequence(i, Request(p, GenerationConfig(max_new_tokens=1, stop_ids=())), gen) for i, p in enumerate(prompts)]
    scheduler._prefill_whole(seqs[:1])  # warm-up
    t = time.perf_counter()
    for s in seqs:
        scheduler._prefill_whole([s])
    print("one thread", time.perf_counter() - t)

    def work(part):
        with torch.inference_mode():
            for s in part:
                scheduler._prefill_whole([s])

    t = time.perf_counter()
    threads = [threading.Thread(target=work, args=(seqs[i::2],)) for i in range(2)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    print("two threads", time.perf_counter() - t)
