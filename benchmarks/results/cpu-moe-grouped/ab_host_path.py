# The 32-request workload in one process, the MoE host path on and off alternately, 3 rounds: python benchmarks/results/cpu-moe-grouped/ab_host_path.py
import torch, time, random, statistics
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request
from dsv41.model import moe
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir(), device="cpu")
gen = Generator(model, tok)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 400))] for _ in range(32)]
lengths = [max(4, int(rng.randint(16, 96))) for _ in range(32)]
orig = moe.MoE._host_experts
def run(fused):
    moe.MoE._host_experts = orig if fused else (lambda self, x, i: None)
    with torch.inference_mode():
        t0=time.perf_counter()
        gen.generate_many([Request(p, GenerationConfig(max_new_tokens=n, stop_ids=())) for p,n in zip(prompts,lengths)], max_batch_size=32)
        return time.perf_counter()-t0
run(True)
res={True:[],False:[]}
for i in range(3):
    for f in (True, False):
        res[f].append(run(f))
print({k:[round(x,2) for x in v] for k,v in res.items()})
