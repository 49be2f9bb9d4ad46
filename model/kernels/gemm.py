"""GEMMs with block-scaled FP8 or packed FP4 weights, dequantized in the kernel (model/layers.py, Linear).

    y = fp8_fake_quant(x, block) @ dequant(W)^T          accumulated in fp32, rounded to x's dtype

    fp8_block_gemm   W: E4M3 [N, K] with one UE8M0 scale per block x block tile ([ceil(N/b), ceil(K/b)])
    fp4_gemm         W: E2M1 pairs [N, K/2] (element 2i in the low nibble) with one UE8M0 per row and 32
                     columns ([N, K/32]); the activation block is the layer's `block`
    fp8_act_quant    the activation rounding alone (E4M3 with one power-of-two scale per block along K)
    dequant_weight   the weight alone, FP8 or FP4 times its scales, as bf16 [N, K] (the cuBLAS path's operand)

Which gemm mode this serves. GEMM_MODE (below; model/layers.py's Linear reads it) has two: "fast" (the activation fake-quantized, both operands
dequantized exactly, one fp32 matmul) and "exact" (REF's kernel order, each 32-wide K block's product
scaled and added in K order, for bit parity with REF's CPU port). The kernel computes "fast": the
quantized activation and the dequantized weight are exact in bf16 (E4M3 / E2M1 times a power of two), so
the bf16 matrix units form every product exactly and add them in fp32; only the order of the fp32
additions differs from the torch path, as it does between any two BLAS libraries. Linear dispatches to
it only in "fast" mode; "exact" keeps the reference loop on every device.

Kernel layout (model/kernels/_triton_gemm.py): one program per (BN weight rows, BM tokens, K range);
the weight tile is loaded as bytes and dequantized in registers (each 32-wide block times its scale),
then multiplies the token tile on the matrix units with the weight as the left operand. Small M (decode)
splits K across programs so that the weight streams from every SM, then adds the fp32 partials in a
fixed order (deterministic); M <= 16 also quantizes the activation inside the GEMM (one launch). Larger M
quantizes the activation once in its own kernel (bf16, exact) and runs unsplit 128 x 128 tiles. A variant
for one token at a time (GEMV: each weight tile times the token's activations, summed along K without the
matrix units) is the launch for one token (DECODE_GEMV: 1.20x on the engine's decode step). From
CUBLAS_MIN_M tokens on CUDA the weight is instead dequantized to bf16 for the call (dequant_weight: one
Triton pass over the stored bytes, equal bit for bit to formats.dequant_*_weight) and cuBLAS multiplies
(fp32 output, rounded as the kernel rounds): the same exact operands, another fp32 summation order.
"""

from __future__ import annotations

import functools

import torch

from dsv41.model import formats
from dsv41.model.kernels import interpreting, opaque, reference, use_triton

# How FP8/FP4 GEMMs are evaluated. "fast": exact dequantization of both operands, one fp32 matmul.
# "exact": REF's kernel order, K blocks of 32 accumulated one after another (bit parity with REF's
# CPU port, slow). The two differ only in the order of fp32 additions. On CUDA with Triton, "fast" runs
# the kernels of model/kernels/gemm.py and model/kernels/experts.py (same products, fp32 sums in another
# order); "exact" always takes the reference loop.
GEMM_MODE = {"mode": "fast"}


def set_gemm_mode(mode: str) -> None:
    if mode not in ("fast", "exact"):
        raise ValueError("gemm mode must be 'fast' or 'exact'")
    GEMM_MODE["mode"] = mode


