"""A second, independently written picture generator: the evaluation set the vision training never sees.

    from dsv41.recipes.tiny.vision.independent import evaluation_set
    pictures = evaluation_set(200)          # the same 200 pictures on every machine (seeded)

It shares no drawing code, colour table or size list with the training generator (`data.py`), which never
imports this module (tests/test_tiny_v2_vision.py checks both):

    drawing     numpy rasterization: every pixel is tested against the shape's geometry (a distance for the
                circle, half-planes for the convex polygons, a point-in-polygon parity test for the star) on a
                3x3 supersampled grid and averaged, so edges are anti-aliased; the training generator fills
                PIL.ImageDraw polygons and ellipses without anti-aliasing
    colours     each named colour is a region of HSV space (hue, saturation, value ranges below: light and
                dark shades, "navy", "sky blue", "lime", "crimson" ...), sampled uniformly; the training
                generator jitters one RGB value per name by +-18 (v1) or samples its own HLS ranges (v2)
    backgrounds white, light grey, a light tint, a vertical or diagonal gradient, light noise, mid grey,
                near black
    canvases    sides from 32 to 1024 px (SIZE_BUCKETS, the other side 0.7-1.4 times the first), the shape
                anywhere inside, its radius 14-42% of the smaller side; the preprocessor upscales below
                56x56 and shrinks anything over 64 image tokens (about 294 px square)
    questions   five phrasings per question, among them the one the training generator uses most
                ("What color is the shape?", "What shape is this?") as a reference and "What shape is it?"

Scoring is `accuracy.score`'s rule: the reply after `</think>` must name the right colour (shape) and no other.
"""

from __future__ import annotations

import colorsys
import math
import random
from dataclasses import dataclass

import numpy as np

SEED = 77_000_000  # picture i is drawn from random.Random(SEED + i)

# name -> (hue range in degrees (lo > hi wraps through 0), saturation range, value range)
HSV_RANGES = {
    "red": ((352.0, 8.0), (0.70, 1.00), (0.55, 1.00)),
    "orange": ((22.0, 34.0), (0.80, 1.00), (0.88, 1.00)),
    "yellow": ((48.0, 58.0), (0.75, 1.00), (0.88, 1.00)),
    "green": ((95.0, 145.0), (0.55, 1.00), (0.40, 0.90)),
    "blue": ((205.0, 238.0), (0.60, 1.00), (0.45, 1.00)),
    "purple": ((268.0, 292.0), (0.50, 0.90), (0.40, 0.85)),
}
COLOUR_NAMES = tuple(HSV_RANGES)
SHAPE_NAMES = ("circle", "square", "triangle", "star")
BACKGROUNDS = ("white", "light grey", "tint", "gradient", "noise", "mid grey", "dark")
SIZE_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)

COLOUR_PHRASINGS = ("What color is the shape?", "What color is it?", "Which colour is this shape?",
                    "Tell me the color of the object in the picture.", "Name the colour you see.")
SHAPE_PHRASINGS = ("What shape is this?", "What shape is it?", "Which shape is drawn here?",
                   "Name the shape in the picture.", "What kind of figure is this?")
REFERENCE = {"colour": COLOUR_PHRASINGS[0], "shape": SHAPE_PHRASINGS[0]}  # the training generator's wording


@dataclass
class Picture:
    image: object  # PIL.Image (RGB)
    colour: str
    shape: str
    rgb: tuple[int, int, int]
    background: str
    size_bucket: int  # the side the canvas was drawn from (the other side is 0.7-1.4 times it)
    questions: dict  # "colour" / "shape" -> the phrasing asked of this picture

    @property
    def facts(self) -> dict:
        return {"colour": self.colour, "shape": self.shape}


