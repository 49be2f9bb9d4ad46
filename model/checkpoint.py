"""Checkpoints on disk: the official Hugging Face layout and our runtime layout (docs/convert.md).

Official layout (what DeepSeek publishes; spec/architecture.md §6)
    `config.json`, `model.safetensors.index.json` ({metadata.total_size, weight_map: name -> shard}),
    shards `model-000NN-of-000MM.safetensors`, tokenizer files. Tensor names are the inference names
    (`layers.{i}.attn.wq_a.weight`, ...). Dense linears are FP8 E4M3 with UE8M0 scales over 32x32
    blocks, routed experts packed E2M1 ("I8", two values per byte, low nibble first) with one UE8M0
    per 32 inputs, the two Engram tables FP8 rows with one UE8M0 per 32 values.

Runtime layout (what `dsv41 convert --to runtime` writes)
    `model{r}-mp{N}.safetensors` for ranks r < N, split by the rules of `NAME_MAP` (those of REF's
    parallel modules), `attn.wo_a` dequantized to bf16 with its block scales (as REF's convert does),
    routed experts in the chosen `--expert-dtype`; `official-scales.safetensors` keeps the dropped
    `wo_a` scales so `--to official` restores the original bytes; `runtime.json` records mp, the
    storage dtypes, each file's size and sha256 (resume verification) and the official shard layout;
    config.json and the tokenizer files are copied unchanged. Every other tensor keeps its stored
    dtype, including the one accepted deviation from the model's dtypes: ViT norm weights stored as
    BF16 (as in the release) instead of F32 (`accepted_dtypes`).

Everything is verified from the safetensors headers before any tensor data is read: a problem is a
`CheckpointError` whose one-line message names the file and the tensor. Then the values (`check_values`:
no NaN/inf, no NaN codes), for checkpoints up to LOAD_SCAN_BYTES on open, for any size with
`verify_checkpoint` (`convert --verify`). Conversion streams: pass-
through tensors (and row/column slices of them) are copied in bounded chunks with `pread`, so a 100 GB
Engram table never has to fit in memory; only tensors that change format (wo_a, converted experts)
are materialized, one at a time. Output goes to `DST.partial/` and is renamed to DST at the end;
finished files are journaled with their sha256, so `--resume` after any interruption (kill -9
included) reuses them and produces the same bytes.

Loading (`load_model`, `load_state_dict`, `load_rank_state`) memory-maps the files: tensors are views
of the page cache, read lazily, tensor by tensor, as the model touches them.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from dsv41.model import formats
from dsv41.model.config import ModelArgs

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MANIFEST_FILE = "runtime.json"
SCALES_FILE = "official-scales.safetensors"
JOURNAL_FILE = ".convert-journal.json"
# small files that travel with the weights; config.json is required, the others are copied when present
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "special_tokens_map.json")
RUNTIME_FORMAT = "dsv41-runtime"
RUNTIME_VERSION = 1
EXPERT_DTYPES = ("fp4", "fp8", "bf16")
CHUNK_BYTES = 32 << 20  # streaming copy granularity: the converter's working buffer
SLOW_ENV = "DSV41_CONVERT_SLOW_S"  # test hook: seconds to sleep after each written tensor
# torch threads while converting: the work is streaming I/O plus small per-tensor format changes, and
# OpenMP threads on a busy machine cost far more than they give (measured: 2 threads 10x slower than 1
# for the FP4 -> FP8 table lookup with other jobs running). Raise it on an idle many-core machine.
THREADS_ENV = "DSV41_CONVERT_THREADS"


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
    slow = float(os.environ.get(SLOW_ENV) or 0)
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
            if slow:
                time.sleep(slow)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def sha256_file(path: Path, reader: _Reader | None = None) -> str:
    reader = reader or _Reader()
    digest = hashlib.sha256()
    for chunk in reader.chunks(path, 0, path.stat().st_size):
        digest.update(chunk)
    return digest.hexdigest()


# ====================================================================================================
# Names: the one table (legacy spellings and model-parallel splits) and the expected inventory
# ====================================================================================================

REPLICATED, ROWS, COLS, ROWS_PADDED, EXPERTS = "replicated", "rows", "cols", "rows-padded", "experts"

# REF-style: a tensor's key is the name component before ".weight"/".scale"/".bias" (for bare
# parameters such as `attn_sink`, the last component); "parent.key" entries override "key".
# Splits follow REF's parallel modules (S0 model.py): ParallelEmbedding / ParallelHead and
# ColumnParallelLinear split dim 0 (ROWS), RowParallelLinear dim 1 (COLS), ParallelEngramEmbedding
# rows in ceil(rows / N) parts with the last zero-padded (ROWS_PADDED). Routed experts go whole to
# the rank owning their index range (EXPERTS, decided by the path, not the key); the vision tower,
# aligner and image_* embeddings, like every key not listed, are replicated. V4.1's shared experts
# are plain Linears in S0 (replicated), unlike V4's column/row-parallel MLP.
#   official key      legacy HF spellings             split across model-parallel ranks
NAME_MAP: dict[str, tuple[tuple[str, ...], str]] = {
    "embed":          (("embed_tokens",),              ROWS),         # vocabulary (also markov_head.embed)
    "head":           (("lm_head",),                   ROWS),         # vocabulary (also markov_head.head)
    "engram.embed":   ((),                             ROWS_PADDED),  # n-gram table rows
    "wq_a":           (("q_a_proj",),                  REPLICATED),
    "q_norm":         (("q_a_layernorm",),             REPLICATED),
    "wq_b":           (("q_b_proj",),                  ROWS),         # query heads (attn and indexer)
    "wkv":            (("kv_a_proj_with_mqa",),        REPLICATED),
    "kv_norm":        (("kv_a_layernorm",),            REPLICATED),
    "wo_a":           ((),                             ROWS),         # output groups
    "wo_b":           (("o_proj",),                    COLS),         # output groups
    "attn_sink":      ((),                             ROWS),         # heads
    "weights_proj":   ((),                             ROWS),         # index heads
    "attn_norm":      (("input_layernorm",),           REPLICATED),
    "ffn_norm":       (("post_attention_layernorm",),  REPLICATED),
    "w1":             (("gate_proj",),                 REPLICATED),
    "w2":             (("down_proj",),                 REPLICATED),
    "w3":             (("up_proj",),                   REPLICATED),
    # path components and suffixes that older HF exports spell differently
    "attn":           (("self_attn",),                 REPLICATED),
    "ffn":            (("mlp",),                       REPLICATED),
    "scale":          (("weight_scale_inv",),          REPLICATED),
    "bias":           (("e_score_correction_bias",),   REPLICATED),
}
_LEGACY = {old: new for new, (olds, _) in NAME_MAP.items() if "." not in new for old in olds}
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def split_of(name: str) -> str:
    """How tensor `name` (official spelling) is split across model-parallel ranks."""
    if _EXPERT.search(name):
        return EXPERTS
    parts = name.split(".")
    if parts[0] in ("vision", "aligner") or parts[0].startswith("image_"):
        return REPLICATED
    if len(parts) >= 2 and parts[-1] in ("weight", "scale", "bias"):
        key, parent = parts[-2], (parts[-3] if len(parts) >= 3 else "")
    else:
        key, parent = parts[-1], parts[-2] if len(parts) >= 2 else ""
    entry = NAME_MAP.get(f"{parent}.{key}") or NAME_MAP.get(key)
    return entry[1] if entry else REPLICATED


def official_name(stored: str, expected: Mapping[str, object]) -> str:
    """The official spelling of a stored name: itself when the model knows it, else the name with the
    legacy spellings of the table replaced (`model.` prefix, `self_attn`, `q_a_proj`, ...)."""
    if stored in expected:
        return stored
    parts = stored.removeprefix("model.").split(".")
    renamed = ".".join(_LEGACY.get(p, p) for p in parts)
    return renamed if renamed in expected else stored


def expected_tensors(args: ModelArgs) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor a checkpoint of `args` holds (in the storage
    dtypes args names: official = FP8 wo_a and FP4 experts; runtime = args with wo_a_dtype="bf16"), as
    the release stores them: the ViT norm weights BF16 (`release_dtype`), everything else in the
    model's dtype. For V4.1-Flash that is the release's 96,085 tensors and 510,286,023,000 bytes
    (`inventory_totals`)."""
    return dict(_inventory(json.dumps(args.to_dict(), sort_keys=True)))


