"""dsv41-tiny v2 vision: the independent evaluation set (recipes/tiny/vision/independent.py), its evaluation through
the generation engine, and the training generator's variety option (recipes/tiny/vision/data.py)."""

from __future__ import annotations

import colorsys
import hashlib
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL.Image")

from dsv41.recipes.tiny.vision import data as D  # noqa: E402
from dsv41.recipes.tiny.vision import independent as I  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAINING_MODULES = ("recipes/tiny/vision/data.py", "recipes/tiny/vision/train.py", "recipes/tiny/train.py")


def test_independent_pictures_are_reproducible_and_show_their_labels():
    a, b = I.picture(7), I.picture(7)
    assert a.image.tobytes() == b.image.tobytes() and a.facts == b.facts and a.questions == b.questions
    pictures = [I.picture(i) for i in range(24)]  # every colour, shape and background
    for p in pictures:
        assert I.in_range(p.colour, p.rgb) and p.facts == {"colour": p.colour, "shape": p.shape}
        w, h = p.image.size
        assert 32 <= min(w, h) and max(w, h) <= 1024 and p.size_bucket in (w, h)
        # a solid patch of exactly the sampled shade: at least half the smallest shape's area
        dist = np.abs(np.asarray(p.image).astype(float) - np.array(p.rgb)).sum(axis=2)
        assert (dist < 6).sum() >= 0.5 * 3 * (0.14 * min(w, h)) ** 2 * 0.5
    assert {p.colour for p in pictures} == set(I.COLOUR_NAMES) and {p.shape for p in pictures} == set(I.SHAPE_NAMES)
    assert {p.background for p in pictures} == set(I.BACKGROUNDS)


def test_rasterized_shapes_have_the_right_area_and_vertices():
    for shape, area in (("circle", np.pi), ("square", 2.0), ("triangle", 3 * np.sqrt(3) / 4)):
        cov = I.coverage(shape, 200, 200, 100.0, 100.0, 60.0, 0.0)
        assert abs(cov.sum() / 60.0**2 - area) < 0.02, shape
    star = I.coverage("star", 200, 200, 100.0, 100.0, 60.0, 0.0)
    assert star[100, 100] == 1.0 and star[100 - 58, 100] > 0 and star[100 - 30, 100 - 30] == 0  # a tip, a notch


def test_every_size_phrasing_and_background_is_covered():
    plans = [I.assignment(i) for i in range(240)]
    assert I.picture(5).size_bucket == plans[5]["bucket"] and I.picture(5).questions == plans[5]["questions"]
    assert {p["bucket"] for p in plans} == set(I.SIZE_BUCKETS) and (min(I.SIZE_BUCKETS), max(I.SIZE_BUCKETS)) == (32, 1024)
    assert {p["questions"]["shape"] for p in plans} == set(I.SHAPE_PHRASINGS) and "What shape is it?" in I.SHAPE_PHRASINGS
    assert {p["questions"]["colour"] for p in plans} == set(I.COLOUR_PHRASINGS)
    assert {p["background"] for p in plans} == set(I.BACKGROUNDS)
    pairs = {(p["colour"], p["shape"]) for p in plans}
    assert len(pairs) == 24  # every colour with every shape


