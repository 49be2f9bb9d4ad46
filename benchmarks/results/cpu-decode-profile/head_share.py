"""What the output head costs inside a decode step of N rows: every host.fixed_order_matmul call of 20 steps with
all N rows running, by shape (the head is the [N, 64] x [64, 129280] one), against the step. Ad hoc timing; its
numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-decode-profile/head_share.py N
"""
import sys, time, random, torch, collections
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator, Request, Scheduler
from dsv41.model.kernels import host
torch.set_num_threads(1); rows = int(sys.argv[1])
model, args, tok = load_model(bundled_model_dir())
print({k: getattr(args, k) for k in ("dim", "vocab_size", "n_layers") if hasattr(args, k)})
gen = Generator(model, tok)
rng = random.Random(0)
acc = collections.defaultdict(float); cnt = collections.Counter(); on = {"v": False}
orig = host.fixed_order_matmul
def fom(x, wt, out=None):
    t = time.perf_counter(); r = orig(x, wt, out)
    if on["v"]:
        k = (tuple(x.shape), tuple(wt.shape)); acc[k] += time.perf_counter() - t; cnt[k] += 1
    return r
host.fixed_order_matmul = fom
dec = Scheduler._decode
state = {"n": 0, "t": 0.0}
def timed(self, *a):
    full = len(self.running) == rows
    on["v"] = full and 3 <= state["n"] < 23
    t = time.perf_counter()
    out = dec(self, *a)
    if on["v"]: state["t"] += time.perf_counter() - t
    if full: state["n"] += 1
    on["v"] = False
    return out
Scheduler._decode = timed
with torch.inference_mode():
    s = Scheduler(gen, rows, overlap_prefill=False)
    for i in range(rows):
        s.submit(Request([rng.randrange(1000, 60000) for _ in range(50)], GenerationConfig(max_new_tokens=40, stop_ids=())), key=i)
    list(s.run())
print("step ms", state["t"] / 20 * 1e3)
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]): print(k, cnt[k] / 20, "per step", round(v / 20 * 1e3, 3), "ms/step")
