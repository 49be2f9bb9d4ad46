"""GPU kernels (Triton) for the hot paths of V4.1-Flash, each beside a plain-PyTorch reference.

One module per kernel:

    sparse_attention   MQA over [window ring ; Top-K compressed entries] with the per-head sink, reading
                       packed FP8 window KV and packed FP4 main KV and dequantizing in the kernel
    mhc                single-pass mHC: residual update, next collapse and next coefficients in one pass
    indexer            ReLU-weighted MXFP4 query-key scores over packed keys (dense or over a candidate pool)
    quant              fused quantize-and-pack of KV entries (FP4 with E4M3 scales; FP8 with UE8M0 scales; MXFP4
                       index keys) and the MXFP4 rounding of the indexer's queries
    gemm               GEMMs with FP8 (32x32 UE8M0 tiles) or packed FP4 weights dequantized in the kernel, the
                       activation quantized to FP8 on the way in (Linear's "fast" gemm mode)
    experts            the routed experts of an MoE layer as grouped GEMMs over expert-sorted tokens (FP4 or
                       FP8 weights, SwiGLU and the routing weight fused, combine in MoE.routed's order)
    norm               RMSNorm in one launch
    rope               RoPE on the last channels in one launch
    routing            the MoE router after its GEMM (sqrt-softplus, biased Top-k, weights) in one launch, and
                       the shared expert's SwiGLU in one

`reference.py` holds the reference of every kernel with the same signature, built from the model's own
arithmetic, which lives there and which the model imports (the sparse attention loop of model/attention.py,
the indexer score of model/indexer.py, the mHC arithmetic of model/mhc.py) and from model/formats.py; the
GEMM and expert references are Linear's and MoE.routed's "fast" path, equal to them bit for bit in the
tests. So "the kernel agrees with the reference" means "the kernel agrees with the model".

This package is a leaf: it imports nothing of the model but model/formats.py and model/config.py (the model
calls the kernels, never the reverse; tests/test_import_graph.py). The GEMM mode flag (`gemm.GEMM_MODE`,
`gemm.set_gemm_mode`) lives with the GEMMs.

Each public function dispatches: Triton when the inputs are on a CUDA device and Triton imports, the
reference otherwise. CPU numerics are therefore never changed by this package. On the CPU, `host.py` runs a
few operator-bound pieces of the decode step (the Sinkhorn loop, the mHC collapse and update, the FP8
activation quantization, RoPE, RMSNorm, the KV formats, the scalar sigmoid and softplus) and the GEMMs of
inference as C functions that give the references' bits (host_kernels.c). Under TRITON_INTERPRET=1
the Triton path can also be forced on CPU tensors (`force_triton=True` per call, or `forced()` for every
call inside a block: the model's whole forward on the kernels), which is how the CPU tests run the kernels.
Triton is the `kernels` extra (pyproject.toml); nothing here imports it unless a kernel runs.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (the `kernels` extra is installed)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


_OPAQUE: list[tuple[str, str]] = []  # (module, function) of every Triton launch function
_OPAQUE_APPLIED = [False]


def opaque(launch):
    """Marks a function that launches Triton kernels, to be kept one opaque call under torch.compile
    (model/engine.py `compiled_decode_rows` calls `keep_launches_opaque` first): the compiler then fuses the
    torch operators around the kernels and calls the kernels as they are. Traced into, a user-defined kernel
    is recompiled by inductor with its scalar arguments retyped (a Python float scale becomes fp64, which the
    split attention kernel's fp32 accumulator refuses: H200 run 2026-12-02). The function itself is returned
    unchanged: wrapping it here would import torch._dynamo with the model (start-up time, and Triton's
    interpreter flag read before a test sets it)."""
    _OPAQUE.append((launch.__module__, launch.__name__))
    return launch


def keep_launches_opaque() -> None:
    """Replace every `opaque` launch function by its torch.compiler.disable'd form, in its module (callers look
    it up there at each call). Once per process; only torch.compile's users call it."""
    if _OPAQUE_APPLIED[0]:
        return
    import importlib

    for module_name, name in _OPAQUE:
        module = importlib.import_module(module_name)
        setattr(module, name, torch.compiler.disable(getattr(module, name), recursive=True))
    _OPAQUE_APPLIED[0] = True


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers, without importing Triton (a launch's host-side arithmetic)."""
    return -(-a // b)


def whole_waves(items: int, groups: int, slots: int, most: int) -> tuple[int, int]:
    """Cut `items` units of work (a row's channel blocks, a segment's index tiles) into k parts, 1 <= k <= most, for
    a grid of `groups` x parts programs of which `slots` run at once: the k whose grid finishes soonest, counted as
    its waves (programs / slots, rounded up) times the units a program walks; ties go to fewer parts (fewer atomics
    or partial outputs). Returns (units per part, parts), no part empty. Used where a grid of 1.45 waves left its
    second wave half empty (mhc's channel ranges, sparse attention's splits; h200-2026-12-04)."""
    best = None
    for k in range(1, max(1, most) + 1):
        per = cdiv(items, k)
        parts = cdiv(items, per)
        cost = cdiv(groups * parts, slots) * per
        if best is None or cost < best[0]:
            best = (cost, per, parts)
    return best[1], best[2]


def decode_mode(choice) -> int:
    """A kernel's FP4 decode constexpr from its tuning value: 0 (False) through fp32, 1 (True) bf16 from bits,
    2 ("e4m3") the codes / 64 by the hardware's E4M3 conversion, the other operand times 64 (the same products)."""
    return 2 if choice == "e4m3" else int(bool(choice))


# The process environment's own dict where the platform keeps one (CPython on POSIX: bytes keys and values, which
# os.environ's assignments, deletions and pytest's monkeypatch update): the flags below are read on the CPU decode
# step's hot path, a few hundred times a step, where os.environ.get decodes and encodes strings at every call.
_ENV_BYTES = getattr(os.environ, "_data", None)
if not (isinstance(_ENV_BYTES, dict) and os.name == "posix"):
    _ENV_BYTES = None


def env_flag(name: str, default: str = "0") -> str:
    """os.environ.get(name, default), read from the environment's dict itself where it can be (`_ENV_BYTES`)."""
    if _ENV_BYTES is None:
        return os.environ.get(name, default)
    value = _ENV_BYTES.get(name.encode())
    return default if value is None else value.decode()


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return env_flag("TRITON_INTERPRET") == "1"


_FORCED = [False]


@contextlib.contextmanager
def forced():
    """Inside the block every dispatching call takes the Triton path whatever the device: with
    TRITON_INTERPRET=1 the CPU tests run the model's forward through every kernel it calls."""
    before = _FORCED[0]
    _FORCED[0] = True
    try:
        yield
    finally:
        _FORCED[0] = before


def inference_kernel(*tensors: torch.Tensor, force: bool = False) -> bool:
    """Whether a kernel without a backward (norm, rope, routing, the expert sort, mhc.expand, the MXFP4 passes)
    takes these tensors: the first on CUDA, or `force` / `forced()`; no gradient wanted through any of them;
    Triton installed (use_triton). A CPU tensor is answered first, without reading the environment: the decode
    step calls these on its hot path."""
    if not (force or _FORCED[0] or tensors[0].is_cuda):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return use_triton(*tensors, force=force)


def use_triton(*tensors: torch.Tensor, force: bool = False) -> bool:
    """Whether a kernel call with these tensors should take the Triton path: all on CUDA with Triton
    installed, or `force` / `forced()` (tests on CPU under the interpreter)."""
    if not triton_available():
        return False
    if force or _FORCED[0]:
        return True
    if env_flag("DSV41_DISABLE_TRITON") == "1":
        return False
    return all(t.is_cuda for t in tensors if t is not None)
