"""Would another admission policy bring bench_engine.py's 32-request workload (`concurrent`) closer to 30x? Two
knobs, in every combination, in fresh processes alternated over rounds: the requests submitted in the workload's
order or longest reply first (max_new_tokens descending: the classic makespan heuristic, so that the last rows
admitted have the shortest tails), and the scheduler's thread prefilling its share of the prompts between decode
steps (the engine as it is) or only decoding while the second prefill thread has prompts (`decode_first`: the
scheduler's thread then starts no prompt of its own while rows run and the thread is busy). The current tree, the
bundled model, torch's default threads (as bench_engine.py's worker). Ad hoc timing; its numbers are in NOTES.md
beside this command.

    python benchmarks/results/cpu-decode-profile/admission_order.py [ROUNDS]
"""

import os
import random
import subprocess
import sys
import time

if len(sys.argv) > 1 and sys.argv[1] == "--one":
    longest_first, decode_first = sys.argv[2] == "1", sys.argv[3] == "1"
    import torch
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model
    from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler

    def decode_first_admit_here(self, finished):
        """Scheduler._admit_here of the tree this ran at (f4ba460), with one check more before a new prompt"""
        spent = 0
        while True:
            if self.prefilling is None:
                if self._prefiller is not None and self.running and self.handed:
                    return  # the check: rows run and the prefill thread has prompts, so only decode here
                if not (self.waiting and self._rows_taken() < self.max_batch_size
                        and self._reserved() + self.waiting[0].need <= self.max_batch_tokens):
                    return
                self.prefilling = self.waiting.pop(0)
                self.prefilling.started = time.perf_counter()
                if self.cache.static:
                    self.cache.reserve(self.prefilling.need)
            seq = self.prefilling
            size = self._next_chunk(seq)
            if spent and spent + size > self.prefill_chunk:
                return
            spent += size
            group = self._companions(seq, size, spent)
            if group:
                spent += size * len(group)
                self.prefilling = None
                self._prefill_group([seq, *group], size, finished)
            else:
                self._prefill(seq, size, finished)

    if decode_first:
        Scheduler._admit_here = decode_first_admit_here
    model, args, tok = load_model(bundled_model_dir())
    gen = Generator(model, tok)
    rng = random.Random(0)  # bench_engine.py's workload: the same seed, the same draws
    prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
    lengths = [rng.randint(16, 96) for _ in range(32)]
    order = sorted(range(32), key=lambda i: -lengths[i]) if longest_first else list(range(32))
    with torch.inference_mode():
        gen.generate(prompts[0][:40], GenerationConfig(max_new_tokens=8, stop_ids=()))  # warm-up
        scheduler = Scheduler(gen, 32)
        for i in order:
            scheduler.submit(Request(prompts[i], GenerationConfig(max_new_tokens=lengths[i], stop_ids=())), key=i)
        t0 = time.perf_counter()
        results = dict(scheduler.run())
        wall = time.perf_counter() - t0
    print(f"{wall:.3f} {scheduler.steps} {sum(len(r.output_ids) for r in results.values())}")
    sys.exit(0)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
variants = [(lf, df) for df in (0, 1) for lf in (0, 1)]
walls: dict = {v: [] for v in variants}
for r in range(rounds):
    for v in variants:
        out = subprocess.run([sys.executable, __file__, "--one", str(v[0]), str(v[1])], capture_output=True,
                             text=True, check=True, env=os.environ).stdout.split()
        walls[v].append(float(out[0]))
        print(f"round {r + 1}: longest_first={v[0]} decode_first={v[1]}: {out[0]} s, {out[1]} steps, {out[2]} tokens",
              flush=True)
base = sorted(walls[(0, 0)])[rounds // 2]
for v in variants:
    med = sorted(walls[v])[rounds // 2]
    print(f"longest_first={v[0]} decode_first={v[1]}: median {med:.3f} s, {base / med:.3f}x the engine as it is")