# ------------------------------------------------------------------------------------------ colours
def sample_rgb(name: str, rng: random.Random) -> tuple[int, int, int]:
    (h_lo, h_hi), (s_lo, s_hi), (v_lo, v_hi) = HSV_RANGES[name]
    span = (h_hi - h_lo) % 360.0
    hue = (h_lo + rng.uniform(0.0, span)) % 360.0
    r, g, b = colorsys.hsv_to_rgb(hue / 360.0, rng.uniform(s_lo, s_hi), rng.uniform(v_lo, v_hi))
    return int(round(r * 255)), int(round(g * 255)), int(round(b * 255))


def hsv_of(rgb) -> tuple[float, float, float]:
    h, s, v = colorsys.rgb_to_hsv(*(c / 255.0 for c in rgb))
    return h * 360.0, s, v


def in_range(name: str, rgb) -> bool:
    """Whether an RGB colour lies in the named colour's HSV region (rounding to 8 bits allowed for)."""
    (h_lo, h_hi), (s_lo, s_hi), (v_lo, v_hi) = HSV_RANGES[name]
    h, s, v = hsv_of(rgb)
    tol = 1.5
    hue_ok = ((h - h_lo + tol) % 360.0) <= ((h_hi - h_lo) % 360.0) + 2 * tol
    return hue_ok and s_lo - 0.02 <= s <= s_hi + 0.02 and v_lo - 0.02 <= v <= v_hi + 0.02


# ------------------------------------------------------------------------------------------ backgrounds
def background(kind: str, w: int, h: int, rng: random.Random) -> np.ndarray:
    """float32 [h, w, 3] in 0..255."""
    if kind == "white":
        return np.full((h, w, 3), 255.0, np.float32)
    if kind == "light grey":
        return np.full((h, w, 3), rng.uniform(200, 235), np.float32)
    if kind == "tint":
        return np.broadcast_to(np.array([rng.uniform(215, 255) for _ in range(3)], np.float32), (h, w, 3)).copy()
    if kind == "gradient":
        a = np.array([rng.uniform(190, 255) for _ in range(3)], np.float32)
        b = np.array([rng.uniform(190, 255) for _ in range(3)], np.float32)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        t = yy / max(h - 1, 1) if rng.random() < 0.5 else (xx + yy) / max(w + h - 2, 1)
        return a + (b - a) * t[..., None]
    if kind == "noise":
        base = rng.uniform(215, 245)
        noise = np.random.default_rng(rng.getrandbits(32)).normal(0.0, 9.0, (h, w, 1)).astype(np.float32)
        return np.clip(base + noise, 0, 255).repeat(3, axis=2)
    if kind == "mid grey":
        return np.full((h, w, 3), rng.uniform(120, 160), np.float32)
    if kind == "dark":
        return np.full((h, w, 3), rng.uniform(10, 45), np.float32)
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------ geometry
def _vertices(shape: str, cx: float, cy: float, r: float, turn: float) -> np.ndarray:
    if shape == "square":
        k = np.arange(4)
        angles = turn + math.pi / 4 + k * math.pi / 2
        radii = np.full(4, r)
    elif shape == "triangle":
        k = np.arange(3)
        angles = turn - math.pi / 2 + k * 2 * math.pi / 3
        radii = np.full(3, r)
    elif shape == "star":
        k = np.arange(10)
        angles = turn - math.pi / 2 + k * math.pi / 5
        radii = np.where(k % 2 == 0, r, r * 0.42)
    else:
        raise ValueError(shape)
    return np.stack([cx + radii * np.cos(angles), cy + radii * np.sin(angles)], axis=1)


