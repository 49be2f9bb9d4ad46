"""Running a conversion plan, atomically and resumably (`execute`), and the two `dsv41 convert` entry
points: `convert` (plan, then execute) and `verify_checkpoint` (`--verify`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from dsv41.model.checkpoint.layout import JOURNAL_FILE, _write_json, detect_layout, partial_dir
from dsv41.model.checkpoint.official import open_official
from dsv41.model.checkpoint.plan import Plan, plan_conversion
from dsv41.model.checkpoint.runtime import open_runtime
from dsv41.model.checkpoint.safetensors import (CheckpointError, Progress, _Problems, _Reader, check_values,
                                                sha256_file, write_safetensors)

# torch threads while converting: the work is streaming I/O plus small per-tensor format changes, and
# OpenMP threads on a busy machine cost far more than they give (measured: 2 threads 10x slower than 1
# for the FP4 -> FP8 table lookup with other jobs running). Raise it on an idle many-core machine.
THREADS_ENV = "DSV41_CONVERT_THREADS"


def execute(plan: Plan, dst: str | os.PathLike, resume: bool = False, progress: Progress | None = None) -> dict:
    """Write `plan` to DST: everything goes to DST.partial/ first and is renamed to DST at the end, so
    DST appears complete or not at all. Each finished file is renamed from its .tmp name and journaled
    with its sha256; with resume=True a journaled file whose size and sha256 still match is kept, and
    only the rest is rewritten (the output is deterministic, so the bytes are those of an
    uninterrupted run). Bad data found while writing removes DST.partial; an interruption keeps it."""
    dst = Path(dst)
    progress = progress or Progress()
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; choose a new destination")
    if not dst.parent.is_dir():
        raise CheckpointError(f"{dst.parent} does not exist")
    work = partial_dir(dst)
    fingerprint = plan.fingerprint()
    journal_path = work / JOURNAL_FILE
    done: dict[str, str] = {}
    if work.exists():
        journal = None
        try:
            journal = json.loads(journal_path.read_text())
        except (OSError, ValueError):
            pass
        if resume and journal and journal.get("plan") == fingerprint:
            done = dict(journal.get("done") or {})
        else:
            why = ("it belongs to a different conversion" if resume else "--resume was not given")
            progress.note(f"discarding the unfinished {work.name} ({why})")
            shutil.rmtree(work)
    elif resume:
        progress.note(f"nothing to resume ({work.name} does not exist); converting from the start")
    work.mkdir(exist_ok=True)
    for stray in work.glob("*.tmp"):
        stray.unlink()

    reader = _Reader()
    digests: dict[str, str] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, int(os.environ.get(THREADS_ENV) or 1))))
    try:
        reused = []
        for f in plan.files:
            target = work / f.name
            if f.name in done and target.is_file() and target.stat().st_size == f.nbytes \
                    and sha256_file(target, reader) == done[f.name]:
                digests[f.name] = done[f.name]
                reused.append(f.name)
            else:
                done.pop(f.name, None)
                target.unlink(missing_ok=True)
        if reused:
            progress.note(f"resuming: reusing {len(reused)} verified file(s): {', '.join(reused)}")
        todo = [f for f in plan.files if f.name not in digests]
        _write_json(journal_path, {"plan": fingerprint, "done": done})
        progress.start(sum(f.nbytes for f in todo), sum(len(f.tensors) for f in todo))
        for f in todo:
            tmp = work / (f.name + ".tmp")
            digests[f.name] = write_safetensors(tmp, f, reader, progress)
            os.replace(tmp, work / f.name)
            done[f.name] = digests[f.name]
            _write_json(journal_path, {"plan": fingerprint, "done": done})
        for name in plan.copies:
            shutil.copyfile(plan.src / name, work / name)
        plan.finish(work, digests)
        journal_path.unlink()
        _fsync_dir(work)
        os.rename(work, dst)
        _fsync_dir(dst.parent)
    except CheckpointError:
        reader.close()
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        reader.close()
        progress.finish()
        torch.set_num_threads(threads)
    return {**plan.summary(), "dst": str(dst), "reused": reused, "sha256": digests}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str = "runtime", mp: int = 1,
            expert_dtype: str = "fp4", dry_run: bool = False, resume: bool = False,
            progress: Progress | None = None) -> dict:
    """`dsv41 convert`: verify SRC, then write DST in the other layout (see module docstring). Returns
    the plan summary (dry run) or the result. Raises CheckpointError for bad input."""
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; choose a new destination")
    plan = plan_conversion(src, to, mp, expert_dtype)
    if dry_run:
        return {**plan.summary(), "dst": str(dst), "dry_run": True}
    return execute(plan, dst, resume=resume, progress=progress)


def verify_checkpoint(src: str | os.PathLike, progress: Progress | None = None) -> dict:
    """`dsv41 convert --verify`: everything `open_official` / `open_runtime` check from the headers, plus,
    whatever the checkpoint's size, every tensor's values (`check_values`: no NaN/inf in BF16/F32, no
    NaN codes in E4M3 weights or UE8M0 scales) and, for the runtime layout, each file's sha256 against
    runtime.json. Raises CheckpointError naming the file and tensor of the first problem, with a count
    of the rest; returns a summary."""
    src = Path(src)
    layout = detect_layout(src)
    if layout == "official":
        ckpt = open_official(src, values=False)
        entries = list(ckpt.tensors.values())
    else:
        ckpt = open_runtime(src, values=False)
        entries = [e for tensors in ckpt.ranks for e in tensors.values()] + list(ckpt.scales.values())
    progress = progress or Progress()
    problems = _Problems()
    progress.start(sum(e.nbytes for e in entries), len(entries))
    try:
        for entry in entries:
            check_values([entry], problems)
            progress.advance(entry.nbytes, 1)
    finally:
        progress.finish()
    problems.raise_if_any()  # a bad value names its tensor; a checksum only its file, so values go first
    if layout == "runtime":
        open_runtime(src, checksums=True, values=False)
    return {"src": str(src), "layout": layout, "tensors": len(entries), "bytes": sum(e.nbytes for e in entries),
            "values": "checked", "checksums": "checked" if layout == "runtime" else None}
