"""Host kernels: the CPU decode step's operator-bound pieces as one C call each (host_kernels.c).

On the CPU a decode step of a small model spends its time launching torch operators (a few microseconds
each), not computing: the 20 Sinkhorn iterations of one mHC step are about 120 operators on a 4 x 4 matrix
per token, one FP8 activation quantization about 14. The C functions do the same fp32 operations in the
same order as their references (reference._sinkhorn_normalize_, formats.fp8_fake_quant_f32,
reference.collapse and expand, layers.rope_tail, reference.head_logits), so they give the same bits
(tests/test_host_kernels.py, on every CPU flavour CI runs).

The output head is the one kernel here that is about arithmetic, not operator counts: the vocabulary-sized
GEMM was a third of a one-sequence decode step, computed on 16 rows (the padding that kept MKL's GEMM
batch-invariant, model/batch_cache.py). Summed in a fixed order per logit, a row's logits are the same
whatever rows are computed with it, so the step computes the head on its rows in use only; the function has
AVX-512, AVX2 and baseline versions (the lanes never meet: the same bits), the widest the CPU runs picked at
the first call (`head_isa`).

The C file is compiled on first use with the system's C compiler (`cc`, or $CC) into a per-user cache
(`$DSV41_CACHE_DIR`, default ~/.cache/dsv41) under a name that hashes the source and the flags, and loaded
with ctypes: no build step at install, no torch headers, 0.37 s of compiling once (2 cores, gcc 12). Where there is
no compiler, or DSV41_HOST_KERNELS=0, `library()` is None and every caller takes its torch reference (the
same numbers, slower); `status()` says which and why (`dsv41 info --json` does not depend on it).

Callers dispatch only for contiguous CPU tensors of the dtypes each wrapper names, with no gradient wanted
(`takes`); the wrappers assume it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dsv41.model import formats

SOURCE = Path(__file__).with_name("host_kernels.c")
# no -march: the baseline ISA of the machine's compiler target, so the code and its numbers are the same on
# every CPU; no fused multiply-add, no fast-math: each operation rounds as the torch reference's does
CFLAGS = ["-O2", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing"]

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
    lib.dsv41_fp8_fake_quant.argtypes = [ptr, ptr, i64, i64, f32, f32]
    lib.dsv41_fp8_fake_quant.restype = None
    lib.dsv41_mhc_collapse.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.dsv41_mhc_collapse.restype = None
    lib.dsv41_mhc_expand.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.dsv41_mhc_expand.restype = None
    lib.dsv41_rope_tail.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.dsv41_rope_tail.restype = None
    for name in ("dsv41_head_logits", *HEAD_VERSIONS.values()):
        if hasattr(lib, name):  # the AVX versions exist on x86-64 only
            getattr(lib, name).argtypes = [ptr, i64, i64, ptr, i64, ptr]
            getattr(lib, name).restype = None
    lib.dsv41_head_isa.restype = ctypes.c_int
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


def sinkhorn_normalize_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """reference._sinkhorn_normalize_ in place on a contiguous fp32 CPU comb [..., n, n]; returns comb."""
    n = comb.shape[-1]
    library().dsv41_sinkhorn_normalize(comb.data_ptr(), comb.numel() // (n * n), n, iters, eps)
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
    return all(t.dtype in _FLOATS and not t.is_cuda and t.is_contiguous() for t in tensors)


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


def head_logits(x: torch.Tensor, wt: torch.Tensor, version: str | None = None) -> torch.Tensor:
    """reference.head_logits: x [R, K] fp32 contiguous, wt [K, V] fp32 contiguous (CPU) -> [R, V] fp32.
    version: "base", "avx2" or "avx512" to run that one (the tests; the CPU must have it), else the CPU's."""
    R, K = x.shape
    V = wt.size(1)
    out = torch.empty(R, V, dtype=torch.float32)
    fn = getattr(library(), f"dsv41_head_logits_{version}" if version else "dsv41_head_logits")
    fn(x.data_ptr(), R, K, wt.data_ptr(), V, out.data_ptr())
    return out
