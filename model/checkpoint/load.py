"""Loading a checkpoint of either layout: its tensors (`load_state_dict`), one rank's part of them
(`load_rank`, `load_rank_state`), and a model filled with them, in one process (`load_model`) or as one
rank of a model split from outside (`load_rank_model`: the split is passed in, e.g. parallel's
`apply_tensor_parallel`; this package never imports dsv41.model.parallel, which depends on its name map).

Files are memory-mapped: tensors are views of the page cache, read lazily, tensor by tensor, as the model
touches them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping

import torch

from dsv41.model.checkpoint.layout import detect_layout, load_args
from dsv41.model.checkpoint.names import (Part, check_mp, meta_device, expected_tensors, rank_tensors, runtime_args,
                                          to_model_dtypes)
from dsv41.model.checkpoint.official import open_official
from dsv41.model.checkpoint.plan import _slice, plan_runtime
from dsv41.model.checkpoint.runtime import RuntimeCheckpoint, _assembled, open_runtime
from dsv41.model.checkpoint.safetensors import (Bytes, CheckpointError, Columns, Piece, Seq, Zeros, _Reader,
                                                materialize, open_tensor)
from dsv41.model.config import ModelArgs


def load_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Every tensor of a checkpoint (either layout), verified, with the ModelArgs that describe it.
    Official: as stored (FP8/FP4 kept), memory-mapped. Runtime: mp 1 memory-mapped; mp N assembled
    from the rank files (split tensors are concatenated in memory). Tensors stored in an accepted other
    dtype (BF16 ViT norm weights, `accepted_dtypes`) come back widened to the model's F32."""
    path = Path(path)
    if detect_layout(path) == "official":
        ckpt = open_official(path)
        state = {name: open_tensor(entry) for name, entry in ckpt.tensors.items()}
        return to_model_dtypes(state, expected_tensors(ckpt.args)), ckpt.args
    ckpt = open_runtime(path)
    reader = _Reader()
    try:
        state = {name: materialize(_assembled(ckpt, name), dtype, shape, reader)
                 for name, (shape, dtype) in ckpt.full.items()}
    finally:
        reader.close()
    return to_model_dtypes(state, expected_tensors(ckpt.args)), ckpt.args


