"""cProfile of 20 prefill forwards of one N-token prompt (after 3 warm-up), one torch thread, the bundled model; the 30
functions of most internal time. Ad hoc; its numbers are in NOTES.md.

    python benchmarks/results/cpu-prefill-lane/prefill_profile.py 8
"""
import cProfile, pstats, time, torch, sys
from dsv41.model.assets import bundled_model_dir
from dsv41.model.checkpoint import load_model
torch.set_num_threads(1)
model, args, tok = load_model(bundled_model_dir())
n = int(sys.argv[1])
ids = torch.randint(1000, 60000, (1, n))
with torch.inference_mode():
    for _ in range(3): model(ids, 0, model.new_cache(1))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): model(ids, 0, model.new_cache(1))
    pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(30)
