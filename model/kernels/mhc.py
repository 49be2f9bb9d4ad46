"""Single-pass mHC at a sub-layer boundary (model/mhc.py, wired as model/block.py's Block.mix does).

From the residual streams X [.., n, d] and the finished sub-layer's output y:

    X'        = post (x) y + comb^T X                       residual update (skipped without y)
    collapsed = sum_j pre_prev_j X'_j                       the next sub-layer's input
    mu        = (W_fn flatten X') * rsqrt(mean X'^2 + eps)  the next coefficients, RMS folded in after
    pre, post, comb = sinkhorn_split(mu, ...)

The residual is read once and written once: one kernel walks X in tiles of (tokens x channels) over all
n streams, writes X' and the collapse, and keeps the tile's share of W_fn X' and of sum X'^2 in registers
while its program walks a range of channels; at the end of the range it adds them into a small per-token
accumulator (one atomic add per token and range; the channels are split into as many ranges as filling the
machine needs, so a decode step of one token still spreads over it); a second, tiny kernel turns the accumulator into pre / post / comb (20 Sinkhorn iterations in
registers). Three launches per step (zeroing the accumulator, the two kernels).
"""

from __future__ import annotations

import weakref

import torch

from dsv41.model.kernels import (cdiv, host, inference_kernel, interpreting, opaque, reference, use_triton,
                                 whole_waves)
from dsv41.model.kernels import norm as kernels_norm

_FN_SPLIT: dict = {}