def fp8_act_quant(x: torch.Tensor, block: int = formats.FP8_BLOCK, force_triton: bool = False) -> torch.Tensor:
    """See reference.fp8_act_quant: formats.fp8_fake_quant(x, block) (bit-exact), in x's dtype."""
    if not use_triton(x, force=force_triton):
        return reference.fp8_act_quant(x, block)
    K = x.size(-1)
    if K % block:
        raise ValueError(f"last dimension {K} is not a multiple of the block size {block}")
    return _act_quant(x.reshape(-1, K), block, x.dtype).view(x.shape)


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = formats.FP8_BLOCK,
                   force_triton: bool = False, config: dict | None = None) -> torch.Tensor:
    """See reference.fp8_block_gemm: x [..., K] times an FP8 weight [N, K] with block x block UE8M0 scales.

    `config` overrides the launch choice (keys of `launch_config`), for benchmarks and tests."""
    if not use_triton(x, weight, force=force_triton):
        return reference.fp8_block_gemm(x, weight, scale, block)
    N, K = weight.shape
    if tuple(scale.shape) != (-(-N // block), -(-K // block)):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight [{N}, {K}] with block {block}")
    return _gemm(x, _bytes(weight), _bytes(scale), N, K, False, block, block, config)


def fp4_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_block: int = formats.FP8_BLOCK,
             force_triton: bool = False, config: dict | None = None) -> torch.Tensor:
    """See reference.fp4_gemm: x [..., K] times a packed FP4 weight [N, K/2] with UE8M0 scales [N, K/32]."""
    if not use_triton(x, weight, force=force_triton):
        return reference.fp4_gemm(x, weight, scale, act_block)
    N, K = weight.size(0), 2 * weight.size(1)
    wb = formats.FP4_WEIGHT_BLOCK
    if tuple(scale.shape) != (N, K // wb):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match an FP4 weight [{N}, {K}]")
    return _gemm(x, _bytes(weight), _bytes(scale), N, K, True, act_block, wb, config)


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, block: int, fp4: bool, force_triton: bool = False,
                   config: dict | None = None) -> torch.Tensor:
    """See reference.dequant_weight: an FP8 weight [N, K] (UE8M0 per block x block tile) or a packed FP4 weight
    [N, K/2] (UE8M0 per row and `block` columns) times its scales, as bf16 [N, K], equal bit for bit to
    formats.dequant_fp8_weight / dequant_fp4_weight in bf16. Weight and scale bytes in any one-byte dtype the
    formats functions take (float8_e4m3fn, float4_e2m1fn_x2, float8_e8m0fnu, uint8, int8). `config` overrides
    DEQUANT_TILE (benchmarks and tests)."""
    if not use_triton(weight, scale, force=force_triton):
        return reference.dequant_weight(weight, scale, block, fp4)
    if weight.element_size() != 1 or scale.element_size() != 1:
        raise TypeError(f"expected one-byte weight and scale tensors, got {weight.dtype} and {scale.dtype}")
    N = weight.size(0)
    K = 2 * weight.size(1) if fp4 else weight.size(1)
    expected = (N, K // block) if fp4 else (-(-N // block), -(-K // block))
    if tuple(scale.shape) != expected or (fp4 and K % block):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match an {'FP4' if fp4 else 'FP8'} weight "
                         f"[{N}, {K}] with block {block}")
    return _dequant_weight(_bytes(weight), _bytes(scale), N, K, block, fp4, config)


# ------------------------------------------------------------------------------------------ launch
def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.view(torch.uint8)
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small, so that tests still see split K


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


# dequant_weight's launch: memory-bound (reads 1 or 1/2 byte per element, writes 2), so wide row-major tiles of
# 8K elements, each thread storing 16-byte vectors, and enough programs to cover every SM many times over.
DEQUANT_TILE = dict(BN=32, BK=256, num_warps=4)


@opaque
def _dequant_weight(w: torch.Tensor, s: torch.Tensor, N: int, K: int, qw: int, fp4: bool,
                    config: dict | None = None) -> torch.Tensor:
    """Weight bytes w ([N, K] or [N, K/2]) and scale bytes s -> bf16 [N, K] (dequant_weight_kernel)."""
    import triton

    from dsv41.model.kernels._triton_gemm import dequant_weight_kernel

    cfg = {**DEQUANT_TILE, **(config or {})}
    BN, BK = cfg["BN"], max(cfg["BK"], qw)  # a tile holds whole scale blocks along K
    y = torch.empty(N, K, dtype=torch.bfloat16, device=w.device)
    if N and K:
        dequant_weight_kernel[(triton.cdiv(N, BN), triton.cdiv(K, BK))](
            w, s, y, N, K, w.size(1), w.stride(0), s.stride(0), y.stride(0), W_FP4=fp4, QW=qw, BN=BN, BK=BK,
            INTERPRET=interpreting(), num_warps=cfg["num_warps"])
    return y


# From this many tokens on CUDA, the weight is dequantized to bf16 for the call (exact) and the product is cuBLAS's
# bf16 GEMM with fp32 output, rounded as the kernel rounds: at M = 4096 the Triton kernel ran 3.3-4.5x its floor
# where cuBLAS bf16 on a weight of the same shape ran near 1x (docs/performance.md, FP8 block GEMM). The
# dequantization reads the weight once per call, small beside a product over this many tokens.
CUBLAS_MIN_M = 512


def k_split(tiles: int, k_tiles: int, per_sm: int, device: torch.device) -> int:
    """K ranges for a launch of `tiles` output tiles over `k_tiles` K steps: enough that about `per_sm` programs
    per SM stream the weight, with at least two K steps per range (1 when the tiles already cover that)."""
    return max(1, min(-(-per_sm * _sm_count(device) // tiles), k_tiles // 2))


# The one-token GEMV for decode steps of at most `max_m` tokens, with its own tiles: dict(max_m=, BN=, BK=,
# per_sm=) (per_sm: the K split's programs per SM, as k_split), or None: the matrix-unit tiles at every M <= 64.
# A GEMV program reads its weight tile once per token, where the matrix units multiply 15 rows of padding. Inside
# the 8-layer stack's engine step at 128K from a CUDA graph, with the experts' split on in both: 4.07 / 4.08 ms
# against 4.90 / 4.90 ms without it, 1.20x (h100-2026-12-05/ab; benchmarks/bench_flash_layers.py --set
# gemm.DECODE_GEMV=... times other tiles, bench_decode_gemms.py --sweep each projection alone).
DECODE_GEMV: dict | None = dict(max_m=1, BN=16, BK=256, per_sm=4)


def launch_config(M: int, N: int, K: int, qa: int, qw: int, device: torch.device) -> dict:
    """Tile sizes, K split, fused activation quantization, warps and stages for an [M, K] x [N, K]^T GEMM.

    Decode (M <= 64) is bound by the weight bytes: narrow weight tiles (64 rows), the token tile padded to
    16..64, and K split until about two programs per SM stream the weight (at least two K tiles each).
    Prefill: 128 x 128 tiles (64 tokens up to M = 128), K whole; from CUBLAS_MIN_M tokens on CUDA, cuBLAS on
    the dequantized weight instead (`cublas`). `gemv` (M <= 16: one program per token, no matrix units,
    gemm_kernel's GEMV) is a config override, or the rule for M <= DECODE_GEMV["max_m"] where that is set."""
    bk_min = max(qa, qw)
    gemv = DECODE_GEMV
    if gemv is not None and M <= min(gemv["max_m"], 16) and gemv["BK"] % bk_min == 0:
        tiles = -(-N // gemv["BN"]) * M
        split = k_split(tiles, -(-K // gemv["BK"]), gemv["per_sm"], device)
        return dict(BM=1, BN=gemv["BN"], BK=gemv["BK"], split=split, fuse=True, num_warps=4, num_stages=4,
                    cublas=False, gemv=True)
    if M <= 64:
        BM, BN, BK = _pow2_at_least(M, 16), 64, max(128, bk_min)
        tiles = -(-N // BN) * -(-M // BM)
        k_tiles = -(-K // BK)
        split = k_split(tiles, k_tiles, 2, device)
        return dict(BM=BM, BN=BN, BK=BK, split=split, fuse=M <= 16, num_warps=4, num_stages=4, cublas=False,
                    gemv=False)
    return dict(BM=64 if M <= 128 else 128, BN=128, BK=max(64, bk_min), split=1, fuse=False, num_warps=8,
                num_stages=3, cublas=M >= CUBLAS_MIN_M and device.type == "cuda", gemv=False)


@opaque
def _act_quant(x2: torch.Tensor, qa: int, out_dtype: torch.dtype) -> torch.Tensor:
    import triton

    from dsv41.model.kernels._triton_gemm import act_quant_kernel

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    y = torch.empty(M, K, dtype=out_dtype, device=x2.device)
    BK = max(qa, min(512, _pow2_at_least(K, qa)))
    BM = max(1, 4096 // BK)
    act_quant_kernel[(triton.cdiv(M, BM), triton.cdiv(K, BK))](x2, y, M, K, x2.stride(0), y.stride(0),
                                                                QA=qa, BM=BM, BK=BK, num_warps=4)
    return y


@opaque
def _gemm(x, w, s, N, K, fp4, qa, qw, config):
    import triton

    from dsv41.model.kernels._triton_gemm import gemm_kernel, split_sum_kernel

    if x.size(-1) != K or K % qa:
        raise ValueError(f"input width {x.size(-1)} does not fit the weight (K = {K}, activation block {qa})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.size(0)
    if M == 0:
        return torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    cfg = launch_config(M, N, K, qa, qw, x.device)
    cfg.update(config or {})
    if cfg.get("cublas") and x2.is_cuda:
        # the same values as the kernel multiplies (both operands exact in bf16), summed in fp32 by cuBLAS
        xq = _act_quant(x2, qa, torch.bfloat16)
        wb = _dequant_weight(w, s, N, K, qw, fp4)  # = formats.dequant_*_weight(w, s, qw, torch.bfloat16)
        return torch.mm(xq, wb.t(), out_dtype=torch.float32).to(x.dtype).view(*lead, N)
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    if BK % qa or BK % qw:
        raise ValueError(f"BK = {BK} must be a multiple of the blocks ({qa}, {qw})")
    if not cfg["fuse"]:
        x2 = _act_quant(x2, qa, torch.bfloat16)  # exact in bf16
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    k_split = -(-K // cfg["split"])
    k_split = -(-k_split // BK) * BK
    split = -(-K // k_split)
    target = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    gemv = bool(cfg.get("gemv")) and M <= 16
    if gemv:
        BM = 1  # one program per token
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), split)
    gemm_kernel[grid](x2, w, s, target, M, N, K, K // 2 if fp4 else K, x2.stride(0), N, M * N, w.stride(0), s.stride(0),
                      K_SPLIT=k_split, W_FP4=fp4, QA=qa, QW=qw, QUANT_A=cfg["fuse"], BM=BM, BN=BN, BK=BK,
                      INTERPRET=interpreting(), GEMV=gemv, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        BLOCK = 1024
        split_sum_kernel[(triton.cdiv(M * N, BLOCK),)](target, out, M * N, S=split, BLOCK=BLOCK,
                                                       INTERPRET=interpreting(), num_warps=4)
    return out.view(*lead, N)
