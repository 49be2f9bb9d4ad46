"""safetensors files: header parsing and verification, memory-mapped and chunked reads, what an output
tensor is made of (`Piece`s: byte ranges, zeros, column bands, computed or in-memory tensors), streaming
writes with their sha256, and the value scan (`check_values`) both layouts run on their tensors. The
lowest layer of the checkpoint package: it knows files and tensors, not the model's names."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

CHUNK_BYTES = 32 << 20  # streaming copy granularity: the converter's working buffer


class CheckpointError(ValueError):
    """A problem with a checkpoint on disk (or a conversion request): a one-line message naming the
    file and tensor. The CLI prints it and exits 2."""


# ====================================================================================================
# safetensors files: header parsing, memory-mapped and chunked reads, streaming writes
# ====================================================================================================

ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 256 << 20  # the real index has ~96k tensors spread over 48 headers of < 1 MB each


def st_name(dtype: torch.dtype) -> str:
    return ST_NAMES[dtype]


def itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=ST_DTYPES[dtype]).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, absolute byte offset and size, dtype and shape."""

    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute position of the first byte in `file`
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


@dataclass
class Header:
    """A parsed safetensors header: tensors in file order, metadata, and the header's own bytes."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    raw: bytes  # length prefix + JSON, for fingerprints
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike) -> Header:
    """Parse and check a safetensors header without reading tensor data: a readable JSON header, known
    dtypes, offsets that match each shape and tile the data area without gaps, and a file exactly as
    long as the header says (shorter: truncated; longer: trailing garbage)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path.name} is truncated: {size} bytes, not even a safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, size - 8):
                if n <= _MAX_HEADER:
                    raise CheckpointError(f"{path.name} is truncated: {size:,} bytes, its header alone needs {8 + n:,}")
                raise CheckpointError(f"{path.name} is not a safetensors file (header length {n:,})")
            raw_json = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path.name} in {path.parent}") from None
    try:
        doc = json.loads(raw_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: unreadable safetensors header ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path.name}: the safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    data_start = 8 + n
    spans = []
    tensors: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: malformed header entry for tensor {name}") from None
        if dtype not in ST_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        expected = math.prod(shape) * itemsize(dtype)
        if end - begin != expected or begin < 0:
            raise CheckpointError(f"{path.name}: tensor {name} spans {end - begin} bytes but {dtype} {list(shape)} "
                                  f"needs {expected}")
        spans.append((begin, end, name))
        tensors[name] = TensorEntry(name, dtype, shape, path, data_start + begin, expected)
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise CheckpointError(f"{path.name}: tensor {name} {what} (offset {begin}, expected {position})")
        position = end
    needed = data_start + position
    if size < needed:
        cut = [name for _, end, name in spans if data_start + end > size]
        more = f" and the {len(cut) - 1} after it are" if len(cut) > 1 else " is"
        raise CheckpointError(f"{path.name} is truncated: {size:,} bytes, its header needs {needed:,} "
                              f"(tensor {cut[0]}{more} cut off)")
    if size > needed:
        raise CheckpointError(f"{path.name} has {size - needed:,} unexpected bytes after its last tensor")
    ordered = {name: tensors[name] for _, _, name in spans}
    return Header(path, ordered, dict(metadata), prefix + raw_json, data_start, size)