def _inside_polygon(px: np.ndarray, py: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """Even-odd rule (crossing number) for any simple polygon, vectorized over the points."""
    inside = np.zeros(px.shape, dtype=bool)
    n = len(poly)
    for i in range(n):
        x1, y1 = poly[i]
        x2, y2 = poly[(i + 1) % n]
        crosses = (y1 > py) != (y2 > py)
        with np.errstate(divide="ignore", invalid="ignore"):
            x_at = x1 + (py - y1) * (x2 - x1) / (y2 - y1)
        inside ^= crosses & (px < x_at)
    return inside


def coverage(shape: str, w: int, h: int, cx: float, cy: float, r: float, turn: float, ss: int = 3) -> np.ndarray:
    """The fraction of each pixel the shape covers, [h, w] in 0..1 (ss x ss samples per pixel). Only the
    shape's bounding box is sampled."""
    x0, x1 = max(0, int(cx - r) - 1), min(w, int(math.ceil(cx + r)) + 2)
    y0, y1 = max(0, int(cy - r) - 1), min(h, int(math.ceil(cy + r)) + 2)
    offsets = (np.arange(ss, dtype=np.float64) + 0.5) / ss
    xs = (np.arange(x0, x1)[:, None] + offsets[None, :]).reshape(-1)
    ys = (np.arange(y0, y1)[:, None] + offsets[None, :]).reshape(-1)
    px, py = np.meshgrid(xs, ys)
    if shape == "circle":
        hit = (px - cx) ** 2 + (py - cy) ** 2 <= r * r
    else:
        hit = _inside_polygon(px, py, _vertices(shape, cx, cy, r, turn))
    cov = hit.reshape(y1 - y0, ss, x1 - x0, ss).mean(axis=(1, 3))
    out = np.zeros((h, w), np.float32)
    out[y0:y1, x0:x1] = cov
    return out


# ------------------------------------------------------------------------------------------ pictures
def draw(shape: str, rgb, bg: str, w: int, h: int, rng: random.Random):
    """(PIL image, coverage mask) of one filled shape on a background, anti-aliased."""
    from PIL import Image

    side = min(w, h)
    r = rng.uniform(0.14, 0.42) * side
    r = max(r, 4.0)
    margin = r * 1.02 + 1
    cx, cy = rng.uniform(margin, w - margin), rng.uniform(margin, h - margin)
    turn = {"circle": 0.0, "square": rng.uniform(-0.45, 0.45), "triangle": rng.uniform(-0.35, 0.35),
            "star": rng.uniform(-0.3, 0.3)}[shape]
    cov = coverage(shape, w, h, cx, cy, r, turn)
    canvas = background(bg, w, h, rng)
    colour = np.array(rgb, np.float32)
    pixels = canvas * (1 - cov[..., None]) + colour * cov[..., None]
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB"), cov


def assignment(i: int) -> dict:
    """What picture i shows and is asked: colour, shape, size bucket, background and phrasings cycle
    through every combination evenly."""
    return {"colour": COLOUR_NAMES[i % len(COLOUR_NAMES)],
            "shape": SHAPE_NAMES[(i // len(COLOUR_NAMES)) % len(SHAPE_NAMES)],
            "bucket": SIZE_BUCKETS[i % len(SIZE_BUCKETS)], "background": BACKGROUNDS[(i // 3) % len(BACKGROUNDS)],
            "questions": {"colour": COLOUR_PHRASINGS[i % len(COLOUR_PHRASINGS)],
                          "shape": SHAPE_PHRASINGS[(i // 2) % len(SHAPE_PHRASINGS)]}}


def picture(i: int) -> Picture:
    """The i-th picture of the evaluation set (`assignment(i)`); the rest (shade, canvas, place, size, turn,
    background shade) is drawn from random.Random(SEED + i)."""
    rng = random.Random(SEED + i)
    plan = assignment(i)
    colour, shape, bucket, bg = plan["colour"], plan["shape"], plan["bucket"], plan["background"]
    aspect = rng.uniform(0.7, 1.4)
    w, h = (bucket, max(32, min(1024, round(bucket * aspect)))) if rng.random() < 0.5 else \
        (max(32, min(1024, round(bucket * aspect))), bucket)
    rgb = sample_rgb(colour, rng)
    image, _ = draw(shape, rgb, bg, w, h, rng)
    return Picture(image, colour, shape, rgb, bg, bucket, plan["questions"])


def evaluation_set(n: int = 200) -> list[Picture]:
    return [picture(i) for i in range(n)]
