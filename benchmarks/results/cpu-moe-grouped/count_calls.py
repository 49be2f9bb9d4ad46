# Torch function calls per one-sequence decode token, by call site (a TorchFunctionMode; tensor attribute reads count): python benchmarks/results/cpu-moe-grouped/count_calls.py
import torch, collections, sys, traceback
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import GenerationConfig, Generator
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir(), device="cpu")
gen = Generator(model, tok)
prompt = tok.encode("Add: 7 3 9 2 5. Think about it step by step, then answer with the sum.")[:40]
cfg = lambda n: GenerationConfig(max_new_tokens=n, stop_ids=())
from torch.overrides import TorchFunctionMode
class Count(TorchFunctionMode):
    def __init__(s): super().__init__(); s.c=collections.Counter(); s.on=False
    def __torch_function__(s, func, types, args=(), kwargs=None):
        if s.on:
            f = sys._getframe(1)
            while f and ('torch/' in f.f_code.co_filename and 'dsv41' not in f.f_code.co_filename): f=f.f_back
            key=(f.f_code.co_filename.split('/')[-1]+':'+str(f.f_lineno)+' '+f.f_code.co_name) if f else '?'
            s.c[key]+=1
        return func(*args, **(kwargs or {}))
with torch.inference_mode():
    gen.generate(prompt, cfg(8))
    m=Count()
    with m:
        gen.generate(prompt, cfg(4))
        m.on=True
        gen.generate(prompt, cfg(20))
    base=collections.Counter()
    # subtract prefill by running cfg(1)
    m2=Count()
    with m2:
        m2.on=True
        gen.generate(prompt, cfg(1))
    diff = {k: (m.c[k]-m2.c[k])/19 for k in m.c}
    tot=sum(diff.values()); print("torch fn calls / decode token", tot)
    byfile=collections.Counter()
    for k,v in diff.items(): byfile[k.split(':')[0]]+=v
    print(byfile.most_common(20))
    for k,v in sorted(diff.items(), key=lambda kv:-kv[1])[:60]: print(f"{v:7.1f} {k}")
