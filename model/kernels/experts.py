"""The routed experts of an MoE layer as grouped GEMMs over expert-sorted tokens (model/moe.py, MoE.routed).

    y_t = sum over t's selected experts e (ascending e) of  w_{t,e} ... E_e(x_t)       fp32 [T, dim]
    E_e(x) = w2_e( round( w_route * silu(min(round(w1_e xq), L)) * clamp(round(w3_e xq), -L, L) ) )

exactly as Expert.forward in the "fast" gemm mode (model/layers.py): every GEMM takes the FP8 fake-quantized
activation and the exactly dequantized weight, accumulates in fp32 and rounds to the activation dtype.

Launches (no host synchronisation, so the routing never waits for the device):

1. routing (torch): the (token, slot) assignments sorted by expert (stable), per-expert row offsets, and a
   table of row tiles (expert, first row) sized by an upper bound, cdiv(T k, BM) + min(E, T k); tiles past
   the real ones carry expert E and exit at once. An expert with no tokens has no tile.
2. fp8_act_quant of all T tokens once (the quantization is per row, so gathering quantized rows equals
   quantizing gathered rows).
3. up: per (row tile, BN intermediate channels), both w1 and w3 products over the gathered rows, the
   SwiGLU epilogue with the routing weight, and w2's input quantized there: h [T k, inter].
4. down: per (row tile, BN model channels), out = round(w2 h) [T k, dim].
5. combine: y_t = sum of t's rows of `out` in ascending expert order, in fp32 (MoE.routed's order).

A decode step's few rows (one row tile per expert) give up and down few programs, each streaming a long K
range (h200-2026-12-05-b: 6.2x and 6.6x their bytes floor at one token). The K range can be split
(`split_up`, `split_down`; by default about 4 programs per SM, SPLIT_PROGRAMS_PER_SM): each program
sums its part in fp32 and the parts are added in order (deterministic) before the rounding, for up by a
finishing kernel that then runs the SwiGLU epilogue, for down inside combine. The same products; fp32 sums
in another order.

The weights stay where the checkpoint put them (one tensor per expert and matrix): the kernels reach them
through a table of byte offsets from one base tensor (ExpertWeights.table), built once per device.
Expert formats: packed FP4 (V4.1's routed experts) or block-scaled FP8 (the `--expert-dtype fp8` convert).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from dsv41.model import formats
from dsv41.model.kernels import decode_mode, inference_kernel, interpreting, opaque, reference, use_triton

_NAMES = ("w1", "s1", "w3", "s3", "w2", "s2")


@dataclass
class ExpertWeights:
    """The stored weights of n routed experts, per expert; None where another rank holds the expert.

    fmt "fp4": w [out, in/2] packed E2M1, s [out, in/32] UE8M0; "fp8": w [out, in] E4M3, s
    [ceil(out/block), ceil(in/block)] UE8M0. `block` is the activation block (and the FP8 weight block)."""

    fmt: str
    block: int
    dim: int
    inter: int
    w1: list
    s1: list
    w3: list
    s3: list
    w2: list
    s2: list
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def n_experts(self) -> int:
        return len(self.w1)

    @classmethod
    def from_experts(cls, experts) -> "ExpertWeights":
        """From model/moe.py's Expert modules (None entries: experts held by another rank)."""
        held = [e for e in experts if e is not None]
        if not held:
            raise ValueError("no expert is held here")
        first = held[0]
        kind = first.w1.kind
        if kind not in ("fp4", "fp8"):
            raise ValueError(f"expert kernels need FP4 or FP8 experts, not {kind}")
        lists = {n: [] for n in _NAMES}
        for e in experts:
            for name, lin in (("1", None if e is None else e.w1), ("3", None if e is None else e.w3),
                              ("2", None if e is None else e.w2)):
                lists["w" + name].append(None if lin is None else lin.weight)
                lists["s" + name].append(None if lin is None else lin.scale)
        return cls(kind, first.w1.block, first.w1.in_features, first.w1.out_features, **lists)

    def held(self, device: torch.device) -> torch.Tensor:
        """[n] bool on `device`: which experts are held here."""
        return self.table(device)[2]

    def table(self, device: torch.device):
        """(base uint8 tensor, byte offsets [6, n] int64 of w1 s1 w3 s3 w2 s2 from base, held [n] bool,
        aligned: every weight offset a multiple of 16 bytes). Built once per device."""
        hit = self._tables.get(device)
        if hit is not None:
            return hit
        held = [w is not None for w in self.w1]
        tensors = [getattr(self, n) for n in _NAMES]
        base = next(w for w in self.w1 if w is not None)
        if base.device != device:
            raise ValueError(f"expert weights are on {base.device}, the input on {device}")
        for name, ts in zip(_NAMES, tensors):  # the kernels take one row stride per matrix
            first = next(t for t in ts if t is not None)
            if any(t is not None and (t.shape != first.shape or t.stride() != first.stride()) for t in ts):
                raise ValueError(f"experts' {name} tensors differ in shape or layout")
            if first.stride(-1) != 1:
                raise ValueError(f"experts' {name} tensors must be contiguous along the last dimension")
        base_ptr = base.data_ptr()
        offsets = [[0 if t is None else t.data_ptr() - base_ptr for t in ts] for ts in tensors]
        aligned = all(o % 16 == 0 for row in (offsets[0], offsets[2], offsets[4]) for o in row) and base_ptr % 16 == 0
        entry = (base.view(torch.uint8), torch.tensor(offsets, dtype=torch.int64, device=device),
                 torch.tensor(held, dtype=torch.bool, device=device), aligned)
        self._tables[device] = entry
        return entry


