"""RMSNorm in one launch: y = w * x / sqrt(mean(x^2) + eps), in fp32, cast back to x's dtype.

In torch the norm is eight launches on CUDA (the widening copy, square, mean, the eps add, rsqrt, two
multiplies, the cast back) and a Reuse layer's decode step runs four of them (attention, FFN, q and kv
norms): 32 of the layer's 168 eager launches (`bench_launches.py`, h200-2026-12-04-d). The kernel reads each
row once and writes it once. Its row sum is a tree where torch's mean reduces in its own order, so the fp32
results differ in the last bits (the bf16 outputs almost never: tests/test_kernels_small.py bounds it).

On the CPU at inference it is one C call (host.rms_norm) with the reference's bits: the row sum in ATen's own
order (a decode step of the bundled model runs 45 norms, seven torch operators each).
"""

from __future__ import annotations

import torch

from dsv41.model.kernels import host, inference_kernel, interpreting, opaque, reference


@opaque
def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import triton

    from dsv41.model.kernels._triton_small import rms_norm_kernel

    D = x.size(-1)
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.size(0)
    y = torch.empty(M, D, dtype=x.dtype, device=x.device)
    BD = triton.next_power_of_2(D)
    BM = max(1, min(16, 4096 // BD))  # a few narrow rows a program (the kv norm's 512), one wide one
    rms_norm_kernel[(triton.cdiv(M, BM),)](rows, weight, y, M, D, rows.stride(0), float(eps), BD=BD, BM=BM,
                                           OUT_BF16=x.dtype == torch.bfloat16, INTERPRET=interpreting(),
                                           num_warps=4 if BD <= 2048 else 8)
    return y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, force_triton: bool = False) -> torch.Tensor:
    """See reference.rms_norm: x [..., D] (bf16 or fp32), weight [D] -> [..., D] in x's dtype. The kernel runs
    on CUDA (or forced under the interpreter) when no gradient is wanted; training keeps the reference."""
    if not inference_kernel(x, weight, force=force_triton) or x.dtype not in (torch.bfloat16, torch.float32):
        if host.takes(x, weight) and host.rms_fits(x):
            return host.rms_norm(x, weight, eps)
        return reference.rms_norm(x, weight, eps)
    return _launch(x, weight, eps)
