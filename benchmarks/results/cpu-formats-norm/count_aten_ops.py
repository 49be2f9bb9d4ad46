# ATen operators per one-sequence decode token (a TorchDispatchMode: what reaches the dispatcher, attribute reads
# not counted), the bundled model, 40-token prompt: PYTHONPATH=TREE python count_aten_ops.py
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator

torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir(), device="cpu")
gen = Generator(model, tok)
prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count(n):
    with Count() as c:
        gen.generate(prompt, GenerationConfig(max_new_tokens=n, stop_ids=()))
    return c.ops


with torch.inference_mode():
    gen.generate(prompt, GenerationConfig(max_new_tokens=4, stop_ids=()))
    long, short = count(21), count(1)
    per = {k: (long[k] - short[k]) / 20 for k in long}
    print(f"ATen operators per decode token: {sum(per.values()):.0f}")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{v:7.1f} {k}")
