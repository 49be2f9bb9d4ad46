"""Shared building blocks: RMSNorm, rotary embeddings (with YaRN), and the linear layer that holds
weights in the checkpoint's storage format (bf16, FP8 E4M3 with 32x32 UE8M0 block scales, or packed
FP4 E2M1 with one UE8M0 scale per 32 inputs).

Activations are bf16 between modules, as in REF; each module computes in fp32 where REF does.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import formats, kernels
from dsv41.model.kernels import host, reference, rope
from dsv41.model.kernels.norm import rms_norm
# How FP8/FP4 GEMMs are evaluated ("fast" or "exact"): the flag lives with the GEMMs (model/kernels/gemm.py);
# Linear reads it, and `dsv41.model.layers.set_gemm_mode` stays importable.
from dsv41.model.kernels.gemm import GEMM_MODE, set_gemm_mode  # noqa: F401

FP4 = "fp4"  # packed E2M1 experts are stored as int8 bytes ("I8" in safetensors), two values per byte


def storage_dtype(kind: str | torch.dtype | None) -> torch.dtype | str:
    """Map a config string ("fp8", "fp4", "bf16") to what `Linear` stores."""
    if isinstance(kind, torch.dtype) or kind == FP4:
        return kind
    return {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, None: torch.bfloat16,
            "fp32": torch.float32}[kind]


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (V4.1 uses eps = 1e-20)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reference.rms_norm's torch arithmetic; on CUDA at inference one kernel (model/kernels/norm.py)
        return rms_norm(x, self.weight, self.eps)


class _StraightThrough(torch.autograd.Function):
    """y = fake_quant(x, *args) in the forward, dy/dx = identity in the backward.

    One autograd node per rounding: the dozens of operators of a fake quantization run without recording
    a graph, and no `x + (y - x).detach()` is added. The values are those of that expression: y - x is
    exact (y is x rounded to a grid whose neighbours are within a factor of 2, so Sterbenz applies, or
    y = 0) and x + (y - x) == y, except that the old expression turned a -0.0 result into +0.0."""

    @staticmethod
    def forward(ctx, x, fake_quant, *args):
        ctx.n_args = len(args)
        return fake_quant(x, *args)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + (None,) * ctx.n_args


def qat(fake_quant, x: torch.Tensor, *args) -> torch.Tensor:
    """Quantization-aware rounding: the forward sees fake_quant(x); the backward passes gradients
    straight through (the rounding has zero derivative almost everywhere)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, fake_quant, *args)
    return fake_quant(x, *args)


def weight_grid(kind: str, w: torch.Tensor, block: int) -> torch.Tensor:
    """A trainable master [..., out, in] rounded onto its storage grid, fp32: FP8 with block x block UE8M0
    tiles, or FP4 E2M1 with one UE8M0 per 32 inputs. The same values as the stored checkpoint's
    dequantized weight (tests/test_train_ops.py), without its byte encoding."""
    if kind == "fp8":
        return formats.fp8_weight_fake_quant(w, block)
    return formats.mxfp4_fake_quant(w.float(), 32)