def test_the_training_generator_never_uses_the_independent_set():
    import re

    for path in TRAINING_MODULES:
        text = (REPO / path).read_text()
        assert not re.search(r"^\s*(from|import)\s[^\n]*independent", text, re.MULTILINE), path
    code = ("import random, sys\n"
            "from dsv41.recipes.tiny.vision import data, train\n"
            "import dsv41.recipes.tiny.train\n"
            "rng = random.Random(0)\n"
            "[data.make_example(rng, variety=True) for _ in range(4)]\n"
            "print('dsv41.recipes.tiny.vision.independent' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
    # and its phrasings are not training's, but for the one reference wording per question
    training = set(D.VARIETY_COLOUR_QUESTIONS + D.VARIETY_SHAPE_QUESTIONS + D.COLOUR_QUESTIONS + D.SHAPE_QUESTIONS)
    assert (set(I.COLOUR_PHRASINGS + I.SHAPE_PHRASINGS) & training) == set(I.REFERENCE.values())


def test_variety_examples_span_shades_sizes_and_answer_in_one_form():
    rng = random.Random(3)
    sizes, hues = [], {c: [] for c in D.COLOURS}
    for _ in range(60):
        size = D.variety_size(rng)
        sizes += list(size)
        ex = D.make_example(rng, kind="shape", size=size, variety=True)
        assert ex.image.size == size and ex.reasoning == f"I see {D.a(ex.facts['colour'])} {ex.facts['shape']}."
        assert ex.answer == {"colour": f"{ex.facts['colour'].capitalize()}.",
                             "shape": f"{D.a(ex.facts['shape']).capitalize()}.",
                             "describe": f"{D.a(ex.facts['colour']).capitalize()} {ex.facts['shape']}."}[ex.question_type]
        assert ex.question in {"colour": D.VARIETY_COLOUR_QUESTIONS, "shape": D.VARIETY_SHAPE_QUESTIONS,
                               "describe": D.VARIETY_DESCRIBE}[ex.question_type]
    assert min(sizes) < 48 and max(sizes) > 600 and all(32 <= s <= 1024 for s in sizes)
    for name in D.COLOURS:
        for _ in range(20):
            r, g, b = D.variety_rgb(name, rng)
            hues[name].append(colorsys.rgb_to_hls(r / 255, g / 255, b / 255)[0] * 360)
    assert max(hues["green"]) - min(hues["green"]) > 30 and max(hues["blue"]) - min(hues["blue"]) > 20
    counted = D.make_example(rng, kind="count", question_type="count", size=(300, 200), variety=True)
    assert counted.answer == D.NUMBER_WORDS[counted.facts["count"]].capitalize() + "."


def test_without_variety_the_generator_draws_what_stages_1_to_16_drew():
    """The questions, answers, sizes and the random stream of the v1 generator are unchanged (the digest was
    taken from the generator as it was before the variety option)."""
    rng = random.Random(123)
    h = hashlib.sha256()
    for _ in range(12):
        e = D.make_example(rng)
        h.update((e.question + e.reasoning + e.answer + str(e.image.size)).encode())
    assert h.hexdigest()[:16] == "cca1f202e530d304" and rng.random() == 0.5028295801565243


def _tilts(variety, monkeypatch, n=300):
    """(shape, tilt) of every polygon the generator draws for n shape pictures, and the random stream after."""
    seen = []
    polygon = D._polygon

    def record(shape, cx, cy, r, angle):
        seen.append((shape, angle))
        return polygon(shape, cx, cy, r, angle)

    with monkeypatch.context() as patch:
        patch.setattr(D, "_polygon", record)
        rng = random.Random(41)
        texts = [D.make_example(rng, kind="shape", size=(64, 48), variety=variety) for _ in range(n)]
    return seen, [(e.question, e.answer) for e in texts], rng.random()


def test_any_turn_draws_every_orientation_and_changes_nothing_else(monkeypatch):
    """variety=2 turns squares, triangles and stars anywhere within their symmetry; variety=True keeps stages
    17-30's small tilts; the questions, answers and the random stream are the same (one draw either way)."""
    import math

    small, qa_small, after_small = _tilts(True, monkeypatch)
    any_, qa_any, after_any = _tilts(2, monkeypatch)
    assert qa_small == qa_any and after_small == after_any
    for shape, limit in D.ANY_TURN.items():
        old = [abs(t) for s, t in small if s == shape]
        new = [abs(t) for s, t in any_ if s == shape]
        assert old and new and max(old) <= (0.2 if shape == "star" else 0.3)
        assert max(new) <= limit and max(new) > 0.8 * limit  # reaches near the symmetry's edge
    assert math.isclose(D.ANY_TURN["square"], math.pi / 4)


def test_robust_pictures_vary_how_they_are_drawn_and_keep_the_facts(monkeypatch):
    """variety=3 (stage 32): the same kinds of picture and question as variety=1, drawn at any scale of 1-3
    (within ROBUST's cap), a share of them blurred, and the dark and mid-grey canvases twice as likely."""
    import collections

    scales, kinds = collections.Counter(), collections.Counter()
    real_canvas, real_background = D._variety_canvas, D.variety_background

    def canvas(w, h, rng, robust=False):
        image, scale, dark = real_canvas(w, h, rng, robust)
        scales[scale] += 1
        assert max(w, h) * scale <= D.ROBUST["max_drawn_side"] or scale == 1
        return image, scale, dark

    def background(kind, w, h, rng):
        kinds[kind] += 1
        return real_background(kind, w, h, rng)

    rng = random.Random(3)
    with monkeypatch.context() as patch:
        patch.setattr(D, "_variety_canvas", canvas)
        patch.setattr(D, "variety_background", background)
        examples = [D.make_example(rng, kind="shape", size=(48, 40), variety=3) for _ in range(420)]
    assert set(scales) == {1, 2, 3}
    assert kinds["dark"] > 1.5 * kinds["white"] and kinds["mid grey"] > 1.5 * kinds["light grey"]
    for e in examples:
        assert e.image.size == (48, 40) and e.facts["shape"] in D.SHAPES and e.facts["colour"] in D.COLOURS
        assert e.answer in ({f"{e.facts['colour'].capitalize()}.", f"{D.a(e.facts['shape']).capitalize()}."}
                            | {f"{D.a(e.facts['colour']).capitalize()} {e.facts['shape']}."})
    big = D.make_example(random.Random(4), kind="shape", size=(1024, 900), variety=3)
    assert big.image.size == (1024, 900)  # drawn at scale 1: the cap is 1024 px drawn


def test_robust_blur_applies_to_its_share_and_softens_edges(monkeypatch):
    import numpy as np
    from PIL import Image

    sharp = Image.new("RGB", (40, 40), (255, 255, 255))
    sharp.paste((200, 0, 0), (10, 10, 30, 30))
    def edge(im) -> int:
        return int(np.abs(np.diff(np.asarray(im, dtype=np.int16), axis=1)).max())

    rng = random.Random(0)
    out = [D._finish(sharp, 40, 40, rng) for _ in range(400)]
    soft = [o for o in out if edge(o) < edge(sharp)]
    assert 0.2 < len(soft) / len(out) < 0.4  # ROBUST's blur share, 0.3
    assert all(np.array_equal(np.asarray(o), np.asarray(sharp)) for o in out if edge(o) == edge(sharp))
    assert D._finish(sharp, 40, 40) is sharp  # without an rng (styles 1 and 2) nothing is blurred


def test_variety_batches_share_one_canvas_and_encode():
    from dsv41.model.config import ModelArgs
    from dsv41.model.image_processor import plan_image_grid
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.vision.train import VISION, make_batch

    args = ModelArgs().replace(**VISION)
    tok = load_tokenizer()
    ids, images, target = make_batch(random.Random(5), 3, tok, args, tok.eos_id, variety=True)
    assert ids.shape[0] == 3 and target.any(dim=1).all()
    assert len({(img[0].vit_h, img[0].vit_w) for img in images}) == 1
    for side in (32, 1024):  # the preprocessor upscales the smallest and caps the largest at 64 positions
        assert plan_image_grid(side, side, args).n_tokens <= args.vision_max_n_token


def test_variety_share_mixes_batches_and_replays_the_pure_stages():
    """A share strictly between 0 and 1 draws each batch's kind from its own generator, about that share of
    them v2; shares 0 and 1 draw nothing, so the stages trained before the mix replay step for step."""
    from dsv41.recipes.tiny.vision.train import variety_step

    for share, expected in ((0.0, False), (False, False), (1.0, True), (True, True)):
        rng = random.Random(9)
        assert all(variety_step(rng, share) is expected for _ in range(50))
        assert rng.random() == random.Random(9).random()  # nothing drawn
    rng = random.Random(9)
    kinds = [variety_step(rng, 0.3) for _ in range(2000)]
    assert 0.26 < sum(kinds) / len(kinds) < 0.34
    rng = random.Random(9)
    assert kinds[:20] == [variety_step(rng, 0.3) for _ in range(20)]


@pytest.mark.parametrize("module,flag", [("dsv41.recipes.tiny.train", "--vision-variety-share"),
                                         ("dsv41.recipes.tiny.vision.train", "--variety-share")])
def test_a_share_outside_0_1_is_a_usage_error(module, flag, tmp_path, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main([flag, "1.5", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "must be in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_independent_evaluation_runs_the_bundled_model_through_the_engine():
    from dsv41.recipes.tiny.vision import accuracy as A
    from dsv41.recipes.tiny.vision.independent_eval import evaluate

    bundled = REPO / "model" / "assets" / "dsv41-tiny"
    report = evaluate(bundled, n=3, modes=("chat",), batch=3)
    for q in ("colour", "shape"):
        row = report["accuracy"][f"chat/{q}"]
        assert row["n"] == 3 and 0 <= row["right"] <= 3
        assert sum(v["n"] for v in report["breakdown"][f"chat/{q}"]["by_size"].values()) == 3
        assert sum(sum(r.values()) for r in report["confusion"][f"chat/{q}"].values()) == 3
    p = I.picture(0)
    assert A.score("colour", p, f"{p.colour.capitalize()}.") and not A.score("shape", p, "Nothing.")
