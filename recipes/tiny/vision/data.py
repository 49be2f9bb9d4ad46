"""Synthetic images with questions and answers, drawn on the fly: the vision tower's training data and
its held-out evaluation set. Nothing is downloaded; a seed fixes every image.

Three kinds of picture, on a white or light background, at a random canvas size:

    shape   one shape (circle, square, triangle, star) in one of six colours, random size and place
    count   two to four shapes of one kind and colour, not overlapping
    text    a short word (CAT, DOG, ...) in dark letters

Each example is (image, question, reasoning, answer). The reasoning goes between `<think>` and
`</think>` in thinking mode; chat mode answers at once:

    "What is in the image?"        -> reasoning "I see a red circle."   answer "A red circle."
    "What color is the shape?"     -> "The shape is red."               "Red."
    "What shape is this?"          -> "It is a circle."                 "A circle."
    "How many shapes are there?"   -> "I count three red circles."      "Three."
    "What does the text say?"      -> 'The text reads "CAT".'           'It says "CAT".'
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

COLOURS = {
    "red": (215, 35, 35), "green": (40, 160, 50), "blue": (35, 70, 215),
    "yellow": (235, 205, 25), "orange": (245, 135, 25), "purple": (135, 45, 175),
}
SHAPES = ("circle", "square", "triangle", "star")
WORDS = ("CAT", "DOG", "SUN", "TREE", "BOOK", "FISH", "STOP", "HELLO")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}

DESCRIBE = ("What is in the image?", "Describe the image.", "What do you see in this picture?")
COLOUR_QUESTIONS = ("What color is the shape?", "What colour is it?", "Which color is the shape in the image?")
SHAPE_QUESTIONS = ("What shape is this?", "What shape is in the image?", "Which shape do you see?")
COUNT_QUESTIONS = ("How many shapes are there?", "How many shapes do you see?", "Count the shapes in the image.")
TEXT_QUESTIONS = ("What does the text say?", "What is written in the image?", "Read the text in the image.")

# canvas sides in pixels (multiples of 14 keep training images free of padding; random aspect)
SIDES = (56, 70, 84, 98, 112, 140, 168)
# sides that are not multiples of 14, so the preprocessor pads them with grey (as it pads most real images);
# drawn only where a stage asks for them (recipes/tiny/vision/train.py --padded-sides), and none of them is
# a held-out side (recipes/tiny/vision/accuracy.py EVAL_SIDES)
PADDED_SIDES = (60, 66, 75, 90, 106, 120, 130, 160)
# larger padded sides, up to 6 image tokens per side (168 px, the largest of SIDES, gives 4): stage 16 of
# the recipe (--large-sides); 224, a held-out side, gives 6
LARGE_SIDES = (180, 200, 230)


@dataclass
class Example:
    image: object  # PIL.Image
    kind: str  # shape | count | text
    question: str
    question_type: str  # describe | colour | shape | count | read
    reasoning: str
    answer: str
    facts: dict  # colour, shape, count, word: what the picture holds


def _background(rng: random.Random):
    if rng.random() < 0.5:
        return (255, 255, 255)
    return tuple(rng.randint(225, 255) for _ in range(3))


def _jitter(colour, rng: random.Random, amount: int = 18):
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if shape == "square":
        corners = [(math.cos(angle + math.pi / 4 + k * math.pi / 2), math.sin(angle + math.pi / 4 + k * math.pi / 2))
                   for k in range(4)]
        return [(cx + r * x, cy + r * y) for x, y in corners]
    if shape == "triangle":
        return [(cx + r * math.cos(angle - math.pi / 2 + k * 2 * math.pi / 3),
                 cy + r * math.sin(angle - math.pi / 2 + k * 2 * math.pi / 3)) for k in range(3)]
    if shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            a = angle - math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
        return points
    raise ValueError(shape)


# any_turn: a turn anywhere within the shape's symmetry (a square repeats every quarter turn, a triangle every
# third, a five-pointed star every fifth), so every orientation is drawn; otherwise the small tilts of stages 1-30
ANY_TURN = {"square": math.pi / 4, "triangle": math.pi / 3, "star": math.pi / 5}


def draw_shape(draw, shape: str, cx: float, cy: float, r: float, colour, rng: random.Random,
               any_turn: bool = False) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        limit = ANY_TURN[shape] if any_turn else (0.3 if shape != "star" else 0.2)
        tilt = rng.uniform(-limit, limit)  # one draw either way: the rest of the picture is drawn as before
        draw.polygon(_polygon(shape, cx, cy, r, tilt), fill=colour)


def shape_image(w: int, h: int, shape: str, colour: str, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (w, h), _background(rng))
    side = min(w, h)
    r = rng.uniform(0.22, 0.42) * side
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, _jitter(COLOURS[colour], rng), rng)
    return image


def _place(n: int, r: float, w: float, h: float, rng) -> tuple[list[tuple[float, float]], float]:
    """n centres of shapes of radius r inside a w x h canvas, pairwise more than 2.2 r apart: rejection
    sampling, the radius shrunk by 0.85 (and the placement restarted) when 200 tries find no room.
    Returns (centres, the radius used)."""
    placed: list[tuple[float, float]] = []
    while len(placed) < n:
        for _ in range(200):
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            if all((cx - x) ** 2 + (cy - y) ** 2 > (2.2 * r) ** 2 for x, y in placed):
                placed.append((cx, cy))
                break
        else:
            r *= 0.85
            placed = []
    return placed, r


def count_image(w: int, h: int, shape: str, colour: str, n: int, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (w, h), _background(rng))
    draw = ImageDraw.Draw(image)
    side = min(w, h)
    r = side * {1: 0.3, 2: 0.2, 3: 0.17, 4: 0.15}[n]
    placed, r = _place(n, r, w, h, rng)
    fill = _jitter(COLOURS[colour], rng)
    for cx, cy in placed:
        draw_shape(draw, shape, cx, cy, r, fill, rng)
    return image


def text_image(w: int, h: int, word: str, rng: random.Random):
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (w, h), _background(rng))
    draw = ImageDraw.Draw(image)
    size = int(min(h * 0.45, w * 1.5 / max(len(word), 1)))
    font = ImageFont.load_default(size=max(size, 10))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    x = rng.uniform(0, max(0.0, w - (right - left))) - left
    y = rng.uniform(0, max(0.0, h - (bottom - top))) - top
    draw.text((x, y), word, fill=tuple(rng.randint(0, 60) for _ in range(3)), font=font)
    return image


def plural(shape: str) -> str:
    return shape + "s"


def a(word: str) -> str:
    """"a red ..." but "an orange ..."."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def make_example(rng: random.Random, kind: str | None = None, question_type: str | None = None,
                 size: tuple[int, int] | None = None, variety: int = False) -> Example:
    """One example; `kind` and `question_type` are drawn when not given, `size` is (width, height).
    variety=True (1): the v2 pictures and questions (`variety_example`, below; stages 1-16 never drew them);
    variety=2: the same with the shapes turned to any orientation (stage 31);
    variety=3: v2 drawn less uniformly (`ROBUST`: any drawing scale, blur, more dark and mid-grey canvases; stage 32)."""
    if variety:
        return variety_example(rng, kind, question_type, size, any_turn=variety == 2, robust=variety == 3)
    w, h = size or (rng.choice(SIDES), rng.choice(SIDES))
    kind = kind or rng.choices(("shape", "count", "text"), weights=(0.6, 0.2, 0.2))[0]
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    if kind == "shape":
        image = shape_image(w, h, shape, colour, rng)
        qt = question_type or rng.choice(("describe", "colour", "shape"))
        facts = {"colour": colour, "shape": shape, "count": 1}
        if qt == "describe":
            q, reasoning, answer = rng.choice(DESCRIBE), f"I see {a(colour)} {shape}.", f"{a(colour).capitalize()} {shape}."
        elif qt == "colour":
            q, reasoning, answer = rng.choice(COLOUR_QUESTIONS), f"The shape is {colour}.", f"{colour.capitalize()}."
        else:
            q, reasoning, answer = rng.choice(SHAPE_QUESTIONS), f"It is {a(shape)}.", f"{a(shape).capitalize()}."
    elif kind == "count":
        n = rng.randint(2, 4)
        image = count_image(w, h, shape, colour, n, rng)
        qt = question_type or rng.choice(("describe", "count"))
        facts = {"colour": colour, "shape": shape, "count": n}
        words = f"{NUMBER_WORDS[n]} {colour} {plural(shape)}"
        if qt == "describe":
            q, reasoning, answer = rng.choice(DESCRIBE), f"I see {words}.", f"{words.capitalize()}."
        else:
            q, reasoning, answer = rng.choice(COUNT_QUESTIONS), f"I count {words}.", f"{NUMBER_WORDS[n].capitalize()}."
    elif kind == "text":
        word = rng.choice(WORDS)
        image = text_image(w, h, word, rng)
        qt = question_type or "read"
        facts = {"word": word}
        q = rng.choice(TEXT_QUESTIONS)
        reasoning, answer = f'The text reads "{word}".', f'It says "{word}".'
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return Example(image, kind, q, qt, reasoning, answer, facts)