def _split_fn(fn: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_fn (fp32) = hi + lo with both parts bf16, padded to `rows` rows; cached per live tensor and version.

    The cache holds a weak reference and checks it is the same tensor object: a key made of the data
    pointer alone would return a freed tensor's split for a new tensor the allocator put at its address."""
    hit = _FN_SPLIT.get(id(fn))
    if hit is not None and hit[0]() is fn and hit[1] == (fn._version, rows):
        return hit[2]
    w = torch.zeros(rows, fn.size(1), dtype=torch.float32, device=fn.device)
    w[: fn.size(0)] = fn.detach().float()
    hi = w.to(torch.bfloat16)
    lo = (w - hi.float()).to(torch.bfloat16)
    if len(_FN_SPLIT) > 256:
        _FN_SPLIT.clear()
    _FN_SPLIT[id(fn)] = (weakref.ref(fn), (fn._version, rows), (hi.contiguous(), lo.contiguous()))
    return hi, lo


# The residual kernel's schedule from 256 tokens on (benchmarks/bench_mhc.py times alternatives against it in
# one run): the tile (BM tokens, BD channels, pipeline stages), warps, and whether a block's n stream tiles
# are loaded once (x_once) or once per output stream (before). TUNE.update(...) changes it for a benchmark.
# x_once at 16 x 64 (2 stages, 2 warps) since h200-2026-12-02-g (CUDA-graph GPU time, x the bytes floor, 4096 /
# 16384 tokens, two runs): 2.25x / 1.67x (1.85x / 1.67x with RANGE_RULE "waves", h200-2026-12-04), against
# 2.61x / 1.96x for the x_once default before it (32 x 64, 2 stages, 4 warps; 0.86x / 0.86x its time in the same
# run) and 4.02x / 3.21x for OLD_DEFAULT (64 x 32, x_once off); at 1024 tokens 1.05x the time of 32 x 64. Its
# sweep (bench_mhc --sweep-set xonce) found nothing faster at both sizes:
# 32 x 64 at 3 stages 0.92x / 0.95x, 16 x 64 at 4 warps or 3 stages 0.80x at 4096 but 1.07x / 0.92x at 16384; the
# tiles that spill in an offline sm_90 compile (32 x 64 at 2 warps, 32 x 128 and 64 x 64 at 4, 16 x 128 at 2,
# 16 x 64 at 1; 255 registers, 840-1024 spill bytes) 1.4-3.8x. In h200-2026-12-02-f
# x_once 32 x 64 replaced OLD_DEFAULT (1.53x / 1.58x faster), and a grid-stride variant that kept W_fn in L1 across
# token tiles was measured and removed (its extra atomic adds cost more than the W_fn re-reads it saved).
# bench_mhc times OLD_DEFAULT beside TUNE in every run. Where d is not a multiple of the tile's 64 channels,
# 64 x 16 (2 stages, 4 warps), also with x_once.
TUNE = dict(tile=(16, 64, 2), num_warps=2, x_once=True)
OLD_DEFAULT = dict(tile=(64, 32, 2), num_warps=4, x_once=False)


def _target_programs(device: torch.device) -> int:
    """Residual-kernel programs to aim for: 4 per SM on a GPU (what fits at 128 registers x 4 warps, or at the
    default tile's 255 registers x 2 warps, compiled offline for sm_90, 2026-12-02); 2 under
    the CPU interpreter, so its tests walk several channel blocks per program."""
    if device.type != "cuda":
        return 2
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(M: int, d: int, device: torch.device, tile: tuple[int, int, int] | None = None) -> dict:
    """The residual kernel's tiling for M tokens of width d (also recorded by benchmarks/bench_mhc.py):
    BM tokens x BD channels per step, and a grid (token blocks, channel ranges) in which each program walks
    blocks_per_range channel blocks. Below 256 tokens: 16 tokens x 32 channels, 4 warps, stream tiles loaded
    per output stream (more token blocks, so fewer channel ranges and atomics are needed to fill the machine;
    the decode schedule, not changed with TUNE); from 256: TUNE's tile, warps and x_once (64 x 16 at 4 warps
    where d is not a multiple of the tile's channels). `tile` = (BM, BD, stages) replaces that rule, at 4 warps
    and TUNE's x_once (benchmarks/diagnose_gaps.py times other tiles; 4 warps as before TUNE's 2, since larger
    tiles at 2 warps spill)."""
    import triton

    fits = d % TUNE["tile"][1] == 0
    big = TUNE["tile"] if fits else (64, 16, 2)  # the fallback keeps its 4 warps whatever TUNE's are
    BM, BD, stages = tile or ((16, 32 if d % 32 == 0 else 16, 3) if M < 256 else big)
    token_blocks = triton.cdiv(M, BM)
    n_blocks = d // BD
    blocks_per_range = _blocks_per_range(token_blocks, n_blocks, _target_programs(device))
    return dict(BM=BM, BD=BD, blocks_per_range=blocks_per_range,
                grid=(token_blocks, triton.cdiv(n_blocks, blocks_per_range)),
                num_warps=TUNE["num_warps"] if M >= 256 and fits and not tile else 4, num_stages=stages,
                x_once=TUNE["x_once"] and M >= 256)


# How the residual kernel's channel blocks are split into ranges: "waves" (the default since h200-2026-12-04: 183.8
# against 223.7 µs GPU time at 4096 tokens, 1.85x against 2.25x the bytes floor, in the same run) or "fill", the
# rule before it (benchmarks/bench_mhc.py --sweep-set ranges times the two in one run).
RANGE_RULE = "waves"


def _blocks_per_range(token_blocks: int, n_blocks: int, target: int) -> int:
    """Channel blocks each program walks. More ranges fill the machine (at most `target` programs run at once:
    4 per SM at the default tile's 255 registers) but cost atomics and W_fn re-reads, so the ranges are as long
    as filling the machine allows; a decode step of one token gets one block per program. "waves": of the range
    counts up to that, the one whose grid finishes soonest (kernels.whole_waves). At 4096 tokens the "fill" rule's
    3 ranges made 768 programs, 1.45 waves, whose second wave ran half empty (ncu, h200-2026-12-04: DRAM at 40% of
    its peak against 54% at 16384 tokens, 1.94 waves); 2 ranges make 512, one wave."""
    most = max(1, min(n_blocks, cdiv(target, token_blocks)))
    if RANGE_RULE == "fill":
        return cdiv(n_blocks, most)
    return whole_waves(n_blocks, token_blocks, target, most)[0]


def mhc_step(x: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             iters: int, hc_eps: float, norm_eps: float, y: torch.Tensor | None = None,
             post: torch.Tensor | None = None, comb: torch.Tensor | None = None, force_triton: bool = False,
             norm: tuple | None = None):
    """See reference.mhc_step: returns (X', collapsed, pre, post, comb). The reference runs where the kernel
    does not apply: off CUDA, when a gradient is wanted (training), or for shapes it does not take (a
    stream count that is not a power of two, d not a multiple of 16; a forced call raises instead).
    norm (weight, eps): the sub-layer's RMSNorm of the collapsed input, returned in its place (kernels/norm.py's
    rms_norm; in the CPU decode step's one call, its C call)."""
    if not force_triton and not use_triton(x, y):  # the usual CPU answer, before any shape is read
        if host.takes(x, pre_prev, *(() if y is None else (y, post, comb))):
            return _host_step(x, pre_prev, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb, norm)
        return _normed(reference.mhc_step(x, pre_prev, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb), norm)
    *lead, n, d = x.shape
    fits = n & (n - 1) == 0 and d % 16 == 0
    if force_triton and not fits:
        raise ValueError(f"mHC kernel needs a power-of-two stream count and d % 16 == 0, got n={n}, d={d}")
    if not fits or not use_triton(x, y, force=force_triton) or torch.is_grad_enabled() and (
            x.requires_grad or (y is not None and y.requires_grad) or fn.requires_grad):
        return _normed(reference.mhc_step(x, pre_prev, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb), norm)
    return _normed(_launch(x, pre_prev, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb), norm)


def _normed(step: tuple, norm: tuple | None) -> tuple:
    """mhc_step's outputs with the collapsed input through the RMSNorm `norm` (weight, eps), where one is given."""
    if norm is None:
        return step
    x_new, collapsed, *coefficients = step
    return (x_new, kernels_norm.rms_norm(collapsed, *norm), *coefficients)


_HOST_OPERANDS: dict = {}


def _host_operands(fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int):
    """host.mhc_step's (W_fn transposed, scales spread per mix, base): host.transposed's copy and
    reference._mix_affine's pair, memoized per live trio of tensors and their versions in one lookup (the two
    caches behind it cost a weak-dictionary lookup and a key of four attribute reads each, 20 times a token)."""
    key = (id(fn), id(scale), id(base), n)
    versions = (fn._version, scale._version, base._version, fn.data_ptr())
    hit = _HOST_OPERANDS.get(key)
    if hit is not None and hit[0]() is fn and hit[1]() is scale and hit[2]() is base and hit[3] == versions:
        return hit[4]
    operands = (host.transposed(fn), *reference._mix_affine(scale, base, n))
    if len(_HOST_OPERANDS) > 256:
        _HOST_OPERANDS.clear()
    _HOST_OPERANDS[key] = (weakref.ref(fn), weakref.ref(scale), weakref.ref(base), versions, operands)
    return operands


def _one_call(x: torch.Tensor, fn: torch.Tensor, y: torch.Tensor | None) -> bool:
    """Whether _host_step's pieces have host.mhc_step's bits, so that it runs instead: the decode step's scalar
    sigmoids (`row_invariant`), the C Sinkhorn's and RMS statistic's shapes, the fixed-order projection, y in x's
    dtype."""
    n, d = x.shape[-2:]
    return (reference._ROW_INVARIANT.get() and n <= host.SINKHORN_MAX_N and n * d >= host.SUM_LANES
            and host.fixed_order_applies(x, fn) and (y is None or y.dtype == x.dtype))


def _host_step(x, pre_prev, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb, norm=None):
    """reference.mhc_step with its operator-bound pieces as C calls (host.py, the same bits): the residual
    update, the collapse and the Sinkhorn loop; the projection W_fn X summed in a fixed order (a token's
    coefficients do not depend on the tokens beside it: host.fixed_order_linear); the RMS statistic in C with
    ATen's order of the sum (host.rms_rstd); the sigmoids, where the decode step sends them down ATen's scalar
    formula (reference.per_row), over the C library's expf (host.scalar_sigmoid); the softmax's exp stays torch's.
    In the decode step (`row_invariant`) all of it but the exp is one C call (host.mhc_step: about 20 operators
    fewer a call, 20 calls a token)."""
    if _one_call(x, fn, y):
        in_call = norm is None or host.takes(norm[0]) and x.size(-1) >= host.SUM_LANES  # rms_norm's host path
        step = host.mhc_step(x, pre_prev, *_host_operands(fn, scale, base, x.size(-2)), iters, hc_eps, norm_eps, y,
                             post, comb, norm if in_call else None)
        return step if in_call else _normed(step, norm)
    x_new = x if y is None else host.expand(y, x, post, comb)
    collapsed = host.collapse(x_new, pre_prev)
    normalize = host.sinkhorn_normalize_ if x.shape[-2] <= host.SINKHORN_MAX_N else None
    xf = x_new.float()
    rstd = host.rms_rstd if host.rms_fits(xf.flatten(-2)) else None
    pre_n, post_n, comb_n = reference._hc_coefficients(xf, fn, scale, base, iters, hc_eps, norm_eps,
                                                       normalize, host.fixed_order_linear, rstd, host.scalar_sigmoid)
    return _normed((x_new, collapsed, pre_n, post_n, comb_n), norm)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           force_triton: bool = False) -> torch.Tensor:
    """reference.expand (the residual update after the last sub-layer of a block): one C call on the CPU; one
    kernel (in torch, seven launches a block) on CUDA at inference, and forced under the interpreter."""
    if host.takes(y, residual, post, comb):
        return host.expand(y, residual, post, comb)
    if (inference_kernel(y, residual, post, comb, force=force_triton)
            and y.dtype in (torch.bfloat16, torch.float32) and residual.dim() >= 2
            and y.shape == residual.shape[:-2] + residual.shape[-1:]):
        return _launch_expand(y, residual, post, comb)
    return reference.expand(y, residual, post, comb)


