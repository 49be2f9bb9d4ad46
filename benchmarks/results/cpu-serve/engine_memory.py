"""The engine alone (no server), the load test's workload, 64 requests outstanding over 32 rows for SECONDS,
then drained: every 10 s the RSS, glibc's blocks in use and free (serve/memory.py), the CPU tensors Python
can reach, the batch cache's entry capacity. `static` runs the batch cache with fixed shapes (entries read at
full capacity, rows in powers of two: what the CUDA-graph path uses). Output: engine_memory.log (NOTES.md).

    python benchmarks/results/cpu-serve/engine_memory.py SECONDS [static]
"""
import sys, time, random, gc, os
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))  # benchmarks/
import bench_serve as B
import torch
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, SamplingConfig, Scheduler
from dsv41.serve.protocol import parse_chat
from dsv41.serve.memory import _Mallinfo2, libc, rss_mib
from dsv41_cli.common import tune_threads
model, margs, tok = load_model(bundled_model_dir(), device='cpu'); tune_threads(margs,'cpu')
gen = Generator(model, tok); rng = random.Random(5)
def request():
    body = B.workload(rng)
    params = parse_chat({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, B.MODEL)
    ids = tok.encode(params.prompt(), allow_special=True); s = params.sampling
    sampling = SamplingConfig(s.temperature, s.top_p, s.seed)
    return Request(ids, GenerationConfig(max_new_tokens=body["max_tokens"], sampling=sampling, stop_ids=(tok.eos_id,)))
def tensors():
    n=b=0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            n+=1; b+=o.untyped_storage().nbytes() if o.device.type=='cpu' else 0
    return n, b/2**20
secs=float(sys.argv[1]); mode=sys.argv[2] if len(sys.argv)>2 else ''
t0=time.perf_counter(); last=t0; ntok=0
def rep(tag):  # glibc's mallinfo2: uordblks (blocks in use in the arenas), fordblks (free there), hblkhd (mmapped)
    lib = libc(); lib.mallinfo2.restype = _Mallinfo2; m = lib.mallinfo2()
    print(tag, round(time.perf_counter()-t0), 'rss', round(rss_mib()), 'in_use', round(m.uordblks / 2**20),
          'free', round(m.fordblks / 2**20), 'mmap', round(m.hblkhd / 2**20), 'tensors', tensors(),
          'cap', sch.cache.capacity, flush=True)
with torch.inference_mode():
    sch = Scheduler(gen, 32)
    if mode == "static": sch.cache.static = True
    rep('start')
    for _ in range(64): sch.submit(request())
    while sch.busy:
        for _ in sch.step():
            if time.perf_counter()-t0 < secs: sch.submit(request())
        if time.perf_counter()-last > 10: last=time.perf_counter(); rep("t")
    rep('end')
    gc.collect(); rep('gc')
