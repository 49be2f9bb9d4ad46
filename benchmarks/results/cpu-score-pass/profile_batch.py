# One and two scoring threads over docs/architecture.md, then cProfile of one 8-window batch: python benchmarks/results/cpu-score-pass/profile_batch.py
import torch, time, sys
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.evals import bpb
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir(), device="cpu")
text=open('docs/architecture.md').read()
t0=time.perf_counter(); ids = tok.encode(text, allow_special=False); print("tokenize", time.perf_counter()-t0, len(ids))
seqs=[];ns=[]
for s,n in bpb.rolling_windows(ids, tok.bos_id, 512, None): seqs.append(s); ns.append(n)
print(len(seqs), [len(s) for s in seqs][:3])
import os
with torch.inference_mode():
    for th in ("1","2"):
        os.environ["DSV41_THREADS"]=th
        t0=time.perf_counter(); r=bpb.score_sequences(model, seqs, ns, batch_size=8); print("threads", th, time.perf_counter()-t0)
    import cProfile, pstats
    os.environ["DSV41_THREADS"]="1"
    pr=cProfile.Profile(); pr.enable(); bpb.score_sequences(model, seqs[:8], ns[:8], batch_size=8); pr.disable()
    pstats.Stats(pr).sort_stats('tottime').print_stats(14)