@opaque
def _launch_expand(y, residual, post, comb):
    import triton

    from dsv41.model.kernels._triton_mhc import expand_kernel

    *lead, n, d = residual.shape
    M = y.numel() // d
    out = torch.empty(*lead, n, d, dtype=y.dtype, device=y.device)
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    BD = min(1024, triton.next_power_of_2(d))
    # enable_fp_fusion=False: each product rounded before its sum, as torch's separate multiply and add (and the C
    # version, built with -ffp-contract=off) round them; a contracted fma rounds once, and where the sum over the
    # streams cancels that moved the bf16 output by up to 5 ulps (the first GPU run, 2026-12-05)
    expand_kernel[(M, triton.cdiv(d, BD))](y.contiguous(), residual.contiguous(), f32(post), f32(comb), out, M, d,
                                           N=n, BD=BD, INTERPRET=interpreting(), num_warps=4,
                                           enable_fp_fusion=False)
    return out


@opaque
def _launch(x, pre_prev, fn, scale, base, iters, hc_eps, norm_eps, y, post, comb):
    """mhc_step on the Triton path."""
    import triton

    from dsv41.model.kernels._triton_mhc import coefficient_kernel, residual_kernel

    *lead, n, d = x.shape
    M = x[..., 0, 0].numel()
    n_mix = (n + 2) * n
    NMP = max(16, triton.next_power_of_2(n_mix))
    fn_hi, fn_lo = _split_fn(fn, NMP)
    xc = x.contiguous()
    has_y = y is not None
    x_new = torch.empty_like(xc) if has_y else xc
    collapsed = torch.empty(*lead, d, dtype=x.dtype, device=x.device)
    acc = torch.zeros(M, NMP + 1, dtype=torch.float32, device=x.device)
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    yc = y.contiguous() if has_y else xc
    postc = f32(post) if has_y else acc
    combc = f32(comb) if has_y else acc
    cfg = launch_config(M, d, x.device)
    residual_kernel[cfg["grid"]](xc, yc, postc, combc, f32(pre_prev), fn_hi, fn_lo, x_new, collapsed, acc, M, d,
                                 cfg["blocks_per_range"], N=n, NMP=NMP, BM=cfg["BM"], BD=cfg["BD"], HAS_Y=has_y,
                                 X_ONCE=cfg["x_once"], INTERPRET=interpreting(), num_warps=cfg["num_warps"],
                                 num_stages=cfg["num_stages"])
    pre_n = torch.empty(*lead, n, dtype=torch.float32, device=x.device)
    post_n = torch.empty_like(pre_n)
    comb_n = torch.empty(*lead, n, n, dtype=torch.float32, device=x.device)
    coefficient_kernel[(triton.cdiv(M, 64),)](acc, f32(scale), f32(base), pre_n, post_n, comb_n, M, float(n * d),
                                              float(norm_eps), float(hc_eps), N=n, NMP=NMP, BM=64, ITERS=iters,
                                              num_warps=4)
    return x_new, collapsed, pre_n, post_n, comb_n