# MoE module -> (key, probe tensors, ExpertWeights); weak on the module, and invisible to deepcopy / pickle
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_weights(owner, experts) -> ExpertWeights:
    """`owner`'s ExpertWeights, built once and reused while its experts' tensors stay in place.

    MoE drops the entry when its weights move (.to, .cuda) or are loaded (load_state_dict), see `forget`.
    Each call also compares the first and last held experts' tensors (identity and data pointer), which
    catches other wholesale replacements; a full check over hundreds of experts per forward would cost
    milliseconds of Python. Replacing one expert's tensors by hand needs forget(moe)."""
    held = [e for e in experts if e is not None]
    probe = [t for e in (held[0], held[-1]) for lin in (e.w1, e.w3, e.w2) for t in (lin.weight, lin.scale)]
    key = (len(experts), len(held), tuple(t.data_ptr() for t in probe))
    hit = _CACHE.get(owner)
    if hit is not None and hit[0] == key and all(a is b for a, b in zip(hit[1], probe)):
        return hit[2]
    weights = ExpertWeights.from_experts(experts)
    _CACHE[owner] = (key, probe, weights)
    return weights


def forget(owner) -> None:
    """Drop `owner`'s cached ExpertWeights (its weights moved or were replaced)."""
    _CACHE.pop(owner, None)


def usable(experts, x: torch.Tensor) -> bool:
    """Whether MoE.routed can take the kernels: CUDA input with Triton, FP4/FP8 stored (not trainable)
    experts, no gradient needed, and the "fast" gemm mode (see model/kernels/gemm.py)."""
    from dsv41.model.kernels.gemm import GEMM_MODE

    if GEMM_MODE["mode"] != "fast" or not (x.is_cuda or interpreting()) or (
            torch.is_grad_enabled() and x.requires_grad) or not use_triton(x):
        return False
    first = next((e for e in experts if e is not None), None)
    return first is not None and first.w1.kind in ("fp4", "fp8") and not first.w1.trainable


# ------------------------------------------------------------------------------------------ routing
SORT_KERNEL_MAX = 512  # assignments (T k) and experts up to which one program sorts them (decode steps; no spill
# at 8 warps there, benchmarks/compile_kernels.py --only small)


