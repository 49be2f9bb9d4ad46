"""The vision pathway (spec §4.9): DeepSeek-ViT, the aligner, and how an image sits in the language
model's sequence. Pixel preprocessing lives in `model/image_processor.py`.

    patches [n, 3*14*14] --patch_embed.proj--> [n, vision_dim]
        32 x ( x += MHA(RMSNorm1 x) with 2D RoPE ;  x += SwiGLU(RMSNorm2 x) )      bidirectional
        --norm--> features [vit_h * vit_w, vision_dim]
    aligner: 3x3 pixel-unshuffle (zero-padded to multiples of 3) -> [llm_h * llm_w, 9 vision_dim]
             -> w2(GELU(w1 .))  -> rows [llm_h * llm_w, dim]

    token layout of one image (every position carries `image_token_id`):
        START, (IMG x llm_w, NEWLINE) x llm_h, END
    START / NEWLINE / END take the learned `image_start` / `image_newline` / `image_end`; the IMG
    slots take the aligner rows in reading order.

Inside the language model an image span is a modality of its own: the router selects experts with
`gate.bias_vl`, Engram treats its positions as dead (gate 0, no n-gram crosses it), and the sliding
window is bidirectional inside the span (`image_window_indices`).

2D RoPE: each head's `head_dim / 2` rotary frequencies are split in two halves, the first rotated by
the patch's row, the second by its column, applied rotate-half style (the first half of the head's
channels paired with the second).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model.config import ModelArgs

# token types of an image span (TEXT marks every other position)
TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3


# ====================================================================================================
# The ViT
# ====================================================================================================


class VisionRMSNorm(nn.Module):
    """The ViT keeps eps 1e-6 and fp32 weights (unlike the text stack's 1e-20, bf16)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_2d(n_h: int, n_w: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h*n_w, 1, dim]: angles of each patch (reading order), `dim/2` frequencies
    theta^(-2j/dim) times its row, then the same frequencies times its column."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.arange(n_h).view(-1, 1).expand(n_h, n_w)
    cols = torch.arange(n_w).view(1, -1).expand(n_h, n_w)
    angles = (torch.stack([rows, cols], dim=-1).reshape(-1, 2, 1).float() * inv).flatten(1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(a, b) -> (a cos - b sin, b cos + a sin) with a, b the two halves of the last dim (fp32)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(3 * args.vision_patch_size ** 2, args.vision_dim, dtype=torch.bfloat16)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Full (bidirectional) multi-head attention over one image's patches."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.vision_n_heads, args.vision_dim // args.vision_n_heads
        self.wqkv = nn.Linear(args.vision_dim, 3 * args.vision_dim, dtype=torch.bfloat16)
        self.wo = nn.Linear(args.vision_dim, args.vision_dim, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., n, d] (any leading batch dims: images of one size attend separately)."""
        *lead, n, _ = x.shape
        q, k, v = (t.unflatten(-1, (self.n_heads, self.head_dim)) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2))
        return self.wo(o.transpose(-3, -2).flatten(-2))


class VisionMLP(nn.Module):
    """SwiGLU: w2(silu(gate) * up) with [gate, up] = w1 x (no bias)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.vision_dim, 2 * args.vision_inter_dim, bias=False, dtype=torch.bfloat16)
        self.w2 = nn.Linear(args.vision_inter_dim, args.vision_dim, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1, self.attn = VisionRMSNorm(args.vision_dim), VisionAttention(args)
        self.norm2, self.mlp = VisionRMSNorm(args.vision_dim), VisionMLP(args)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.rope_dim = args.vision_dim // args.vision_n_heads // 2
        self.theta = args.vision_rope_theta
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.vision_n_layers))
        self.norm = VisionRMSNorm(args.vision_dim)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [..., n_h*n_w, 3*p*p] -> features [..., n_h*n_w, vision_dim]."""
        x = self.patch_embed(patches)
        cos, sin = rope_2d(n_h, n_w, self.rope_dim, self.theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ratio = args.vision_downsample_ratio
        self.w1 = nn.Linear(args.vision_dim * self.ratio ** 2, args.dim, dtype=torch.bfloat16)
        self.w2 = nn.Linear(args.dim, args.dim, dtype=torch.bfloat16)

    def unshuffle(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[..., n_h*n_w, C] -> [..., ceil(n_h/r)*ceil(n_w/r), C*r*r]: each r x r cell of the patch grid
        (zero-padded at the bottom/right) becomes one row, channel-major (c, cell row, cell col)."""
        r = self.ratio
        lead = x.shape[:-2]
        grid = x.reshape(-1, n_h, n_w, x.size(-1)).permute(0, 3, 1, 2).float()
        grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))
        cells = F.unfold(grid, r, stride=r).transpose(1, 2)  # [B, cells, C*r*r]
        return cells.reshape(*lead, cells.size(1), cells.size(2)).to(x.dtype)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """ViT features [..., n_h*n_w, vision_dim] -> LM rows [..., llm_h*llm_w, dim] in reading order."""
        return self.w2(F.gelu(self.w1(self.unshuffle(x, n_h, n_w))))


