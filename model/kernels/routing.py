"""The MoE router after its GEMM, and the shared expert's SwiGLU, one launch each (model/moe.py).

    route    s = sqrt(softplus(x W_g^T / temp)); I = Top-k(s + b); w = s_I / (sum s_I + 1e-20) * route_scale
    gate_route  the GEMM x W_g^T and route; in the CPU decode step two C calls (host.gate_route)
    swiglu   h = silu(min(gate, L)) * clamp(up, -L, L), cast to the activation dtype

In torch the router is nine launches after its GEMM (softplus, sqrt, the bias add, topk, gather, sum, the eps
add, the division, the scale) and the SwiGLU seven (two widening copies, two clamps, silu, the product, the
cast). The Top-k is k passes of a row maximum (the lowest index among equal scores, where torch's CUDA topk
promises no order among ties); softplus is torch's formula (x itself above 20, log1p(e^x) below) with a
log1p good to a few ulp, so the scores can differ from torch's in the last bits, and an expert choice only
where two biased scores are that close (tests/test_kernels_small.py).
"""

from __future__ import annotations

import torch

from dsv41.model.kernels import host, inference_kernel, interpreting, opaque, reference


@opaque
def _launch_route(scores, bias, topk, gate_temp, norm_topk_prob, route_scale):
    import triton

    from dsv41.model.kernels._triton_small import route_kernel

    N, E = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    bias = bias.float().contiguous()  # [E], or [N, E] for a bias per token
    stride_b = bias.stride(0) if bias.dim() == 2 else 0
    weights = torch.empty(N, topk, dtype=torch.float32, device=scores.device)
    indices = torch.empty(N, topk, dtype=torch.int64, device=scores.device)
    if N:
        route_kernel[(N,)](scores, bias, weights, indices, E, scores.stride(0), stride_b, float(gate_temp),
                           float(route_scale), K=topk, KP=triton.next_power_of_2(topk),
                           BE=triton.next_power_of_2(E), TEMP=gate_temp != 1.0, NORM=norm_topk_prob and topk > 1,
                           num_warps=4)
    return weights, indices


def route(scores: torch.Tensor, bias: torch.Tensor, topk: int, score_func: str = "sqrtsoftplus",
          gate_temp: float = 1.0, norm_topk_prob: bool = True, route_scale: float = 1.0,
          force_triton: bool = False):
    """See reference.route: fp32 scores [N, E], bias [E] or [N, E] -> (weights [N, k] fp32, indices [N, k])."""
    if (score_func != "sqrtsoftplus" or scores.dtype != torch.float32 or scores.dim() != 2 or topk > scores.size(-1)
            or not inference_kernel(scores, bias, force=force_triton)):
        # on the CPU the decode step's softplus is ATen's scalar formula (reference.per_row), one C call there
        return reference.route(scores, bias, topk, score_func, gate_temp, norm_topk_prob, route_scale,
                               host.scalar_softplus if host.takes(scores) else None)
    return _launch_route(scores, bias, topk, gate_temp, norm_topk_prob, route_scale)


def gate_route(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, topk: int, score_func: str = "sqrtsoftplus",
               gate_temp: float = 1.0, norm_topk_prob: bool = True, route_scale: float = 1.0,
               fixed_rows: bool = False):
    """The router with its GEMM (model/moe.py Gate): x [N, d], w [E, d] -> route(x W^T in fp32, ...): the GEMM by
    host.fixed_order_linear (F.linear off the host path; with `fixed_rows`, a decode step's, on a fixed row count
    there), then `route`. In the CPU decode step (the softplus by
    ATen's scalar formula: reference.scalar_loop_applies) both are two C calls around torch's sqrt,
    host.gate_route, save for a row whose choice has a tie or a NaN."""
    E = w.size(0)
    if (score_func == "sqrtsoftplus" and 1 <= topk <= min(E, host.GATE_MAX_TOPK) and E <= host.GATE_MAX_EXPERTS
            and x.dim() == 2 and reference.scalar_loop_applies(E) and host.takes(x)
            and bias.dtype == torch.float32 and bias.is_contiguous() and not bias.is_cuda and bias.size(-1) == E
            and (bias.dim() == 1 or bias.shape == (x.size(0), E))):
        out = host.gate_route(x, w, bias, topk, gate_temp, norm_topk_prob, route_scale)
        if out is not None:
            return out
    return route(host.fixed_order_linear(x, w, fixed_rows), bias, topk, score_func, gate_temp, norm_topk_prob,
                 route_scale)


@opaque
def _launch_swiglu(gate, up, limit, dtype):
    import triton

    from dsv41.model.kernels._triton_small import swiglu_kernel

    N = gate.size(-1)
    g, u = gate.reshape(-1, N), up.reshape(-1, N)
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    M = g.size(0)
    h = torch.empty(M, N, dtype=dtype, device=gate.device)
    BN = min(1024, triton.next_power_of_2(N))
    BM = max(1, min(16, 2048 // BN))
    swiglu_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](g, u, h, M, N, g.stride(0), u.stride(0), float(limit),
                                                           BM=BM, BN=BN, HAS_LIMIT=limit > 0,
                                                           OUT_BF16=dtype == torch.bfloat16,
                                                           INTERPRET=interpreting(), num_warps=4)
    return h.view(*gate.shape[:-1], N)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype,
           force_triton: bool = False) -> torch.Tensor:
    """See reference.swiglu: gate, up [..., N] (bf16 or fp32, one shape) -> [..., N] in dtype (bf16 or fp32)."""
    if (gate.shape != up.shape or dtype not in (torch.bfloat16, torch.float32)
            or not inference_kernel(gate, up, force=force_triton)):
        return reference.swiglu(gate, up, limit, dtype)
    return _launch_swiglu(gate, up, limit, dtype)