# ------------------------------------------------------------------------------------ v2: variety
# `make_example(..., variety=True)`: the pictures and questions of the v2 vision stages (recipes/tiny/README.md,
# "v2 plan"). Nothing above changes, so stages 1-16 draw exactly what they drew. Drawn with PIL.ImageDraw as
# above; the evaluation set of recipes/tiny/vision/independent.py is other code with other ranges, and none of it is used here.
#
#   shades       each colour name is a box in HLS space (hue in degrees, lightness, saturation), sampled uniformly
#   backgrounds  white or light (as v1), light grey, mid grey, dark, a two-colour gradient, speckle noise
#   canvases     sides log-uniform in 32..1024 px (random aspect), the shape anywhere, its radius 12-45% of the
#                smaller side; below 300 px drawn at 2x and shrunk (anti-aliased edges), above it drawn directly
#   questions    many phrasings per question type (VARIETY_*), none of them one of the evaluation set's but its reference
#   answers      one form: the reasoning always says what is seen ("I see a red circle."), the answer gives the
#                part asked for: "Red." / "A circle." / "A red circle." / "Three." / 'It says "CAT".'
HLS_BOXES = {  # name -> (hue range in degrees, lightness range, saturation range); red wraps through 0
    "red": ((-9.0, 7.0), (0.30, 0.58), (0.62, 1.00)),
    "orange": ((20.0, 35.0), (0.45, 0.62), (0.85, 1.00)),
    "yellow": ((46.0, 60.0), (0.45, 0.62), (0.80, 1.00)),
    "green": ((90.0, 150.0), (0.22, 0.55), (0.45, 1.00)),
    "blue": ((203.0, 240.0), (0.25, 0.62), (0.55, 1.00)),
    "purple": ((265.0, 295.0), (0.22, 0.52), (0.40, 0.90)),
}
VARIETY_SIDE_RANGE = (32, 1024)
VARIETY_BACKGROUNDS = ("white", "light", "light grey", "mid grey", "dark", "gradient", "speckle")
VARIETY_COLOUR_QUESTIONS = (
    "What color is the shape?", "What colour is the shape?", "What colour is it?", "What color is this?",
    "Which color is the shape in the image?", "Which colour does the shape have?", "What is the color of the shape?",
    "What colour is the object?", "Say the color of the shape.", "Color of the shape?", "What color do you see?",
    "Which colour is shown?", "What color is the thing in the image?", "Identify the colour of the shape.")
