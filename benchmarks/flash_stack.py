"""A V4.1-Flash-shaped layer stack for the end-to-end benchmarks on one GPU (issue #9, build item 5).

The full model (40 layers, 384 FP4 experts each, ~280 GB of weights plus 196B Engram parameters) does not
fit on one H200. This builds every layer at full width (dim 5120, 64 heads x 512, q rank 1280, 384 routed
experts of 2304, 32 index heads x 128, window 128, Top-512, candidate pool 2048 blocks x 8) but only 8
layers, one of each CSA2 role in each CED part, in the real model's order:

    layer  part     m  mode     as in V4.1-Flash
    0      encoder  0  swa      layers 0-1
    1      encoder  2  full     layers 2, 8, 14 (kv + index source)
    2, 3   encoder  2  reuse    the other 15 encoder layers
    4      decoder  1  full     layer 20 (= n_layers // 2: CED projects the encoder output here; candidate source)
    5      decoder  1  reindex  layers 24, 28, 32, 36 (scores inside the candidate pool)
    6, 7   decoder  1  reuse    the other 15 decoder layers

Left out, and said so in every result: Engram (its tables hold 196B parameters; the real model has it
before layers 1 and 14), the DSpark stages (n_mtp_layers = 0) and the vision tower. With 384 experts
the weights take about 60 GB; `n_experts` reduces the routed experts (the active 6 per token stay) when
that does not fit.

Weights are random (the scales of `dsv41.model.transformer.init_random_`), generated on the device: the model
is built on the meta device, materialized with `to_empty`, and each group of same-shaped FP4 experts is
quantized in one call (init_random_ draws every weight on the CPU, which at this size takes minutes).

`fill_cache` makes a cache look as if `n` tokens had been consumed, without running them: random window
rings and random compressed main-KV entries and index keys, packed by the cache's own codecs. The cost of
a decode step or a prefill chunk depends on how many entries the cache holds, not on their values, so
this is how the 128K and 1M contexts are reached in seconds (a real 1M prefill would take hours here).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.model import formats  # noqa: E402
from dsv41.model.cache import INDEX_KEY_CODEC, KVCache, Rows  # noqa: E402
from dsv41.model.config import ModelArgs, preset  # noqa: E402
from dsv41.model.layers import Linear  # noqa: E402
from dsv41.model.transformer import Transformer, init_random_param_  # noqa: E402

STACK_RATIOS = (0, 2, 2, 2, 1, 1, 1, 1)
STACK_KV_SOURCES = (1, 4)
STACK_INDEX_SOURCES = (1, 4, 5)
STACK_CANDIDATE_SOURCE = 4
REPRESENTS = {0: "encoder swa", 1: "encoder full", 2: "encoder reuse", 3: "encoder reuse", 4: "decoder full",
              5: "decoder reindex", 6: "decoder reuse", 7: "decoder reuse"}
OMITTED = "Engram (before layers 1 and 14 in V4.1-Flash), DSpark stages, vision tower"


def stack_args(base: str = "v4.1-flash", n_experts: int | None = None) -> ModelArgs:
    """The 8-layer stack with the widths of `base` ("v4.1-flash", or "tiny" for the CPU check)."""
    a = preset(base)
    e = n_experts or a.n_routed_experts
    if e < a.n_activated_experts:
        raise ValueError(f"n_experts ({e}) must be at least the {a.n_activated_experts} activated experts")
    return a.replace(
        name=f"{base}-stack8", n_layers=8, n_mtp_layers=0, compress_ratios=STACK_RATIOS,
        kv_source_layers=STACK_KV_SOURCES, index_source_layers=STACK_INDEX_SOURCES,
        candidate_source_layer=STACK_CANDIDATE_SOURCE, engram_layer_ids=(), engram_num_embeddings=(),
        dspark_target_layer_ids=(), vision_n_layers=0, n_routed_experts=e,
        dspark_n_routed_experts=min(a.dspark_n_routed_experts, e))


def flash_layer_types() -> dict[str, int]:
    """How many layers of each (part, mode) the real V4.1-Flash has (from its layer plan)."""
    counts: dict[str, int] = defaultdict(int)
    for spec in preset("v4.1-flash").plan.layers:
        counts[f"{spec.part} {spec.mode}"] += 1
    return dict(counts)


# ---------------------------------------------------------------------------------------- random weights
@torch.no_grad()
def init_weights_(model: Transformer, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in their storage formats, drawn on the model's device (scales of init_random_)."""
    dev = model.embed.weight.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def normal(shape, s):
        return torch.randn(shape, generator=g, device=dev) * s

    groups: dict[tuple, list[Linear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, Linear):
            groups[(m.kind, m.out_features, m.in_features)].append(m)
    for (kind, out_f, in_f), mods in groups.items():
        s = std * (in_f / 32) ** -0.25
        if kind == "fp4":  # experts: many same-shaped matrices, quantized together (MXFP4 is per row)
            per = max(1, (1 << 28) // (out_f * in_f))
            for i in range(0, len(mods), per):
                chunk = mods[i:i + per]
                q, sc = formats.quant_fp4_weight(normal((len(chunk) * out_f, in_f), s), 32)
                q, sc = q.view(torch.int8).view(len(chunk), out_f, -1), sc.view(len(chunk), out_f, -1)
                for j, m in enumerate(chunk):
                    m.weight.copy_(q[j]), m.scale.copy_(sc[j])
        else:
            for m in mods:
                w = normal((out_f, in_f), s)
                if kind == "fp8":
                    q, sc = formats.quant_fp8_weight(w, m.block)
                    m.weight.copy_(q), m.scale.copy_(sc)
                else:
                    m.weight.copy_(w.to(m.weight.dtype))
        for m in mods:
            if m.bias is not None:
                m.bias.copy_(normal(m.bias.shape, std).to(m.bias.dtype))
    linear_params = {id(p) for m in model.modules() if isinstance(m, Linear) for p in m.parameters()}
    for name, p in model.named_parameters():
        if id(p) not in linear_params and not init_random_param_(model, name, p, normal, std):
            raise RuntimeError(f"no random init for {name} ({p.dtype})")


def build(args: ModelArgs, device: str, seed: int = 0) -> Transformer:
    """The model on `device` with random weights, built without a CPU copy of the weights."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    init_weights_(model, seed)
    return model.eval()


def weight_bytes(model: Transformer) -> int:
    return sum(p.nbytes for p in model.parameters())


# ---------------------------------------------------------------------------------------- synthetic cache
@torch.no_grad()
def fill_cache(model: Transformer, n: int, batch: int = 1, seed: int = 1, spare: int = 8192) -> KVCache:
    """A cache that holds `n` consumed tokens: window rings of the last `window_size` positions, and at each
    kv source n // m random main entries and index keys (packed by the cache's codecs), with room for
    `spare` more rows so the measured steps do not reallocate; a pending partial group where n % m != 0.
    Values are N(0, 1), the scale of the RMS-normalized latents the model writes."""
    args = model.args
    dev = model.embed.weight.device
    g = torch.Generator(device=dev).manual_seed(seed)
    cache = model.new_cache(batch)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device=dev).to(dtype)

    piece = 1 << 16
    for spec in model.plan.layers:
        keep = min(args.window_size, n)
        if keep:
            cache.write_window(spec.id, rand(batch, keep, args.head_dim), n - keep)
        if not spec.owns_kv:
            continue
        m = spec.compress_ratio
        entries = n // m
        lc = cache.layer(spec.id)
        for attr, codec, dim in (("main", cache.main_codec, args.head_dim),
                                 ("index_keys", INDEX_KEY_CODEC, args.index_head_dim)):
            rows = Rows(codec)
            rows.dtype = torch.bfloat16
            probe = codec.pack(rand(batch, 1, dim))
            rows.parts = tuple(p.new_zeros(batch, entries + spare, *p.shape[2:]) for p in probe)
            for s in range(0, entries, piece):
                e = min(s + piece, entries)
                for whole, part in zip(rows.parts, codec.pack(rand(batch, e - s, dim))):
                    whole[:, s:e] = part
            setattr(lc, attr, rows)
        lc.n_compressed = entries
        if n % m:  # the compressor's pending group: fp32 projections of its tokens, as Compressor keeps them
            lc.compressor_state.kv = rand(batch, n % m, args.head_dim, dtype=torch.float32)
            lc.compressor_state.score = rand(batch, n % m, args.head_dim, dtype=torch.float32)
    cache.pos = n
    return cache


# ---------------------------------------------------------------------------------------- timing
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class LayerTimer:
    """Time spent inside each block's forward, by CUDA events (no host sync) or the CPU clock; the
    per-layer totals accumulate over every forward while active."""

    def __init__(self, model: Transformer):
        self.model = model
        self.cuda = model.embed.weight.is_cuda
        self.marks: dict[int, list] = defaultdict(list)
        self.handles = []

    def _stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _before(self, i):
        self.marks[i].append([self._stamp(), None])

    def _after(self, i):
        self.marks[i][-1][1] = self._stamp()

    def __enter__(self):
        for i, block in enumerate(self.model.layers):
            self.handles.append(block.register_forward_pre_hook(lambda mod, args, i=i: self._before(i)))
            self.handles.append(block.register_forward_hook(lambda mod, args, out, i=i: self._after(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def seconds(self) -> dict[int, float]:
        sync("cuda" if self.cuda else "cpu")
        out = {}
        for i, pairs in self.marks.items():
            if self.cuda:
                out[i] = sum(a.elapsed_time(b) for a, b in pairs) * 1e-3
            else:
                out[i] = sum(b - a for a, b in pairs)
        return out



def timed(model: Transformer, run) -> tuple[float, LayerTimer]:
    """Wall seconds of run() between two device syncs, and its per-layer times; the CUDA peak-memory
    counter is reset first, so memory_note() speaks of this run."""
    dev = model.embed.weight.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(dev)
    with LayerTimer(model) as timer:
        t0 = time.perf_counter()
        run()
        sync(dev)
        return time.perf_counter() - t0, timer

# ---------------------------------------------------------------------------------------- floors
def _linear_flops(model: Transformer, layer: int) -> tuple[float, float, int]:
    """(per-token multiply-add FLOPs of the non-routed Linears, of one routed expert, number of experts)."""
    block = model.layers[layer]
    dense = routed = 0.0
    for name, m in block.named_modules():
        if isinstance(m, Linear):
            f = 2.0 * m.in_features * m.out_features
            if name.startswith("ffn.experts.0."):
                routed += f
            elif not name.startswith("ffn.experts."):
                dense += f
    return dense, routed, len(block.ffn.experts)


def _weight_bytes_split(model: Transformer, layer: int) -> tuple[int, int]:
    """(bytes of the block's parameters outside the routed experts, bytes of one routed expert)."""
    block = model.layers[layer]
    other = sum(p.nbytes for n, p in block.named_parameters() if not n.startswith("ffn.experts."))
    one = sum(p.nbytes for p in block.ffn.experts[0].parameters())
    return other, one


def work(model: Transformer, start: int, tokens: int, layers=None, head: bool = True) -> tuple[float, float]:
    """(bytes, FLOPs) an ideal implementation needs for `tokens` queries at positions start.. (the roofline
    of a decode step: tokens = 1; of a prefill chunk: tokens = the chunk). Counted, per layer:

    - weights read once: everything outside the routed experts, plus the experts the tokens touch
      (expected distinct experts of uniform routing, E (1 - (1 - k/E)^tokens));
    - residual streams in and out (hc_mult x dim bf16, read and written per sub-layer);
    - window KV: tokens + window rows of 528 B (FP8 + UE8M0 per 32) read, tokens written;
    - compressed main KV: min(entries, tokens x Top-K) rows of 288 B (E2M1 + E4M3 per 16); new entries
      written (288 + 68 B) at kv sources;
    - index keys (68 B) scored by index-source layers: every visible entry (full/candidate source) or the
      candidate pool (reindex); FLOPs 2 x index heads x index dim per scored key and query;
    - sparse attention FLOPs 4 x heads x head_dim x (window + Top-K) per query; Linear FLOPs 2 x in x out
      per token (routed experts: k per token);
    - the head (vocab x dim bf16) once and its FLOPs per logit row (one row: the last position).
    Visible entries per query are taken at the chunk's middle position."""
    a = model.args
    layers = range(a.n_layers) if layers is None else layers
    mid = start + tokens / 2
    total_b = total_f = 0.0
    pool = a.candidate_topk_blocks * a.candidate_block_size
    for l in layers:
        spec = model.plan.layers[l]
        other_b, expert_b = _weight_bytes_split(model, l)
        dense_f, expert_f, E = _linear_flops(model, l)
        k = spec.n_activated_experts
        touched = E * (1 - (1 - k / E) ** tokens)
        b = other_b + touched * expert_b + tokens * 2 * 2 * (2 * a.hc_mult * a.dim)
        f = tokens * (dense_f + k * expert_f)
        b += (tokens + a.window_size) * 528 + tokens * 528
        kw = min(a.window_size, start + tokens)
        km = 0
        if spec.compress_ratio:
            m = spec.compress_ratio
            visible = mid / m
            km = min(a.index_topk, visible)
            b += min((start + tokens) / m, tokens * a.index_topk) * 288
            if spec.owns_kv:
                b += tokens / m * (288 + 68)
            if spec.owns_index:
                scored = min(visible, pool) if spec.uses_candidates else visible
                b += min((start + tokens) / m, tokens * scored) * 68
                f += tokens * 2 * a.index_n_heads * a.index_head_dim * scored
        f += tokens * 4 * a.n_heads * a.head_dim * (kw + km)
        total_b += b
        total_f += f
    if head:
        total_b += a.vocab_size * a.dim * 2
        total_f += 2 * a.vocab_size * a.dim
    return total_b, total_f


def row(case: str, seconds: float, bytes_: float, flops: float, cuda: bool, **extra) -> dict:
    """A result row in the kernels_common convention (floor = max(bytes / copy ceiling, FLOPs / matmul
    ceiling), both ceilings measured in this run); without CUDA the floor columns are None."""
    if cuda:
        from kernels_common import record

        return record("flash_stack", case, seconds, bytes_, flops, **extra)
    return {"kernel": "flash_stack", "case": case, "us": seconds * 1e6, "bytes": bytes_, "flops": flops,
            "GBps": bytes_ / seconds / 1e9, "TFLOPs": flops / seconds / 1e12, "floor_us": None, "x_floor": None,
            "bound": None, **extra}


def print_rows(rows: list[dict], title: str) -> None:
    print(f"\n== {title}")
    print(f"{'case':52s} {'ms':>10s} {'tok/s':>10s} {'floor ms':>9s} {'x floor':>8s} {'bound':>6s}")
    for r in rows:
        fl = "-" if r.get("floor_us") is None else f"{r['floor_us'] / 1e3:9.3f}"
        xf = "-" if r.get("x_floor") is None else f"{r['x_floor']:8.1f}"
        tps = r.get("tokens_per_s")
        print(f"{r['case']:52s} {r['us'] / 1e3:10.3f} {'-' if tps is None else f'{tps:10.1f}':>10s} {fl:>9s} "
              f"{xf:>8s} {str(r.get('bound') or '-'):>6s}")
        if r.get("layer_ms"):
            print("    per layer ms: " + "  ".join(f"{k}:{v:.2f}" for k, v in r["layer_ms"].items()))
        if r.get("top_kernels"):
            print(f"    kernels per step {r['kernels_per_step']}, their device time {r['kernel_us_per_step']} us")
            for k in r["top_kernels"][:25]:
                print(f"      {k['us_per_step']:9.1f} us  x{k['per_step']:<6g} {k['name'][:90]}")


def context_label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else (f"{n >> 10}K" if n % 1024 == 0 else str(n))


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def memory_note() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"allocated_GiB": gib(torch.cuda.memory_allocated()), "peak_GiB": gib(torch.cuda.max_memory_allocated()),
            "total_GiB": gib(torch.cuda.get_device_properties(0).total_memory)}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


__all__ = ["stack_args", "build", "fill_cache", "LayerTimer", "timed", "work", "row", "print_rows", "flash_layer_types",
           "REPRESENTS", "OMITTED", "context_label", "weight_bytes", "memory_note", "sync", "is_oom", "gib"]


def compose_flash(layer_seconds: dict[int, float], total: float) -> dict:
    """An estimate of the same measurement for all 40 V4.1-Flash layers, composed from this stack's
    per-layer times: what ran outside the blocks (embedding, head, CED's projection at layer n/2) once,
    plus each (part, mode) type's measured time (mean of its representatives) times its count in the
    real model. Engram and DSpark are not in it. An estimate, labelled as such wherever it is printed."""
    by_type: dict[str, list[float]] = defaultdict(list)
    for i, t in layer_seconds.items():
        by_type[REPRESENTS[i]].append(t)
    other = total - sum(layer_seconds.values())
    types = flash_layer_types()
    missing = [t for t in types if t not in by_type]
    if missing:
        raise ValueError(f"no measured layer of type {missing}")
    est = other + sum(n * sum(by_type[t]) / len(by_type[t]) for t, n in types.items())
    return {"estimate_40_layers_s": est, "outside_blocks_s": other, "layer_types": types}
