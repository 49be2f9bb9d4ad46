"""Tensor and expert parallelism across processes: one model split over N ranks (torch.distributed,
launched by torchrun), the way the official inference code runs V4.1 (REF's parallel modules).

The split is applied to a built model from the outside: `apply_tensor_parallel(model, rank, world)`
swaps a few modules for their parallel forms and narrows others in place; no module of the model
asks how many ranks there are. What each rank holds is exactly what `dsv41.model.checkpoint.rank_part`
assigns it (the table `NAME_MAP`), so a rank loads its `model{r}-mp{N}.safetensors` as is, or
cuts the same tensors from a checkpoint of any other layout at load (`dsv41.model.checkpoint.load_rank`):

    part of the model              held by rank r of N                       combined by
    embed (and DSpark markov embed) vocabulary rows [r V/N, (r+1) V/N)       all-reduce (one rank has the row)
    head (and markov head)          vocabulary rows                           all-gather of the logits
    attn.wq_b, attn_sink            heads [r H/N, (r+1) H/N)                  - (heads are independent)
    attn.wo_a                       output groups [r G/N, (r+1) G/N)          - (groups are independent)
    attn.wo_b                       the input columns of those groups         all-reduce (fp32 partial sums)
    indexer.wq_b, weights_proj      index heads                               all-reduce of the head sums
                                                                              (before Top-K: every rank picks alike)
    routed experts                  experts [r E/N, (r+1) E/N)                all-reduce (fp32), then the shared expert
    Engram tables                   rows [r R', (r+1) R'), R' = ceil(R/N),    all-reduce (one rank has the row)
                                    the last part zero-padded
    everything else                 replicated: wq_a, the window KV, the compressor and indexer keys (so the
                                    KV cache is whole on every rank), norms, mHC, the router, shared experts,
                                    DSpark main_proj / confidence head, vision

Every rank sees the same activations after each combining collective and replicates the small
computations between them, so every decision (router Top-K, indexer Top-K, candidate blocks,
sampled tokens) comes out the same on every rank: the ranks stay in lock-step without exchanging
anything but the collectives above.

Processes. `init_from_env()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
starts the process group (NCCL on CUDA, gloo on the CPU) and returns a `ParallelContext`; outside
torchrun it returns a one-process context and starts nothing, so commands call it unconditionally.
The ranks form a grid of `world / tp` model copies of `tp` ranks each (`tp` = world unless
`DSV41_TP` says otherwise): model collectives run inside a copy; `split_work` (`share` / `gather`)
deals a list of independent work items (scoring batches, evaluation requests) out to the copies and
reassembles the results in order (data parallelism, for evaluation). Rank 0 owns the console: the
other ranks' stdout goes to /dev/null, and `on_main` / `broadcast_object` hand rank 0's inputs to all.

Numerics: a sharded matmul sums in a different order (wo_b's partial sums, the indexer's head sums),
so logits differ from one process by float rounding; greedy tokens agree unless two candidates are
within that rounding of each other.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import random
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv41.model import formats
from dsv41.model.checkpoint import check_mp, check_state_matches, load_rank_model, rank_part, st_name
from dsv41.model.dspark import MarkovHead
from dsv41.model.engram import EngramEmbedding
from dsv41.model.indexer import Indexer
from dsv41.model.kernels.host import fixed_order_linear
from dsv41.model.layers import FP4, GEMM_MODE, Linear, qat
from dsv41.model.moe import MoE
from dsv41.model.transformer import Head

TP_ENV = "DSV41_TP"  # model-parallel size when it should be smaller than the world (the rest is data parallel)
TIMEOUT_ENV = "DSV41_DIST_TIMEOUT"  # seconds a collective may wait before the process gives up


# ====================================================================================================
# Processes
# ====================================================================================================


@dataclass
class ParallelContext:
    """Where this process stands: global `rank` of `world`, and its place in the grid of model copies
    (`tp` ranks share one copy; `dp = world / tp` copies)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    tp: int = 1
    device: str = "cpu"
    backend: str | None = None
    tp_group: object | None = None  # the process group of this rank's model copy (None: the default group)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that reads the console and prints results."""
        return self.rank == 0

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    # ------------------------------------------------------------------ rank 0's inputs for everyone
    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every rank (any picklable value)."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def on_main(self, fn, *args, **kwargs):
        """Run `fn` on rank 0 only (reading the console, a file, a prompt) and return its result on
        every rank. If it raises there, the same exception is raised on every rank, so all leave together
        (rank 0 keeps the original with its traceback)."""
        if not self.distributed:
            return fn(*args, **kwargs)
        value = error = None
        if self.is_main:
            try:
                value = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to every rank, then re-raised
                error = e
        value, shipped = self.broadcast_object((value, _picklable(error)))
        if self.is_main and error is not None:
            raise error
        if shipped is not None:
            raise shipped
        return value

    def same_seed(self, seed: int | None) -> int | None:
        """A sampling seed every rank shares: `seed` if given, else one drawn on rank 0. Sampling
        happens on every rank from the same logits, so the same seed gives the same tokens."""
        if not self.distributed:
            return seed
        return self.broadcast_object(seed if seed is not None else random.SystemRandom().randrange(2**63))

    # ------------------------------------------------------------------ data parallelism over model copies
    def share(self, items) -> list:
        """This model copy's share of `items`: every `dp`-th item from its copy index on (dealt round
        robin, so that a list sorted by cost gives every copy a similar load); all of them with one copy."""
        return list(items)[self.dp_rank::self.dp]

    def gather(self, part) -> list:
        """The inverse of `share`: every copy's results, back in the order of the items, on every rank.
        A collective over the whole world (every rank calls it); the ranks of one copy hold the same
        results, and each copy's first rank's are used."""
        part = list(part)
        if self.dp == 1:
            return part
        parts = [self.all_gather_object(part)[c * self.tp] for c in range(self.dp)]
        merged: list = [None] * sum(map(len, parts))
        for c, p in enumerate(parts):
            merged[c::self.dp] = p
        return merged

    def split_work(self, items, run) -> list:
        """`run(share)` -> one result per item of the share, on this copy's share of `items`; every
        copy's results in the order of `items` on every rank. An exception in any copy is raised on
        every rank (rank-by-rank errors would leave the other copies waiting in the gather)."""
        items = list(items)
        if self.dp == 1:
            return list(run(items))
        mine = self.share(items)
        try:
            part, error = list(run(mine)), None
        except Exception as e:  # noqa: BLE001 - handed to every rank, then re-raised
            part, error = [], e
        everyone = self.all_gather_object((part, _picklable(error)))
        if error is not None:
            raise error
        for _, shipped in everyone:
            if shipped is not None:
                raise shipped
        merged: list = [None] * len(items)
        for c in range(self.dp):
            merged[c::self.dp] = everyone[c * self.tp][0]
        return merged

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (any picklable value)."""
        if not self.distributed:
            return [obj]
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, obj)
        return everyone

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _picklable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - some exceptions carry unpicklable state
        return RuntimeError(f"{type(error).__name__}: {error}")


_CONTEXT: ParallelContext | None = None


def current() -> ParallelContext:
    """The context `init_from_env` set up (a one-process context before that)."""
    return _CONTEXT if _CONTEXT is not None else ParallelContext()


def init_from_env(device: str = "cpu", tp: int | None = None, quiet_others: bool = True) -> ParallelContext:
    """Join the process group torchrun describes in the environment; one process without it.

    device: "cpu", "cuda" or "auto" (under torchrun each rank takes GPU LOCAL_RANK, which the
    context's device then names; NCCL on GPUs, gloo on the CPU).
    tp: ranks per model copy (default: `DSV41_TP`, else the whole world). quiet_others: send the
    stdout of ranks other than 0 to /dev/null (their stderr stays, so their errors are seen).
    Calling it again returns the same context."""
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        _CONTEXT = ParallelContext(device=device)
        return _CONTEXT
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device, backend = f"cuda:{local_rank}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    tp = int(tp or os.environ.get(TP_ENV) or world)
    if tp < 1 or world % tp:
        raise ValueError(f"{TP_ENV}={tp} does not divide the {world} ranks")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, 1800)))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        atexit.register(_shutdown)
    tp_group = None
    if 1 < tp < world:  # every rank creates every group, in the same order
        for first in range(0, world, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                tp_group = group
    _CONTEXT = ParallelContext(rank, world, local_rank, tp, device, backend, tp_group)
    if quiet_others and rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    return _CONTEXT


def _shutdown() -> None:
    """At exit: wait for the other ranks, then tear the process group down. Under gloo a rank that destroys
    its group while a peer's last collective is still draining can abort the peer at exit ("terminate called
    without an active exception", SIGABRT after every command had finished); the barrier first makes the
    teardown happen after the last collective everywhere. A bounded, monitored barrier, so a rank whose
    peer died does not hang at exit."""
    if dist.is_initialized():
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - a peer is gone: leave anyway
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


# ====================================================================================================
# Collectives on activations
# ====================================================================================================


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def _all_gather_last(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim, in rank order."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=-1)


# ====================================================================================================
# Parallel forms of the model's modules
# ====================================================================================================


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, stop) of the vocabulary. Ids outside read row 0 and are zeroed, so the
    all-reduce sums exactly one real row per id (exact in any dtype)."""

    def __init__(self, vocab_size: int, dim: int, rank: int, world: int, group=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        part = vocab_size // world
        self.num_embeddings, self.embedding_dim = vocab_size, dim
        self.start, self.stop, self.group = rank * part, (rank + 1) * part, group
        self.weight = nn.Parameter(torch.empty(part, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        y = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return _all_reduce(y.masked_fill(outside.unsqueeze(-1), 0), self.group)


class VocabParallelHead(Head):
    """Logits of this rank's vocabulary rows in fp32, all-gathered into the whole vocabulary."""

    def __init__(self, vocab_size: int, dim: int, world: int, group=None):
        super().__init__(vocab_size // world, dim)
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # summed in the fixed order of the one-process head on the CPU (host.fixed_order_linear), so a decode
        # step's rows do not depend on each other here either (model/batch_cache.py)
        return _all_gather_last(fixed_order_linear(x, self.weight), self.world, self.group)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, where rank r holds input columns r of W (and x_r is its own
    slice of the input). Each rank computes its partial product in fp32; the all-reduce sums them in
    fp32 and the result is rounded once, as one process rounds the full product. FP8 activation
    blocks of 32 never straddle two ranks (the split is block-aligned), so each rank quantizes its
    slice exactly as one process quantizes the whole row."""

    group = None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dense":
            return fixed_order_linear(x.to(self.weight.dtype), self.weight)
        if GEMM_MODE["mode"] == "exact" and not self.trainable:  # REF's kernel order, rounded per rank as REF does
            return Linear.forward(self, x).float()
        xq = qat(formats.fp8_fake_quant, x, self.block).float()
        # the partial product in the one-process Linear's fixed order on the CPU (F.linear elsewhere)
        return fixed_order_linear(xq, self.dequantized_weight(torch.float32))

    def host_matrix(self) -> None:
        """None: the product is the ranks' partial products summed, which no host call of one rank computes (the
        fused calls that take Linear.host_matrix, host.attention_output's wo_b, then run the module instead)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _all_reduce(self.partial(x), self.group).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


class RowShardedEngramEmbedding(EngramEmbedding):
    """Rows [start, start + part) of an Engram table, part = ceil(rows / N) (the last rank's part is
    zero-padded). Rows held elsewhere are looked up as row 0 and zeroed; the all-reduce sums the one
    real row (exact)."""

    def __init__(self, num_rows: int, head_dim: int, block: int, trainable: bool, rank: int, world: int, group=None):
        part = -(-num_rows // world)
        super().__init__(part, head_dim, block, trainable)
        self.total_rows, self.start, self.group = num_rows, rank * part, group

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        outside = (rows < self.start) | (rows >= self.start + self.num_rows)
        values = super().forward((rows - self.start).masked_fill(outside, 0))
        return _all_reduce(values.masked_fill(outside.unsqueeze(-1), 0), self.group)


# The three below take over an existing module in place (its __class__ is swapped, its parameters
# narrowed by the `_shard_*` functions), so the module keeps its configuration attributes.


class VocabParallelMarkovHead(MarkovHead):
    """The DSpark Markov head with its embedding and head split by vocabulary rows."""

    world, group = 1, None

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(token_ids)
        return _all_gather_last(F.linear(e.float(), self.head.weight.float()), self.world, self.group), e


class HeadParallelIndexer(Indexer):
    """This rank's index heads: the per-rank head sums are all-reduced into the full score before
    visibility, the candidate pool and Top-K, which every rank then computes alike."""

    group = None

    def head_scores(self, x, qr, keys, freqs, candidates=None, by_entry=False):
        return _all_reduce(super().head_scores(x, qr, keys, freqs, candidates, by_entry).contiguous(), self.group)

    def _host_select(self, *args) -> None:
        """None: the choice needs the ranks' head sums all-reduced first (head_scores), which the decode step's one
        C call (Indexer._host_select) would skip."""
        return None


class ExpertParallelMoE(MoE):
    """This rank's routed experts (the others are None). The router is replicated, so every rank
    picks the same experts; the fp32 partial sums are all-reduced before the shared expert
    (replicated) is added, as in REF."""

    group = None

    def routed(self, x, weights, indices, every_row=None):
        return _all_reduce(super().routed(x, weights, indices, every_row), self.group)


# ====================================================================================================
# Applying the split
# ====================================================================================================


def _linear_like(lin: Linear, in_features: int | None = None, out_features: int | None = None,
                 cls: type = Linear) -> Linear:
    """An empty Linear of `lin`'s storage format with a narrower input or output."""
    dtype = {"fp4": FP4, "fp8": torch.float8_e4m3fn}.get(lin.kind, lin.weight.dtype)
    return cls(in_features or lin.in_features, out_features or lin.out_features, dtype, lin.block,
               bias=lin.bias is not None, trainable=lin.trainable)


def _split(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} = {n} cannot be split across {world} ranks")
    return n // world


def _shard_attention(attn, rank: int, world: int, group) -> None:
    """Heads and output groups [r/N, (r+1)/N); window KV, compressor and indexer keys stay whole."""
    heads, groups = _split(attn.n_heads, world, "n_heads"), _split(attn.n_groups, world, "o_groups")
    attn.wq_b = _linear_like(attn.wq_b, out_features=heads * attn.head_dim)
    attn.attn_sink = nn.Parameter(torch.empty(heads, dtype=attn.attn_sink.dtype))
    attn.wo_a = _linear_like(attn.wo_a, out_features=groups * attn.o_lora_rank)
    wo_b = _linear_like(attn.wo_b, in_features=attn.wo_b.in_features // world, cls=RowParallelLinear)
    wo_b.group = group
    attn.wo_b = wo_b
    attn.n_heads, attn.n_groups = heads, groups
    indexer = attn.indexer
    if indexer is not None and indexer.spec.owns_index:
        index_heads = _split(indexer.n_heads, world, "index_n_heads")
        indexer.wq_b = _linear_like(indexer.wq_b, out_features=index_heads * indexer.head_dim)
        indexer.weights_proj = _linear_like(indexer.weights_proj, out_features=index_heads)
        indexer.n_heads = index_heads  # weight_scale keeps the global head count, as the score is the global sum
        indexer.__class__ = HeadParallelIndexer
        indexer.group = group


def _shard_moe(moe, rank: int, world: int, group) -> None:
    part = _split(moe.n_routed, world, "n_routed_experts")
    first, last = rank * part, (rank + 1) * part
    for e in range(moe.n_routed):
        if not first <= e < last:
            moe.experts[e] = None  # held by another rank; its checkpoint names keep their global index
    moe.__class__ = ExpertParallelMoE
    moe.group = group


def apply_tensor_parallel(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Split `model` (a `Transformer`) in place for rank `rank` of `world` and return it.

    Built on the meta device (the usual way, then fill it with `load_rank_state`) the model stays
    there; with weights, each rank keeps its part of them (cut by the checkpoint's own rules, so the
    result equals loading `model{rank}-mp{world}.safetensors`). `group`: the process group of the
    ranks sharing this model (None: the default group). world = 1 returns the model unchanged."""
    from dsv41.model.attention import Attention

    if world == 1:
        return model
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    if getattr(model, "tensor_parallel", None):
        raise ValueError(f"this model is already split (rank, world = {model.tensor_parallel})")
    args = model.args
    check_mp(args, world)
    full = model.state_dict()
    has_weights = not any(t.is_meta for t in full.values())
    device = next(iter(full.values())).device

    with torch.device(device):
        for module in list(model.modules()):
            if isinstance(module, Attention):
                _shard_attention(module, rank, world, group)
            elif isinstance(module, MoE):
                _shard_moe(module, rank, world, group)
            elif isinstance(module, MarkovHead):
                embed, head = module.embed, module.head
                module.embed = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, rank, world, group,
                                                      embed.weight.dtype)
                module.head = _linear_like(head, out_features=head.out_features // world)
                module.__class__ = VocabParallelMarkovHead
                module.world, module.group = world, group
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is EngramEmbedding:
                    setattr(parent, name, RowShardedEngramEmbedding(child.num_rows, child.head_dim, child.block,
                                                                    child.trainable, rank, world, group))
        model.embed = VocabParallelEmbedding(args.vocab_size, args.dim, rank, world, group, model.embed.weight.dtype)
        model.head = VocabParallelHead(args.vocab_size, args.dim, world, group)

    if has_weights:
        local = shard_state(full, args, rank, world)
        check_state_matches(model, local, f"rank {rank} of {world}: the rank's tensors")
        model.load_state_dict(local, strict=True, assign=True)
    model.tensor_parallel = (rank, world)
    return model


def shard_state(full: dict[str, torch.Tensor], args, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a whole state dict, by the checkpoint's split rules (`rank_part`)."""
    shapes = {n: (tuple(t.shape), st_name(t.dtype)) for n, t in full.items()}
    out = {}
    for name, t in full.items():
        part = rank_part(name, tuple(t.shape), shapes, args, world, rank)
        if part is None:
            continue
        if part.dim is not None:
            t = t.narrow(part.dim, part.start, part.stop - part.start)
            if part.pad:
                pad_shape = list(t.shape)
                pad_shape[part.dim] = part.pad
                t = torch.cat([t, t.new_zeros(pad_shape)], dim=part.dim)
        out[name] = t.clone()
    return out


# ====================================================================================================
# Loading this process's part: the checkpoint's loader, split by apply_tensor_parallel
# ====================================================================================================


def load_model_parallel(path: str | os.PathLike, device: str | None = None, ctx: ParallelContext | None = None):
    """(model, args, tokenizer) for this process: the whole model in one process, else this rank's part
    of it (`dsv41.model.checkpoint.load_rank_model`: the rank's tensors, in a model split by
    `apply_tensor_parallel` on the meta device). Same contract as `dsv41.model.checkpoint.load_model`;
    every rank of a model copy must call it. Any layout loads under any rank count `check_mp` allows."""
    ctx = ctx or current()
    return load_rank_model(path, ctx.tp_rank, ctx.tp, device=device or ctx.device,
                           shard=lambda model: apply_tensor_parallel(model, ctx.tp_rank, ctx.tp, ctx.tp_group))


# ====================================================================================================
# Planning: what one rank holds
# ====================================================================================================


def memory_plan(args, mp: int, context: int, batch: int = 1, expert_dtype: str = "fp4",
                main_format: str = "fp4") -> dict:
    """Bytes each of `mp` ranks holds: its parameters (the runtime layout `convert --mp` writes:
    wo_a bf16, routed experts in `expert_dtype`, block scales included) and its KV cache for `batch`
    sequences of `context` tokens (`dsv41.model.cache.kv_cache_bytes`, from the codecs' bytes per entry).
    Every rank holds the whole KV cache: there is one latent KV head (MQA), which REF replicates too.
    Activations and workspace are not counted."""
    from dsv41.model.cache import kv_cache_bytes
    from dsv41.model.checkpoint import check_mp, expected_tensors, itemsize, rank_tensors, runtime_args

    check_mp(args, mp)
    target = runtime_args(args, expert_dtype)
    full = expected_tensors(target)
    params = []
    for r in range(mp):
        held = rank_tensors(full, target, mp, r)
        params.append(sum(_numel(shape) * itemsize(dtype) for shape, dtype, _ in held.values()))
    kv = kv_cache_bytes(args, context, batch, main_format)
    return {
        "mp": mp, "context": context, "batch": batch, "expert_dtype": expert_dtype, "kv_main_format": main_format,
        "kv_bytes_per_rank": kv["total"], "kv": kv,
        "ranks": [{"rank": r, "param_bytes": p, "kv_bytes": kv["total"], "total_bytes": p + kv["total"]}
                  for r, p in enumerate(params)],
        "max_rank_bytes": max(params) + kv["total"],
        "total_param_bytes": sum(params),
    }


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
