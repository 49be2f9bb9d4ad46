"""The phases of `dsv41 bpb docs/architecture.md` in one process: load, tokenize, score, wall seconds each, and the
document's negative log-likelihood (the same at any thread count). Run from the tree to measure, its folder first
on PYTHONPATH: `DSV41_THREADS=1 python benchmarks/results/cpu-score-threads/phases.py` (or 2)."""

import time

import torch

from dsv41.evals import bpb
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model

torch.set_num_threads(1)  # as tune_threads does for the bundled model
t0 = time.perf_counter()
model, args, tok = load_model(bundled_model_dir())
t1 = time.perf_counter()
corpus = bpb.load_corpus("docs/architecture.md")
ids = bpb.tokenize_corpus(tok, corpus)
t2 = time.perf_counter()
docs = bpb.score_corpus(model, tok, corpus, 512, token_ids=ids)
t3 = time.perf_counter()
print(f"load {t1 - t0:.2f} s, tokenize {t2 - t1:.2f} s, score {t3 - t2:.2f} s, nll {docs[0].nll!r}")
