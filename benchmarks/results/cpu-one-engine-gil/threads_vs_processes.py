"""How much one engine's two threads slow each other: prefill forwards (thread B) and 32-row decode steps (thread A),
each alone and both at once, one intra-op thread each, in one process (one GIL), and the same pair as two processes
(an EnginePool's layout). The bundled model; a 128-token prompt's prefill forward and the decode step of 32 rows of
bench_engine.py's prompts; medians over SECONDS of each. Ad hoc; its numbers are in NOTES.md.

    python benchmarks/results/cpu-one-engine-gil/threads_vs_processes.py [SECONDS]
"""
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time

import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.batch_cache import BatchCache
from dsv41.model.checkpoint import load_model

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0


def setup():
    torch.set_num_threads(1)
    model, _, _ = load_model(bundled_model_dir())
    rng = random.Random(0)
    seqs = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
    cache = BatchCache(model.args, 32, model.args.max_seq_len, "cpu")
    with torch.inference_mode():
        for row, seq in enumerate(seqs):
            kv = model.new_cache(1)
            model(torch.tensor([seq]), 0, kv)
            cache.load(row, kv)
    return model, cache


def prefill_loop(model, stop, out):
    torch.set_num_threads(1)
    ids = torch.randint(1000, 60000, (1, 128))
    with torch.inference_mode():
        while not stop.is_set():
            t = time.perf_counter(); model(ids, 0, model.new_cache(1)); out.append(time.perf_counter() - t)


def decode_loop(model, cache, stop, out):
    torch.set_num_threads(1)
    ids = torch.randint(1000, 60000, (32,))
    with torch.inference_mode():
        n = 0
        while not stop.is_set() and n < 200:  # stay inside the cache's windows
            t = time.perf_counter(); model.decode(ids, cache); out.append(time.perf_counter() - t); n += 1


def timed(targets):
    stop, outs, threads = threading.Event(), [], []
    for fn, args in targets:
        o = []; outs.append(o); threads.append(threading.Thread(target=fn, args=(*args, stop, o)))
    for t in threads: t.start()
    time.sleep(SECONDS); stop.set()
    for t in threads: t.join()
    return [statistics.median(o[2:]) * 1e3 for o in outs]


def proc(kind, barrier, q):
    model, cache = setup()
    stop, o = threading.Event(), []
    barrier.wait()
    threading.Timer(SECONDS, stop.set).start()
    prefill_loop(model, stop, o) if kind == "prefill" else decode_loop(model, cache, stop, o)
    q.put((kind, statistics.median(o[2:]) * 1e3))


if __name__ == "__main__":
    model, cache = setup()
    p_alone, = timed([(prefill_loop, (model,))])
    _, cache = setup()
    d_alone, = timed([(decode_loop, (model, cache))])
    _, cache = setup()
    p_both, d_both = timed([(prefill_loop, (model,)), (decode_loop, (model, cache))])
    print(f"one process, two threads: prefill of 128 tokens {p_alone:.1f} ms alone, {p_both:.1f} ms beside the decode "
          f"thread ({p_both / p_alone:.2f}x); 32-row decode step {d_alone:.1f} ms alone, {d_both:.1f} ms beside the "
          f"prefill thread ({d_both / d_alone:.2f}x)", flush=True)
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    ps = [ctx.Process(target=proc, args=(k, barrier, q)) for k in ("prefill", "decode")]
    for p in ps: p.start()
    res = dict(q.get() for _ in ps)
    for p in ps: p.join()
    print(f"two processes: prefill of 128 tokens {res['prefill']:.1f} ms ({res['prefill'] / p_alone:.2f}x alone), "
          f"32-row decode step {res['decode']:.1f} ms ({res['decode'] / d_alone:.2f}x alone)", flush=True)
