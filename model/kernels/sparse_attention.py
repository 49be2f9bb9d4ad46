"""Sparse MQA with a per-head sink over [window rows ; compressed rows], dequantizing packed KV in the kernel.

    o_{t,h} = sum_j e^{l_j - M} kv_j / (sum_j e^{l_j - M} + e^{sink_h - M}),   l_j = scale q_{t,h} . kv_{idx_j}

over j in window_idx[t] (rows of the window store) and main_idx[t] (rows of the compressed store), -1 = empty
(model/attention.py: sparse_attention). Keys and values are the same latent row (one 512-wide head shared
by all query heads), so each row is read and dequantized once per block of heads and used for both
products.

Two kernels. The split kernel runs for decode (T = 1) and prefill when H <= 64 (PREFILL_VARIANT; `variant=
"split"` forces it): flash-decoding. Each query token's index list, [window ; main] cut into tiles of BK rows (each segment
padded to whole tiles), is split across programs (segment_splits: each segment's launch in whole waves of the
programs the SMs hold, at most about 2 x SMs programs, so decode at B = 1 gets one split per tile and a long
prefill one split per segment); each split_kernel program takes ALL
heads of its (token, split), so every gathered row is decoded once and used by every head ([H, D] x [D, BK]
then [H, BK] x [BK, D]), loads each row as contiguous bytes (the FP4 nibbles are decoded apart and
interleaved with join + reshape), and writes a normalised fp32 partial output with its max and sum; one
launch per segment (the two loops in one program spill on sm_90). Then split_combine_kernel merges the splits by
log-sum-exp with the sink. The B*T query tokens go through in groups of at most SPLIT_GROUP_ROWS (the split
launches and the combine per group, one partial buffer reused), so a long prefill's partials stay bounded.
The tile kernel (`variant="tiles"`, PREFILL_VARIANT = "tiles", and H > 64, more heads than the split kernel's
all-heads program holds):
one program per (token, block of BH heads) walking the window indices and then the compressed indices in
tiles of BK rows with the online softmax. Both start the running max at the sink (so an empty row ends as 0,
and an empty split has l = 0 and no NaN). The tile kernel keeps every D-vector as its even and odd halves
(q.kv = q_even.kv_even + q_odd.kv_odd) so the FP4 nibbles never interleave; it loads FP8 and bf16 rows with
stride 2. Row formats (constexpr per segment): DENSE (bf16 rows), FP8 (E4M3 bytes + UE8M0 per 32), FP4 (E2M1
pairs + E4M3 per 16).

Numerics: the dequantized values are exact in bf16 (at most 5 significant bits), q enters the matrix
units as bf16 (the model's q is bf16), the logits and the accumulator are fp32, the probabilities enter
the second product as bf16 (as flash attention does); the output is rounded to q's dtype. The split path
decodes the packed rows straight to bf16 (exact) and keeps its partial outputs, maxima and sums in fp32.
"""

from __future__ import annotations

import torch

from dsv41.model.kernels import cdiv, gemm, host, interpreting, opaque, quant, reference, use_triton, whole_waves

DENSE, FP8, FP4, NONE = 0, 1, 2, 3