def load_rank_state(path: str | os.PathLike, rank: int, mp: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of `mp` model-parallel ranks holds, in runtime dtypes and with the split rules
    of `NAME_MAP` (routed experts keep their global index in the name; Engram parts are zero-padded to
    ceil(rows / mp)), from a checkpoint of any layout (`load_rank`, which also gives the ModelArgs of
    what it returns). BF16-stored ViT norm weights come back widened to F32, as the model holds them."""
    return load_rank(path, rank, mp)[0]


def load_rank(path: str | os.PathLike, rank: int, mp: int) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """(state, args): rank `rank` of `mp`'s part of the checkpoint at `path`, and the ModelArgs of the
    model it fills (the runtime dtypes: wo_a bf16, experts as stored in a runtime checkpoint, FP4 from
    an official one). Every layout loads under any `mp` that `check_mp` allows, reading only the rank's
    own slices of the files:

    * runtime, converted with this mp: the rank's file, memory-mapped (as is);
    * runtime, another mp (1 included): the rank's part cut from the rank files that hold it
      (`_resplit`): a tensor one file holds whole, or whose rows the rank takes from one file, stays
      memory-mapped; a column slice or rows gathered from several files are copied (the rank's part
      only);
    * official: the per-rank pieces of `convert --mp mp`'s plan (`plan_runtime`): tensors kept as
      stored are memory-mapped or sliced as above; wo_a (this rank's rows) is dequantized to bf16.

    Rank-part combinations that cannot be cut (an mp that does not divide the heads, experts or
    vocabulary; a part smaller than a scale block) are a one-line `CheckpointError`."""
    path = Path(path)
    if not 0 <= rank < mp:
        raise CheckpointError(f"rank {rank} is not in [0, {mp})")
    if detect_layout(path) == "runtime":
        ckpt = open_runtime(path)
        args = ckpt.args
        if ckpt.mp == mp:
            state = {name: open_tensor(entry) for name, entry in ckpt.ranks[rank].items()}
            return to_model_dtypes(state, expected_tensors(args)), args
        check_mp(args, mp)
        held = rank_tensors(ckpt.full, args, mp, rank)
        pieces = [(name, _resplit(ckpt, name, part), ckpt.full[name][1], shape)
                  for name, (shape, _, part) in held.items()]
    else:
        ckpt = open_official(path)
        args = runtime_args(ckpt.args, "fp4")
        plan = plan_runtime(ckpt, mp, "fp4")
        pieces = [(t.name, t.data, t.dtype, t.shape) for t in plan.files[rank].tensors]
    reader = _Reader()
    try:
        state = {name: _load_piece(piece, dtype, shape, reader) for name, piece, dtype, shape in pieces}
    finally:
        reader.close()
    return to_model_dtypes(state, expected_tensors(args)), args


def _resplit(ckpt: RuntimeCheckpoint, name: str, part: Part | None) -> Piece:
    """Part `part` of the full tensor `name` (indices [start, stop) along part.dim, then part.pad zero
    rows; None or dim None: all of it) as pieces of the rank files of a runtime checkpoint of another
    mp. Like `_assembled`, rows of a block scale that several files hold are taken once and the zero
    rows padding the last Engram parts of the files are skipped."""
    holders = [(r, ckpt.parts[r][name]) for r in range(ckpt.mp) if name in ckpt.parts[r]]
    r0, p0 = holders[0]
    entry0 = ckpt.ranks[r0][name]
    if p0.dim is None:  # one file holds it whole: the rank's part is a plain slice of it
        return _slice(entry0, part or Part(None))
    shape, _ = ckpt.full[name]
    dim = p0.dim
    if part is None or part.dim is None:
        part = Part(dim, 0, shape[dim])
    if part.dim != dim:
        raise CheckpointError(f"internal: {name} is split along dim {dim} in the rank files, the rank needs dim "
                              f"{part.dim}")
    pieces, covered = [], part.start
    for r, src in holders:
        first, last = max(src.start, covered), min(src.stop, part.stop, shape[dim])
        if last <= first:
            continue
        pieces.append((ckpt.ranks[r][name], first - src.start, last - src.start))
        covered = last
    if covered != part.stop:
        raise CheckpointError(f"internal: the rank files cover {name} up to {covered} along dim {dim}, the rank "
                              f"needs [{part.start}, {part.stop})")
    if dim == 1:
        if part.pad:
            raise CheckpointError(f"internal: {name} is padded along dim 1")
        return Columns(pieces)
    rows: list[Piece] = [Bytes(e, a * e.row_bytes, b * e.row_bytes) for e, a, b in pieces]
    if part.pad:
        rows.append(Zeros(part.pad * entry0.row_bytes))
    return rows[0] if len(rows) == 1 else Seq(rows)


def _load_piece(piece: Piece, dtype: str, shape: tuple[int, ...], reader: _Reader) -> torch.Tensor:
    """A rank's tensor: a whole stored tensor or a range of its rows as a view of the memory-mapped
    file (read lazily, shared with the page cache); anything else (column slices, rows from several
    files, padded or converted tensors) copied into memory by `materialize`."""
    if isinstance(piece, Bytes) and piece.entry.dtype == dtype and len(shape) == len(piece.entry.shape) >= 1 \
            and tuple(shape[1:]) == tuple(piece.entry.shape[1:]) and piece.entry.row_bytes \
            and piece.start % piece.entry.row_bytes == 0 and piece.nbytes == shape[0] * piece.entry.row_bytes:
        first = piece.start // piece.entry.row_bytes
        return open_tensor(piece.entry).narrow(0, first, shape[0])
    return materialize(piece, dtype, shape, reader)


def load_model(path: str | os.PathLike, device: str = "cpu"):
    """(Transformer, ModelArgs, tokenizer) from a checkpoint directory of either layout.

    The model is built on the meta device and filled with the checkpoint's tensors as they are stored
    (official: FP8 linears and FP4 experts; runtime: bf16 wo_a and the converted expert dtype; BF16
    ViT norm weights widened to F32), strictly: a missing or unexpected name is an error. On CPU the
    weights stay memory-mapped."""
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.model.transformer import Transformer

    path = Path(path)
    state, args = load_state_dict(path)
    tokenizer = load_tokenizer(path)
    with meta_device():
        model = Transformer(args, tokenizer=tokenizer)
    check_state_matches(model, state, f"{path}: the checkpoint")
    return fill_meta_model(model, state, device), args, tokenizer


def load_rank_model(path: str | os.PathLike, rank: int, world: int, shard: Callable[[torch.nn.Module], object],
                    device: str = "cpu"):
    """(model, args, tokenizer) for rank `rank` of `world` ranks sharing one model: the contract of
    `load_model`, for this rank's part (world = 1: `load_model` itself). Any layout loads under any
    `world` that `check_mp` allows (official, runtime mp 1, runtime mp N; `load_rank`, which reads only
    the rank's slices). The model is built on the meta device in the dtypes of the rank's tensors (the
    runtime layout's: wo_a bf16, which computes what the official FP8 wo_a does, as both are dequantized
    to bf16 before use), split by `shard(model)` (dsv41.model.parallel's `apply_tensor_parallel` for this
    rank, passed in: parallel depends on this package's name map, never the reverse), then filled."""
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.model.transformer import Transformer

    if world == 1:
        return load_model(path, device=device)
    path = Path(path)
    try:  # before reading any tensor: every rank gives the one-line error of an impossible split alike
        check_mp(load_args(path), world)
    except CheckpointError as e:
        raise CheckpointError(f"the model cannot be split over {world} ranks (--nproc-per-node, or DSV41_TP for "
                              f"model copies): {e}") from None
    state, args = load_rank(path, rank, world)
    tokenizer = load_tokenizer(path)
    with meta_device():
        model = Transformer(args, tokenizer=tokenizer)
    shard(model)
    check_state_matches(model, state, f"{path} (rank {rank} of {world}): the rank's tensors")
    return fill_meta_model(model, state, device), args, tokenizer


def load_rank_weights(path: str | os.PathLike, rank: int, world: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of `world` holds of the checkpoint at `path`, from any layout (`load_rank_state`:
    its rank file when the runtime checkpoint was converted with --mp world; otherwise cut from the files,
    official or runtime of another mp, reading only this rank's slices)."""
    return load_rank_state(path, rank, world)


def check_state_matches(model: torch.nn.Module, state: Mapping[str, torch.Tensor], holder: str) -> None:
    """Names and shapes of `state` against the model built for it (whole, or one rank's split): say
    which tensor is missing, unexpected or of another shape. `holder` opens the message."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has unexpected tensor {unexpected[0]}"
        raise CheckpointError(f"{holder} {what} ({len(missing)} missing, {len(unexpected)} unexpected)")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise CheckpointError(f"{holder}: {name} is {list(t.shape)} in the checkpoint, the model needs "
                                  f"{list(own[name].shape)}")


def fill_meta_model(model: torch.nn.Module, state: Mapping[str, torch.Tensor], device: str = "cpu"):
    """A model built on the meta device, given `state`'s tensors themselves (no copy: on CPU they stay
    memory-mapped), moved to `device`, in eval mode."""
    model.load_state_dict(state, strict=True, assign=True)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"internal: {leftover[0]} was not loaded")
    if device != "cpu":
        model = model.to(device)
    return model.eval()