VARIETY_SHAPE_QUESTIONS = (
    "What shape is this?", "What shape is in the image?", "Which shape do you see?", "What shape is shown?",
    "What is the shape?", "Which shape is it?", "Identify the shape.", "What shape do you see here?",
    "Shape?", "What is the shape of the object?", "Which figure is in the image?", "What shape is the object?",
    "Tell me which shape this is.", "What shape has been drawn?")
VARIETY_DESCRIBE = DESCRIBE + ("What is shown?", "Describe the picture.", "What do you see?", "What is this?")
VARIETY_COUNT_QUESTIONS = COUNT_QUESTIONS + ("How many are there?", "How many shapes can you count?")
VARIETY_TEXT_QUESTIONS = TEXT_QUESTIONS + ("What word is shown?", "Which word is written here?")


def variety_rgb(name: str, rng: random.Random) -> tuple[int, int, int]:
    import colorsys

    (h0, h1), (l0, l1), (s0, s1) = HLS_BOXES[name]
    r, g, b = colorsys.hls_to_rgb((rng.uniform(h0, h1) % 360.0) / 360.0, rng.uniform(l0, l1), rng.uniform(s0, s1))
    return round(r * 255), round(g * 255), round(b * 255)


def variety_background(kind: str, w: int, h: int, rng: random.Random):
    """(PIL image, whether it is dark)."""
    from PIL import Image

    if kind in ("white", "light"):
        return Image.new("RGB", (w, h), _background(rng)), False
    if kind == "light grey":
        g = rng.randint(195, 235)
        return Image.new("RGB", (w, h), (g, g, g)), False
    if kind == "mid grey":
        g = rng.randint(110, 165)
        return Image.new("RGB", (w, h), (g, g, g)), False
    if kind == "dark":
        return Image.new("RGB", (w, h), tuple(rng.randint(0, 50) for _ in range(3))), True
    import numpy as np

    if kind == "gradient":
        a, b = (np.array([rng.randint(180, 255) for _ in range(3)], np.float32) for _ in range(2))
        ramp = np.linspace(0.0, 1.0, h if rng.random() < 0.5 else w, dtype=np.float32)
        ramp = ramp[:, None] if len(ramp) == h else ramp[None, :]
        pixels = a + (b - a) * np.broadcast_to(ramp, (h, w))[..., None]
        return Image.fromarray(pixels.astype(np.uint8), "RGB"), False
    if kind == "speckle":
        base = rng.randint(205, 245)
        noise = np.random.default_rng(rng.getrandbits(32)).integers(-14, 15, (h, w, 1))
        return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8).repeat(3, axis=2), "RGB"), False
    raise ValueError(kind)


