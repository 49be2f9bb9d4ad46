"""The trainable (QAT) paths that were rewritten to launch fewer operators and never sync
(benchmarks/count_train_ops.py, docs/performance.md "Training step") compute what the straightforward
forms computed: the weight grid equals the stored checkpoint's round trip, the straight-through rounding
equals x + (y - x).detach(), and the grouped MoE equals the per-expert loop."""

from __future__ import annotations

import pytest
import torch

from dsv41.model import formats
from dsv41.model.layers import qat, weight_grid


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1]).pow(torch.rand(shape, generator=g))
    w[..., :3] = 0.0  # zeros and sign of zero
    w.view(-1)[5] = -0.0
    return w


@pytest.mark.parametrize("shape", [(64, 64), (70, 45), (3, 33, 96)])
def test_fp8_weight_grid_equals_the_checkpoint_round_trip(shape):
    w = _weights(shape, 0)
    got = weight_grid("fp8", w, 32)
    rows = w.reshape(-1, *shape[-2:])
    ref = torch.stack([formats.dequant_fp8_weight(*formats.quant_fp8_weight(r, 32), 32) for r in rows])
    assert torch.equal(got.view(ref.shape).view(torch.int32), ref.view(torch.int32))  # bitwise, -0.0 included


@pytest.mark.parametrize("shape", [(64, 128), (2, 16, 64)])
def test_fp4_weight_grid_equals_the_checkpoint_round_trip(shape):
    w = _weights(shape, 1)
    got = weight_grid("fp4", w, 32)
    rows = w.reshape(-1, *shape[-2:])
    ref = torch.stack([formats.dequant_fp4_weight(*formats.quant_fp4_weight(r, 32), 32) for r in rows])
    assert torch.equal(got.view(ref.shape).view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("fake_quant", [formats.fp8_fake_quant, formats.mxfp4_fake_quant, formats.fp4_e4m3_fake_quant])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_straight_through_equals_the_detach_form(fake_quant, dtype):
    x = _weights((4, 64), 2).to(dtype).requires_grad_()
    y = qat(fake_quant, x)
    old = x + (fake_quant(x) - x).detach()
    # the same values; only the sign of a zero may differ (the old form turned -0.0 into +0.0)
    assert torch.equal(y, old) and torch.equal(y, fake_quant(x.detach()))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, g)  # straight through
    assert y.grad_fn is not None and y.grad_fn.next_functions[0][0] is not None


def test_constants_are_built_once_and_keep_negative_zero():
    a = formats._grid_table(torch.device("cpu"))
    assert a is formats._grid_table(torch.device("cpu"))
    assert a.tolist() == list(formats.E2M1_GRID) + [-v for v in formats.E2M1_GRID] and bool(a[8].signbit())
    with torch.inference_mode():
        formats._CONSTANTS.clear()
        formats._fp32_const(0.25, torch.device("cpu"))
    c = formats._fp32_const(0.25, torch.device("cpu"))
    assert not c.is_inference()  # usable later in a forward that records gradients


def _trainable_moe(seed=0):
    from dsv41.model.config import LayerPlan, preset
    from dsv41.model.moe import MoE

    args = preset("tiny").replace(dim=64, moe_inter_dim=64, n_routed_experts=6, n_activated_experts=2,
                                  expert_dtype="fp4", trainable=True)
    moe = MoE(args, LayerPlan.from_args(args).layers[0])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return moe.float()


def _loop_routed(moe, x, weights, indices):
    """The per-expert loop of MoE.routed (what stored, non-trainable layers run on CPU)."""
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(indices).tolist():
        rows, slot = torch.where(indices == e)
        y[rows] += moe.experts[e](x[rows], weights[rows, slot, None]).float()
    return y


def test_trainable_moe_matches_the_per_expert_loop_bitwise():
    moe = _trainable_moe()
    assert moe._trainable()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    x[:, :32] *= 30  # different FP8 block scales within a row
    with torch.no_grad():
        moe.gate.bias[0] = -10.0  # expert 0 is never selected
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w, idx = moe.gate(x1)
    assert not (idx == 0).any()
    grouped = moe.routed(x1, w, idx)
    loop = _loop_routed(moe, x2, *moe.gate(x2))
    assert torch.equal(grouped, loop)
    g = torch.randn(grouped.shape, generator=torch.Generator().manual_seed(5))
    params = [p for n, p in moe.named_parameters() if n.startswith("experts.") and not n.startswith("experts.0.")]
    params.append(moe.gate.weight)
    for a, b in zip(torch.autograd.grad(grouped, [x1] + params, g), torch.autograd.grad(loop, [x2] + params, g)):
        assert torch.equal(a, b)
    # an expert no token chose stays out of the graph and gets no gradient, as in the loop
    moe.routed(x1, *moe.gate(x1)).backward(g)
    assert moe.experts[0].w1.weight.grad is None and moe.experts[1].w1.weight.grad is not None


def test_moe_load_counts_selections():
    moe = _trainable_moe()
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        moe(x.unsqueeze(0))
        _, idx = moe.gate(x)
    assert torch.equal(moe.load, torch.bincount(idx.flatten(), minlength=moe.n_routed))
