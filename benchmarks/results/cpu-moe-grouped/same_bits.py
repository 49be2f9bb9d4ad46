# Greedy tokens of 12 requests and a full forward, MoE host path on / off / on: python benchmarks/results/cpu-moe-grouped/same_bits.py
import torch, time
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request
from dsv41.model import moe
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir(), device="cpu")
gen = Generator(model, tok)
import random
rng = random.Random(0)
prompts = [[rng.randrange(1000, 60000) for _ in range(rng.randint(8, 120))] for _ in range(12)]
def run():
    with torch.inference_mode():
        t0=time.perf_counter()
        r = [x.output_ids for x in gen.generate_many([Request(p, GenerationConfig(max_new_tokens=40, stop_ids=())) for p in prompts], max_batch_size=12)]
        full = model(torch.tensor([prompts[0]]), all_logits=True)
        return r, full, time.perf_counter()-t0
a, fa, ta = run()
orig = moe.MoE._host_experts
moe.MoE._host_experts = lambda self, x, i: None
b, fb, tb = run()
moe.MoE._host_experts = orig
c, fc, tc = run()
print("same tokens", a == b, "same full logits", torch.equal(fa, fb), "times fused/loop/fused", round(ta,2), round(tb,2), round(tc,2))
