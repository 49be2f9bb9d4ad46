# python benchmarks/results/cpu-small-kernels/count_ops.py  (DSV41_PENDING_KERNELS=0 to leave the pending kernels out)
# torch operators (not views, not the interpreter's own) of one engine decode step on the tiny stack, by model site,
# with the CUDA-path dispatch forced (TRITON_INTERPRET=1, host kernels off): what a GPU step launches besides Triton
import os, sys, collections
os.environ["TRITON_INTERPRET"] = "1"; os.environ["DSV41_HOST_KERNELS"] = "0"; os.environ.setdefault("DSV41_PENDING_KERNELS", "1")
sys.path.insert(0, "benchmarks")
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import flash_stack as fs
import dsv41.model
from dsv41.model import kernels
MODEL_DIR = os.path.dirname(os.path.abspath(dsv41.model.__file__)) + os.sep
ROOT = os.path.dirname(MODEL_DIR.rstrip(os.sep)) + os.sep
SKIP = {"aten.detach","aten.view","aten._unsafe_view","aten.alias","aten.lift_fresh","aten.t","aten.transpose","aten.unsqueeze","aten.squeeze","aten.expand","aten.permute","aten.select","aten.slice","aten.as_strided","aten.view_as_real","aten.view_as_complex","aten.unbind","aten.split","aten.split_with_sizes","aten.chunk","aten._reshape_alias","aten.reshape","aten.unflatten","aten.flatten","aten.empty","aten.empty_like","aten.new_empty","aten.empty_strided","aten.tensor_split","aten._conj","aten.resolve_conj","aten.is_same_size","aten.dim","aten.set_","aten.copy_", "aten._local_scalar_dense", "aten.item"}
class Ops(TorchDispatchMode):
    def __init__(s): super().__init__(); s.c = collections.Counter(); s.sites = collections.Counter()
    def __torch_dispatch__(s, func, types, a=(), kw=None):
        name = str(func.overloadpacket)
        f = sys._getframe(1); frames = []
        while f:
            fn = f.f_code.co_filename
            if fn.startswith(MODEL_DIR): frames.append(fn[len(ROOT):] + ":" + str(f.f_lineno) + " " + f.f_code.co_name)
            f = f.f_back
        inside_launch = any("_launch" in fr or " up" in fr[-3:] or "down" in fr.split()[-1] or "combine" in fr.split()[-1] for fr in frames[:1])
        if name not in SKIP and not name.startswith("aten.sym") and not inside_launch:
            s.c[name] += 1
            s.sites[" < ".join(frames[:2]) + "  " + name] += 1
        return func(*a, **(kw or {}))
args = fs.stack_args("tiny", None)
model = fs.build(args, "cpu")
with torch.inference_mode(), kernels.forced():
    kv = fs.fill_cache(model, 200, spare=0)
    cache = model.new_batch_cache(1, 260)
    cache.reserve(260); cache.load(0, kv)
    ids = torch.randint(3, args.vocab_size, (3,))
    model.decode(ids[:1], cache); model.decode(ids[1:2], cache)
    m = Ops()
    with m: model.decode(ids[2:3], cache)
n_layers = len(model.layers)
print("layers", n_layers, "torch ops outside launches", sum(m.c.values()), "per layer", sum(m.c.values()) / n_layers)
for k, v in m.c.most_common(20): print(f"{v:5d} {k}")
for k, v in m.sites.most_common(60): print(f"{v:5d} {k}")
