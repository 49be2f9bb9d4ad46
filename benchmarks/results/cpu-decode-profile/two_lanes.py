"""Decode steps: one BatchCache of N rows (prompts of 200 tokens) on one thread against two of N/2 rows, each
stepped on its own thread at the same time (two "decode lanes"), and one lane of N/2 alone; STEPS greedy steps
each, two rounds. Ad hoc timing; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-decode-profile/two_lanes.py N STEPS
"""
import sys, time, random, threading, torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.batch_cache import BatchCache
torch.set_num_threads(1)
N, STEPS = int(sys.argv[1]), int(sys.argv[2])
model, args, tok = load_model(bundled_model_dir())
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(200)] for _ in range(N)]
def lane(rows):
    cache = BatchCache(model.args, len(rows), model.args.max_seq_len, "cpu")
    toks = []
    for r, p in enumerate(rows):
        kv = model.new_cache(1)
        logits = model(torch.tensor([p]), 0, kv)
        cache.load(r, kv)
        toks.append(int(logits[0, -1].argmax()))
    return cache, toks
@torch.inference_mode()
def run(cache, toks, steps, out):
    torch.set_num_threads(1)
    ids = torch.tensor(toks)
    t = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(ids, cache)
        ids = logits.argmax(-1)
    out.append(time.perf_counter() - t)
with torch.inference_mode():
    for rnd in range(2):
        c, t = lane(prompts)
        o = []; run(c, t, STEPS, o); one = o[0]
        c1, t1 = lane(prompts[:N // 2]); c2, t2 = lane(prompts[N // 2:])
        o = []
        th = [threading.Thread(target=run, args=(c1, t1, STEPS, o)), threading.Thread(target=run, args=(c2, t2, STEPS, o))]
        w = time.perf_counter()
        for x in th: x.start()
        for x in th: x.join()
        two = time.perf_counter() - w
        c1, t1 = lane(prompts[:N // 2]); o = []; run(c1, t1, STEPS, o); half = o[0]
        print(f"round {rnd}: {N} rows one thread {one/STEPS*1e3:.1f} ms/step; two lanes of {N//2} on two threads "
              f"{two/STEPS*1e3:.1f} ms/step ({one/two:.2f}x); one lane of {N//2} alone {half/STEPS*1e3:.1f} ms/step", flush=True)