# ====================================================================================================
# Images in the language model's sequence
# ====================================================================================================


def image_token_types(llm_h: int, llm_w: int) -> torch.Tensor:
    """[START, (IMAGE x llm_w, NEWLINE) x llm_h, END] as token types (int64)."""
    row = [IMAGE] * llm_w + [IMAGE_NEWLINE]
    return torch.tensor([IMAGE_START] + row * llm_h + [IMAGE_END], dtype=torch.int64)


@dataclass
class ImageInput:
    """One image placed in a sequence: its span starts at absolute position `start` and has the token
    types `types`; `patches` [vit_h*vit_w, 3 p p] feed the ViT."""

    start: int
    patches: torch.Tensor
    vit_h: int
    vit_w: int
    types: torch.Tensor

    @property
    def end(self) -> int:
        """One past the span's last position."""
        return self.start + self.types.numel()

    def shifted(self, offset: int) -> "ImageInput":
        return ImageInput(self.start + offset, self.patches, self.vit_h, self.vit_w, self.types)


def expand_image_placeholders(ids: Sequence[int], images: Sequence, args: ModelArgs,
                              ) -> tuple[list[int], list[int], list[ImageInput]]:
    """Each `image_token_id` placeholder in `ids` becomes its image's whole span (prompt order).

    images: one entry per placeholder: an image record of the chat encoding, a path, bytes or a PIL
    image. Returns (ids, token_types, image inputs); span positions all carry `image_token_id`, and
    token_types tell START / IMAGE / NEWLINE / END apart (TEXT elsewhere)."""
    from dsv41.model.image_processor import preprocess

    placeholder = args.image_token_id
    n_placeholders = sum(1 for t in ids if t == placeholder)
    if (n_placeholders or images) and not args.vision_enabled:
        raise ValueError("this model has no vision tower (vision_n_layers = 0) but the prompt contains images")
    if n_placeholders != len(images):
        raise ValueError(f"the prompt has {n_placeholders} image placeholders but {len(images)} images were given")
    out_ids: list[int] = []
    out_types: list[int] = []
    inputs: list[ImageInput] = []
    pending = iter(images)
    for token in ids:
        if token != placeholder:
            out_ids.append(token)
            out_types.append(TEXT)
            continue
        patches, grid = preprocess(next(pending), args)
        types = image_token_types(grid.llm_h, grid.llm_w)
        inputs.append(ImageInput(len(out_ids), patches, grid.vit_h, grid.vit_w, types))
        out_ids += [placeholder] * types.numel()
        out_types += types.tolist()
    return out_ids, out_types, inputs


def image_mask_from_inputs(images: Sequence[Sequence[ImageInput]], batch: int, start_pos: int, seqlen: int,
                           device=None) -> torch.Tensor:
    """[B, T] bool: True at the positions of image spans (START ... END) within this chunk."""
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
    for b, row in enumerate(images):
        for img in row or ():
            mask[b, max(img.start - start_pos, 0): max(img.end - start_pos, 0)] = True
    return mask


