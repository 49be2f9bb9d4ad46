"""The official layout (what DeepSeek publishes): verifying it (`open_official`), its default shard
layout and index, and writing it from tensors (`save_official`: fixtures, publishing a model)."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from dsv41.model.checkpoint.layout import (COPIED_FILES, INDEX_FILE, SINGLE_FILE, _check_against_config,
                                           _read_json, load_args, partial_dir)
from dsv41.model.checkpoint.names import _file_order, accepted_dtypes, expected_tensors, official_name
from dsv41.model.checkpoint.safetensors import (ST_DTYPES, CheckpointError, Header, InMemory, OutFile, OutTensor,
                                                TensorEntry, _Problems, _Reader, _scan_wanted, check_values,
                                                itemsize, read_header, st_name, write_safetensors)
from dsv41.model.config import ModelArgs


@dataclass
class OfficialCheckpoint:
    path: Path
    args: ModelArgs
    tensors: dict[str, TensorEntry]  # official name -> where it is stored
    headers: dict[str, Header]  # shard file name -> header, in shard order
    index_text: str | None  # the index file as published (None for a single-file checkpoint)

    @property
    def nbytes(self) -> int:
        return sum(h.file_size for h in self.headers.values())


def open_official(path: str | os.PathLike, args: ModelArgs | None = None, values: bool | None = None
                  ) -> OfficialCheckpoint:
    """Verify an official-layout checkpoint from its config, index and shard headers: every listed shard
    exists and is complete, the index and the headers agree tensor by tensor, and every tensor has the
    name, dtype and shape the config implies, none missing, none extra. Then the tensors' values
    (`check_values`: no NaN/inf, no NaN codes): with values=True always, with None (the default) when
    the tensors total at most LOAD_SCAN_BYTES, with False never (headers only)."""
    path = Path(path)
    if args is None:
        args = load_args(path)
    expected = expected_tensors(args)
    problems = _Problems()
    index_text = None
    if (path / INDEX_FILE).is_file():
        index_text = (path / INDEX_FILE).read_text(encoding="utf-8")
        index = _read_json(path / INDEX_FILE, "the shard index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{INDEX_FILE} has no weight_map")
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            listed = [n for n, s in weight_map.items() if s == missing[0]]
            raise CheckpointError(f"missing shard {missing[0]} ({INDEX_FILE} lists {len(listed)} tensors in it, "
                                  f"e.g. {listed[0]})" + (f"; {len(missing) - 1} more shards missing"
                                                          if len(missing) > 1 else ""))
    elif (path / SINGLE_FILE).is_file():
        shards, weight_map = [SINGLE_FILE], None
    else:
        raise CheckpointError(f"{path} has no {INDEX_FILE}")
    headers = {s: read_header(path / s) for s in sorted(shards)}
    found: dict[str, TensorEntry] = {}
    for shard, header in headers.items():
        for stored, entry in header.tensors.items():
            if weight_map is not None:
                listed = weight_map.get(stored)
                if listed is None:
                    problems.add(f"{shard} holds tensor {stored}, which {INDEX_FILE} does not list")
                elif listed != shard:
                    problems.add(f"{shard} holds tensor {stored}, which {INDEX_FILE} lists in {listed}")
            name = official_name(stored, expected)
            if name in found:
                problems.add(f"tensor {stored} is stored twice: in {found[name].file.name} and {shard}")
            found[name] = entry
    if weight_map is not None:
        for stored, shard in weight_map.items():
            if stored not in headers[shard].tensors:
                problems.add(f"{INDEX_FILE} lists tensor {stored} in {shard}, which does not contain it")
    problems.raise_if_any()
    _check_against_config(found, expected, problems)
    problems.raise_if_any()
    ordered = {name: found[name] for name in expected}
    if _scan_wanted(values, ordered.values()):
        check_values(ordered.values(), problems)
        problems.raise_if_any()
    return OfficialCheckpoint(path, args, ordered, headers, index_text)


def _default_shards(out: Mapping[str, OutTensor], args: ModelArgs, n_shards: int | None,
                    max_shard_bytes: int = 5 << 30) -> list[OutFile]:
    """Shards as published: the backbone in shards of similar size in model order, each Engram table
    (weight + scale) in a shard of its own at the end."""
    names = list(out)
    tables = [[n for n in names if f"layers.{l}.engram.embed." in n] for l in args.engram_layer_ids]
    tables = [t for t in tables if t]
    in_tables = {n for t in tables for n in t}
    rest = [n for n in names if n not in in_tables]
    total = sum(out[n].data.nbytes for n in rest)
    n_rest = max(1, (n_shards - len(tables)) if n_shards else -(-total // max_shard_bytes))
    groups: list[list[str]] = [[] for _ in range(n_rest)]
    acc = 0
    for n in rest:  # cut where the running total crosses each 1/n_rest of the bytes
        groups[min(n_rest - 1, int(acc * n_rest / max(total, 1)))].append(n)
        acc += out[n].data.nbytes
    groups = [g for g in groups if g] + tables
    count = len(groups)
    files = []
    for i, g in enumerate(groups):
        order = _file_order(g, {n: out[n].dtype for n in g})
        files.append(OutFile(f"model-{i + 1:05d}-of-{count:05d}.safetensors", [out[n] for n in order]))
    return files


def _write_index(dst: Path, files: list[OutFile]) -> None:
    weight_map = {t.name: f.name for f in files for t in f.tensors}
    total = sum(t.data.nbytes for f in files for t in f.tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


# ====================================================================================================
# Writing the official layout from tensors (fixtures, publishing a model)
# ====================================================================================================


def save_official(tensors: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]], args: ModelArgs,
                  dst: str | os.PathLike, n_shards: int | None = None, tokenizer_dir: str | os.PathLike | None = None,
                  tokenizer_json: str | None = None) -> Path:
    """Write a model's tensors (official names, storage dtypes: FP8 + UE8M0, packed FP4 "I8") as an
    official-layout checkpoint: config.json, shards, index, tokenizer files. A value may be a callable
    returning the tensor, so large checkpoints are produced one tensor at a time. Atomic like convert.

    Dtypes are the release's (`expected_tensors`): the ViT norm weights are written BF16, from BF16, or
    from the model's F32 when BF16 holds the values exactly; F32 values that BF16 would round stay F32
    (lossless; every loader accepts both)."""
    dst = Path(dst)
    expected = expected_tensors(args)
    problems = _Problems()
    for name in tensors:
        if name not in expected:
            problems.add(f"tensor {name} is not part of the model")
    for name in expected:
        if name not in tensors:
            problems.add(f"tensor {name} is missing")
    problems.raise_if_any()
    out = {}
    for name, (shape, dtype) in expected.items():
        value = tensors[name]
        if isinstance(value, torch.Tensor):
            if tuple(value.shape) != shape or st_name(value.dtype) not in accepted_dtypes(name, dtype):
                raise CheckpointError(f"tensor {name} is {st_name(value.dtype)} {list(value.shape)}, the model "
                                      f"needs {' or '.join(accepted_dtypes(name, dtype))} {list(shape)}")
            value = _narrowed(value, dtype)  # F32 ViT norms as the release's BF16, where exact
            dtype = st_name(value.dtype)  # F32 values BF16 cannot hold exactly are written as given
        out[name] = OutTensor(name, dtype, shape, InMemory(_checked(value, name, shape, dtype),
                                                           math.prod(shape) * itemsize(dtype)))
    files = _default_shards(out, args, n_shards)
    work = partial_dir(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        (work / "config.json").write_text(json.dumps(args.to_hf_config(), indent=2) + "\n", encoding="utf-8")
        reader = _Reader(chunk=1 << 16)
        for f in files:
            write_safetensors(work / f.name, f, reader)
        _write_index(work, files)
        if tokenizer_json is not None:
            (work / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        if tokenizer_dir is not None:
            for name in COPIED_FILES[1:]:
                if (Path(tokenizer_dir) / name).is_file() and not (work / name).exists():
                    shutil.copyfile(Path(tokenizer_dir) / name, work / name)
        os.rename(work, dst)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dst


def _narrowed(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """`t` in `dtype` (the release's) when that conversion is exact, else `t` unchanged."""
    if st_name(t.dtype) == dtype:
        return t
    out = t.to(ST_DTYPES[dtype])
    return out if torch.equal(out.to(t.dtype), t) else t


def _checked(value, name, shape, dtype):
    if isinstance(value, torch.Tensor):
        return value

    def make():
        t = value()
        if tuple(t.shape) == shape and st_name(t.dtype) in accepted_dtypes(name, dtype):
            t = _narrowed(t, dtype)  # the header says `dtype`: an F32 ViT norm must fit BF16 exactly
        if tuple(t.shape) != shape or st_name(t.dtype) != dtype:
            raise CheckpointError(f"tensor {name} is {st_name(t.dtype)} {list(t.shape)}, the model needs "
                                  f"{dtype} {list(shape)}")
        return t

    return make