def variety_size(rng: random.Random) -> tuple[int, int]:
    lo, hi = VARIETY_SIDE_RANGE
    side = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    other = min(hi, max(lo, round(side * rng.uniform(0.6, 1.6))))
    return (side, other) if rng.random() < 0.5 else (other, side)


# robust (variety=3, stage 32): after stage 30 the shapes the tower missed on pictures drawn by other code were
# the ones on the near-black canvas (18 of 33 right) and on mid grey, gradients and noise (76-79%), and squares read
# as circles at the small and the 128 px sides. Three changes, none of them a property of the evaluation set's
# generator: the drawing scale is any of 1-3 at every size (edges hard or smoothed whatever the canvas), a light
# blur on some pictures (edges that are not crisp), and the dark and mid-grey canvases drawn twice as often.
ROBUST = {"scales": (1, 2, 3), "max_drawn_side": 1024, "blur_share": 0.3, "blur_radius": (0.3, 1.2),
          "blur_max_side": 384, "backgrounds": VARIETY_BACKGROUNDS + ("dark", "mid grey")}


def _variety_canvas(w: int, h: int, rng: random.Random, robust: bool = False):
    """(background image at the drawing scale, drawing scale, dark?)"""
    if robust:
        scales = [s for s in ROBUST["scales"] if max(w, h) * s <= ROBUST["max_drawn_side"]] or [1]
        scale, kinds = rng.choice(scales), ROBUST["backgrounds"]
    else:
        scale, kinds = (2 if max(w, h) <= 300 else 1), VARIETY_BACKGROUNDS
    image, dark = variety_background(rng.choice(kinds), w * scale, h * scale, rng)
    return image, scale, dark