@lru_cache(maxsize=16)
def _inventory(args_json: str) -> tuple:
    from dsv41.model.ledger import parameter_inventory

    args = ModelArgs.from_dict(json.loads(args_json))
    return tuple((name, (tuple(shape), release_dtype(name, st_name(dtype))))
                 for name, shape, dtype in parameter_inventory(args))


def inventory_totals(tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> dict:
    """Tensor and byte counts of (name, shape, safetensors dtype) entries, in total and per dtype (the
    numbers a shard-header tally of a checkpoint gives)."""
    by_dtype: dict[str, dict[str, int]] = {}
    for _, shape, dtype in tensors:
        row = by_dtype.setdefault(dtype, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += math.prod(shape) * itemsize(dtype)
    return {"tensors": sum(r["tensors"] for r in by_dtype.values()),
            "bytes": sum(r["bytes"] for r in by_dtype.values()),
            "by_dtype": dict(sorted(by_dtype.items()))}


# Tensors the release stores in another dtype than the model holds: (pattern, model dtype, release dtype).
# The ViT RMSNorm weights are fp32 Parameters in S0's vision.py (`torch.ones(dim, dtype=torch.float32)`),
# but the release's shard headers store its 65 norm vectors of 1024 (32 blocks x norm1/norm2 + the
# final norm) as BF16 (BF16 520, F32 387 tensors; 133,120 bytes below an all-F32 inventory). S0 loads
# that (load_state_dict copies with conversion), and so do we: the inventory (`expected_tensors`) and
# `save_official` use BF16 for exactly these tensors, F32 is accepted too (checkpoints written before,
# e.g. the bundled dsv41-tiny), `convert` keeps either as stored (so the round trip is byte for byte),
# and both are widened losslessly to F32 when loaded into the model. Every other tensor must have the
# model's dtype.
_RELEASE_DTYPES: tuple[tuple[re.Pattern, str, str], ...] = (
    (re.compile(r"vision\.(?:blocks\.\d+\.norm[12]|norm)\.weight"), "F32", "BF16"),
)


def release_dtype(name: str, dtype: str) -> str:
    """The safetensors dtype the release stores tensor `name` in, when the model holds it as `dtype`."""
    for pattern, model_dtype, stored in _RELEASE_DTYPES:
        if dtype == model_dtype and pattern.fullmatch(name):
            return stored
    return dtype


def model_dtype(name: str, dtype: str) -> str:
    """The dtype the model holds tensor `name` in, when a checkpoint (or the inventory) stores it as
    `dtype` in one of its `accepted_dtypes`."""
    for pattern, held, stored in _RELEASE_DTYPES:
        if dtype in (held, stored) and pattern.fullmatch(name):
            return held
    return dtype


def accepted_dtypes(name: str, dtype: str) -> tuple[str, ...]:
    """The safetensors dtypes a checkpoint may store tensor `name` in, when the inventory says `dtype`
    (the release's dtype first; for the ViT norm weights: BF16, then the model's F32)."""
    for pattern, held, stored in _RELEASE_DTYPES:
        if dtype in (held, stored) and pattern.fullmatch(name):
            return (stored, held)
    return (dtype,)


def to_model_dtypes(state: dict[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], str]]
                    ) -> dict[str, torch.Tensor]:
    """`state` with every tensor stored in an accepted other dtype (BF16 ViT norm weights) widened to
    the model's dtype, losslessly (BF16 -> F32 is exact); everything else untouched (still mapped)."""
    for name, t in state.items():
        if name in expected:
            want = ST_DTYPES[model_dtype(name, expected[name][1])]
            if t.dtype != want and st_name(t.dtype) in accepted_dtypes(name, expected[name][1]):
                state[name] = t.to(want)
    return state


