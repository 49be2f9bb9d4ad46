"""The vision pathway's modules (spec §4.9): DeepSeek-ViT and the aligner, with the official
parameter names (`vision.*`, `aligner.*`). Image preprocessing and the image token layout come with
the vision issue; these modules already compute their forward.

ViT: patch projection (Linear 3*14*14 -> 1024), 32 blocks of RMSNorm -> bidirectional MHA with 2D
RoPE (rotate-half, the first half of each head's rope dims by row, the second by column) -> RMSNorm
-> SwiGLU, final RMSNorm. Aligner: 3x3 pixel-unshuffle, Linear -> GELU -> Linear to the LM width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelArgs


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
    """cos/sin [n_h*n_w, 1, 2*dim/2]: each patch's (row, col) angles, row frequencies then column ones."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.arange(n_h).view(-1, 1).expand(n_h, n_w)
    cols = torch.arange(n_w).view(1, -1).expand(n_h, n_w)
    angles = (torch.stack([rows, cols], dim=-1).reshape(-1, 2, 1).float() * inv).flatten(1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(3 * args.vision_patch_size ** 2, args.vision_dim, dtype=torch.bfloat16)


class VisionAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.vision_n_heads, args.vision_dim // args.vision_n_heads
        self.wqkv = nn.Linear(args.vision_dim, 3 * args.vision_dim, dtype=torch.bfloat16)
        self.wo = nn.Linear(args.vision_dim, args.vision_dim, dtype=torch.bfloat16)

    def forward(self, x, cos, sin):
        n = x.size(0)
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
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
        """patches [n_h*n_w, 3*p*p] -> features [n_h*n_w, vision_dim]."""
        x = self.patch_embed.proj(patches.flatten(1).to(self.patch_embed.proj.weight.dtype))
        cos, sin = rope_2d(n_h, n_w, self.rope_dim, self.theta)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ratio = args.vision_downsample_ratio
        self.w1 = nn.Linear(args.vision_dim * self.ratio ** 2, args.dim, dtype=torch.bfloat16)
        self.w2 = nn.Linear(args.dim, args.dim, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """3x3 pixel-unshuffle (zero-padded to multiples of 3), then the two-layer MLP, row-major rows."""
        r = self.ratio
        x = x.view(n_h, n_w, -1).permute(2, 0, 1)
        x = F.pad(x, (0, -n_w % r, 0, -n_h % r))
        x = F.unfold(x.unsqueeze(0).float(), r, stride=r).squeeze(0).transpose(0, 1).to(x.dtype)
        return self.w2(F.gelu(self.w1(x)))
