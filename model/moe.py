"""Mixture of experts (spec §4.7): sqrt-softplus router with selection-only bias, routed experts in
packed FP4, one shared expert in FP8, SwiGLU clamped at `swiglu_limit`.

    s = sqrt(softplus(x W_g^T / gate_temp))                     (fp32)
    I = topk(s + b, k)           b = gate.bias, or gate.bias_vl for image-span tokens
    w = s_I / (sum s_I + 1e-20) * route_scale                   (the bias picks, it never weighs)
    y = sum_{e in I} w_e E_e(x) + Shared(x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import LayerSpec, ModelArgs
from model.kernels import experts as expert_kernels
from model.layers import FP4, Linear, storage_dtype


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.topk = spec.n_activated_experts
        self.score_func, self.gate_temp = args.score_func, args.gate_temp
        self.norm_topk_prob, self.route_scale = args.norm_topk_prob, args.route_scale
        self.weight = nn.Parameter(torch.zeros(spec.n_routed_experts, args.dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(spec.n_routed_experts, dtype=torch.float32))
        # a second aux-free balancing bias for image tokens: each modality balances its own load
        self.bias_vl = (nn.Parameter(torch.zeros(spec.n_routed_experts, dtype=torch.float32))
                        if args.vision_enabled else None)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        """x [N, d] -> (weights [N, k] fp32, indices [N, k])."""
        scores = F.linear(x.float(), self.weight.float()) / self.gate_temp
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, bias)
        indices = (scores + bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices


class Expert(nn.Module):
    """SwiGLU: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L)); the routing weight multiplies before w2."""

    def __init__(self, dim: int, inter_dim: int, dtype, block: int, swiglu_limit: float, trainable: bool = False):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype, block, trainable=trainable)
        self.w2 = Linear(inter_dim, dim, dtype, block, trainable=trainable)
        self.w3 = Linear(dim, inter_dim, dtype, block, trainable=trainable)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.dim = args.dim
        self.n_routed = spec.n_routed_experts
        expert_dtype = FP4 if args.expert_dtype == "fp4" else storage_dtype(args.expert_dtype or args.dtype)
        dense = storage_dtype(args.dtype)
        self.gate = Gate(args, spec)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, expert_dtype, args.fp8_block_size,
                                            args.swiglu_limit, args.trainable) for _ in range(self.n_routed))
        if args.n_shared_experts != 1:
            raise ValueError("exactly one shared expert is supported (as in every V4/V4.1 config)")
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, dense, args.fp8_block_size, args.swiglu_limit,
                                     args.trainable)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        # tokens per expert: read by training to update the selection bias (aux-loss-free balancing)
        self.load = torch.bincount(indices.flatten(), minlength=self.n_routed).detach()
        y = self.routed(x, weights, indices)
        y += self.shared_experts(x).float()
        return y.to(x.dtype).reshape(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_k w_k E_k(x) over the selected experts held here, fp32 [N, dim]. Under expert
        parallelism (model/parallel.py) the experts another rank holds are None and this is a partial sum."""
        if expert_kernels.usable(self.experts, x):  # CUDA: grouped GEMMs over expert-sorted tokens
            weights_ = expert_kernels.cached_weights(self, self.experts)
            return expert_kernels.routed_experts(x, weights, indices, weights_, self._swiglu_limit())
        y = torch.zeros_like(x, dtype=torch.float32)
        # group tokens by expert: each expert runs once on the tokens routed to it
        for e in torch.unique(indices).tolist():
            if self.experts[e] is None:
                continue
            rows, slot = torch.where(indices == e)
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None]).float()
        return y

    def _swiglu_limit(self) -> float:
        return next(e for e in self.experts if e is not None).limit

    # the kernels reach the experts' weights through a table of addresses (model/kernels/experts.py):
    # moving or loading the weights drops it
    def _apply(self, fn, *args, **kwargs):
        expert_kernels.forget(self)
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        expert_kernels.forget(self)
        super()._load_from_state_dict(*args, **kwargs)
