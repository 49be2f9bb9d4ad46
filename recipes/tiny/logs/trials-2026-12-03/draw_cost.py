"""Seconds to draw 300 pictures of v2 style 1 and of the robust style 3 (data.make_example), one core, after a
warm-up, the two alternating three times: `python recipes/tiny/logs/trials-2026-12-03/draw_cost.py`."""
import random, time
from dsv41.recipes.tiny.vision import data as D
for v in (1, 3):
    D.make_example(random.Random(0), variety=v)  # warm-up: imports, fonts
out = {}
for v in (1, 3, 1, 3, 1, 3):
    r = random.Random(1); t = time.perf_counter()
    for _ in range(300):
        D.make_example(r, variety=v)
    out.setdefault(v, []).append(round(time.perf_counter() - t, 3))
print(out)