class Linear(nn.Module):
    """y = x W^T with W in its storage format.

    FP8 and FP4 weights take the quantized path of REF: the activation is quantized to FP8 in groups
    of `block` along K with power-of-two scales, both sides are dequantized exactly to fp32 (the
    products of FP8 x FP8 and FP4 x FP8 values are exact in fp32), and the sum runs in fp32.

    trainable=True keeps an FP8/FP4 layer's weight as a dense fp32 master copy (no `scale`) and applies
    the same formats as quantization-aware training: the forward rounds the weight to its storage grid
    and the activation to FP8, exactly what the stored checkpoint will compute.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | str = torch.bfloat16,
                 block: int = 32, bias: bool = False, trainable: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.kind = "fp4" if dtype == FP4 else ("fp8" if dtype == torch.float8_e4m3fn else "dense")
        self.trainable = trainable and self.kind != "dense"
        self._dequantized: tuple | None = None
        self._dequantized_as: tuple | None = None  # (key, the dequantized weight in another dtype)
        if self.trainable:
            self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float32))
            self.register_parameter("scale", None)
        elif self.kind == "fp4":
            self.weight = nn.Parameter(torch.zeros(out_features, in_features // 2, dtype=torch.int8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.zeros(out_features, in_features // 32, dtype=torch.float8_e8m0fnu),
                                      requires_grad=False)
        elif self.kind == "fp8":
            self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.zeros(math.ceil(out_features / block), math.ceil(in_features / block),
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=torch.bfloat16))
        else:
            self.register_parameter("bias", None)

    # ---------------------------------------------------------------- formats
    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A real-valued weight -> (stored weight, scale) in this layer's format."""
        if self.kind == "fp8":
            return formats.quant_fp8_weight(w.float(), self.block)
        q, s = formats.quant_fp4_weight(w.float(), 32)
        return q.view(torch.int8), s

    def _weight_grid(self, w: torch.Tensor) -> torch.Tensor:
        return weight_grid(self.kind, w, self.block)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as real numbers (exact for FP8/FP4 storage; cached until the weight changes)."""
        if self.kind == "dense":
            return self.weight.to(dtype)
        if self.trainable:
            return qat(self._weight_grid, self.weight).to(dtype)
        if dtype == torch.float32:
            return self._cached_weight()
        # another dtype (the attention's wo_a einsum in bf16 on CUDA) is kept as well: cast once, not at every
        # step (at V4.1-Flash's wo_a, 33.5M values: the fp32 copy read and a bf16 copy written per layer and step)
        key = (*self._weight_key(), dtype)
        hit = self._dequantized_as
        if hit is None or hit[0] != key:
            fp32 = self._dequantized
            with torch.inference_mode(False), torch.no_grad():  # an ordinary tensor, as _cached_weight's
                # the fp32 weight only where it is kept anyway (the host path); else made, cast and dropped
                base = fp32[1] if fp32 is not None and fp32[0] == key[:3] else self._dequantize()
                hit = self._dequantized_as = (key, base.to(dtype))
        return hit[1]

    def _cached_weight(self) -> torch.Tensor:
        """The fp32 dequantized stored weight, rebuilt when the weight or scale changes in place (version)
        or is replaced (address: a new .data, or a move to another device, whose address space CUDA's
        unified addressing keeps apart from the host's)."""
        key = self._weight_key()
        cached = self._dequantized
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # cached: an ordinary tensor, usable anywhere
                weight = self._dequantize()
                on_cpu = weight.device.type == "cpu"
                # the host GEMM's operand, transposed once ([in, out]: host.fixed_order_matmul walks outputs)
                wt = weight.t().contiguous() if on_cpu and host.available() else None
            cached = self._dequantized = (key, weight, on_cpu, wt, None if wt is None else wt.data_ptr())
        return cached[1]

    def _dequantize(self) -> torch.Tensor:
        if self.kind == "fp8":
            return formats.dequant_fp8_weight(self.weight, self.scale, self.block)
        return formats.dequant_fp4_weight(self.weight, self.scale, 32)

    def _kernel_usable(self, x: torch.Tensor) -> bool:
        """Stored FP8/FP4 weights, inputs on CUDA with Triton (model/kernels), no gradient to the input.
        (Device first: a CPU run never imports Triton; the interpreter flag lets the tests force the path.)"""
        return ((x.is_cuda or kernels.interpreting()) and not self.trainable
                and not (torch.is_grad_enabled() and x.requires_grad) and kernels.use_triton(x, self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not torch.is_grad_enabled() and (x.dtype == torch.bfloat16 or x.dtype == torch.float32)
                and x.is_contiguous() and x.shape[-1] % self.block == 0):
            # the decode step's common case, asked in one pass: inference on the host with the transposed weight
            # kept and current (what _host_weight and _fused_host ask, below, in the order that answers soonest)
            wt_ptr = self.host_matrix()
            if wt_ptr is not None and host.available():
                return host.fp8_linear(x, self.block, self._dequantized[3], wt_ptr)
        w = self._host_weight(x)
        if w is not None:
            dtype = x.dtype
            if self._fused_host(x):
                # the quantization, the GEMM and the cast back in one C call: the bits of the steps below
                return host.fp8_linear(x, self.block, self._dequantized[3], self._dequantized[4])
            return self._host_forward(_host_act_quant(x, self.block, dtype), w, dtype)
        if self.kind == "dense":
            y = F.linear(x.to(self.weight.dtype), self.weight)
        elif GEMM_MODE["mode"] == "exact" and not self.trainable:
            fn = formats.fp8_linear if self.kind == "fp8" else formats.fp4_linear
            y = fn(x, self.weight, self.scale, self.block)
        elif self._kernel_usable(x):
            # the same "fast" numbers from a Triton kernel that dequantizes the stored weight in registers
            # (CUDA only; no fp32 copy of the weight is cached). model/kernels/gemm.py
            from dsv41.model.kernels import gemm

            fn = gemm.fp8_block_gemm if self.kind == "fp8" else gemm.fp4_gemm
            y = fn(x, self.weight, self.scale, self.block)
        else:
            # FP8 activation (1 x block, UE8M0) times the exact weight, accumulated in fp32
            xq = qat(formats.fp8_fake_quant, x, self.block).float()
            w = self.dequantized_weight(torch.float32)
            if self._host_weight(x) is not None:  # the first call on the host, which made the cache: its GEMM
                return self._host_forward(xq, w, x.dtype)  # in the fixed order of every later call
            y = F.linear(xq, w).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _host_forward(self, xq: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward's last branch given the fp32 activation grid xq and the cached weight, each output summed
        in a fixed order (host.fixed_order_linear: a row's outputs do not depend on the rows beside it) from
        the transposed copy kept with it; MKL's F.linear without the C library."""
        _, _, _, wt, wt_ptr = self._dequantized
        if wt is not None and host.available() and xq.is_contiguous():
            y = host.fixed_order_rows(xq, wt, wt_ptr).to(dtype)
        else:
            y = F.linear(xq, w).to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _fused_host(self, x: torch.Tensor) -> bool:
        """Whether host.fp8_linear can take the host path (given _host_weight): the transposed weight kept, no
        bias, a contiguous bf16 or fp32 x whose width is whole blocks, the C library loaded."""
        return (self._dequantized[3] is not None and self.bias is None
                and (x.dtype == torch.bfloat16 or x.dtype == torch.float32)
                and x.shape[-1] % self.block == 0 and x.is_contiguous() and host.available())

    def host_matrix(self) -> int | None:
        """The address of the transposed fp32 weight that forward's host path multiplies by, where that path takes
        any contiguous bf16/fp32 CPU input whose width is whole blocks, with no gradient wanted (what forward's
        first branch asks of the layer, not of the input: the weight kept and current, no bias, the "fast" GEMM
        mode, no Triton interpreter); else None. Fused host calls (host.attention_inputs) take it."""
        cached = self._dequantized
        if (cached is not None and cached[3] is not None and self._parameters["bias"] is None
                and GEMM_MODE["mode"] != "exact" and not kernels.interpreting() and cached[0] == self._weight_key()):
            return cached[4]
        return None

    def _host_current(self) -> bool:
        """Whether the transposed weight of the host path is kept and current (the weight and scale unchanged
        since it was made): `_host_weight` and `_fused_host` less what they ask of the call, which MoE's routed
        host path asks once per call (host_path_applies and x's dtype, width and layout)."""
        cached = self._dequantized
        return cached is not None and cached[3] is not None and cached[0] == self._weight_key()

    def _weight_key(self) -> tuple:
        """What the dequantized weight caches are made from: the stored weight's and scale's versions (an in-place
        change) and the weight's address (a new .data, or a move to another device, whose address space CUDA's
        unified addressing keeps apart from the host's). Read through _parameters: this is asked every call."""
        params = self._parameters
        w = params["weight"]
        return w._version, params["scale"]._version, w.data_ptr()

    def _host_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The cached fp32 weight when forward's last branch is certain to run on the host with no graph
        through x, else None. This is the decode step's common case, answered from the cache without
        asking the device of x: a cached CPU weight means a CPU x (the GEMM needs both on one device),
        and then only the Triton interpreter could route the call to a kernel."""
        cached = self._dequantized
        if (cached is None or not cached[2] or self.trainable or self.kind == "dense"
                or GEMM_MODE["mode"] == "exact" or kernels.interpreting()
                or torch.is_grad_enabled() and x.requires_grad):
            return None
        return cached[1] if cached[0] == self._weight_key() else None


def host_path_applies(x: torch.Tensor) -> bool:
    """Whether a quantized inference Linear (FP8/FP4 storage, not trainable) computes x on its host path, whose C
    GEMM sums each output row in a fixed order whatever rows come with it (from the layer's first call on): a CPU
    x, the C library loaded, outside the "exact" GEMM mode and the Triton interpreter, no graph through x. The
    answer for every such layer at once (MoE.every_row); `Linear._host_weight` answers it per layer from the
    weight cache on the hot path."""
    return (x.device.type == "cpu" and host.available() and GEMM_MODE["mode"] != "exact"
            and not kernels.interpreting() and not (torch.is_grad_enabled() and x.requires_grad))


def _host_act_quant(x: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """qat(fp8_fake_quant, x, block).float() off the graph: for bf16 and fp32 inputs straight in fp32,
    skipping the cast to x's dtype and back (exact there; formats.fp8_fake_quant_f32)."""
    if dtype == torch.bfloat16 or dtype == torch.float32:
        if host.available() and x.shape[-1] % block == 0:  # one C call for about 14 operators, the same bits
            return host.fp8_fake_quant_f32(x, block)
        return formats.fp8_fake_quant_f32(x, block)
    return formats.fp8_fake_quant(x, block).float()


def linear_pair(a: Linear, b: Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a(x), b(x)). When both take the host path with one block size (a SwiGLU's w1 and w3), x is
    quantized once for both: the same grid, so the same outputs as two calls, at half the quantizing."""
    wa = a._host_weight(x)
    wb = b._host_weight(x) if wa is not None and a.block == b.block else None
    if wb is None:
        return a(x), b(x)
    if a._fused_host(x) and b._fused_host(x):  # one C call: x quantized once, both products, both casts
        return host.fp8_linear(x, a.block, a._dequantized[3], a._dequantized[4], None, b._dequantized[3],
                               b._dequantized[4])
    dtype = x.dtype
    xq = _host_act_quant(x, a.block, dtype)
    return a._host_forward(xq, wa, dtype), b._host_forward(xq, wb, dtype)


# ----------------------------------------------------------------------------------- rotary
@lru_cache(maxsize=16)
def rope_frequencies(rope_dim: int, max_len: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """Complex rotations e^{i t theta_j}, [max_len, rope_dim/2] (complex64).

    theta_j = base^(-2j/r). With original_seq_len > 0 YaRN rescales: dimensions whose wavelength
    fits the training context keep theta, those far beyond it use theta/factor, and a linear ramp
    between beta_fast and beta_slow fades from one to the other (no mscale)."""
    # cached across calls: build it as an ordinary tensor even when the first caller runs under
    # inference_mode (an inference tensor could not be used later in a forward that records gradients)
    with torch.inference_mode(False), torch.no_grad():
        return _rope_table(rope_dim, max_len, base, original_seq_len, factor, beta_fast, beta_slow)


_DEVICE_ROPE: dict[tuple, torch.Tensor] = {}


def rope_frequencies_on(device, *table_args) -> torch.Tensor:
    """`rope_frequencies(*table_args)` held on `device`: moved there once, not sliced on the CPU and
    copied in every forward (a pageable host-to-device copy per layer and step, which also forbids
    capturing a decode step in a CUDA graph)."""
    device = torch.device(device)
    if device.type == "cpu":
        return rope_frequencies(*table_args)
    key = (device, *table_args)
    t = _DEVICE_ROPE.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():  # an ordinary tensor, as rope_frequencies'
            t = _DEVICE_ROPE[key] = rope_frequencies(*table_args).to(device)
    return t


def _rope_table(rope_dim, max_len, base, original_seq_len, factor, beta_fast, beta_slow) -> torch.Tensor:
    theta = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        theta = theta / factor * (1 - smooth) + theta * smooth
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), theta)
    return torch.polar(torch.ones_like(angles), angles)


# the torch arithmetic of RoPE lives with the kernels' references (model/kernels/reference.py)
apply_rope = reference.apply_rope


def rope_tail(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """RoPE on the LAST rope_dim channels only; the leading channels carry no position."""
    if host.takes(x) and host.rope_fits(x, freqs):  # one C call, the same bits (kernels/host.py)
        return host.rope_tail(x, freqs, rope_dim, inverse)
    return rope.rope_tail(x, freqs, rope_dim, inverse)  # one kernel on CUDA at inference, else reference's

