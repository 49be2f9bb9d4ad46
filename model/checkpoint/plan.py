"""Conversion plans: everything `dsv41 convert` will write, decided before any data is read (`Plan`),
official -> runtime (`plan_runtime`: ranks split by the name map, wo_a dequantized, experts converted) and
runtime -> official (`plan_official`: ranks reassembled, wo_a requantized, experts back to FP4), and the
exact expert format changes they use. `runner.execute` writes a plan."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

import torch

from dsv41.model import formats
from dsv41.model.checkpoint.layout import (COPIED_FILES, EXPERT_DTYPES, INDEX_FILE, MANIFEST_FILE, RUNTIME_FORMAT,
                                           RUNTIME_VERSION, SCALES_FILE, SINGLE_FILE, _read_manifest, _write_json,
                                           detect_layout)
from dsv41.model.checkpoint.names import (EXPERTS, Part, _file_order, _weight_name, check_mp, expected_tensors,
                                          official_name, rank_tensors, runtime_args, split_of)
from dsv41.model.checkpoint.official import OfficialCheckpoint, _default_shards, _write_index, open_official
from dsv41.model.checkpoint.runtime import RuntimeCheckpoint, _assembled, open_runtime, rank_file
from dsv41.model.checkpoint.safetensors import (Bytes, CheckpointError, Columns, Computed, Header, OutFile,
                                                OutTensor, Piece, Seq, TensorEntry, Zeros, _Reader, materialize,
                                                read_header)


@dataclass
class Plan:
    """Everything a conversion will write, decided before any data is read."""

    src: Path
    to: str
    mp: int
    expert_dtype: str
    files: list[OutFile]
    copies: list[str]  # small files copied from SRC
    source_fingerprint: str
    finish: Callable[[Path, dict[str, str]], None]  # writes the manifest / index, given file -> sha256

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def n_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def fingerprint(self) -> str:
        """Identifies the output: same source, options and file plan -> same bytes."""
        doc = {"src": self.source_fingerprint, "to": self.to, "mp": self.mp, "expert_dtype": self.expert_dtype,
               "files": [[f.name, hashlib.sha256(f.header()).hexdigest()] for f in self.files],
               "version": RUNTIME_VERSION}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def summary(self) -> dict:
        return {"src": str(self.src), "to": self.to, "mp": self.mp,
                "expert_dtype": self.expert_dtype if self.to == "runtime" else "fp4",
                "tensors": self.n_tensors, "bytes": self.nbytes,
                "files": [{"name": f.name, "tensors": len(f.tensors), "bytes": f.nbytes} for f in self.files],
                "copied": self.copies}


def _source_fingerprint(path: Path, headers: Iterable[Header]) -> str:
    digest = hashlib.sha256()
    for name in COPIED_FILES + (INDEX_FILE, MANIFEST_FILE):
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256((path / name).read_bytes()).digest())
    for h in headers:
        digest.update(h.path.name.encode() + b"\0" + str(h.file_size).encode() + b"\0" + h.raw)
    return digest.hexdigest()


def _copies(path: Path) -> list[str]:
    return [name for name in COPIED_FILES if (path / name).is_file()]


def _check_bf16_exact(values: torch.Tensor, name: str) -> torch.Tensor:
    out = values.to(torch.bfloat16)
    if not torch.equal(out.float(), values):
        raise CheckpointError(f"{name}: {int((out.float() != values).sum())} values are not exactly representable "
                              "in bf16 (scales out of range)")
    return out


# ---------------------------------------------------------------------------------- official -> runtime
def plan_runtime(ckpt: OfficialCheckpoint, mp: int = 1, expert_dtype: str = "fp4") -> Plan:
    """Official layout -> `model{r}-mp{mp}.safetensors` for each rank, plus the wo_a scale sidecar."""
    if mp < 1:
        raise CheckpointError(f"--mp must be at least 1, not {mp}")
    if expert_dtype not in EXPERT_DTYPES:
        raise CheckpointError(f"--expert-dtype must be one of {', '.join(EXPERT_DTYPES)}, not {expert_dtype!r}")
    args = ckpt.args
    check_mp(args, mp)
    block = args.fp8_block_size
    target = runtime_args(args, expert_dtype)
    full = expected_tensors(target)
    official = expected_tensors(args)
    files = []
    for rank in range(mp):
        held = rank_tensors(full, target, mp, rank)
        out = {}
        for name, (shape, dtype, part) in held.items():
            if name.endswith(".attn.wo_a.weight"):
                out[name] = OutTensor(name, dtype, shape, _dequant_wo_a(ckpt, name, part, shape, block))
            elif split_of(name) == EXPERTS and expert_dtype != "fp4":
                out[name] = OutTensor(name, dtype, shape, _convert_expert(ckpt, name, expert_dtype, shape, block))
            else:  # as stored (the model's dtype, or an accepted other one such as BF16 ViT norms)
                out[name] = OutTensor(name, ckpt.tensors[name].dtype, shape, _slice(ckpt.tensors[name], part))
        order = _file_order(out, {n: t.dtype for n, t in out.items()})
        files.append(OutFile(rank_file(rank, mp), [out[n] for n in order]))
    scales = [n for n in official if n.endswith(".attn.wo_a.scale")]
    if scales:
        files.append(OutFile(SCALES_FILE, [OutTensor(n, official[n][1], official[n][0], Bytes(ckpt.tensors[n]))
                                           for n in scales]))
    copies = _copies(ckpt.path)
    roles = {rank_file(r, mp): {"rank": r} for r in range(mp)}
    roles[SCALES_FILE] = {"role": "official wo_a scales"}

    def finish(dst: Path, digests: dict[str, str]) -> None:
        manifest = {
            "format": RUNTIME_FORMAT, "version": RUNTIME_VERSION, "mp": mp, "expert_dtype": expert_dtype,
            "wo_a_dtype": "bf16",
            "files": {f.name: {"bytes": f.nbytes, "sha256": digests[f.name], **roles[f.name]} for f in files},
            "copied": copies,
            # enough to write the official layout back byte for byte: the index as published and
            # each shard's metadata and tensor order
            "official": {
                "index": ckpt.index_text,
                "shards": {s: {"metadata": h.metadata, "tensors": [official_name(n, official) for n in h.tensors]}
                           for s, h in ckpt.headers.items()},
            },
        }
        _write_json(dst / MANIFEST_FILE, manifest)

    return Plan(ckpt.path, "runtime", mp, expert_dtype, files, copies,
                _source_fingerprint(ckpt.path, ckpt.headers.values()), finish)


def _slice(entry: TensorEntry, part: Part) -> Piece:
    """A rank's part of a stored tensor, streamed: rows are a byte range, columns a banded copy."""
    if part.dim is None:
        return Bytes(entry)
    if part.dim == 0:
        rows = Bytes(entry, part.start * entry.row_bytes, part.stop * entry.row_bytes)
        return Seq([rows, Zeros(part.pad * entry.row_bytes)]) if part.pad else rows
    return Columns([(entry, part.start, part.stop)])


