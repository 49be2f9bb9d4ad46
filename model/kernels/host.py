"""Host kernels: the CPU decode step's operator-bound pieces as one C call each (host_kernels.c).

On the CPU a decode step of a small model spends its time launching torch operators (a few microseconds
each), not computing: the 20 Sinkhorn iterations of one mHC step are about 120 operators on a 4 x 4 matrix
per token, one FP8 activation quantization about 14. The C functions do the same fp32 operations in the
same order as their references (reference._sinkhorn_normalize_, formats.fp8_fake_quant_f32,
reference.collapse and expand, layers.rope_tail, reference.head_logits, the KV cache's packers and unpackers
of formats.py, reference.rms_norm), so they give the same bits (tests/test_host_kernels.py, on every CPU
flavour CI runs). RMSNorm's statistic is a torch reduction: its C sum walks ATen's own order (SumKernel.cpp's
cascade over 8-lane vectors, which torch 2.13 runs at every x86-64 capability), checked at every row length.

The GEMMs of inference are the kernels here that are about arithmetic, not operator counts. The output head
(the vocabulary-sized GEMM was a third of a one-sequence decode step) and every other GEMM of CPU inference
(`fixed_order_linear`: the linear layers, the router, the mHC projection, the grouped `wo_a`) sum each
output in a fixed order, so a row's outputs are the same whatever rows are computed with it: a decode step
computes its rows in use only, where MKL's GEMM needed the step padded to 16 rows to give a row the same bits
in any batch (model/batch_cache.py). One function, `fixed_order_matmul`, with AVX-512, AVX2 and baseline
versions (the lanes never meet: the same bits), the widest the CPU runs picked at the first call
(`head_isa`). Unlike the other kernels, `fixed_order_linear` has no torch fallback of the same bits where the
library is missing: the torch loop of its reference (`reference.fixed_order_matmul`) is K operators per
GEMM, so without the library the model keeps MKL's GEMMs (and the padding rows).

The C file is compiled on first use with the system's C compiler (`cc`, or $CC) into a per-user cache
(`$DSV41_CACHE_DIR`, default ~/.cache/dsv41) under a name that hashes the source and the flags, and loaded
with ctypes: no build step at install, no torch headers, 0.37 s of compiling once (2 cores, gcc 12). Where there is
no compiler, or DSV41_HOST_KERNELS=0, `library()` is None and every caller takes its torch reference (the
same numbers, slower); `status()` says which and why (`dsv41 info --json` does not depend on it).

Callers dispatch only for contiguous CPU tensors of the dtypes each wrapper names, with no gradient wanted
(`takes`); the wrappers assume it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from dsv41.model import formats

SOURCE = Path(__file__).with_name("host_kernels.c")
# no -march: the baseline ISA of the machine's compiler target, so the code and its numbers are the same on
# every CPU; no fused multiply-add, no fast-math: each operation rounds as the torch reference's does
CFLAGS = ["-O2", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math",
          "-fno-strict-aliasing"]

_STATUS: list[str] = ["not loaded yet"]


def _cache_dir() -> Path:
    root = os.environ.get("DSV41_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "dsv41"


def _build(cc: str) -> Path:
    """Compile SOURCE into the cache (atomically: a concurrent process sees the old file or the new one)."""
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *CFLAGS, platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / "host-kernels" / f"host_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded C library, or None (no compiler, a failed build, or DSV41_HOST_KERNELS=0; `status()`)."""
    if os.environ.get("DSV41_HOST_KERNELS", "1") == "0":
        _STATUS[0] = "disabled (DSV41_HOST_KERNELS=0)"
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        _STATUS[0] = "no C compiler (cc or $CC): the torch references run"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _STATUS[0] = f"build failed ({type(e).__name__}: {detail.decode(errors='replace')[:200] or e})"
        return None
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.dsv41_sinkhorn_normalize.argtypes = [ptr, i64, i64, i64, f32]
    lib.dsv41_sinkhorn_normalize.restype = None
    lib.dsv41_sinkhorn_normalize_version.argtypes = [ctypes.c_int, ptr, i64, i64, i64, f32]
    lib.dsv41_sinkhorn_normalize_version.restype = None
    lib.dsv41_fp8_fake_quant.argtypes = [ptr, ptr, i64, i64, f32, f32]
    lib.dsv41_fp8_fake_quant.restype = None
    lib.dsv41_mhc_collapse.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.dsv41_mhc_collapse.restype = None
    lib.dsv41_mhc_expand.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.dsv41_mhc_expand.restype = None
    lib.dsv41_rope_tail.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.dsv41_rope_tail.restype = None
    lib.dsv41_fixed_order_matmul.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64]
    lib.dsv41_fixed_order_matmul.restype = None
    lib.dsv41_fp8_linear.argtypes = [ptr, ctypes.c_int, i64, i64, i64, f32, f32, ptr, i64, ptr, ptr, i64, ptr,
                                     ctypes.c_int]
    lib.dsv41_fp8_linear.restype = ctypes.c_int
    for name in HEAD_VERSIONS.values():
        if hasattr(lib, name):  # the AVX versions exist on x86-64 only
            getattr(lib, name).argtypes = [ptr, i64, i64, ptr, i64, ptr]
            getattr(lib, name).restype = None
    lib.dsv41_head_isa.restype = ctypes.c_int
    for name in ("dsv41_head_bf16", "dsv41_head_bf16_two", "dsv41_head_logits_two", *HEAD_BF16_VERSIONS.values()):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ptr, i64, i64, ptr, i64, ptr]
            getattr(lib, name).restype = None
    for name in ("dsv41_score_logits", *SCORE_VERSIONS.values()):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
            getattr(lib, name).restype = None
    lib.dsv41_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    lib.dsv41_fp8_linear_grouped.argtypes = [ptr, ctypes.c_int, i64, i64, f32, f32, i64, ptr, ptr, i64, ptr, ptr,
                                             i64, ptr, ctypes.c_int]
    lib.dsv41_fp8_linear_grouped.restype = ctypes.c_int
    lib.dsv41_argmax_rows.restype = None
    lib.dsv41_pack_fp8_ue8m0.argtypes = [ptr, ctypes.c_int, i64, i64, f32, f32, ptr, ptr]
    lib.dsv41_pack_fp8_ue8m0.restype = None
    lib.dsv41_mxfp4.argtypes = [ptr, ctypes.c_int, i64, i64, f32, f32, ptr, ctypes.c_int, ptr, ptr, ptr]
    lib.dsv41_mxfp4.restype = None
    lib.dsv41_pack_fp4_e4m3.argtypes = [ptr, ctypes.c_int, i64, i64, f32, ptr, ptr, ptr]
    lib.dsv41_pack_fp4_e4m3.restype = None
    lib.dsv41_unpack.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ptr]
    lib.dsv41_unpack.restype = None
    for name in ("dsv41_sigmoid_scalar", "dsv41_softplus_scalar"):
        getattr(lib, name).argtypes = [ptr, ptr, i64]
        getattr(lib, name).restype = None
    lib.dsv41_attention_inputs.argtypes = [ptr, ctypes.c_int, i64, i64, i64, f32, f32, ptr, i64, ptr, ctypes.c_int,
                                           f32, ptr, i64, i64, ptr, ptr, ctypes.c_int, f32, ptr, i64, ctypes.c_int,
                                           ptr, ptr, ptr]
    lib.dsv41_attention_inputs.restype = ctypes.c_int
    lib.dsv41_attention_output.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ctypes.c_int, i64, ptr, i64,
                                           i64, f32, f32, ptr, i64, ptr]
    lib.dsv41_attention_output.restype = ctypes.c_int
    lib.dsv41_indexer_decode.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, i64,
                                         i64, i64, ptr, ptr]
    lib.dsv41_indexer_decode.restype = ctypes.c_int
    lib.dsv41_engram_dot.argtypes = [ptr, ctypes.c_int, ptr, ctypes.c_int, i64, i64, i64, ptr, ctypes.c_int, ptr,
                                     ctypes.c_int, f32, f32, f32, ptr, ptr]
    lib.dsv41_engram_dot.restype = ctypes.c_int
    lib.dsv41_engram_mix.argtypes = [ptr, ctypes.c_int, ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ptr]
    lib.dsv41_engram_mix.restype = None
    lib.dsv41_gate_softplus.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, i64, ctypes.c_int, f32, ptr]
    lib.dsv41_gate_softplus.restype = ctypes.c_int
    lib.dsv41_route_pick.argtypes = [ptr, i64, i64, ptr, i64, i64, ctypes.c_int, f32, ptr, ptr]
    lib.dsv41_route_pick.restype = ctypes.c_int
    lib.dsv41_rms_rstd.argtypes = [ptr, ctypes.c_int, i64, i64, f32, ptr]
    lib.dsv41_rms_rstd.restype = ctypes.c_int
    lib.dsv41_rms_norm.argtypes = [ptr, ctypes.c_int, ptr, ctypes.c_int, i64, i64, f32, ptr]
    lib.dsv41_rms_norm.restype = ctypes.c_int
    lib.dsv41_sparse_attention.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64,
                                           ptr, ptr, i64, i64, ptr, i64, ptr, f32, ptr]
    lib.dsv41_sparse_attention.restype = ctypes.c_int
    lib.dsv41_sparse_attention_version.argtypes = [ctypes.c_int, *lib.dsv41_sparse_attention.argtypes]
    lib.dsv41_sparse_attention_version.restype = ctypes.c_int
    lib.dsv41_mhc_step.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ptr, f32, f32, ptr,
                                   ptr, ptr, ptr, ptr]
    lib.dsv41_mhc_step.restype = ctypes.c_int
    lib.dsv41_put_rows.argtypes = [ptr, i64, i64, ptr, ptr, i64]
    lib.dsv41_put_rows.restype = ctypes.c_int
    lib.dsv41_moe_up.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, f32, f32, ptr, i64, ptr, ptr, ptr, ptr,
                                 i64, f32, ptr, ptr, ptr]
    lib.dsv41_moe_up.restype = ctypes.c_int
    lib.dsv41_moe_down.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, ptr, i64, ptr, ptr, i64,
                                   ctypes.c_int, ptr]
    lib.dsv41_moe_down.restype = ctypes.c_int
    _STATUS[0] = "loaded"
    return lib


