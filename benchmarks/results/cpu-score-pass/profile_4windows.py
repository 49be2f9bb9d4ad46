# cProfile of one batch of 4 windows of 512 tokens, and one head block timed apart: python benchmarks/results/cpu-score-pass/profile_4windows.py
import torch, time
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.evals import bpb
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir(), device="cpu")
ids = tok.encode(open('docs/architecture.md').read())[:2049]
seqs=[ids[i:i+513] for i in range(0,2048,512)]
import cProfile,pstats
with torch.inference_mode():
    t=time.perf_counter()
    pr=cProfile.Profile(); pr.enable()
    r=bpb.score_sequences(model, seqs, [512]*4, batch_size=8)
    pr.disable()
    print("score 2048 tok", time.perf_counter()-t)
    pstats.Stats(pr).sort_stats('tottime').print_stats(15)
    h=torch.randn(512,64)
    t=time.perf_counter(); bpb.score_positions(model, h, torch.arange(512)); print("head 512", time.perf_counter()-t)
    logits=torch.randn(32,129280)
    t=time.perf_counter(); 
    for _ in range(16): torch.logsumexp(logits,-1)
    print("lse 512", time.perf_counter()-t)
    t=time.perf_counter(); 
    for _ in range(16): model.head(h[:32])
    print("head only 512", time.perf_counter()-t)
    t=time.perf_counter(); 
    for _ in range(16): logits.argmax(-1)
    print("argmax 512", time.perf_counter()-t)