def sparse_attention_packed(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                            main_codes: torch.Tensor | None, main_scales: torch.Tensor | None,
                            sink: torch.Tensor, window_idx: torch.Tensor, main_idx: torch.Tensor | None,
                            scale: float, force_triton: bool = False, variant: str = "auto",
                            window_values: torch.Tensor | None = None) -> torch.Tensor:
    """See reference.sparse_attention_packed (same signature, same result within bf16 rounding). `variant`
    picks the kernel ("auto": split up to SPLIT_MAX_HEADS heads, for prefill PREFILL_VARIANT's; tiles above;
    "tiles" or "split" to compare them). The reference also runs for what the kernel does not take unless forced: a head dim that is not a power of
    two >= 32, a q that is not bf16. window_values: the window rows decoded (the reference's shortcut; the
    kernel decodes the bytes itself)."""
    usable = force_triton or (supported(q, window_codes.size(-1)) and q.dtype == torch.bfloat16)
    if not usable or not use_triton(q, window_codes, main_codes, force=force_triton):
        if host_applies(q, window_codes):
            return host.sparse_attention_packed(q, window_codes, window_scales, main_codes, main_scales, sink,
                                                window_idx, main_idx, scale, window_values)
        return reference.sparse_attention_packed(q, window_codes, window_scales, main_codes, main_scales, sink,
                                                 window_idx, main_idx, scale, window_values, unpack=quant.unpack)
    segments = [(FP8, window_codes, window_scales, window_idx)]
    if main_codes is not None and main_idx is not None:
        segments.append((FP4, main_codes, main_scales, main_idx))
    return _launch(q, sink, scale, segments, variant)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                     force_triton: bool = False, variant: str = "auto") -> torch.Tensor:
    """See reference.sparse_attention (dsv41.model.attention.sparse_attention off the kernel): unpacked bf16
    rows kv [B,N,D] through the same kernel."""
    if not use_triton(q, kv, force=force_triton) or kv.dtype != torch.bfloat16:
        return reference.sparse_attention(q, kv, sink, idx, scale)
    return _launch(q, sink, scale, [(DENSE, kv, None, idx)], variant)


def host_applies(q: torch.Tensor, window_codes: torch.Tensor) -> bool:
    """Whether the CPU takes host.sparse_attention_packed (reference.sparse_attention_fixed_order's sums, one C
    call): a contiguous bf16/fp32 CPU q with no gradient wanted, whole FP8 and FP4 scale blocks, the library
    loaded, the "fast" GEMM mode (the "exact" mode keeps REF's order: reference.sparse_attention) and no Triton
    interpreter (whose runs compare the kernels against the reference)."""
    return (q.dim() == 4 and q.size(-1) % 32 == 0 and window_codes.size(-1) == q.size(-1)
            and gemm.GEMM_MODE["mode"] == "fast" and not interpreting() and host.takes(q))