def runtime_args(args: ModelArgs, expert_dtype: str) -> ModelArgs:
    """The ModelArgs of a runtime-layout checkpoint converted from an official one of `args`."""
    return args.replace(wo_a_dtype="bf16", expert_dtype=expert_dtype)


def _weight_name(scale_name: str) -> str:
    return scale_name[: -len("scale")] + "weight"


def _expert_owner(name: str, args: ModelArgs, mp: int) -> int:
    """Rank holding routed expert `name`: experts [r E/N, (r+1) E/N) live on rank r."""
    expert = int(_EXPERT.search(name).group(1))
    head, layer = name.split(".")[:2]
    routed, _ = args.moe_shape(int(layer) + (args.n_layers if head == "mtp" else 0))
    if routed % mp:
        raise CheckpointError(f"cannot split the {routed} routed experts of {head}.{layer} across {mp} ranks")
    return expert // (routed // mp)


@dataclass(frozen=True)
class Part:
    """The part of a full tensor that one rank holds: indices [start, stop) along `dim` (None: all of
    it), followed by `pad` zero rows (the last Engram-table parts)."""

    dim: int | None
    start: int = 0
    stop: int = 0
    pad: int = 0


def rank_part(name: str, shape: tuple[int, ...], tensors: Mapping[str, tuple[tuple[int, ...], str]],
              args: ModelArgs, mp: int, rank: int) -> Part | None:
    """Which part of tensor `name` (full shape `shape`) rank `rank` of `mp` holds; None: none of it.

    A block scale follows its weight: the rank gets the scale rows (columns) of the blocks its weight
    rows (columns) fall in. That needs each rank's weight part to be whole blocks, or to lie inside one
    block (then neighbouring ranks hold a copy of the same scale row)."""
    rule = split_of(name)
    if rule == EXPERTS:
        return Part(None) if _expert_owner(name, args, mp) == rank else None
    if rule == REPLICATED or mp == 1:
        return Part(None)
    dim = 1 if rule == COLS else 0
    is_scale = name.endswith(".scale") and _weight_name(name) in tensors
    if is_scale:
        weight_shape = tensors[_weight_name(name)][0]
        wpart = rank_part(_weight_name(name), weight_shape, tensors, args, mp, rank)
        if wpart.dim is None:
            return Part(None)
        block = 1 if shape[dim] == weight_shape[dim] else args.fp8_block_size
        size = wpart.stop - wpart.start
        if block > 1 and size % block and block % size:
            raise CheckpointError(f"cannot split {_weight_name(name)} {list(weight_shape)} across {mp} ranks: "
                                  f"parts of {size} do not align with its {block}-wide scale blocks")
        start = wpart.start // block
        stop = -(-wpart.stop // block) if wpart.stop > wpart.start else start
        pad = -(-(wpart.stop + wpart.pad) // block) - stop if wpart.pad else 0
        return Part(dim, start, stop, pad)
    if len(shape) <= dim:
        raise CheckpointError(f"cannot split {name} {list(shape)} along dim {dim}")
    size = shape[dim]
    if rule == ROWS_PADDED:
        part = -(-size // mp)
        start = min(rank * part, size)
        stop = min(start + part, size)
        return Part(dim, start, stop, part - (stop - start))
    if size % mp:
        raise CheckpointError(f"cannot split {name} {list(shape)} into {mp} equal parts along dim {dim}")
    part = size // mp
    return Part(dim, rank * part, (rank + 1) * part)


def check_mp(args: ModelArgs, mp: int) -> None:
    """REF's parallel modules need whole heads, output groups, index heads, vocabulary rows and
    experts on every rank."""
    counts = {"n_heads": args.n_heads, "o_groups": args.o_groups, "index_n_heads": args.index_n_heads,
              "vocab_size": args.vocab_size, "n_routed_experts": args.n_routed_experts}
    if args.dspark_enabled:
        counts["dspark_n_routed_experts"] = args.dspark_n_routed_experts
    for key, value in counts.items():
        if value % mp:
            raise CheckpointError(f"--mp {mp} does not divide {key} = {value}; choose an mp that divides "
                                  f"{', '.join(f'{k} {v}' for k, v in counts.items())}")


def part_shape(shape: tuple[int, ...], part: Part) -> tuple[int, ...]:
    if part.dim is None:
        return tuple(shape)
    out = list(shape)
    out[part.dim] = part.stop - part.start + part.pad
    return tuple(out)


def rank_tensors(full: Mapping[str, tuple[tuple[int, ...], str]], args: ModelArgs, mp: int,
                 rank: int) -> dict[str, tuple[tuple[int, ...], str, Part]]:
    """name -> (shape, dtype, part) of what rank `rank` holds of the full (runtime-dtype) tensors."""
    out = {}
    for name, (shape, dtype) in full.items():
        part = rank_part(name, shape, full, args, mp, rank)
        if part is not None:
            out[name] = (part_shape(shape, part), dtype, part)
    return out


def _file_order(names: Iterable[str], dtypes: Mapping[str, str]) -> list[str]:
    """Wider dtypes first (keeps every tensor aligned to its element size), then model order."""
    names = list(names)
    rank = {n: i for i, n in enumerate(names)}
    return sorted(names, key=lambda n: (-itemsize(dtypes[n]), rank[n]))


# ====================================================================================================
# The official layout
# ====================================================================================================


def _read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"missing {path.name} in {path.parent} ({what})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path.name}: expected a JSON object")
    return doc


def load_args(path: str | os.PathLike) -> ModelArgs:
    """ModelArgs of a checkpoint directory (either layout): config.json, plus for the runtime layout
    the storage dtypes from runtime.json."""
    from dsv41.model.config import load_config

    path = Path(path)
    try:
        args = load_config(path)
    except FileNotFoundError:
        raise CheckpointError(f"missing config.json in {path}") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"config.json: {e}") from None
    if (path / MANIFEST_FILE).is_file():
        manifest = _read_manifest(path)
        args = runtime_args(args, manifest["expert_dtype"])
    return args


def detect_layout(path: str | os.PathLike) -> str:
    """'runtime' (runtime.json present) or 'official' (an index, or a single model.safetensors)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / MANIFEST_FILE).is_file():
        return "runtime"
    if (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file():
        return "official"
    raise CheckpointError(f"{path} holds neither {INDEX_FILE} (official layout) nor {MANIFEST_FILE} (runtime layout)")


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


def _check_against_config(found: Mapping[str, TensorEntry], expected: Mapping[str, tuple[tuple[int, ...], str]],
                          problems: _Problems, where: str = "config.json", container: str = "the checkpoint") -> None:
    for name, entry in found.items():
        if name not in expected:
            problems.add(f"{entry.file.name} holds tensor {entry.name}, which is not part of the model {where} "
                         "describes")
            continue
        shape, dtype = expected[name]
        if entry.shape != shape:
            problems.add(f"{entry.file.name}: tensor {entry.name} has shape {list(entry.shape)}, {where} implies "
                         f"{list(shape)}")
        elif entry.dtype not in accepted_dtypes(name, dtype):
            problems.add(f"{entry.file.name}: tensor {entry.name} is {entry.dtype}, {where} implies "
                         f"{' or '.join(accepted_dtypes(name, dtype))}")
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        problems.add(f"{container} lacks tensor {missing[0]}{more} (required by {where})")


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


# ====================================================================================================
# The runtime layout
# ====================================================================================================


def rank_file(rank: int, mp: int) -> str:
    return f"model{rank}-mp{mp}.safetensors"


def _read_manifest(path: Path) -> dict:
    manifest = _read_json(path / MANIFEST_FILE, "the runtime-layout manifest")
    if manifest.get("format") != RUNTIME_FORMAT:
        raise CheckpointError(f"{MANIFEST_FILE}: format is {manifest.get('format')!r}, expected {RUNTIME_FORMAT!r}")
    if manifest.get("version") != RUNTIME_VERSION:
        raise CheckpointError(f"{MANIFEST_FILE}: version {manifest.get('version')} is not supported "
                              f"(this toolkit reads version {RUNTIME_VERSION})")
    mp = manifest.get("mp")
    if not isinstance(mp, int) or mp < 1:
        raise CheckpointError(f"{MANIFEST_FILE}: mp must be a positive integer, not {mp!r}")
    if manifest.get("expert_dtype") not in EXPERT_DTYPES:
        raise CheckpointError(f"{MANIFEST_FILE}: expert_dtype must be one of {', '.join(EXPERT_DTYPES)}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{MANIFEST_FILE}: no files table")
    return manifest


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


# ====================================================================================================
# Conversion plans
# ====================================================================================================


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


def _write_json(path: Path, doc: dict) -> None:
    """Deterministic JSON (sorted keys), written to a temporary name and renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ====================================================================================================
# Running a plan: atomic, resumable
# ====================================================================================================


def partial_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ".partial")


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


# ====================================================================================================
# Loading
# ====================================================================================================


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
    with torch.device("meta"):
        model = Transformer(args, tokenizer=tokenizer)
    check_state_matches(model, state, f"{path}: the checkpoint")
    return fill_meta_model(model, state, device), args, tokenizer


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
