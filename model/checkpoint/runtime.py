"""The runtime layout (what `dsv41 convert --to runtime` writes): verifying it (`open_runtime`) and
reading its tensors back as pieces of the rank files (`_assembled`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsv41.model.checkpoint.layout import (MANIFEST_FILE, SCALES_FILE, _check_against_config, _read_manifest,
                                           load_args)
from dsv41.model.checkpoint.names import Part, expected_tensors, rank_tensors
from dsv41.model.checkpoint.safetensors import (Bytes, CheckpointError, Columns, Piece, Seq, TensorEntry, _Problems,
                                                _Reader, _scan_wanted, check_values, read_header, sha256_file)
from dsv41.model.config import ModelArgs


def rank_file(rank: int, mp: int) -> str:
    return f"model{rank}-mp{mp}.safetensors"


@dataclass
class RuntimeCheckpoint:
    path: Path
    args: ModelArgs  # runtime dtypes (wo_a bf16, experts in expert_dtype)
    manifest: dict
    ranks: list[dict[str, TensorEntry]]  # per rank: name -> entry
    parts: list[dict[str, Part]]  # per rank: name -> the part of the full tensor it holds
    full: dict[str, tuple[tuple[int, ...], str]]  # the assembled tensors: name -> (shape, dtype)
    scales: dict[str, TensorEntry]  # official wo_a scales kept beside the ranks (may be empty)

    @property
    def mp(self) -> int:
        return self.manifest["mp"]


def open_runtime(path: str | os.PathLike, checksums: bool = False, values: bool | None = None) -> RuntimeCheckpoint:
    """Verify a runtime-layout checkpoint: the manifest, each rank file's size (and with checksums=True
    its sha256) and header, and every tensor's name, dtype and shape against the config and the split
    rules; then the tensors' values as `open_official` does (`values`)."""
    path = Path(path)
    manifest = _read_manifest(path)
    args = load_args(path)
    mp = manifest["mp"]
    full = expected_tensors(args)
    problems = _Problems()
    files = manifest["files"]
    for name in [rank_file(r, mp) for r in range(mp)]:
        if name not in files:
            problems.add(f"{MANIFEST_FILE} does not list {name}")
    problems.raise_if_any()
    reader = _Reader() if checksums else None
    for name, info in files.items():
        p = path / name
        if not p.is_file():
            problems.add(f"missing file {name} (listed in {MANIFEST_FILE})")
            continue
        size = p.stat().st_size
        if size != info.get("bytes"):
            state = "truncated" if size < info.get("bytes", 0) else "larger than recorded"
            problems.add(f"{name} is {state}: {size:,} bytes, {MANIFEST_FILE} records {info.get('bytes'):,}")
        elif checksums and sha256_file(p, reader) != info.get("sha256"):
            problems.add(f"{name}: sha256 differs from {MANIFEST_FILE} (the file is corrupt)")
    if reader:
        reader.close()
    problems.raise_if_any()
    ranks, parts = [], []
    for r in range(mp):
        header = read_header(path / rank_file(r, mp))
        want = rank_tensors(full, args, mp, r)
        _check_against_config(header.tensors, {n: (s, d) for n, (s, d, _) in want.items()},
                              problems, where=f"config.json with mp={mp}", container=rank_file(r, mp))
        ranks.append(header.tensors)
        parts.append({n: p for n, (_, _, p) in want.items()})
    problems.raise_if_any()
    # the assembled tensors in their stored dtypes (an accepted other dtype, e.g. BF16 ViT norms, stays
    # as stored so --to official writes it back unchanged); every rank holding a tensor must agree
    stored: dict[str, str] = {}
    for r, tensors in enumerate(ranks):
        for name, entry in tensors.items():
            if stored.setdefault(name, entry.dtype) != entry.dtype:
                problems.add(f"{rank_file(r, mp)}: tensor {name} is {entry.dtype}, another rank file holds it as "
                             f"{stored[name]}")
    full = {name: (shape, stored.get(name, dtype)) for name, (shape, dtype) in full.items()}
    scales = {}
    if SCALES_FILE in files:
        scales = read_header(path / SCALES_FILE).tensors
        official = expected_tensors(args.replace(wo_a_dtype=None, expert_dtype="fp4"))
        for name, entry in scales.items():
            if name not in official or not name.endswith(".wo_a.scale"):
                problems.add(f"{SCALES_FILE} holds tensor {name}, which is not a wo_a scale of this model")
            elif (entry.shape, entry.dtype) != official[name]:
                problems.add(f"{SCALES_FILE}: tensor {name} is {entry.dtype} {list(entry.shape)}, config.json "
                             f"implies {official[name][1]} {list(official[name][0])}")
    problems.raise_if_any()
    stored_entries = [e for tensors in ranks for e in tensors.values()] + list(scales.values())
    if _scan_wanted(values, stored_entries):
        check_values(stored_entries, problems)
        problems.raise_if_any()
    return RuntimeCheckpoint(path, args, manifest, ranks, parts, full, scales)


def _assembled(ckpt: RuntimeCheckpoint, name: str) -> Piece:
    """The full tensor `name` (runtime dtype) as pieces of the rank files. Rows of one block scale held
    by several ranks, and the zero rows padding the last Engram parts, are taken once / dropped."""
    holders = [(r, ckpt.parts[r][name]) for r in range(ckpt.mp) if name in ckpt.parts[r]]
    r0, p0 = holders[0]
    if p0.dim is None:
        return Bytes(ckpt.ranks[r0][name])
    shape, _ = ckpt.full[name]
    pieces, covered = [], 0
    for r, part in holders:
        entry = ckpt.ranks[r][name]
        first, last = max(part.start, covered), min(part.stop, shape[part.dim])
        if last <= first:
            continue
        local = (first - part.start, last - part.start)
        pieces.append((entry, local))
        covered = last
    if covered != shape[p0.dim]:
        raise CheckpointError(f"internal: the rank files cover {covered} of {shape[p0.dim]} along dim {p0.dim} "
                              f"of {name}")
    if p0.dim == 0:
        return Seq([Bytes(e, a * e.row_bytes, b * e.row_bytes) for e, (a, b) in pieces])
    return Columns([(e, a, b) for e, (a, b) in pieces])