@lru_cache(maxsize=None)
def _mapping(path: str, mtime_ns: int, size: int) -> mmap.mmap:
    # copy-on-write: tensors are writable views (torch wants that), writes stay private, pages are
    # shared with the page cache until written. A kernel that refuses a private mapping larger than
    # its memory (heuristic overcommit, a 101 GB Engram shard) gets a read-only one.
    with open(path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def open_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor as a zero-copy view of its memory-mapped file (read lazily by the OS)."""
    st = entry.file.stat()
    mm = _mapping(str(entry.file), st.st_mtime_ns, st.st_size)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.torch_dtype)
    with warnings.catch_warnings():  # a read-only mapping: torch warns that writes would fault
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
    return flat.view(entry.torch_dtype).view(entry.shape)


class _Reader:
    """Positional reads of source files through one reusable buffer (no mmap, so what is copied does
    not stay resident: the converter's memory stays bounded)."""

    def __init__(self, chunk: int | None = None):
        self.buffer = bytearray(chunk or CHUNK_BYTES)
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def read_into(self, path: Path, offset: int, view: memoryview) -> None:
        fd, done = self.fd(path), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"{path.name} ended early while reading at byte {offset + done:,} "
                                      "(the file changed during the conversion?)")
            done += got

    def chunks(self, path: Path, offset: int, nbytes: int) -> Iterator[memoryview]:
        """Successive views of bytes [offset, offset + nbytes) of `path`, each valid until the next."""
        view = memoryview(self.buffer)
        while nbytes > 0:
            n = min(nbytes, len(view))
            self.read_into(path, offset, view[:n])
            yield view[:n]
            offset, nbytes = offset + n, nbytes - n

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """A private in-memory copy of one stored tensor."""
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
        if entry.nbytes:
            self.read_into(entry.file, entry.offset, memoryview(out.numpy()))
        return out.view(entry.torch_dtype).view(entry.shape)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


# ---------------------------------------------------------------------------------- data sources
# What an output tensor is made of. Each kind yields its bytes in bounded chunks.
class Piece:
    nbytes: int

    def chunks(self, reader: _Reader) -> Iterator[memoryview]:
        raise NotImplementedError


@dataclass
class Bytes(Piece):
    """Bytes [start, stop) of a stored tensor: the whole tensor, or a range of its rows."""

    entry: TensorEntry
    start: int = 0
    stop: int | None = None

    def __post_init__(self):
        self.stop = self.entry.nbytes if self.stop is None else self.stop
        self.nbytes = self.stop - self.start

    def chunks(self, reader):
        yield from reader.chunks(self.entry.file, self.entry.offset + self.start, self.nbytes)


@dataclass
class Zeros(Piece):
    nbytes: int

    def chunks(self, reader):
        left = self.nbytes
        while left:
            n = min(left, len(reader.buffer))
            yield memoryview(bytes(n))
            left -= n


@dataclass
class Columns(Piece):
    """Columns of 2-D stored tensors placed side by side: [(entry, first col, end col), ...], all with
    the same rows. One part is a column slice (splitting along dim 1), several are a reassembly.
    Read in bands of rows so the working set stays bounded."""

    parts: list[tuple[TensorEntry, int, int]]

    def __post_init__(self):
        first = self.parts[0][0]
        self.rows = first.shape[0]
        self.elem = itemsize(first.dtype)
        self.nbytes = self.rows * sum(c1 - c0 for _, c0, c1 in self.parts) * self.elem

    def chunks(self, reader):
        width = max(e.row_bytes for e, _, _ in self.parts)
        band = max(1, len(reader.buffer) // (2 * width))
        for r0 in range(0, self.rows, band):
            r1 = min(self.rows, r0 + band)
            pieces = []
            for entry, c0, c1 in self.parts:
                block = torch.empty((r1 - r0) * entry.row_bytes, dtype=torch.uint8)
                reader.read_into(entry.file, entry.offset + r0 * entry.row_bytes, memoryview(block.numpy()))
                pieces.append(block.view(r1 - r0, entry.row_bytes)[:, c0 * self.elem:c1 * self.elem])
            yield memoryview(torch.cat(pieces, dim=1).contiguous().view(-1).numpy())


@dataclass
class Computed(Piece):
    """A tensor that changes format on the way (wo_a, converted experts): computed in memory, one
    tensor at a time, by `make(reader)`."""

    make: Callable[[_Reader], torch.Tensor]
    nbytes: int
    what: str = ""

    def chunks(self, reader):
        t = self.make(reader).contiguous()
        if t.numel() * t.element_size() != self.nbytes:
            raise CheckpointError(f"internal: {self.what} computed {t.numel() * t.element_size()} bytes, "
                                  f"planned {self.nbytes}")
        if self.nbytes:
            yield memoryview(t.view(torch.uint8).view(-1).numpy())


@dataclass
class InMemory(Piece):
    """A tensor already in memory (the fixture writer, `save_official`)."""

    tensor: torch.Tensor | Callable[[], torch.Tensor]
    nbytes: int

    def chunks(self, reader):
        t = self.tensor() if callable(self.tensor) else self.tensor
        t = t.detach().contiguous().cpu()
        if t.numel():
            yield memoryview(t.view(torch.uint8).view(-1).numpy())


@dataclass
class Seq(Piece):
    parts: list[Piece]

    def __post_init__(self):
        self.nbytes = sum(p.nbytes for p in self.parts)

    def chunks(self, reader):
        for p in self.parts:
            yield from p.chunks(reader)


def materialize(piece: Piece, dtype: str, shape: tuple[int, ...], reader: _Reader | None = None) -> torch.Tensor:
    """The bytes of a piece as a tensor in memory. A whole stored tensor comes back memory-mapped."""
    if isinstance(piece, Bytes) and piece.start == 0 and piece.nbytes == piece.entry.nbytes \
            and piece.entry.shape == tuple(shape):
        return open_tensor(piece.entry)
    own = reader is None
    reader = reader or _Reader()
    try:
        out = torch.empty(piece.nbytes, dtype=torch.uint8)
        flat, pos = out.numpy(), 0
        for chunk in piece.chunks(reader):
            flat[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        return out.view(ST_DTYPES[dtype]).view(shape)
    finally:
        if own:
            reader.close()


# ---------------------------------------------------------------------------------- writing
@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Piece


@dataclass
class OutFile:
    """One safetensors file to write: tensors in file order, the header computed up front."""

    name: str
    tensors: list[OutTensor]
    metadata: dict[str, str] | None = field(default_factory=lambda: {"format": "pt"})

    def header(self) -> bytes:
        if getattr(self, "_header", None) is None:
            self._header = self._make_header()
        return self._header

    def _make_header(self) -> bytes:
        doc: dict = {}
        if self.metadata:
            doc["__metadata__"] = self.metadata
        pos = 0
        for t in self.tensors:
            expected = math.prod(t.shape) * itemsize(t.dtype)
            if t.data.nbytes != expected:
                raise CheckpointError(f"internal: {t.name} has {t.data.nbytes} bytes of data, {t.dtype} "
                                      f"{list(t.shape)} needs {expected}")
            doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + expected]}
            pos += expected
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
        return struct.pack("<Q", len(text)) + text

    @property
    def nbytes(self) -> int:
        return len(self.header()) + sum(t.data.nbytes for t in self.tensors)


class Progress:
    """What the converter reports; the CLI draws it as a progress bar. The default reports nothing."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def advance(self, nbytes: int, tensors: int = 0) -> None: ...

    def note(self, message: str) -> None: ...

    def finish(self) -> None: ...


def write_safetensors(path: Path, file: OutFile, reader: _Reader, progress: Progress | None = None) -> str:
    """Stream `file` to `path` (header first, then each tensor's chunks); return the sha256 of the bytes."""
    progress = progress or Progress()
    digest = hashlib.sha256()
    # sha256 runs beside the write (both release the GIL): each chunk is hashed while it is written
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        head = file.header()
        f.write(head)
        digest.update(head)
        progress.advance(len(head))
        for t in file.tensors:
            written = 0
            for chunk in t.data.chunks(reader):
                hashed = hasher.submit(digest.update, chunk)
                f.write(chunk)
                hashed.result()  # the reader reuses the chunk's buffer next
                written += len(chunk)
                progress.advance(len(chunk))
            if written != t.data.nbytes:
                raise CheckpointError(f"internal: wrote {written} bytes for {t.name}, planned {t.data.nbytes}")
            progress.advance(0, 1)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def sha256_file(path: Path, reader: _Reader | None = None) -> str:
    reader = reader or _Reader()
    digest = hashlib.sha256()
    for chunk in reader.chunks(path, 0, path.stat().st_size):
        digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------- verification: problems and values
class _Problems:
    """Collects verification problems; raises the first with a count of the rest."""

    def __init__(self):
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self) -> None:
        if self.items:
            more = len(self.items) - 1
            raise CheckpointError(self.items[0] + (f" (and {more} more problem{'s' * (more > 1)})" if more else ""))


# Values no stored tensor may hold: NaN/inf in BF16/F16/F32, the NaN codes of E4M3 (0x7F/0xFF, E4M3
# "fn" has no inf) and of UE8M0 (0xFF). Packed FP4 ("I8", every byte is two E2M1 codes) and integer
# tensors cannot hold any. The scan is one min/max reduction per chunk (a NaN or inf shows in it),
# so it reads the data once at memory speed; counting the bad values runs only where there are some.
SCAN_CHUNK = 1 << 24  # elements per step of a value scan (bounds the temporaries of the count)
# open_official / open_runtime scan every tensor's values when the checkpoint's tensors total at most
# this many bytes (the bundled dsv41-tiny: 41 MB, measured in docs/convert.md); larger checkpoints are
# checked by `dsv41 convert --verify`, and generation stops on non-finite logits (model/engine.py).
LOAD_SCAN_BYTES = 1 << 30
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def out_of_format(t: torch.Tensor) -> tuple[int, str] | None:
    """(how many, what) values of stored tensor `t` lie outside its format (see SCAN_CHUNK), or None."""
    if t.dtype not in _FLOATS + (torch.float8_e4m3fn, torch.float8_e8m0fnu) or t.numel() == 0:
        return None
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), SCAN_CHUNK):
        c = flat[start:start + SCAN_CHUNK]
        if t.dtype in _FLOATS:
            lo, hi = torch.aminmax(c)
            bad = not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))
        else:
            u = c.view(torch.uint8)
            bad = int(u.max()) == 0xFF or (t.dtype == torch.float8_e4m3fn and int(u.view(torch.int8).max()) == 0x7F)
        if bad:
            break
    else:
        return None
    count = 0
    for start in range(0, flat.numel(), SCAN_CHUNK):
        c = flat[start:start + SCAN_CHUNK]
        if t.dtype in _FLOATS:
            count += int((~torch.isfinite(c)).sum())
        elif t.dtype == torch.float8_e4m3fn:
            count += int(((c.view(torch.uint8) & 0x7F) == 0x7F).sum())
        else:
            count += int((c.view(torch.uint8) == 0xFF).sum())
    what = {torch.float8_e4m3fn: "E4M3 NaN codes (0x7F/0xFF)", torch.float8_e8m0fnu: "UE8M0 NaN scales (0xFF)"}
    return count, what.get(t.dtype, "non-finite values (NaN/inf)")


def check_values(entries: Iterable[TensorEntry], problems: _Problems) -> int:
    """Scan the stored values of `entries` (memory-mapped, tensor by tensor) for `out_of_format` ones;
    each tensor holding some is a problem naming its file (with the checkpoint directory) and tensor.
    Returns the bytes scanned."""
    scanned = 0
    for entry in entries:
        bad = out_of_format(open_tensor(entry))
        scanned += entry.nbytes
        if bad:
            n = math.prod(entry.shape)
            problems.add(f"{entry.file}: tensor {entry.name} holds {bad[0]:,} {bad[1]} of {n:,} values; the data "
                         "behind its header is corrupt")
    return scanned


def _scan_wanted(values: bool | None, entries: Iterable[TensorEntry]) -> bool:
    return values if values is not None else sum(e.nbytes for e in entries) <= LOAD_SCAN_BYTES