def supported(q: torch.Tensor, head_dim: int) -> bool:
    """Shapes the kernel handles: a power-of-two head dim of at least 32 (tl.dot needs 16 per half)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0 and q.size(-1) == head_dim


VARIANTS = ("auto", "tiles", "split")
SPLIT_MAX_HEADS = 64  # the split kernel keeps every head of a token in one program: [H, D] fp32 accumulator
SPLIT_WARPS = 8  # 64 x 512 fp32 accumulator over 256 threads: 128 registers each
# 32-row tiles without software pipelining: 123.5 µs replayed from a graph at B=64, N=4K against 164.6 µs
# for the previous 16-row tiles pipelined once (SPLIT_STAGES=2, SPLIT_BK=16) in the same run
# (h200-2026-12-02-c, bench_sparse_attention's sweep); 32-row tiles spill 40-88 bytes on sm_90 and still win
SPLIT_STAGES = 1
SPLIT_BK = 32  # rows per tile at D >= 256
SPLIT_PER_SM = 2  # programs aimed at per SM (rows x splits): fewer means fewer fp32 partials to write and merge
# Query tokens per launch group of the split path (its partials hold one group at a time). A group of this many
# rows gets one split per segment from split_config (rows >= SPLIT_PER_SM x SMs), 2 x H x D x 4 = 256 KiB of
# fp32 partials per token at H = 64, D = 512: 256 MiB for the group, where a 32K-token prefill in one launch
# would take 8 GiB. It still gives each launch 1024 programs per segment (~8 per SM on an H200's 132) and costs
# a 4096-token prefill 4 x 3 launches; every decode batch up to 1024 sequences stays one group, as before.
SPLIT_GROUP_ROWS = 1024
# The kernel "auto" takes for prefill (T > 1): the split kernel, in groups of SPLIT_GROUP_ROWS. At T = 4096, N = 4096
# it took 4.92 ms against the tile kernel's 66.4 ms in the same run (13.5x; 11.2x its floor against 151x), and the
# 8-layer stack's 32K prefill 3.03 s against 6.53 s (h200-2026-12-02-h). "tiles" stays for comparison and H > 64.
PREFILL_VARIANT = "split"


def _launch(q, sink, scale, segments, variant="auto"):
    B, T, H, D = q.shape
    if not supported(q, D):
        raise ValueError(f"sparse attention kernel needs a power-of-two head dim >= 32, got {D}")
    if variant not in VARIANTS:
        raise ValueError(f"sparse attention variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "split" or (variant == "auto" and H <= SPLIT_MAX_HEADS and (T == 1 or PREFILL_VARIANT == "split")):
        return _launch_split(q, sink, scale, segments)
    return _launch_tiles(q, sink, scale, segments)


def _segment_args(q, segments):
    """Kernel arguments of the two segment slots (an absent second segment gets NONE and dummies)."""
    B, T = q.shape[:2]
    args = []
    fmts = []
    for fmt, codes, scales, idx in segments + [(NONE, None, None, None)] * (2 - len(segments)):
        fmts.append(fmt)
        if fmt == NONE:
            dummy = q  # never read (the segment's loop has no iterations)
            args += [dummy, dummy, 0, 0, 0, 0, torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device), 0, 0, 0]
            continue
        codes = codes.contiguous()
        scales = codes if scales is None else scales.contiguous()
        idx = idx.to(torch.int32).expand(B, T, -1).contiguous()
        args += [codes, scales, codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
                 idx, idx.stride(0), idx.stride(1), idx.size(2)]
    return args, fmts


def split_config(rows: int, counts: list[int], D: int, sms: int) -> tuple[int, int, list[int]]:
    """(BK, tiles per split, splits of each segment) for `rows` query tokens whose index lists hold `counts`
    indices per segment: enough programs to fill the GPU about twice (rows x splits ~ SPLIT_PER_SM x SMs), at
    least one tile per split, never an empty split. B=1 gets as many splits as its lists have tiles."""
    BK = SPLIT_BK if D >= 256 else 64
    seg_tiles = [-(-k // BK) for k in counts]
    n_tiles = max(sum(seg_tiles), 1)
    want = max(1, -(-SPLIT_PER_SM * sms // max(rows, 1)))
    tiles = -(-n_tiles // min(want, n_tiles))
    return BK, tiles, [-(-n // tiles) for n in seg_tiles]


# How the split path cuts each segment's tiles into splits: "waves" (the default since h200-2026-12-04: decode at
# B=64 103.9 against 124.5 µs GPU time at 128K in the same run) or "share", split_config's rule before it
# (bench_sparse_attention.py's sweep times the two in one run).
SPLIT_RULE = "waves"
# Split-kernel programs an SM holds at once at V4.1's D = 512, H = 64: one (255 registers x 256 threads, 131 KB of
# shared memory; ncu, h200-2026-12-04). The waves rule counts in units of SMs x this.
SPLIT_RESIDENT = 1


def segment_splits(rows: int, counts: list[int], D: int, sms: int) -> tuple[int, list[tuple[int, int]]]:
    """(BK, [(tiles per split, splits)] of each segment) for `rows` query tokens whose index lists hold `counts`
    indices per segment. The segments launch one after the other, so each is cut on its own ("waves"): into the
    split count whose grid finishes soonest in waves of sms x SPLIT_RESIDENT programs (kernels.whole_waves; ties:
    fewer splits, fewer fp32 partials), at most about SPLIT_PER_SM x sms programs a
    segment as split_config allows (each split writes H x D fp32 partials). split_config's shared tile count ("share")
    gave decode at B = 64 a window launch of 64 programs, one wave on half the SMs, and a main launch of 256, two
    waves; "waves" gives 128 and 128. Every tile covered, no split empty."""
    if SPLIT_RULE == "share":
        BK, tiles, seg = split_config(rows, counts, D, sms)
        return BK, [(tiles, n) for n in seg]
    BK = SPLIT_BK if D >= 256 else 64
    most = max(1, cdiv(SPLIT_PER_SM * sms, max(rows, 1)))  # split_config's bound on rows x splits: the partials
    plan = []
    for k in counts:
        n_tiles = cdiv(k, BK)
        plan.append(whole_waves(n_tiles, max(rows, 1), max(1, sms * SPLIT_RESIDENT), min(n_tiles, most))
                    if n_tiles else (1, 0))
    return BK, plan


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100/H200's count, so the CPU tests take the same split choices


@opaque
def _launch_split(q, sink, scale, segments):
    """Flash-decoding: split_kernel over (token, split) for each segment, all heads per program, then
    split_combine_kernel merges the splits with the sink; the B*T query tokens in groups of SPLIT_GROUP_ROWS."""
    import triton

    from dsv41.model.kernels._triton_sparse_attention import split_combine_kernel, split_kernel

    B, T, H, D = q.shape
    q = q.contiguous()
    o = torch.empty_like(q)
    sink = sink.float().contiguous()
    R = B * T
    group_rows = max(1, min(R, SPLIT_GROUP_ROWS))
    # one split choice for every group (a full group's, also the last, shorter one's): the partial buffer fits
    # each group, and a token's splits do not depend on the group it falls in
    counts = [idx.size(-1) for _, _, _, idx in segments]
    BK, plan = segment_splits(group_rows, counts, D, _sm_count(q.device))
    seg_splits = [n for _, n in plan]
    splits = max(sum(seg_splits), 1)
    BH = max(16, triton.next_power_of_2(H))
    po = torch.empty(group_rows, splits, H, D, dtype=torch.float32, device=q.device)
    pm = torch.empty(group_rows, splits, H, dtype=torch.float32, device=q.device)
    pl = torch.empty(group_rows, splits, H, dtype=torch.float32, device=q.device)
    if sum(seg_splits) == 0:  # no index at all: every query sees only its sink, o = 0 (no launch writes these)
        pm.fill_(float("-inf"))
        pl.zero_()
        po.zero_()
    launched = []  # (fmt, codes, scales, idx, first split, splits) of the segments that have indices
    split0 = 0
    for (fmt, codes, scales, idx), (tiles, n) in zip(segments, plan):
        if n == 0:
            continue
        codes = codes.contiguous()
        scales = codes if scales is None else scales.contiguous()
        idx = idx.to(torch.int32).expand(B, T, -1).contiguous()
        launched.append((fmt, codes, scales, idx, split0, n, tiles))
        split0 += n
    BHC, BD = 16, min(D, 128)
    for row0 in range(0, R, group_rows):
        rows = min(group_rows, R - row0)
        for fmt, codes, scales, idx, split0, n, tiles in launched:
            split_kernel[(rows, n)](q, sink, po, pm, pl, q.stride(0), q.stride(1), q.stride(2), T, H, float(scale),
                                    row0, tiles, split0, splits, codes, scales, codes.stride(0), codes.stride(1),
                                    scales.stride(0), scales.stride(1), idx, idx.stride(0), idx.stride(1),
                                    idx.size(2), D=D, BH=BH, BK=BK, FMT=fmt, INTERPRET=interpreting(),
                                    num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES)
        split_combine_kernel[(rows, triton.cdiv(H, BHC), D // BD)](po, pm, pl, sink, o, o.stride(0), o.stride(1),
                                                              o.stride(2), T, H, row0, SPLITS=splits, D=D,
                                                              BH=BHC, BD=BD, INTERPRET=interpreting(), num_warps=4)
    return o


@opaque
def _launch_tiles(q, sink, scale, segments):
    """The first kernel: one program per (token, block of BH heads) walking the whole list (prefill by default,
    `variant="tiles"`, and more heads than the split kernel's program holds)."""
    import triton

    B, T, H, D = q.shape
    q = q.contiguous()
    o = torch.empty_like(q)
    sink = sink.float().contiguous()
    args, fmts = _segment_args(q, segments)
    BH = min(max(16, triton.next_power_of_2(H)), 16 if D >= 256 else 64)
    BK = 32 if D >= 256 else 64
    grid = (B * T, triton.cdiv(H, BH))
    from dsv41.model.kernels._triton_sparse_attention import tiles_kernel

    tiles_kernel[grid](q, o, sink, q.stride(0), q.stride(1), q.stride(2), T, H, float(scale), *args,
                 D2=D // 2, BH=BH, BK=BK, FMT_A=fmts[0], FMT_B=fmts[1],
                 INTERPRET=interpreting(), num_warps=4)
    return o