def _dequant_wo_a(ckpt: OfficialCheckpoint, name: str, part: Part, shape, block: int) -> Piece:
    """wo_a rows of this rank, FP8 x UE8M0 32x32 blocks -> bf16 (exact: E4M3 times a power of two)."""
    w_entry, s_entry = ckpt.tensors[name], ckpt.tensors[name[: -len("weight")] + "scale"]

    def make(reader: _Reader) -> torch.Tensor:
        w = reader.tensor(w_entry)
        s = reader.tensor(s_entry)
        if part.dim == 0:
            w, s = w[part.start:part.stop], s[part.start // block:-(-part.stop // block)]
        return _check_bf16_exact(formats.dequant_fp8_weight(w, s, block), name)

    return Computed(make, math.prod(shape) * 2, name)


# Expert format changes run on the bytes: the ~47,000 expert matrices of V4.1-Flash (5.6e11 values)
# through the float reference would take hours; a table lookup per packed byte is several times
# faster. Exact by construction; tests compare it with model.formats bit for bit.
FP4_GROUP = 32  # one UE8M0 per 32 inputs of a packed-FP4 expert row
_FP8_OFFSETS = range(-8, 7)  # FP4 group scale / FP8 tile scale = 2^k; below 2^-8, 0.5 * 2^k leaves E4M3


@lru_cache(maxsize=1)
def _e2m1_pairs_to_e4m3_table() -> torch.Tensor:
    """int16 [len(_FP8_OFFSETS) * 256]: for offset 2^k and a packed byte (two E2M1 codes, the even
    element in the low nibble), the two E4M3 bytes of e2m1(code) * 2^k, even element in the low byte
    (so a little-endian int16 array viewed as bytes is the FP8 row). -0 becomes +0, as in REF's table."""
    grid = formats.e2m1_decode(torch.arange(16)) + 0.0
    single = torch.stack([formats.to_e4m3(grid * 2.0 ** k).view(torch.uint8) for k in _FP8_OFFSETS]).to(torch.int16)
    byte = torch.arange(256)
    return (single[:, byte & 0xF] | (single[:, byte >> 4] << 8)).reshape(-1)


def fp4_experts_to_fp8(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 [out, in/2] + UE8M0 per 32 [out, in/32] -> E4M3 [out, in] + UE8M0 tiles [out/block, in/block],
    exactly `formats.fp4_weight_to_fp8`: tile scale = largest group scale / 2^6, each value times its
    group's power-of-two offset. Raises ValueError where that is not exact (offset below 2^-8)."""
    if sys.byteorder != "little":
        raise ValueError("the FP4 -> FP8 table assumes a little-endian machine")
    packed = packed.contiguous().view(torch.uint8)
    out_features, in_features = packed.size(0), packed.size(1) * 2
    if out_features % block or in_features % block or block % FP4_GROUP:
        raise ValueError(f"[{out_features}, {in_features}] is not tiled by {block}x{block}")
    s = scale.contiguous().view(torch.uint8).to(torch.int32)  # [out, in/32] biased exponents
    if bool((s == formats.E8M0_NAN).any()):
        raise ValueError("NaN scale")
    per_tile = block // FP4_GROUP
    tile = s.view(out_features // block, block, in_features // block, per_tile).amax(dim=(1, 3)) - 6
    if bool((tile < 0).any()):
        raise ValueError("a tile scale would fall below 2^-127")
    k = s - tile.repeat_interleave(block, 0).repeat_interleave(per_tile, 1)  # [out, in/32], <= 6
    groups = packed.view(out_features, in_features // FP4_GROUP, FP4_GROUP // 2)
    low = k < _FP8_OFFSETS[0]
    if bool(low.any()):
        too_small = low & ((groups & 0x77) != 0).any(dim=-1)  # a nonzero magnitude in either nibble
        if bool(too_small.any()):
            raise ValueError(f"FP4 -> FP8 is not exact for {int(too_small.sum())} groups (scales spread over > 2^14)")
        k = k.clamp_min(_FP8_OFFSETS[0])
    index = ((k - _FP8_OFFSETS[0]) * 256).unsqueeze(-1) + groups
    weight = _e2m1_pairs_to_e4m3_table()[index].view(torch.uint8).view(out_features, in_features)
    return weight.view(torch.float8_e4m3fn), tile.to(torch.uint8).view(torch.float8_e8m0fnu)


def fp4_experts_to_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 + UE8M0 per 32 -> fp32 values [out, in] (exact)."""
    codes = formats.unpack_fp4(packed)
    out_features, in_features = codes.shape
    values = formats.e2m1_decode(codes).view(out_features, in_features // FP4_GROUP, FP4_GROUP)
    return (values * formats.e8m0_to_float(scale).unsqueeze(-1)).view(out_features, in_features)


_expert_cache: dict = {}


def _cached(key, compute):
    """Weight and scale of a converted expert are written one after the other: keep the last result."""
    if _expert_cache.get("key") != key:
        value = compute()
        _expert_cache.clear()
        _expert_cache.update(key=key, value=value)
    return _expert_cache["value"]


def _convert_expert(ckpt: OfficialCheckpoint, name: str, expert_dtype: str, shape, block: int) -> Piece:
    """A routed expert tensor in the runtime expert dtype: FP8 (lossless) or bf16 (exact values)."""
    stem = name.rsplit(".", 1)[0]
    w_entry, s_entry = ckpt.tensors[stem + ".weight"], ckpt.tensors[stem + ".scale"]
    elem = 1 if expert_dtype == "fp8" else 2
    if expert_dtype == "fp8":
        index = 0 if name.endswith(".weight") else 1

        def make(reader):
            try:
                return _cached((str(w_entry.file), w_entry.offset), lambda: fp4_experts_to_fp8(
                    reader.tensor(w_entry), reader.tensor(s_entry), block))[index]
            except ValueError as e:
                raise CheckpointError(f"{stem}: {e}") from None
    else:
        def make(reader):
            return _check_bf16_exact(fp4_experts_to_values(reader.tensor(w_entry), reader.tensor(s_entry)), name)

    return Computed(make, math.prod(shape) * elem, name)


# ---------------------------------------------------------------------------------- runtime -> official
def plan_official(ckpt: RuntimeCheckpoint, n_shards: int | None = None) -> Plan:
    """Runtime layout -> the official layout: ranks reassembled, wo_a requantized to FP8 with the kept
    scales (bit-exact; without them, with the smallest exact power-of-two scales), experts back to
    packed FP4. The shard layout recorded at conversion time is reproduced, else a default one."""
    args = ckpt.args.replace(wo_a_dtype=None, expert_dtype="fp4")
    official = expected_tensors(args)
    block = args.fp8_block_size
    out: dict[str, OutTensor] = {}
    for name, (shape, dtype) in official.items():
        if name.endswith(".attn.wo_a.weight"):
            data = _requant_wo_a(ckpt, name, shape, block)
        elif name.endswith(".attn.wo_a.scale"):
            data = (Bytes(ckpt.scales[name]) if name in ckpt.scales
                    else _requant_wo_a(ckpt, _weight_name(name), official[_weight_name(name)][0], block, scale=True))
        elif split_of(name) == EXPERTS and ckpt.manifest["expert_dtype"] != "fp4":
            data = _expert_to_fp4(ckpt, name, shape, block)
        else:
            data = _assembled(ckpt, name)
            dtype = ckpt.full[name][1]  # as the rank files store it (BF16 ViT norms stay BF16)
        out[name] = OutTensor(name, dtype, shape, data)
    record = ckpt.manifest.get("official") or {}
    layout = record.get("shards")
    if layout and set(n for s in layout.values() for n in s["tensors"]) == set(out) and n_shards is None:
        files = [OutFile(shard, [out[n] for n in spec["tensors"]], spec.get("metadata") or None)
                 for shard, spec in layout.items()]
        index_text = record.get("index")
    else:
        files, index_text = _default_shards(out, args, n_shards), None
    copies = _copies(ckpt.path)

    def finish(dst: Path, digests: dict[str, str]) -> None:
        if len(files) == 1 and files[0].name == SINGLE_FILE:
            return
        if index_text is not None:
            (dst / INDEX_FILE).write_text(index_text, encoding="utf-8")
        else:
            _write_index(dst, files)

    return Plan(ckpt.path, "official", ckpt.mp, "fp4", files, copies,
                _source_fingerprint(ckpt.path, [read_header(ckpt.path / f) for f in ckpt.manifest["files"]]), finish)


def _pow2_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ratio (> 0), exactly (no reciprocal rounding)."""
    mantissa, exponent = torch.frexp(ratio.double())
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own ceiling
    return torch.ldexp(torch.ones_like(ratio, dtype=torch.float64), exponent).float()


def _requant_wo_a(ckpt: RuntimeCheckpoint, name: str, shape, block: int, scale: bool = False) -> Piece:
    """bf16 wo_a -> FP8 + UE8M0. With the original scale every value divides back exactly to its E4M3
    byte; without it, each tile takes the smallest power of two that keeps it within +-448, which
    represents the same values (a bf16 value that came from E4M3 x 2^k needs no rounding)."""
    full = _assembled(ckpt, name)
    scale_name = name[: -len("weight")] + "scale"
    out_rows, in_cols = shape

    def make(reader):
        w = materialize(full, "BF16", tuple(shape), reader).float()
        if scale_name in ckpt.scales:
            s = formats.e8m0_to_float(reader.tensor(ckpt.scales[scale_name]))
        else:
            tiles = torch.nn.functional.pad(w.abs(), (0, -in_cols % block, 0, -out_rows % block))
            amax = tiles.unflatten(0, (-1, block)).unflatten(2, (-1, block)).amax(dim=(1, 3))
            s = _pow2_ceil(amax.clamp_min(2.0 ** -120) / formats.FP8_E4M3_MAX)
        expanded = s.repeat_interleave(block, 0)[:out_rows].repeat_interleave(block, 1)[:, :in_cols]
        q = formats.to_e4m3(w / expanded)
        s_bytes = formats.float_to_e8m0(s).view(torch.float8_e8m0fnu)
        if not torch.equal(formats.dequant_fp8_weight(q, s_bytes, block), w):
            raise CheckpointError(f"{name}: the bf16 values are not FP8 x {block}x{block} UE8M0 blocks; "
                                  "cannot write them in the official format exactly")
        return s_bytes if scale else q

    n = math.prod(shape) if not scale else (-(-out_rows // block)) * (-(-in_cols // block))
    return Computed(make, n, name)


def _expert_to_fp4(ckpt: RuntimeCheckpoint, name: str, shape, block: int) -> Piece:
    """FP8 (or bf16) expert -> packed E2M1 + one UE8M0 per 32 inputs, each group with the smallest
    power-of-two scale that puts it on the E2M1 grid. Exact for experts that came from FP4 (the values
    are E2M1 x 2^k); anything else is refused rather than rounded."""
    stem = name.rsplit(".", 1)[0]
    w_name = stem + ".weight"
    dtype = ckpt.manifest["expert_dtype"]
    w_piece = _assembled(ckpt, w_name)
    s_piece = _assembled(ckpt, stem + ".scale") if dtype == "fp8" else None
    w_shape, _ = ckpt.full[w_name]
    out_rows, in_cols = w_shape
    index = 0 if name.endswith(".weight") else 1

    def compute(reader):
        if dtype == "fp8":
            s = materialize(s_piece, "F8_E8M0", ckpt.full[stem + ".scale"][0], reader)
            w = formats.dequant_fp8_weight(materialize(w_piece, "F8_E4M3", w_shape, reader), s, block)
        else:
            w = materialize(w_piece, "BF16", w_shape, reader).float()
        groups = w.view(out_rows, in_cols // FP4_GROUP, FP4_GROUP)
        scale = _pow2_ceil(groups.abs().amax(dim=-1).clamp_min(2.0 ** -120) / formats.FP4_E2M1_MAX)
        codes = formats.e2m1_encode(groups / scale.unsqueeze(-1)).view(out_rows, in_cols)
        packed = formats.pack_fp4(codes).view(torch.int8)
        s_bytes = formats.float_to_e8m0(scale).view(torch.float8_e8m0fnu)
        if not torch.equal(fp4_experts_to_values(packed, s_bytes), w):
            raise CheckpointError(f"{stem}: the {dtype} expert values are not FP4 x UE8M0 groups; "
                                  "cannot write them in the official format exactly")
        return packed, s_bytes

    def make(reader):
        return _cached(("fp4", w_name, str(ckpt.path)), lambda: compute(reader))[index]

    n = math.prod(shape)
    return Computed(make, n, name)


def plan_conversion(src: str | os.PathLike, to: str = "runtime", mp: int = 1, expert_dtype: str = "fp4") -> Plan:
    """Verify SRC and decide what `convert` would write."""
    src = Path(src)
    layout = detect_layout(src)
    if to == "runtime":
        if layout != "official":
            raise CheckpointError(f"{src} is already in the runtime layout (mp={_read_manifest(src)['mp']}); "
                                  "convert it --to official first to re-split it")
        return plan_runtime(open_official(src), mp, expert_dtype)
    if to == "official":
        if layout != "runtime":
            raise CheckpointError(f"{src} is already in the official layout")
        return plan_official(open_runtime(src))
    raise CheckpointError(f"--to must be runtime or official, not {to!r}")
