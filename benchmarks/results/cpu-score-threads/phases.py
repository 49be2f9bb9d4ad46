# The phases of `dsv41 bpb docs/architecture.md` in one process: load, tokenize, score (DSV41_THREADS=1 or 2;
# run from the tree to measure, with its folder first on PYTHONPATH).
import time, torch
t0=time.time()
from dsv41.model.checkpoint import load_model
from dsv41.model.assets import bundled_model_dir
from dsv41.evals import bpb
t1=time.time()
torch.set_num_threads(1)
model,args,tok=load_model(bundled_model_dir())
t2=time.time()
c=bpb.load_corpus('docs/architecture.md')
ids=bpb.tokenize_corpus(tok,c)
t3=time.time()
docs=bpb.score_corpus(model,tok,c,512,token_ids=ids)
t4=time.time()
print(f"import {t1-t0:.2f} load {t2-t1:.2f} tokenize {t3-t2:.2f} score {t4-t3:.2f}", docs[0].nll_nats if hasattr(docs[0],'nll_nats') else docs[0])