def check_spans_in_chunk(images: Sequence[Sequence[ImageInput]], start_pos: int, seqlen: int) -> None:
    """An image is encoded and attends to itself within one forward: its span must lie in the chunk."""
    for row in images:
        for img in row or ():
            if img.start < start_pos or img.end > start_pos + seqlen:
                raise ValueError(f"image span [{img.start}, {img.end}) does not lie inside the chunk "
                                 f"[{start_pos}, {start_pos + seqlen}); prefill an image within one chunk")


def encode_images(vision: VisionTransformer, aligner: Aligner, images: Sequence[ImageInput],
                  batched: bool = False) -> list[torch.Tensor]:
    """Aligner rows [llm_h*llm_w, dim] of each image, one ViT call per image (bit-identical to S0).
    batched=True runs images of one patch grid in one call: faster for training, but bf16 matmuls
    over a batch round differently, so an image's rows would depend on its batch-mates."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, img in enumerate(images):
        key = (img.vit_h, img.vit_w) if batched else (img.vit_h, img.vit_w, i)
        groups.setdefault(key, []).append(i)
    device = vision.patch_embed.proj.weight.device
    rows: list[torch.Tensor | None] = [None] * len(images)
    for (n_h, n_w, *_), members in groups.items():
        if len(members) == 1:  # no batch dim: a 3-D bf16 matmul may round differently from a 2-D one
            patches = images[members[0]].patches.to(device)
            rows[members[0]] = aligner(vision(patches, n_h, n_w), n_h, n_w)
            continue
        patches = torch.stack([images[i].patches for i in members]).to(device)
        out = aligner(vision(patches, n_h, n_w), n_h, n_w)
        for j, i in enumerate(members):
            rows[i] = out[j]
    return rows


def span_embeddings(types: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, newline: torch.Tensor,
                    end: torch.Tensor) -> torch.Tensor:
    """[n, dim] embeddings of one span: learned START/NEWLINE/END, aligner rows at IMAGE positions in
    reading order. Built by gathering (no in-place writes), so gradients reach every source."""
    types = types.to(rows.device)
    table = torch.cat([start.to(rows.dtype)[None], newline.to(rows.dtype)[None], end.to(rows.dtype)[None], rows])
    is_image = types == IMAGE
    if int(is_image.sum()) != rows.size(0):
        raise ValueError(f"the span has {int(is_image.sum())} IMAGE slots but the aligner gave {rows.size(0)} rows")
    which = torch.full_like(types, 0)
    which = torch.where(types == IMAGE_NEWLINE, 1, which)
    which = torch.where(types == IMAGE_END, 2, which)
    which = torch.where(is_image, 3 + torch.cumsum(is_image.long(), 0) - 1, which)
    return table[which]


def image_window_indices(images: Sequence[Sequence[ImageInput]], start_pos: int, seqlen: int, n_prev: int,
                         window: int, device=None) -> torch.Tensor | None:
    """Bidirectional sliding window inside image spans: extra window columns [B, T, S] (S = the longest
    span in this chunk) that let every position of a span see the whole span.

    The window KV of a forward is laid out [n_prev cached positions ; this chunk's T], index
    p - (start_pos - n_prev) for position p. A query t of a span [a, e) already sees the causal window
    t-window+1 .. t; the extra columns add the span positions outside it (p > t, or p <= t - window)
    and are -1 elsewhere (text queries, positions already in the window), so no key is counted twice.
    None when the chunk holds no image."""
    spans = [(b, img.start, img.end) for b, row in enumerate(images) for img in (row or ())]
    if not spans:
        return None
    width = max(e - a for _, a, e in spans)
    base = start_pos - n_prev
    extra = torch.full((len(images), seqlen, width), -1, dtype=torch.long, device=device)
    for b, a, e in spans:
        t = torch.arange(a, e, device=device).unsqueeze(1)  # queries of the span
        p = torch.arange(a, e, device=device).unsqueeze(0)  # keys of the span
        outside = (p > t) | (p <= t - window)
        cols = torch.where(outside, p - base, -1)
        extra[b, a - start_pos: e - start_pos, : e - a] = cols
    return extra