def _finish(image, w: int, h: int, rng: random.Random | None = None):
    """Shrink to (w, h); with `rng` (robust pictures) blur a share of them lightly, at sides up to 384 px (the
    image processor shrinks larger pictures to about 294 px square, which would undo most of a blur there)."""
    from PIL import Image, ImageFilter

    image = image if image.size == (w, h) else image.resize((w, h), Image.LANCZOS)
    if rng is not None and rng.random() < ROBUST["blur_share"] and max(w, h) <= ROBUST["blur_max_side"]:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(*ROBUST["blur_radius"])))
    return image


def variety_example(rng: random.Random, kind: str | None = None, question_type: str | None = None,
                    size: tuple[int, int] | None = None, any_turn: bool = False, robust: bool = False) -> Example:
    from PIL import ImageDraw, ImageFont

    w, h = size or variety_size(rng)
    kind = kind or rng.choices(("shape", "count", "text"), weights=(0.7, 0.15, 0.15))[0]
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    image, k, dark = _variety_canvas(w, h, rng, robust)
    blur = rng if robust else None
    draw = ImageDraw.Draw(image)
    W, H = image.size
    if kind in ("shape", "count"):
        n = 1 if kind == "shape" else rng.randint(2, 4)
        fill = variety_rgb(colour, rng)
        r = (rng.uniform(0.12, 0.45) if n == 1 else {2: 0.2, 3: 0.17, 4: 0.15}[n] * rng.uniform(0.8, 1.1)) * min(W, H)
        placed, r = _place(n, r, W, H, rng)
        for cx, cy in placed:
            draw_shape(draw, shape, cx, cy, r, fill, rng, any_turn)
        image = _finish(image, w, h, blur)
        seen = f"{a(colour)} {shape}" if n == 1 else f"{NUMBER_WORDS[n]} {colour} {plural(shape)}"
        facts = {"colour": colour, "shape": shape, "count": n}
        if kind == "shape":
            qt = question_type or rng.choice(("describe", "colour", "shape", "colour", "shape"))
            q = rng.choice({"describe": VARIETY_DESCRIBE, "colour": VARIETY_COLOUR_QUESTIONS,
                            "shape": VARIETY_SHAPE_QUESTIONS}[qt])
            answer = {"describe": f"{seen.capitalize()}.", "colour": f"{colour.capitalize()}.",
                      "shape": f"{a(shape).capitalize()}."}[qt]
        else:
            qt = question_type or rng.choice(("describe", "count"))
            q = rng.choice(VARIETY_DESCRIBE if qt == "describe" else VARIETY_COUNT_QUESTIONS)
            answer = f"{seen.capitalize()}." if qt == "describe" else f"{NUMBER_WORDS[n].capitalize()}."
        return Example(image, kind, q, qt, f"I see {seen}.", answer, facts)
    if kind == "text":
        word = rng.choice(WORDS)
        size_px = int(min(H * 0.45, W * 1.5 / len(word)))
        font = ImageFont.load_default(size=max(size_px, 10))
        left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
        x = rng.uniform(0, max(0.0, W - (right - left))) - left
        y = rng.uniform(0, max(0.0, H - (bottom - top))) - top
        ink = tuple(rng.randint(205, 255) for _ in range(3)) if dark else tuple(rng.randint(0, 60) for _ in range(3))
        draw.text((x, y), word, fill=ink, font=font)
        qt = question_type or "read"
        return Example(_finish(image, w, h, blur), kind, rng.choice(VARIETY_TEXT_QUESTIONS), qt,
                       f'I see the word "{word}".', f'It says "{word}".', {"word": word})
    raise ValueError(f"unknown kind {kind!r}")