def available() -> bool:
    return library() is not None


def status() -> str:
    library()
    return _STATUS[0]


# ATen sums a row or column of up to 4 elements left to right, as the C loop does (every CPU flavour; tested);
# longer ones it may split into partial sums, so larger stream counts keep the torch loop (V4.1 uses n = 4).
SINKHORN_MAX_N = 4


def sinkhorn_normalize_(comb: torch.Tensor, iters: int, eps: float, version: str | None = None) -> torch.Tensor:
    """reference._sinkhorn_normalize_ in place on a contiguous fp32 CPU comb [..., n, n]; returns comb. version:
    "base", "avx2" or "avx512" as in head_logits, for the tests (4 x 4 matrices go in vector lanes, one matrix a
    lane; the same bits in each); default the widest the CPU runs."""
    if not comb.is_contiguous() or comb.dtype != torch.float32:  # the C loop walks the memory as [-1, n, n] fp32
        raise ValueError("host.sinkhorn_normalize_ needs a contiguous fp32 comb")
    n = comb.shape[-1]
    isa = -1 if version is None else ["base", "avx2", "avx512"].index(version)
    library().dsv41_sinkhorn_normalize_version(isa, comb.data_ptr(), comb.numel() // (n * n), n, iters, eps)
    return comb


def fp8_fake_quant_f32(x: torch.Tensor, block: int = formats.FP8_BLOCK) -> torch.Tensor:
    """formats.fp8_fake_quant_f32 of a bf16 or fp32 CPU x whose last dim is a multiple of block."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    library().dsv41_fp8_fake_quant(x.data_ptr(), out.data_ptr(), x.numel(), block, formats.FP8_AMAX_FLOOR,
                                   formats._FP8_RATIO)
    return out


# The mHC mixes and RoPE take bf16 or fp32 tensors; other dtypes (and non-contiguous inputs) stay with the
# references, which the callers check with `takes`.
_FLOATS = (torch.bfloat16, torch.float32)


def takes(*tensors: torch.Tensor) -> bool:
    """True when these tensors can go to a host kernel: the library loaded, every tensor a contiguous bf16 or
    fp32 CPU tensor, and no gradient wanted (the kernels record nothing for autograd)."""
    if library() is None or torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not all() over a generator: asked about 150 times a decode step
        if t.dtype not in _FLOATS or t.is_cuda or not t.is_contiguous():
            return False
    return True


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """reference.collapse: x [..., n, d] (bf16/fp32), pre [..., n] fp32 -> [..., d] in x's dtype."""
    *lead, n, d = x.shape
    out = x.new_empty(*lead, d)
    library().dsv41_mhc_collapse(x.data_ptr(), pre.data_ptr(), out.data_ptr(), x.numel() // (n * d), n, d,
                                 x.dtype == torch.bfloat16)
    return out


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """reference.expand: y [..., d], residual [..., n, d], post [..., n], comb [..., n, n] fp32 -> [..., n, d]
    in y's dtype."""
    *lead, n, d = residual.shape
    out = y.new_empty(*lead, n, d)
    library().dsv41_mhc_expand(y.data_ptr(), residual.data_ptr(), post.data_ptr(), comb.data_ptr(), out.data_ptr(),
                               residual.numel() // (n * d), n, d, y.dtype == torch.bfloat16,
                               residual.dtype == torch.bfloat16)
    return out


def rope_fits(x: torch.Tensor, freqs: torch.Tensor) -> bool:
    """x [B, T, D] or [B, T, H, D] with complex64 freqs [T, r/2] or [B, T, r/2], contiguous: the shapes
    rope_tail walks (layers.apply_rope also broadcasts a [1, T, r/2] table; that stays with it)."""
    fshape = freqs.shape
    return (freqs.dtype == torch.complex64 and freqs.is_contiguous() and not freqs.is_conj()
            and x.dim() in (3, 4) and fshape[-2] == x.shape[1]
            and (len(fshape) == 2 or len(fshape) == 3 and fshape[0] == x.shape[0]))


def rope_tail(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """layers.rope_tail for a contiguous bf16/fp32 x [B, T, D] or [B, T, H, D] and complex64 freqs [T, r/2]
    or [B, T, r/2] (contiguous)."""
    shape = x.shape
    B, T, D = shape[0], shape[1], shape[-1]
    H = shape[2] if len(shape) == 4 else 1
    out = torch.empty_like(x)
    per_row = freqs.dim() == 3
    library().dsv41_rope_tail(x.data_ptr(), out.data_ptr(), freqs.data_ptr(), B, T, H, D, rope_dim, per_row,
                              inverse, x.dtype == torch.bfloat16)
    return out


# host_kernels.c's versions of the head by instruction set, the value dsv41_head_isa returns for each
HEAD_VERSIONS = {0: "dsv41_head_logits_base", 1: "dsv41_head_logits_avx2", 2: "dsv41_head_logits_avx512"}


def head_isa() -> str:
    """The head version this CPU runs: "avx512", "avx2" or "base"."""
    return HEAD_VERSIONS[library().dsv41_head_isa()].rsplit("_", 1)[-1]


def head_logits(x: torch.Tensor, wt: torch.Tensor, version: str | None = None, threads: int | None = None
                ) -> torch.Tensor:
    """reference.head_logits: x [R, K] fp32 contiguous, wt [K, V] fp32 contiguous (CPU) -> [R, V] fp32.
    version: "base", "avx2" or "avx512" to run that one (the tests; the CPU must have it), else the CPU's.
    threads: 2 splits the columns between this thread and one more (the same bits); default head_threads()."""
    if version is None and not _split(threads):
        return fixed_order_matmul(x, wt)
    R, K = x.shape
    V = wt.size(1)
    out = torch.empty(R, V, dtype=torch.float32)
    fn = getattr(library(), "dsv41_head_logits_two" if version is None else f"dsv41_head_logits_{version}")
    fn(x.data_ptr(), R, K, wt.data_ptr(), V, out.data_ptr())
    return out


# A second core for the head (dsv41_head_logits_two, dsv41_head_bf16_two), per calling thread: the scheduler lends
# it for a CPU decode step while its prefill thread, whose core it is, has no prompt (engine.Scheduler._decode).
# The head is the one piece of the step that is a single large product (129,280 columns on the bundled model), so
# the one worth a thread's start (tens of microseconds) there.
_HELPER = threading.local()


def head_threads() -> int:
    """The threads the head may use on the calling thread: 2 inside helper_core(True), else 1."""
    return getattr(_HELPER, "threads", 1)


def _split(threads: int | None) -> bool:
    """Whether the head splits its columns: `threads` when given, else head_threads()."""
    return (threads or head_threads()) >= 2


@contextlib.contextmanager
def helper_core(on: bool):
    """Within it, the head on the calling thread runs on two threads when `on` (the caller knows a second core
    idles) and torch runs one intra-op thread (as the CLI sets it for small models: docs/architecture.md), unless
    DSV41_HEAD_HELPER=0. With more intra-op threads torch's OpenMP workers keep spinning on the other cores
    between operators, and a helper thread there made the step slower (96 against 100 tokens/s for one sequence
    of the bundled model; docs/performance.md, `cpu-head-helper`)."""
    before = head_threads()
    lend = on and torch.get_num_threads() == 1 and os.environ.get("DSV41_HEAD_HELPER", "1") != "0"
    _HELPER.threads = 2 if lend else 1
    try:
        yield
    finally:
        _HELPER.threads = before


# The head for a few rows from its bf16 weight in column blocks of HEAD_VB (host_kernels.c, dsv41_head_bf16): one
# sequence's decode step is one row, bound by reading the vocabulary-sized weight, which this reads at half the
# fp32 copy's bytes and as one stream per block. Up to head_bf16_max_rows() rows, by the ISA the CPU runs: on this
# project's 2-core AVX-512 CPU (bundled model, 129,280 x 64) 0.32 against 0.80 ms for one row, 2.24 against 2.56 ms
# for 16, 4.74 against 4.03 ms for 32, where the fp32 kernel's register tile, bound by arithmetic, no longer waits on
# the bytes and the widening costs more than it saves: 16 rows. On a 2-core AVX2 EPYC, with AVX2's 4-row tiles
# (2026-12-06), 5.71 against 7.82 ms for 16 rows and 10.42 against 14.32 ms for 32 (cpu-head-avx2): 32 rows. The
# same sums in the same order: the same bits.
HEAD_VB = 64
HEAD_BF16_MAX_ROWS = {"avx512": 16, "avx2": 32, "base": 16}
HEAD_BF16_VERSIONS = {0: "dsv41_head_bf16_base", 1: "dsv41_head_bf16_avx2", 2: "dsv41_head_bf16_avx512"}
_HEAD_BLOCKS = WeakTensorKeyDictionary()


@functools.cache
def head_bf16_max_rows() -> int:
    """The most rows the head takes from the bf16 blocks on this CPU (HEAD_BF16_MAX_ROWS by head_isa())."""
    return HEAD_BF16_MAX_ROWS[head_isa()]


def head_blocks(w: torch.Tensor) -> torch.Tensor:
    """The bf16 head weight w [V, K] as dsv41_head_bf16 reads it: [ceil(V / HEAD_VB), K, HEAD_VB], column block b
    holding columns b * HEAD_VB .. of w^T, zeros past V; kept while w lives and is unchanged (`_kept`)."""
    def make():
        V, K = w.shape
        blocks = -(-V // HEAD_VB)
        padded = torch.zeros(blocks * HEAD_VB, K, dtype=torch.bfloat16)
        padded[:V] = w.detach()
        return padded.view(blocks, HEAD_VB, K).transpose(1, 2).contiguous()

    return _kept(_HEAD_BLOCKS, w, None, make)


def head_logits_bf16(x: torch.Tensor, blocks: torch.Tensor, V: int, version: str | None = None,
                     threads: int | None = None) -> torch.Tensor:
    """reference.head_logits(x, w.float().t()) for the bf16 head weight w [V, K] given as head_blocks(w): x [R, K]
    fp32 contiguous -> [R, V] fp32, the same bits. version and threads as in head_logits."""
    R, K = x.shape
    out = torch.empty(R, V, dtype=torch.float32)
    if version is None:
        fn = getattr(library(), "dsv41_head_bf16_two" if _split(threads) else "dsv41_head_bf16")
    else:
        fn = getattr(library(), f"dsv41_head_bf16_{version}")
    fn(x.data_ptr(), R, K, blocks.data_ptr(), V, out.data_ptr())
    return out


# host_kernels.c's versions of the scoring pass, as HEAD_VERSIONS
SCORE_VERSIONS = {0: "dsv41_score_logits_base", 1: "dsv41_score_logits_avx2", 2: "dsv41_score_logits_avx512"}


def score_logits(logits: torch.Tensor, targets: torch.Tensor, version: str | None = None):
    """reference.score_logits: fp32 logits [R, V] (rows contiguous, possibly strided) and int64 targets [R] in
    0..V-1 -> (ln p(target) fp32 [R], log-sum-exp fp32 [R], argmax int64 [R]), one C call. version as in
    head_logits."""
    R, V = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or logits.is_cuda:
        raise ValueError("host.score_logits needs fp32 CPU logits with contiguous rows")
    targets = targets.to(torch.int64).contiguous()
    logprob, lse = torch.empty(R, dtype=torch.float32), torch.empty(R, dtype=torch.float32)
    argmax = torch.empty(R, dtype=torch.int64)
    fn = getattr(library(), "dsv41_score_logits" if version is None else f"dsv41_score_logits_{version}")
    fn(logits.data_ptr(), R, V, logits.stride(0), targets.data_ptr(), logprob.data_ptr(), lse.data_ptr(),
       argmax.data_ptr())
    return logprob, lse, argmax


def argmax_rows(logits: torch.Tensor, count_nonfinite: bool = False):
    """logits.argmax(-1) of fp32 CPU logits [R, V] with contiguous rows, int64 [R], in one C call (torch's answer:
    the first index of the maximum, of the first NaN when there is one): greedy decoding's pick (engine.greedy_ids),
    one vector pass a row where torch's argmax took 2.5-4.5 ms for 16-32 rows of V4.1's vocabulary.
    count_nonfinite: also the number of rows holding a NaN or an inf, from the same pass -> (argmax, rows)."""
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64)
    bad = ctypes.c_int64(0)
    library().dsv41_argmax_rows(logits.data_ptr(), R, V, logits.stride(0), out.data_ptr(),
                                ctypes.addressof(bad) if count_nonfinite else None)
    return (out, bad.value) if count_nonfinite else out


def fixed_order_matmul(x: torch.Tensor, wt: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """reference.fixed_order_matmul: x [M, K] fp32 CPU, each row contiguous (rows may be strided: a group's
    columns of a wider tensor), wt [K, N] fp32 contiguous -> [M, N] fp32, written into `out` when given (rows
    contiguous, possibly strided: a group's columns of the output)."""
    M, K = x.shape
    N = wt.size(1)
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    library().dsv41_fixed_order_matmul(x.data_ptr(), M, K, x.stride(0), wt.data_ptr(), N, out.data_ptr(),
                                       out.stride(0))
    return out


def fixed_order_rows(x: torch.Tensor, wt: torch.Tensor, wt_ptr: int | None = None) -> torch.Tensor:
    """fixed_order_matmul of a contiguous fp32 CPU x [..., K] -> [..., N] fp32, with the fewest torch calls (the
    decode step's linear layers, about 180 a step on the bundled model, which keep wt's address)."""
    shape = x.shape
    K, N = shape[-1], wt.size(1)
    out = torch.empty(*shape[:-1], N, dtype=torch.float32)
    library().dsv41_fixed_order_matmul(x.data_ptr(), math.prod(shape[:-1]), K, K,
                                       wt.data_ptr() if wt_ptr is None else wt_ptr, N, out.data_ptr(), N)
    return out


def fp8_linear(x: torch.Tensor, block: int, wt: torch.Tensor, wt_ptr: int | None = None,
               dtype: torch.dtype | None = None, wt_b: torch.Tensor | None = None, wt_b_ptr: int | None = None):
    """fixed_order_rows(fp8_fake_quant_f32(x, block), wt).to(dtype) in one C call: a contiguous bf16 or fp32 CPU
    x [..., K] (K a multiple of block) -> [..., N] in `dtype` (bf16 or fp32; default x's), the same bits (a
    NaN's payload aside). The decode step's linear layers (Linear.forward's host path). With wt_b, the pair
    (x wt, x wt_b) from one quantization of x (layers.linear_pair)."""
    shape = x.shape
    lead, K, N = shape[:-1], shape[-1], wt.size(1)
    dtype = dtype or x.dtype
    out = torch.empty(*lead, N, dtype=dtype)
    Nb = 0 if wt_b is None else wt_b.size(1)
    out_b = None if wt_b is None else torch.empty(*lead, Nb, dtype=dtype)
    if library().dsv41_fp8_linear(x.data_ptr(), x.dtype == torch.bfloat16, math.prod(lead), K, block,
                                  formats.FP8_AMAX_FLOOR, formats._FP8_RATIO,
                                  wt.data_ptr() if wt_ptr is None else wt_ptr, N, out.data_ptr(),
                                  None if wt_b is None else (wt_b.data_ptr() if wt_b_ptr is None else wt_b_ptr), Nb,
                                  None if out_b is None else out_b.data_ptr(), dtype == torch.bfloat16):
        raise MemoryError(f"fp8_linear: no scratch memory for {tuple(shape)} x [{K}, {N}]")
    return out if wt_b is None else (out, out_b)


def fp8_linear_grouped(x: torch.Tensor, block: int, counts: list[int], wt_ptrs: list[int], N: int,
                       wt_b_ptrs: list[int] | None = None, Nb: int = 0, dtype: torch.dtype | None = None):
    """fp8_linear over consecutive groups of x's rows, one C call: x [R, K] contiguous (bf16 or fp32, K a multiple
    of block), group g its next counts[g] rows times the transposed fp32 weight at address wt_ptrs[g] ([K, N],
    kept alive by its owner: Linear's cache) -> [R, N] in `dtype` (default x's); with wt_b_ptrs the pair, as
    fp8_linear. Each group's rows get the bits of an fp8_linear call on them alone (MoE.routed's host path)."""
    R, K = x.shape
    if sum(counts) != R or len(counts) != len(wt_ptrs) or (wt_b_ptrs is not None and len(wt_b_ptrs) != len(counts)):
        raise ValueError("fp8_linear_grouped: one weight (pair) per group and the groups' rows summing to x's")
    dtype = dtype or x.dtype
    G = len(counts)
    out = torch.empty(R, N, dtype=dtype)
    out_b = None if wt_b_ptrs is None else torch.empty(R, Nb, dtype=dtype)
    pointers = ctypes.c_void_p * G
    if library().dsv41_fp8_linear_grouped(
            x.data_ptr(), x.dtype == torch.bfloat16, K, block, formats.FP8_AMAX_FLOOR, formats._FP8_RATIO, G,
            (ctypes.c_int64 * G)(*counts), pointers(*wt_ptrs), N, out.data_ptr(),
            None if wt_b_ptrs is None else pointers(*wt_b_ptrs), Nb, None if out_b is None else out_b.data_ptr(),
            dtype == torch.bfloat16):
        raise MemoryError(f"fp8_linear_grouped: no scratch memory for {tuple(x.shape)} x [{K}, {N}]")
    return out if wt_b_ptrs is None else (out, out_b)


_TRANSPOSED = WeakTensorKeyDictionary()


def transposed(w: torch.Tensor, groups: int | None = None) -> torch.Tensor:
    """w [N, K] (any float dtype, CPU) widened to fp32 and transposed, contiguous [K, N]: fixed_order_matmul's
    wt; with `groups`, each group of N / groups rows transposed apart, [groups, K, N / groups]. Kept while w
    lives and is unchanged (its version and address), so a layer's weight is transposed once, not per call."""
    def make():
        wt = w.detach().float().reshape(groups or 1, -1, w.size(-1)).transpose(1, 2).contiguous()
        return wt if groups else wt[0]

    return _kept(_TRANSPOSED, w, groups, make)


def _kept(store: WeakTensorKeyDictionary, w: torch.Tensor, extra, make):
    """make() of weight w, kept in `store` while w lives and is unchanged (its version, address and shape, and
    `extra`) and made again when it changed; an ordinary tensor, usable in and out of inference. (An inference
    tensor keeps no version: a weight made under inference_mode is taken as fixed.)"""
    key = (-1 if w.is_inference() else w._version, w.data_ptr(), tuple(w.shape), extra)
    hit = store.get(w)
    if hit is None or hit[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            hit = (key, make())
        store[w] = hit
    return hit[1]


_WIDENED = WeakTensorKeyDictionary()


def widened(w: torch.Tensor) -> torch.Tensor:
    """w.float(), kept while w lives and is unchanged when no gradient flows to w: the router's weight on CUDA,
    widened once instead of copied (a launch and the whole matrix written) at every step."""
    if w.dtype == torch.float32 or (torch.is_grad_enabled() and w.requires_grad):
        return w.float()
    return _kept(_WIDENED, w, None, lambda: w.detach().float())


def fixed_order_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether fixed_order_linear sums x w^T in its fixed order: a CPU x, the C library loaded, and no graph to
    record through x or w (inference)."""
    return (x.device.type == "cpu" and available()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


# Off the CPU, a BLAS's fp32 GEMM sums a row in an order it picks by the matrix's row count: cuBLAS runs one row as
# a GEMV. Measured on an H100 (2026-12-07, benchmarks/results/h100-2026-12-07): in the first layer the router's
# scores of one request of 32 came out an ulp apart alone and in a batch; that moved a routing weight, and through
# the layers after it the row's logits by up to 0.52 and one greedy token of 768. With FIXED_ROWS set, a decode
# step's fp32 GEMMs there (the router's scores, the compressor's projections: `fixed_rows`) run on a multiple of
# FIXED_ROWS rows, the rows in use and then zero rows: for any batch of up to FIXED_ROWS rows the same GEMM, whose
# sums for a row read that row only. None (the default): the rows in use only. Off until a GPU run measures what
# it costs in the decode step and that the rows then come out equal (`device_batch.sh` STEPS=ab with
# VARIANTS="default;host.FIXED_ROWS=64", and tests/test_batch_engine.py -m gpu); the CPU tests its GEMM
# (tests/test_host_kernels.py, on MKL, which also sums one row as a GEMV).
FIXED_ROWS: int | None = None


def padded_linear(x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """F.linear(x, w) in fp32 with x's rows (all its dimensions but the last, flattened) padded with zero rows to a
    multiple of `rows`, whose outputs are dropped: each row's sums by the GEMM of the padded row count."""
    lead, K = x.shape[:-1], x.size(-1)
    x2 = x.reshape(-1, K).float()
    M = x2.size(0)
    y = F.linear(F.pad(x2, (0, 0, 0, -M % rows)), widened(w))
    return y[:M].view(*lead, w.size(0))


def fixed_order_linear(x: torch.Tensor, w: torch.Tensor, fixed_rows: bool = False) -> torch.Tensor:
    """F.linear(x, w) in fp32, for inference on the CPU with each output summed over the input in a fixed order
    (reference.fixed_order_matmul; fixed_order_matmul above in C): a row's outputs depend neither on how many
    rows are computed with it nor on the CPU's vector width, where MKL's fp32 GEMM changes its summation
    order with the row count (one row is a GEMV). So a decode step computes only its rows in use and each row
    gets the numbers it gets alone (model/batch_cache.py). w [N, K] in any float dtype (widened and transposed
    once: `transposed`). Elsewhere (CUDA, a graph to record, no C library) it is F.linear in fp32; with
    `fixed_rows` (a decode step's GEMM) off the CPU on a multiple of FIXED_ROWS rows (`padded_linear`). (The
    CPU's own BLAS path pads the whole step instead: BatchCache.MIN_ROWS.)"""
    if not fixed_order_applies(x, w):
        if fixed_rows and FIXED_ROWS and x.device.type != "cpu":
            return padded_linear(x, w, FIXED_ROWS)
        return F.linear(x.float(), widened(w))
    lead, K = x.shape[:-1], x.size(-1)
    x2 = x.reshape(-1, K).float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return fixed_order_matmul(x2, transposed(w)).view(*lead, w.size(0))


def fixed_order_grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """The block-diagonal projection einsum("...gd,grd->...gr", x, w.view(groups, -1, d)) in fp32 with
    fixed_order_linear's order: x [..., groups, d] on the CPU (fixed_order_applies), w [groups * r, d] ->
    [..., groups, r] fp32. Each group's rows are read and its outputs written in place (strided rows)."""
    *lead, G, D = x.shape
    x2 = x.reshape(-1, G * D).float().contiguous()
    wt = transposed(w, groups)
    M, N = x2.size(0), wt.size(-1)
    out = torch.empty(M, G, N, dtype=torch.float32)
    matmul, xp, wp, op = library().dsv41_fixed_order_matmul, x2.data_ptr(), wt.data_ptr(), out.data_ptr()
    for g in range(G):  # group g: x2's columns g D.., wt[g], out's columns g N.. (addresses: no views a group)
        matmul(xp + 4 * g * D, M, D, G * D, wp + 4 * g * D * N, N, op + 4 * g * N, G * N)
    return out.view(*lead, G, N)


# ------------------------------------------------------------------------------- the KV cache's formats
# formats.py's packers and unpackers, one C call each (host_kernels.c) with their bytes and values: a decode step
# packs a window row, the compressors' entries and the indexer's keys and queries in every layer, and unpacks
# the rows its attention reads, each a dozen torch operators or more. Callers check `takes(x)` (packers) or
# `takes_codes` (unpackers) first.

_E2M1_BELOW = (ctypes.c_float * 7)(*formats._E2M1_BELOW_BOUNDARIES)  # what e2m1_code compares against


def _whole_blocks(x: torch.Tensor, block: int, name: str) -> int:
    """x's last dim D, which must be whole blocks (formats raises the same)."""
    D = x.shape[-1]
    if D % block:
        raise ValueError(f"{name}: last dimension {D} is not a multiple of the block size {block}")
    return D


def _packed(x: torch.Tensor, block: int, name: str, code_bytes: int):
    """(codes [..., D * code_bytes], scales [..., D / block]) uint8, empty, for a packer's input x [..., D] of
    whole blocks; code_bytes 1 (E4M3) or 1/2 (E2M1 pairs)."""
    D = _whole_blocks(x, block, name)
    lead = x.shape[:-1]
    return (torch.empty(*lead, int(D * code_bytes), dtype=torch.uint8),
            torch.empty(*lead, D // block, dtype=torch.uint8))


def pack_fp8_ue8m0(x: torch.Tensor, block: int = formats.FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """formats.pack_fp8_ue8m0 of a contiguous bf16/fp32 CPU x [..., D]: (E4M3 bytes [..., D], UE8M0 [..., D/block])."""
    codes, scales = _packed(x, block, "pack_fp8_ue8m0", 1)
    library().dsv41_pack_fp8_ue8m0(x.data_ptr(), x.dtype == torch.bfloat16, x.numel(), block, formats.FP8_AMAX_FLOOR,
                                   formats._FP8_RATIO, codes.data_ptr(), scales.data_ptr())
    return codes, scales


def pack_mxfp4(x: torch.Tensor, block: int = formats.MXFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """formats.pack_mxfp4 of a contiguous bf16/fp32 CPU x [..., D]: (E2M1 pairs [..., D/2], UE8M0 [..., D/block])."""
    packed, scales = _packed(x, block, "pack_mxfp4", 0.5)
    library().dsv41_mxfp4(x.data_ptr(), x.dtype == torch.bfloat16, x.numel(), block, formats.MXFP4_AMAX_FLOOR,
                          1.0 / formats.FP4_E2M1_MAX, _E2M1_BELOW, 0, None, packed.data_ptr(), scales.data_ptr())
    return packed, scales


def mxfp4_fake_quant(x: torch.Tensor, block: int = formats.MXFP4_BLOCK) -> torch.Tensor:
    """formats.mxfp4_fake_quant of a contiguous bf16/fp32 CPU x: rounded to MXFP4 and back, in x's dtype."""
    _whole_blocks(x, block, "mxfp4_fake_quant")
    out = torch.empty_like(x)
    library().dsv41_mxfp4(x.data_ptr(), x.dtype == torch.bfloat16, x.numel(), block, formats.MXFP4_AMAX_FLOOR,
                          1.0 / formats.FP4_E2M1_MAX, _E2M1_BELOW, 1, out.data_ptr(), None, None)
    return out


def pack_fp4_e4m3(x: torch.Tensor, block: int = formats.FP4_E4M3_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """formats.pack_fp4_e4m3 of a contiguous bf16/fp32 CPU x [..., D]: (E2M1 pairs [..., D/2], E4M3 scale bytes
    [..., D/block])."""
    packed, scales = _packed(x, block, "pack_fp4_e4m3", 0.5)
    library().dsv41_pack_fp4_e4m3(x.data_ptr(), x.dtype == torch.bfloat16, x.numel(), block,
                                  formats.FP4_E4M3_AMAX_FLOOR, _E2M1_BELOW, packed.data_ptr(), scales.data_ptr())
    return packed, scales


_UNPACK_FORMATS = {"fp8_ue8m0": 0, "fp4_e4m3": 1, "mxfp4": 2}


def takes_codes(*tensors: torch.Tensor) -> bool:
    """True when packed bytes can go to `unpack`: the library loaded, every tensor a contiguous one-byte CPU
    tensor (the unpackers record nothing for autograd, and bytes carry no gradient)."""
    if library() is None:
        return False
    return all(t.element_size() == 1 and not t.is_cuda and t.is_contiguous() for t in tensors)


def unpack(fmt: str, codes: torch.Tensor, scales: torch.Tensor, block: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """formats.unpack_<fmt>(codes, scales, block, dtype) for fmt "fp8_ue8m0", "fp4_e4m3" or "mxfp4": contiguous CPU
    bytes [..., D] (E4M3) or [..., D/2] (E2M1 pairs) and their scales [..., D/block] -> values [..., D]."""
    D = codes.shape[-1] * (1 if fmt == "fp8_ue8m0" else 2)
    if scales.shape[-1] * block != D or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"unpack {fmt}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match "
                         f"blocks of {block}")
    out = torch.empty(*codes.shape[:-1], D, dtype=torch.float32)
    library().dsv41_unpack(codes.data_ptr(), scales.data_ptr(), out.numel(), block, _UNPACK_FORMATS[fmt],
                           out.data_ptr())
    return out if dtype == torch.float32 else out.to(dtype)


# ------------------------------------------------------------------------------- RMSNorm
# torch's sum over a row in its own order (host_kernels.c, `aten_row_sum`), so the statistic keeps its bits: a row
# of at least SUM_LANES values (shorter rows keep the torch code, whose order for them depends on the rows beside).
SUM_LANES = 8


def rms_fits(x: torch.Tensor) -> bool:
    """Whether x's last dim is long enough for the C statistic (callers also check `takes`)."""
    return x.shape[-1] >= SUM_LANES


def rms_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps) of a contiguous bf16/fp32 CPU x, fp32 [..., 1]."""
    n = x.shape[-1]
    out = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    if library().dsv41_rms_rstd(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // n, n, eps, out.data_ptr()):
        raise MemoryError(f"rms_rstd: no scratch memory for {tuple(x.shape)}")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm of a contiguous bf16/fp32 CPU x [..., n] and weight [n] (bf16/fp32, contiguous)."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    if library().dsv41_rms_norm(x.data_ptr(), x.dtype == torch.bfloat16, weight.data_ptr(),
                                weight.dtype == torch.bfloat16, x.numel() // n, n, eps, out.data_ptr()):
        raise MemoryError(f"rms_norm: no scratch memory for {tuple(x.shape)}")
    return out


# ------------------------------------------------------------------------------- ATen's scalar sigmoid and softplus
# What `reference.per_row` computes inside the engine's decode step (every element by ATen's scalar formula, through
# a strided view and a stack): the same formulas over the C library's expf and log1pf, one call. For a contiguous
# fp32 CPU tensor; anything else (and the vector path, whose Sleef functions round otherwise) stays with torch.


def _scalar(name: str, t: torch.Tensor) -> torch.Tensor | None:
    if t.dtype != torch.float32 or t.is_cuda or not t.is_contiguous() or library() is None:
        return None
    out = torch.empty_like(t)
    getattr(library(), name)(t.data_ptr(), out.data_ptr(), t.numel())
    return out


def scalar_sigmoid(t: torch.Tensor) -> torch.Tensor | None:
    """torch.sigmoid(t) as ATen's scalar loop computes each element (None where this does not take t)."""
    return _scalar("dsv41_sigmoid_scalar", t)


def scalar_softplus(t: torch.Tensor) -> torch.Tensor | None:
    """F.softplus(t) (beta 1, threshold 20) as ATen's scalar loop computes each element (None where this does not
    take t)."""
    return _scalar("dsv41_softplus_scalar", t)


# ------------------------------------------------------------------------------- a decode step's attention inputs
def attention_inputs(x: torch.Tensor, block: int, wq_a: int, q_lora: int, q_norm: torch.Tensor, q_eps: float,
                     wq_b: int, n_heads: int, head_dim: int, wkv: int, kv_norm: torch.Tensor, kv_eps: float,
                     freqs: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention.query and Attention.window_latent of a decode step in one C call (host_kernels.c,
    dsv41_attention_inputs: the calls those make, in their order and dtypes, so the same bits): x [R, 1, dim]
    contiguous bf16/fp32 (dim whole blocks); wq_a, wq_b, wkv the addresses of the layers' transposed fp32 weights
    (Linear.host_matrix); q_norm [q_lora], kv_norm [head_dim] contiguous bf16/fp32 weights; freqs complex64
    [R, 1, r/2] (each row's) or [1, r/2], contiguous. Returns (qr [R, 1, q_lora], q [R, 1, H, head_dim], the window
    latent [R, 1, head_dim]) in x's dtype."""
    R = x.size(0)
    qr = x.new_empty(R, 1, q_lora)
    q = x.new_empty(R, 1, n_heads, head_dim)
    kv = x.new_empty(R, 1, head_dim)
    if library().dsv41_attention_inputs(
            x.data_ptr(), x.dtype == torch.bfloat16, R, x.size(-1), block, formats.FP8_AMAX_FLOOR, formats._FP8_RATIO,
            wq_a, q_lora, q_norm.data_ptr(), q_norm.dtype == torch.bfloat16, q_eps, wq_b, n_heads, head_dim, wkv,
            kv_norm.data_ptr(), kv_norm.dtype == torch.bfloat16, kv_eps, freqs.data_ptr(), rope_dim,
            freqs.dim() == 3, qr.data_ptr(), q.data_ptr(), kv.data_ptr()):
        raise MemoryError(f"attention_inputs: no scratch memory for {tuple(x.shape)}")
    return qr, q, kv


def attention_output(o: torch.Tensor, freqs: torch.Tensor, rope_dim: int, wo_a: torch.Tensor, groups: int, block: int,
                     wo_b: int, dim: int) -> torch.Tensor:
    """Attention.output of a decode step in one C call (host_kernels.c, dsv41_attention_output: the inverse RoPE,
    the grouped fixed-order wo_a product rounded to o's dtype, wo_b's host path; the same bits): o [R, 1, H, D]
    contiguous bf16/fp32, freqs as attention_inputs', wo_a the fp32 weight [G r, H D / G] (transposed per group once:
    `transposed`), wo_b the address of wo_b's transposed fp32 weight (Linear.host_matrix) -> [R, 1, dim] in o's
    dtype."""
    R, _, H, D = o.shape
    wt = transposed(wo_a, groups)
    out = o.new_empty(R, 1, dim)
    if library().dsv41_attention_output(o.data_ptr(), o.dtype == torch.bfloat16, R, H, D, freqs.data_ptr(), rope_dim,
                                        freqs.dim() == 3, groups, wt.data_ptr(), wt.size(-1), block,
                                        formats.FP8_AMAX_FLOOR, formats._FP8_RATIO, wo_b, dim, out.data_ptr()):
        raise MemoryError(f"attention_output: no scratch memory for {tuple(o.shape)}")
    return out


# ------------------------------------------------------------------------------- the indexer's choice
# At most this many index heads: ATen's bf16 sum over so short a row is fp32 from 0, left to right, rounded once
INDEXER_MAX_HEADS = 4


def indexer_decode(q: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, visible: torch.Tensor,
                   pool: torch.Tensor | None, topk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Indexer.select of a decode step (batch_invariant, bf16 scores) in one C call (host_kernels.c,
    dsv41_indexer_decode: the exact path of reference.weighted_relu_scores, the masks, the stable Top-K, the ids
    ascending and -1 past the visible ones, padded to topk): q [B, 1, H, Dk] contiguous bf16/fp32 MXFP4 values with
    Dk one MXFP4 block and H <= INDEXER_MAX_HEADS, w [B, 1, H] contiguous bf16, the packed keys [B, N, Dk / 2] and
    [B, N, Dk / 32] (rows contiguous), visible [B, 1] int64, pool None or the candidate mask [B, 1, N] bool ->
    (scores [B, 1, N] fp32, top [B, 1, topk] int64), or None where a score is NaN (torch's order for it)."""
    B, _, H, Dk = q.shape
    N = codes.size(1)
    apart = _rows_apart(codes, scales)
    if apart is None:
        codes, scales, apart = codes.contiguous(), scales.contiguous(), N
    visible = visible.reshape(B).to(torch.int64).contiguous()
    scores = torch.empty(B, 1, N, dtype=torch.float32)
    top = torch.empty(B, 1, topk, dtype=torch.int64)
    status = library().dsv41_indexer_decode(
        q.data_ptr(), q.dtype == torch.bfloat16, w.data_ptr(), codes.data_ptr(), scales.data_ptr(), apart, B, H, Dk, N,
        visible.data_ptr(), None if pool is None else pool.data_ptr(), 0 if pool is None else pool.stride(0), topk,
        topk, scores.data_ptr(), top.data_ptr())
    if status < 0:
        raise MemoryError(f"indexer_decode: no scratch memory for {tuple(q.shape)} and {N} entries")
    return None if status else (scores, top)


# ------------------------------------------------------------------------------- Engram's gate
def engram_mix(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
               floor: float) -> torch.Tensor:
    """Engram.forward after its wkv product, in the decode step (where its sigmoid is ATen's scalar formula:
    reference.scalar_loop_applies), in two C calls around torch's sqrt (host_kernels.c, dsv41_engram_dot / _mix: the
    torch code's operations in its order, the sums in ATen's): x [..., hc, dim] and kv [..., (hc + 1) dim] contiguous
    bf16/fp32 (dim >= SUM_LANES), q_weight and k_weight [hc, dim] contiguous -> [..., hc, dim] in x's dtype."""
    *lead, hc, dim = x.shape
    R = x.numel() // (hc * dim)
    lib = library()
    dot = torch.empty(*lead, hc, dtype=torch.float32)
    root = torch.empty(*lead, hc, dtype=torch.float32)
    if lib.dsv41_engram_dot(x.data_ptr(), x.dtype == torch.bfloat16, kv.data_ptr(), kv.dtype == torch.bfloat16, R, hc,
                            dim, q_weight.data_ptr(), q_weight.dtype == torch.bfloat16, k_weight.data_ptr(),
                            k_weight.dtype == torch.bfloat16, eps, dim ** -0.5, floor, dot.data_ptr(), root.data_ptr()):
        raise MemoryError(f"engram_mix: no scratch memory for {tuple(x.shape)}")
    root.sqrt_()  # torch's sqrt, whose bits C does not have (host_kernels.c, the router's note)
    out = torch.empty_like(x)
    lib.dsv41_engram_mix(x.data_ptr(), x.dtype == torch.bfloat16, kv.data_ptr(), kv.dtype == torch.bfloat16, R, hc,
                         dim, dot.data_ptr(), root.data_ptr(), out.data_ptr())
    return out


# ------------------------------------------------------------------------------- the MoE router
# At most this many experts a token and this many experts: the router's sum of the chosen scores is ATen's left to
# right order only for so short a row (as SINKHORN_MAX_N's sums); the biased scores of a row sit on the C stack
GATE_MAX_TOPK, GATE_MAX_EXPERTS = 4, 256


def gate_route(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, topk: int, gate_temp: float = 1.0,
               norm_topk_prob: bool = True, route_scale: float = 1.0):
    """reference.gate_route (sqrt-softplus scores, softplus by ATen's scalar formula) in two C calls around torch's
    sqrt: a contiguous bf16 or fp32 CPU x [N, d], the router's weight w [E, d] (widened and transposed once:
    `transposed`), a contiguous fp32 bias [E] or [N, E], topk <= GATE_MAX_TOPK, E <= GATE_MAX_EXPERTS ->
    (weights [N, k] fp32, indices [N, k] int64), or None where a row's choice has a tie or a NaN (torch.topk's
    own order for equal values; the caller takes the reference)."""
    N, K = x.shape
    E = w.size(0)
    lib = library()
    scores = torch.empty(N, E, dtype=torch.float32)
    if lib.dsv41_gate_softplus(x.data_ptr(), x.dtype == torch.bfloat16, N, K, transposed(w).data_ptr(), E,
                               gate_temp != 1.0, gate_temp, scores.data_ptr()):
        raise MemoryError(f"gate_route: no scratch memory for {tuple(x.shape)}")
    scores.sqrt_()  # torch's sqrt, whose bits C does not have (host_kernels.c)
    weights = torch.empty(N, topk, dtype=torch.float32)
    indices = torch.empty(N, topk, dtype=torch.int64)
    if lib.dsv41_route_pick(scores.data_ptr(), N, E, bias.data_ptr(), E if bias.dim() == 2 else 0, topk,
                            norm_topk_prob, route_scale, weights.data_ptr(), indices.data_ptr()):
        return None
    return weights, indices


# ------------------------------------------------------------------------------- sparse attention
def _rows_apart(*stores: torch.Tensor) -> int | None:
    """The rows between one sequence's first row and the next's, shared by these [B, N, width] stores whose rows
    are contiguous (a row-range view of the cache keeps its sequences' stride); None where they differ."""
    first = stores[0]
    if any(t.stride(-1) != 1 or t.stride(-2) != t.size(-1) for t in stores):
        return None
    apart = first.stride(0) // first.size(-1) if first.size(0) > 1 else first.size(1)
    if any(t.size(0) > 1 and t.stride(0) != apart * t.size(-1) for t in stores):
        return None
    return apart


def sparse_attention_packed(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                            main_codes: torch.Tensor | None, main_scales: torch.Tensor | None, sink: torch.Tensor,
                            window_idx: torch.Tensor, main_idx: torch.Tensor | None, scale: float,
                            window_values: torch.Tensor | None = None, version: str | None = None) -> torch.Tensor:
    """reference.sparse_attention_packed(..., attend=reference.sparse_attention_fixed_order) in one C call (version:
    "base", "avx2" or "avx512" as in head_logits, for the tests; default the widest the CPU runs): q
    [B, T, H, D] contiguous bf16/fp32 (D a multiple of 32); the window's FP8 bytes (or their fp32 values) and the
    main store's FP4 bytes are read in place: a decode step's token decodes the rows it selects, a prefill's tokens
    share each sequence's rows, decoded once."""
    B, T, H, D = q.shape
    window = window_values if window_values is not None else window_codes
    w_apart = _rows_apart(window) if window_values is not None else _rows_apart(window_codes, window_scales)
    if w_apart is None:
        window_codes, window_scales = window_codes.contiguous(), window_scales.contiguous()
        window_values = None if window_values is None else window_values.contiguous()
        w_apart = window.size(1)
    win_idx = window_idx.to(torch.int64).contiguous()
    main = main_codes is not None and main_idx is not None
    m_apart = 0
    if main:
        m_apart = _rows_apart(main_codes, main_scales)
        if m_apart is None:
            main_codes, main_scales = main_codes.contiguous(), main_scales.contiguous()
            m_apart = main_codes.size(1)
        main_idx = main_idx.to(torch.int64).contiguous()
    sink = sink.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    isa = -1 if version is None else ["base", "avx2", "avx512"].index(version)
    if library().dsv41_sparse_attention_version(
            isa, q.data_ptr(), q.dtype == torch.bfloat16, B, T, H, D, ptr(window_values), window_codes.data_ptr(),
            window_scales.data_ptr(), w_apart, window.size(1), win_idx.data_ptr(), win_idx.size(-1),
            ptr(main_codes) if main else None, ptr(main_scales) if main else None, m_apart,
            main_codes.size(1) if main else 0, ptr(main_idx) if main else None, main_idx.size(-1) if main else 0,
            sink.data_ptr(), scale, out.data_ptr()):
        raise MemoryError(f"sparse_attention: no scratch memory for {tuple(q.shape)}")
    return out


# ------------------------------------------------------------------------------- mHC
def mhc_step(x: torch.Tensor, pre_prev: torch.Tensor, fn_t: torch.Tensor, scale_mix: torch.Tensor, base: torch.Tensor,
             iters: int, hc_eps: float, norm_eps: float, y: torch.Tensor | None = None,
             post: torch.Tensor | None = None, comb: torch.Tensor | None = None, norm: tuple | None = None):
    """reference.mhc_step_fixed_order in two C calls around torch's exp, for takes(x, pre_prev[, y, post, comb])
    with y in x's dtype: x [..., n, d] (n <= SINKHORN_MAX_N), fn_t = transposed(W_fn) [n d, (n+2) n] fp32, scale_mix
    and base [(n+2) n] fp32 contiguous (the scales spread per mix: reference._mix_affine).
    Returns (X', collapsed, pre, post, comb). norm (weight, eps), a contiguous bf16/fp32 weight [d] with d >= SUM_LANES:
    the collapsed input then comes out through rms_norm's C call (the sub-layer's RMSNorm, model/block.py)."""
    *lead, n, d = x.shape
    rows = x.numel() // (n * d)
    x_new = x if y is None else torch.empty_like(x)
    collapsed = x.new_empty(*lead, d)
    pre_n, post_n, comb_n = torch.empty(*lead, n), torch.empty(*lead, n), torch.empty(*lead, n, n)
    lib = library()
    bf16 = x.dtype == torch.bfloat16
    if lib.dsv41_mhc_step(
            x.data_ptr(), None if y is None else y.data_ptr(), None if y is None else post.data_ptr(),
            None if y is None else comb.data_ptr(), pre_prev.data_ptr(), bf16, rows, n, d, fn_t.data_ptr(),
            scale_mix.data_ptr(), base.data_ptr(), hc_eps, norm_eps, x_new.data_ptr(), collapsed.data_ptr(),
            pre_n.data_ptr(), post_n.data_ptr(), comb_n.data_ptr()):
        raise MemoryError(f"mhc_step: no scratch memory for {tuple(x.shape)}")
    if norm is not None:  # in place: each row's statistic is read before the row is written
        weight, eps = norm
        if lib.dsv41_rms_norm(collapsed.data_ptr(), bf16, weight.data_ptr(), weight.dtype == torch.bfloat16, rows, d,
                              eps, collapsed.data_ptr()):
            raise MemoryError(f"mhc_step: no scratch memory for {tuple(x.shape)}")
    torch.exp(comb_n, out=comb_n)  # torch's exp, whose bits C does not have; then sinkhorn_normalize_'s C loop
    lib.dsv41_sinkhorn_normalize(comb_n.data_ptr(), rows, n, iters, hc_eps)
    return x_new, collapsed, pre_n, post_n, comb_n


# ------------------------------------------------------------------------------- a MoE layer's decode step
def moe_up(x: torch.Tensor, indices: torch.Tensor, block: int, w1: list, w3: list, shared_w1: int, shared_w3: int,
           N: int, limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of MoE.every_row's host path in one C call (host_kernels.c, dsv41_moe_up): x [R, K]
    contiguous bf16/fp32 (K whole blocks), indices [n, k] int64 contiguous (the first n tokens' experts), w1[e] /
    w3[e] the addresses of expert e's transposed fp32 weights [K, N] (None for an expert no token chose),
    shared_w1 / shared_w3 the shared expert's. Returns (gate, up) fp32 [n k + R, N], clamped, the routed rows by
    expert and then the shared rows, and the sorted assignments [n k] for moe_down."""
    R, K = x.shape
    n, k = indices.shape
    E = len(w1)
    gate = torch.empty(n * k + R, N)
    up = torch.empty(n * k + R, N)
    order = torch.empty(n * k, dtype=torch.int64)
    pointers = ctypes.c_void_p * E
    _moe_status("moe_up", library().dsv41_moe_up(
        x.data_ptr(), x.dtype == torch.bfloat16, R, n, k, K, block, formats.FP8_AMAX_FLOOR, formats._FP8_RATIO,
        indices.data_ptr(), E, pointers(*w1), pointers(*w3), shared_w1, shared_w3, N, limit, gate.data_ptr(),
        up.data_ptr(), order.data_ptr()), E)
    return gate, up, order


def _moe_status(name: str, rc: int, E: int) -> None:
    if rc == -2:
        raise IndexError(f"{name}: an expert index outside 0..{E - 1}, or an expert chosen without its weights")
    if rc:
        raise MemoryError(f"{name}: no scratch memory")


def moe_down(silu_gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
             order: torch.Tensor, block: int, w2: list, shared_w2: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """The second half (dsv41_moe_down): silu_gate = F.silu(gate) and up of moe_up, weights [n, k] fp32
    contiguous (the router's), indices and order as moe_up's, w2[e] the address of expert e's transposed w2 [N, D]
    (None where unchosen), shared_w2 the shared expert's -> the layer's output [R, D] in dtype (x's)."""
    M, N = up.shape
    n, k = indices.shape
    R = M - n * k
    E = len(w2)
    out = torch.empty(R, D, dtype=dtype)
    _moe_status("moe_down", library().dsv41_moe_down(
        silu_gate.data_ptr(), up.data_ptr(), R, n, k, N, block, formats.FP8_AMAX_FLOOR, formats._FP8_RATIO,
        indices.data_ptr(), order.data_ptr(), weights.data_ptr(), E, (ctypes.c_void_p * E)(*w2), shared_w2, D,
        dtype == torch.bfloat16, out.data_ptr()), E)
    return out


# ------------------------------------------------------------------------------- the batch cache's writes
def put_rows(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[r, slots[r]] = src[r] for each row r < R = slots' length, in one C call: dst [S, W, ...] contiguous (S >=
    R), src R rows of dst's trailing shape contiguous in dst's dtype, slots int64 contiguous, all on the CPU, no
    gradient wanted. False (nothing written) where it does not take them: the caller's torch put runs."""
    if (library() is None or torch.is_grad_enabled() or dst.is_cuda or not dst.is_contiguous()
            or not src.is_contiguous() or src.dtype != dst.dtype or slots.dtype != torch.int64
            or not slots.is_contiguous() or slots.dim() != 1):
        return False
    R, W = slots.size(0), dst.size(1)
    row = dst[0, 0].numel() if dst.dim() > 2 else 1
    if src.numel() != R * row or dst.size(0) < R:
        return False
    if library().dsv41_put_rows(dst.data_ptr(), W, row * dst.element_size(), slots.data_ptr(), src.data_ptr(), R):
        raise IndexError(f"put_rows: a slot outside 0..{W - 1}")
    return True
