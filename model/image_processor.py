"""Image preprocessing for the vision pathway (spec §4.9; the official `inference/image_processor.py`
of S0 decides where the spec is vague): an image file becomes ViT patches and a token grid.

    image --RGB--> (w, h)
      upscale    if w*h < min_pixels:  (w, h) <- (int(w*s), int(h*s)),  s = sqrt(min_pixels / (w*h))
      round up   (W, H) = (ceil(w/p)*p, ceil(h/p)*p)                       p = patch size (14)
      token grid (n_h, n_w) = (ceil(H/p / r), ceil(W/p / r))               r = downsample ratio (3)
      shrink     while n_h (n_w + 1) + 2 > max_image_tokens: the largest aspect-preserving (H, W),
                 multiples of p, whose grid fits (closed form below)
      pixels     the image fitted inside (W, H) (aspect kept, bicubic) and centred on grey (127)
      normalize  x = (v/255 - 0.5) / 0.5
      patches    p x p tiles in reading order, each flattened (channel, row, col) -> [H/p * W/p, 3 p p]

The language model reads n_h (n_w + 1) + 2 positions per image: START, n_h rows of (n_w IMG + NEWLINE),
END (`dsv41.model.vision.image_token_types`).

Pillow is imported only when an image is actually loaded: text-only use never needs it.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from pathlib import Path

import torch

GREY = (127, 127, 127)  # the padding colour: 127/255 normalizes to about 0


@dataclass(frozen=True)
class ImageGrid:
    """Where an image of a given size ends up: its pixel size (multiples of the patch size), the
    ViT's patch grid and the language model's token grid (after the aligner's r x r downsample)."""

    height: int
    width: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int

    @property
    def n_patches(self) -> int:
        return self.vit_h * self.vit_w

    @property
    def n_tokens(self) -> int:
        """Positions the image takes in the language model's sequence."""
        return num_image_tokens(self.llm_h, self.llm_w)


def num_image_tokens(llm_h: int, llm_w: int) -> int:
    """START + llm_h rows of (llm_w IMG + NEWLINE) + END."""
    return llm_h * (llm_w + 1) + 2


def token_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    """The aligner's output grid for a pixel size: patches per side, then ceil(/ratio) (the aligner pads
    a partial r x r cell)."""
    return math.ceil((height // patch) / ratio), math.ceil((width // patch) / ratio)


def fit_token_budget(height: float, width: float, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest pixel size (H, W), multiples of `patch`, with the aspect of (height, width), whose
    token grid n_h (n_w + 1) + 2 stays within max_tokens.

    With a = height/width and n_h = a n_w, the budget a n_w^2 + a n_w <= max_tokens - 2 gives
    n_w <= sqrt((max_tokens - 2)/a + 1/4) - 1/2. Whole aligner cells (patch*ratio pixels) of that grid,
    scaled uniformly: beta = min(floor(n_w) cell / width, floor(n_h) cell / height). An image too tall
    for even one column of cells becomes one column; too wide for one row, one row."""
    aspect = height / width
    cell = patch * ratio
    max_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    if max_w < 1.0:  # a single column: n_h * 2 + 2 tokens
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:  # a single row: n_w + 3 tokens
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    # never below one patch per side (an extreme aspect could round a side to zero)
    return (max(patch, math.floor(height * beta / patch) * patch),
            max(patch, math.floor(width * beta / patch) * patch))


def plan_image_grid(width: int, height: int, args) -> ImageGrid:
    """The resize plan for an image of (width, height) pixels under `args` (vision_patch_size,
    vision_downsample_ratio, vision_min_pixels, vision_max_n_token, vision_max_wh_ratio)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image needs a positive size, not {width}x{height}")
    p, r, budget = args.vision_patch_size, args.vision_downsample_ratio, args.vision_max_n_token
    if budget < 4:
        raise ValueError(f"vision_max_n_token = {budget}: an image needs at least 4 positions")
    if args.vision_max_wh_ratio is not None and width > height * args.vision_max_wh_ratio:
        width = height * args.vision_max_wh_ratio  # very wide images are squeezed, not padded
    if width * height < args.vision_min_pixels:
        scale = (args.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    llm_h, llm_w = token_grid(best_h, best_w, p, r)
    if num_image_tokens(llm_h, llm_w) > budget:
        best_h, best_w = fit_token_budget(height, width, p, r, budget)
        llm_h, llm_w = token_grid(best_h, best_w, p, r)
        assert num_image_tokens(llm_h, llm_w) <= budget, (best_h, best_w, budget)
    return ImageGrid(best_h, best_w, best_h // p, best_w // p, llm_h, llm_w)


# ---------------------------------------------------------------------------------------------- loading
def image_bytes(record) -> bytes:
    """The encoded bytes of an image record as the chat encoding produces them
    (`{"type": "image", "url" | "data" | "source": ...}`): raw bytes, base64 `data`, an Anthropic-style
    `source` ({"data": base64} or {"url": ...}), a `data:` URL, an http(s) URL, or a file path.
    A plain string or Path is a file path."""
    if isinstance(record, (str, Path)):
        record = {"url": str(record)}
    data = record.get("data")
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return base64.b64decode(data)
    source = record.get("source")
    if isinstance(source, dict):
        if source.get("data") is not None:
            return base64.b64decode(source["data"])
        if source.get("url"):
            return image_bytes({"url": source["url"]})
    url = record.get("url")
    if isinstance(url, str) and url:
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise ValueError(f"unsupported data URL encoding: {header}")
            return base64.b64decode(payload)
        if url.startswith(("http://", "https://")):
            from urllib.request import urlopen

            with urlopen(url, timeout=30) as response:
                return response.read()
        path = Path(url[len("file://"):] if url.startswith("file://") else url).expanduser()
        try:
            return path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read image {url}: {e.strerror or e}") from None
    raise ValueError(f"cannot load an image from a record with keys {sorted(record)}")


def open_image(record):
    """A PIL image (RGB) from a record, path, bytes or PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(record, Image.Image):
        return record.convert("RGB")
    raw = record if isinstance(record, bytes) else image_bytes(record)
    try:
        with Image.open(io.BytesIO(raw)) as source:
            return source.convert("RGB")
    except UnidentifiedImageError:
        name = record if isinstance(record, (str, Path)) else (record.get("url") if isinstance(record, dict) else None)
        raise ValueError(f"not an image file{f': {name}' if name else ''}") from None


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [(H/p)(W/p), 3 p p]: tiles in reading order, each flattened channel-major."""
    c, h, w = pixels.shape
    tiles = pixels.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4)
    return tiles.reshape((h // patch) * (w // patch), c * patch * patch)


def preprocess(image, args) -> tuple[torch.Tensor, ImageGrid]:
    """An image (record, path, bytes or PIL image) -> (patches [n_patches, 3 p p] bf16, its grid)."""
    import numpy as np
    from PIL import ImageOps

    image = open_image(image)
    grid = plan_image_grid(image.width, image.height, args)
    size = (grid.width, grid.height)
    if args.vision_max_wh_ratio is not None and image.width >= args.vision_max_wh_ratio * image.height:
        image = image.resize(size)  # squeezed to the capped aspect
    else:
        image = ImageOps.pad(image, size, color=GREY)  # aspect kept, centred, grey around it
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = (pixels - 0.5) / 0.5
    return patchify(pixels, args.vision_patch_size).to(torch.bfloat16), grid
