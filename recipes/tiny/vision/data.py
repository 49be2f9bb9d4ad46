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


def draw_shape(draw, shape: str, cx: float, cy: float, r: float, colour, rng: random.Random) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        tilt = rng.uniform(-0.3, 0.3) if shape != "star" else rng.uniform(-0.2, 0.2)
        draw.polygon(_polygon(shape, cx, cy, r, tilt), fill=colour)


def shape_image(w: int, h: int, shape: str, colour: str, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (w, h), _background(rng))
    side = min(w, h)
    r = rng.uniform(0.22, 0.42) * side
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, _jitter(COLOURS[colour], rng), rng)
    return image


def count_image(w: int, h: int, shape: str, colour: str, n: int, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (w, h), _background(rng))
    draw = ImageDraw.Draw(image)
    side = min(w, h)
    r = side * {1: 0.3, 2: 0.2, 3: 0.17, 4: 0.15}[n]
    placed: list[tuple[float, float]] = []
    while len(placed) < n:  # rejection sampling of non-overlapping centres; shrink if it takes long
        for _ in range(200):
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            if all((cx - x) ** 2 + (cy - y) ** 2 > (2.2 * r) ** 2 for x, y in placed):
                placed.append((cx, cy))
                break
        else:
            r *= 0.85
            placed = []
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
                 size: tuple[int, int] | None = None) -> Example:
    """One example; `kind` and `question_type` are drawn when not given, `size` is (width, height)."""
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