def sort_by_expert(weights: torch.Tensor, indices: torch.Tensor, held: torch.Tensor, BM: int,
                   force_triton: bool = False):
    """The assignments grouped by expert, without a host synchronisation.

    Returns (token [R] int32, route weight [R] fp32, offsets [E+1] int32, tile expert [TILES] int32 (E =
    no tile), tile first row [TILES] int32, pos [T, k] int32: the sorted row of each of a token's slots in
    ascending order, -1 for experts not held). R = T k; assignments to experts not held sort last and lie
    beyond offsets[E]. Up to SORT_KERNEL_MAX assignments and experts, one kernel (`_sort_kernel`, the same
    outputs) where torch takes about thirty launches: on CUDA at inference, and forced under the interpreter."""
    T, k = indices.shape
    if (0 < T * k <= SORT_KERNEL_MAX and held.numel() <= SORT_KERNEL_MAX
            and inference_kernel(indices, force=force_triton)):
        return _sort_kernel(weights, indices, held, BM)
    E = held.numel()
    R = T * k
    dev = indices.device
    flat = indices.reshape(-1).long()
    is_held = held[flat]
    key = torch.where(is_held, flat, E)
    order = torch.argsort(key, stable=True)
    token = (order // k).to(torch.int32)
    route = weights.reshape(-1).float()[order].contiguous()
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    tiles = (counts + BM - 1) // BM
    tile_end = torch.cumsum(tiles, 0)
    n_tiles = -(-R // BM) + min(E, R)
    t = torch.arange(n_tiles, device=dev)
    tile_expert = torch.searchsorted(tile_end, t, right=True)
    e = tile_expert.clamp(max=E - 1)
    tile_row = offsets[e] + (t - (tile_end - tiles)[e]) * BM
    pos = torch.empty(R, dtype=torch.int64, device=dev)
    pos[order] = torch.arange(R, device=dev)
    pos = torch.where(is_held, pos, -1).view(T, k).sort(dim=1).values
    i32 = lambda v: v.to(torch.int32).contiguous()  # noqa: E731
    return token, route, i32(offsets), i32(tile_expert), i32(tile_row), i32(pos)


@opaque
def _sort_kernel(weights: torch.Tensor, indices: torch.Tensor, held: torch.Tensor, BM: int):
    import triton

    from dsv41.model.kernels._triton_gemm import expert_sort_kernel

    T, k = indices.shape
    E, R = held.numel(), T * k
    dev = indices.device
    n_tiles = -(-R // BM) + min(E, R)
    i32 = lambda *shape: torch.empty(*shape, dtype=torch.int32, device=dev)  # noqa: E731
    token, offsets, tile_e, tile_r, pos, scratch = i32(R), i32(E + 1), i32(n_tiles), i32(n_tiles), i32(T, k), i32(R)
    route = torch.empty(R, dtype=torch.float32, device=dev)
    p2 = triton.next_power_of_2
    wide = p2(E + 1) * p2(-(-R // BM)) > 4096  # the tile table's [EP, JP] scatter: 8 warps keep it in registers
    expert_sort_kernel[(1,)](weights.reshape(-1).float().contiguous(), indices.reshape(-1).contiguous(),
                             held.view(torch.uint8), token, route, offsets, tile_e, tile_r, pos, scratch,
                             T, R, E, k, n_tiles, BM, RP=p2(R), EP=p2(E + 1), JP=p2(-(-R // BM)), NTP=p2(n_tiles),
                             TP=p2(T), KP=p2(k), num_warps=8 if wide else 4)
    return token, route, offsets, tile_e, tile_r, pos


def launch_config(R: int, n_held: int, block: int, qw: int) -> dict:
    """Row tile from the mean rows per expert (decode: a few; prefill: tens to hundreds). FP4 weights are
    decoded straight to bf16 (dec16): 0.46x the time of the fp32 decode at 64 tokens and, with 128 output
    channels per program, 0.45x at 4096 (bench_experts --sweep, h200-2026-12-02-h), the same values. dec16="e4m3"
    (the codes / 64 by the E4M3 conversion, the indexer's default since h200-2026-12-04) is an override: here it
    was 0.99x at 64 tokens and 0.87x (slower) at 4096 (h200-2026-12-04-b), the same bits."""
    mean = R / max(n_held, 1)
    BM = 16 if mean <= 16 else 32 if mean <= 32 else 64
    big = BM >= 64
    return dict(BM=BM, BN=128 if big else 64, BK=max(64, block, qw), num_warps=8 if big else 4, num_stages=3,
                dec16=True, split_up=None, split_down=None)


# A split K range's target: about this many programs per SM over the row tiles a few rows occupy (a decode
# step); split_up / split_down None in the config = this rule, an int forces that many ranges; None here = one
# range. Unsplit, a decode step's up / down stages ran 6.2x / 6.6x their bytes floor (h200-2026-12-05-b: the
# few rows leave most SMs idle). Inside the 8-layer stack's engine step at 128K from a CUDA graph, against one
# range in the same call: 2 per SM 1.01x, 4 per SM 1.02x (h100-2026-12-05/ab, two rounds each).
SPLIT_PROGRAMS_PER_SM: int | None = 4


def k_ranges(K: int, BK: int, split: int) -> tuple[int, int]:
    """(K steps of BK per range, ranges) for about `split` ranges of whole BK steps over K."""
    steps = -(-K // BK)
    per = -(-steps // max(1, min(split, steps)))
    return per, -(-steps // per)


def decode_split(R: int, E: int, N: int, K: int, cfg: dict, device: torch.device,
                 per_sm: int | None = None) -> int:
    """Ranges of K for a stage of R rows over E experts (BM = 16 only: a few rows per expert): enough that the
    row tiles the rows can occupy (at most min(R, E)) times the channel blocks reach `per_sm` programs per SM
    (default SPLIT_PROGRAMS_PER_SM; None: one range), with at least two K steps per range."""
    per_sm = SPLIT_PROGRAMS_PER_SM if per_sm is None else per_sm
    if per_sm is None or cfg["BM"] > 16:
        return 1
    from dsv41.model.kernels.gemm import k_split

    return k_split(max(1, min(R, E)) * -(-N // cfg["BN"]), -(-K // cfg["BK"]), per_sm, device)


# ------------------------------------------------------------------------------------------ entry
def routed_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: ExpertWeights,
                   swiglu_limit: float, force_triton: bool = False, config: dict | None = None) -> torch.Tensor:
    """See reference.routed_experts: x [T, dim], routing weights / indices [T, k] -> fp32 [T, dim]."""
    if not use_triton(x, force=force_triton):
        return reference.routed_experts(x, weights, indices, experts, swiglu_limit)
    prep = prepare(x, weights, indices, experts, config)
    h = up(x, prep, experts, swiglu_limit)
    out = down(h, prep, experts, x.dtype)
    return combine(out, prep)


def prepare(x, weights, indices, experts: ExpertWeights, config=None) -> dict:
    """Routing (step 1) and the activation quantization (step 2)."""
    if x.dim() != 2 or x.size(1) != experts.dim:
        raise ValueError(f"expected x [T, {experts.dim}], got {tuple(x.shape)}")
    base, table, held, aligned = experts.table(x.device)
    qw = formats.FP4_WEIGHT_BLOCK if experts.fmt == "fp4" else experts.block
    T, k = indices.shape
    cfg = launch_config(T * k, experts.n_experts, experts.block, qw)
    cfg.update(config or {})
    for key, N, K in (("split_up", experts.inter, experts.dim), ("split_down", experts.dim, experts.inter)):
        if cfg[key] is None:  # rows' tiles bounded by all the experts (held or not: an upper bound)
            cfg[key] = decode_split(T * k, experts.n_experts, N, K, cfg, x.device)
    token, route, offsets, tile_e, tile_r, pos = sort_by_expert(weights, indices, held, cfg["BM"])
    from dsv41.model.kernels.gemm import _act_quant

    xq = _act_quant(x, experts.block, x.dtype) if T else x
    return dict(cfg=cfg, qw=qw, base=base, table=table, aligned=aligned, token=token, route=route,
                offsets=offsets, tile_e=tile_e, tile_r=tile_r, pos=pos, xq=xq, T=T, k=k)


def _packed(experts: ExpertWeights, k: int) -> int:
    """Bytes per weight row for k inputs."""
    return k // 2 if experts.fmt == "fp4" else k


def _first(ts):
    return next(t for t in ts if t is not None)


@opaque
def up(x, prep, experts: ExpertWeights, swiglu_limit: float) -> torch.Tensor:
    """Step 3: h [T k, inter] in x's dtype (w2's quantized input; rows of unheld experts unwritten)."""
    import triton

    from dsv41.model.kernels._triton_gemm import expert_up_finish_kernel, expert_up_kernel

    cfg, R = prep["cfg"], prep["T"] * prep["k"]
    E, K, N = experts.n_experts, experts.dim, experts.inter
    h = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R == 0:
        return h
    w1, s1 = _first(experts.w1), _first(experts.s1)
    nk, split = k_ranges(K, cfg["BK"], cfg["split_up"])
    part = torch.empty(split, 2, R, N, dtype=torch.float32, device=x.device) if split > 1 else h
    grid = (prep["tile_e"].numel(), triton.cdiv(N, cfg["BN"]), split)
    common = dict(HAS_LIMIT=swiglu_limit > 0, QA=experts.block, SPLIT=split, BM=cfg["BM"], BN=cfg["BN"],
                  INTERPRET=interpreting())
    expert_up_kernel[grid](prep["xq"], prep["token"], prep["route"], prep["tile_e"], prep["tile_r"],
                           prep["offsets"], prep["base"], prep["table"], h, part, E, K, _packed(experts, K), N, R * N,
                           prep["xq"].stride(0), h.stride(0), w1.stride(0), s1.stride(0), float(swiglu_limit),
                           W_FP4=experts.fmt == "fp4", QW=prep["qw"], ALIGNED=prep["aligned"], NK=nk, BK=cfg["BK"],
                           DEC16=decode_mode(cfg["dec16"]) if experts.fmt == "fp4" else 0, num_warps=cfg["num_warps"],
                           num_stages=cfg["num_stages"], **common)
    if split > 1:
        expert_up_finish_kernel[grid[:2]](part, prep["route"], prep["tile_e"], prep["tile_r"], prep["offsets"], h, E,
                                          N, R * N, h.stride(0), float(swiglu_limit), num_warps=4, **common)
    return h


@opaque
def down(h, prep, experts: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """Step 4: out [T k, dim] in the activation dtype; with a split K range, the ranges' fp32 sums
    [split, T k, dim], which combine adds in order and rounds."""
    import triton

    from dsv41.model.kernels._triton_gemm import expert_down_kernel

    cfg, R = prep["cfg"], h.size(0)
    E, K, N = experts.n_experts, experts.inter, experts.dim
    nk, split = k_ranges(K, cfg["BK"], cfg["split_down"])
    out = torch.empty(R, N, dtype=dtype, device=h.device) if split == 1 else \
        torch.empty(split, R, N, dtype=torch.float32, device=h.device)
    if R == 0:
        return out
    w2, s2 = _first(experts.w2), _first(experts.s2)
    grid = (prep["tile_e"].numel(), triton.cdiv(N, cfg["BN"]), split)
    expert_down_kernel[grid](h, prep["tile_e"], prep["tile_r"], prep["offsets"], prep["base"], prep["table"], out,
                             E, K, _packed(experts, K), N, R * N, h.stride(0), N, w2.stride(0), s2.stride(0),
                             W_FP4=experts.fmt == "fp4", QW=prep["qw"], ALIGNED=prep["aligned"], NK=nk, SPLIT=split,
                             BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], INTERPRET=interpreting(),
                             DEC16=decode_mode(cfg["dec16"]) if experts.fmt == "fp4" else 0,
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


@opaque
def combine(out, prep) -> torch.Tensor:
    """Step 5: y [T, dim] fp32, from down's output (its ranges' fp32 sums where it split K)."""
    import triton

    from dsv41.model.kernels._triton_gemm import expert_combine_kernel

    T, k = prep["T"], prep["k"]
    split = out.size(0) if out.dim() == 3 else 1
    R, N = out.shape[-2:]
    y = torch.empty(T, N, dtype=torch.float32, device=out.device)
    if T == 0:
        return y
    BT, BN = 16, 128
    expert_combine_kernel[(triton.cdiv(T, BT), triton.cdiv(N, BN))](
        out, prep["pos"], y, prep["xq"], T, N, R * N, N, y.stride(0), SLOTS=k, SPLIT=split, BT=BT, BN=BN,
        INTERPRET=interpreting(), num_warps=4)
    return y
