"""The largest logit difference d that tests/test_dspark_greedy.py's bundled-model test bounds (BUNDLED_BOUND): the
README's main prompt (thinking, effort 75), 48 greedy tokens, DSpark's output teacher-forced through one-token steps.
Run from the repository root, once per CPU flavour:
    python recipes/tiny/logs/trials-2026-12-03/dspark_bound.py
    ATEN_CPU_CAPABILITY=avx2 python recipes/tiny/logs/trials-2026-12-03/dspark_bound.py
    ATEN_CPU_CAPABILITY=default python recipes/tiny/logs/trials-2026-12-03/dspark_bound.py
(dspark_bound_s36.txt: the checkpoint after stage 36, 2026-12-03.)"""
import sys

sys.path.insert(0, ".")
from dsv41.model import encoding
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import Generator

from tests.test_dspark_greedy import trace

model, args, tok = load_model(bundled_model_dir())
text = encoding.encode_messages([{"role": "user", "content": "Add: 7 3 9 2 5"}], mode="thinking", effort=75)
ids = tok.encode(text, allow_special=True)
d = trace(Generator(model, tok), ids, 48, run_plain=False, think_end_id=tok.token_to_id(encoding.THINK_END))["diff"]
k = max(range(len(d)), key=lambda i: d[i])
print(f"max {max(d):.2f} at token {k}; max elsewhere {max(x for i, x in enumerate(d) if i != k):.2f}")
