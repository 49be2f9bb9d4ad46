"""Mixture of experts (spec §4.7): sqrt-softplus router with selection-only bias, routed experts in
packed FP4, one shared expert in FP8, SwiGLU clamped at `swiglu_limit`.

    s = sqrt(softplus(x W_g^T / gate_temp))                     (fp32)
    I = topk(s + b, k)           b = gate.bias, or gate.bias_vl for image-span tokens
    w = s_I / (sum s_I + 1e-20) * route_scale                   (the bias picks, it never weighs)
    y = sum_{e in I} w_e E_e(x) + Shared(x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import formats
from dsv41.model.config import LayerSpec, ModelArgs
from dsv41.model.kernels import experts as expert_kernels
from dsv41.model.kernels import host, reference, routing
from dsv41.model.layers import FP4, Linear, host_path_applies, linear_pair, qat, storage_dtype, weight_grid


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.topk = spec.n_activated_experts
        self.score_func, self.gate_temp = args.score_func, args.gate_temp
        self.norm_topk_prob, self.route_scale = args.norm_topk_prob, args.route_scale
        self.weight = nn.Parameter(torch.zeros(spec.n_routed_experts, args.dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(spec.n_routed_experts, dtype=torch.float32))
        # a second aux-free balancing bias for image tokens: each modality balances its own load
        self.bias_vl = (nn.Parameter(torch.zeros(spec.n_routed_experts, dtype=torch.float32))
                        if args.vision_enabled else None)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None, fixed_rows: bool = False):
        """x [N, d] -> (weights [N, k] fp32, indices [N, k]). fixed_rows: a decode step's rows, whose scores must not
        depend on the batch (host.fixed_order_linear)."""
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, bias)
        # the scores x W_g^T in fp32 (in a fixed order on the CPU), then the biased Top-k and the weights:
        # reference.route's torch arithmetic (one kernel on CUDA at inference, two C calls with the GEMM in the CPU
        # decode step: model/kernels/routing.py)
        return routing.gate_route(x, self.weight, bias, self.topk, self.score_func, self.gate_temp,
                                  self.norm_topk_prob, self.route_scale, fixed_rows)


class Expert(nn.Module):
    """SwiGLU: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L)); the routing weight multiplies before w2."""

    def __init__(self, dim: int, inter_dim: int, dtype, block: int, swiglu_limit: float, trainable: bool = False):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype, block, trainable=trainable)
        self.w2 = Linear(inter_dim, dim, dtype, block, trainable=trainable)
        self.w3 = Linear(dim, inter_dim, dtype, block, trainable=trainable)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = linear_pair(self.w1, self.w3, x)  # one FP8 rounding of x for both where it can
        if weights is None:  # the shared expert: _hidden's arithmetic, one kernel on CUDA (kernels/routing.py)
            return self.w2(routing.swiglu(gate, up, self.limit, x.dtype))
        return self.w2(self._hidden(gate.float(), up.float(), weights).to(x.dtype))

    def _hidden(self, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return h

    def qat_forward(self, x: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    w3: torch.Tensor) -> torch.Tensor:
        """`forward` of trainable (QAT) layers given their weights already on the grid (fp32 [out, in]):
        what Linear's trainable path computes, with one FP8 rounding of x for both w1 and w3. Only for
        an x that nothing else uses (a routed expert's rows): then x's gradient is the same two-term sum."""
        block = self.w1.block
        xq = qat(formats.fp8_fake_quant, x, block).float()
        gate, up = F.linear(xq, w1).to(x.dtype).float(), F.linear(xq, w3).to(x.dtype).float()
        hq = qat(formats.fp8_fake_quant, self._hidden(gate, up, weights).to(x.dtype), block).float()
        return F.linear(hq, w2).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.dim = args.dim
        self.n_routed = spec.n_routed_experts
        expert_dtype = FP4 if args.expert_dtype == "fp4" else storage_dtype(args.expert_dtype or args.dtype)
        dense = storage_dtype(args.dtype)
        self.gate = Gate(args, spec)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, expert_dtype, args.fp8_block_size,
                                            args.swiglu_limit, args.trainable) for _ in range(self.n_routed))
        if args.n_shared_experts != 1:
            raise ValueError("exactly one shared expert is supported (as in every V4/V4.1 config)")
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, dense, args.fp8_block_size, args.swiglu_limit,
                                     args.trainable)
        self._quantized_experts: bool | None = None  # every routed expert FP8/FP4 inference weights (every_row)
        # (the experts held, their linears where `_routed_host` can run, the shared expert's where it joins them)
        self._layout: tuple | None = None
        self._chosen: torch.Tensor | None = None  # the last forward's expert indices, and their counts (`load`)
        self._load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        self._chosen, self._load = indices, None  # `load` counts them when read (training), not every forward
        y = self.routed(x, weights, indices)
        y += self.shared_experts(x).float()
        return y.to(x.dtype).reshape(shape)

    @property
    def load(self) -> torch.Tensor | None:
        """Tokens per expert in the last forward [n_routed] int64: read by training to update the selection bias
        (aux-loss-free balancing). Counted on first read, so inference, which never reads it, launches nothing
        for it (three launches a layer on CUDA). (scatter_add, not bincount, on CUDA: bincount reads the largest
        index back to size its output.)"""
        if self._load is None and self._chosen is not None:
            flat = self._chosen.flatten()
            if flat.device.type == "cpu":  # the same counts in one operator
                self._load = torch.bincount(flat, minlength=self.n_routed)
            else:
                self._load = torch.zeros(self.n_routed, dtype=torch.int64, device=flat.device).scatter_add_(
                    0, flat, torch.ones_like(flat))
        return self._load

    @load.setter
    def load(self, value: torch.Tensor | None) -> None:
        self._chosen, self._load = None, value

    def routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
               every_row: int | None = None) -> torch.Tensor:
        """sum_k w_k E_k(x) over the selected experts held here, fp32 [N, dim]. Under expert
        parallelism (model/parallel.py) the experts another rank holds are None and this is a partial sum.
        every_row (a count n): each expert chosen by any of the first n rows runs on every row, weight 0
        where the row did not choose it (see `every_row`); the same values, exact zeros added."""
        if expert_kernels.usable(self.experts, x):  # CUDA: grouped GEMMs over expert-sorted tokens
            weights_ = expert_kernels.cached_weights(self, self.experts)
            return expert_kernels.routed_experts(x, weights, indices, weights_, self._swiglu_limit())
        if every_row is None:  # (first: QAT masters never take it, and it answers without walking every expert)
            host_path = self._host_experts(x, indices)
            if host_path is not None:
                return self._routed_host(x, weights, indices, *host_path)
        if self._trainable():
            return self._routed_trainable(x, weights, indices)
        y = torch.zeros_like(x, dtype=torch.float32)
        if every_row is not None:
            dense = torch.zeros(x.size(0), self.n_routed, dtype=weights.dtype, device=x.device).scatter_(
                1, indices, weights)
            for e in torch.unique(indices[:every_row]).tolist():
                if self.experts[e] is not None:
                    y += self.experts[e](x, dense[:, e, None]).float()
            return y
        # group tokens by expert: each expert runs once on the tokens routed to it
        for e in torch.unique(indices).tolist():
            if self.experts[e] is None:
                continue
            rows, slot = torch.where(indices == e)
            # rows are distinct within an expert: an accumulating index_put_ makes the same one addition per
            # element as y[rows] += ..., in one operator instead of a gather, an add and a scatter; on the CPU it
            # is 1.4-3.6x faster than index_add_, which goes through the thread pool even for one row and waits
            # on a busy core (docs/performance.md, cpu-moe-scatter)
            y.index_put_((rows,), self.experts[e](x[rows], weights[rows, slot, None]).float(), accumulate=True)
        return y

    def _host_experts(self, x: torch.Tensor, indices: torch.Tensor):
        """(tokens per expert, the experts in use) when `routed`'s loop can run as `_routed_host`: every expert held
        here, each one in use with its three weights cached for Linear's fused host path (host.fp8_linear) and one
        block size (whole blocks in w2's input width too), x contiguous bf16/fp32 and every hidden and output width
        whole vector chunks of ATen's elementwise loops (so silu computes each element as in the loop, whatever the
        rows beside it). Else None (the loop runs; its first call also fills the weight caches)."""
        if not self._sums_rows_alone(x):
            return None
        linears = self._host_linears()
        if not self._host_input(x, linears):
            return None
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed).tolist()
        used = [e for e, c in enumerate(counts) if c]
        for e in used:
            for lin in linears[e]:
                if not lin._host_current():
                    return None
        return counts, used

    @staticmethod
    def _host_input(x: torch.Tensor, linears: list) -> bool:
        """What Linear._fused_host asks of its input, asked once of x for every expert GEMM (w2's input, the hidden
        state, has x's dtype and layout, and its width is whole blocks: _host_linears)."""
        return (bool(linears) and x.shape[-1] % linears[0][0].block == 0 and x.is_contiguous()
                and (x.dtype == torch.bfloat16 or x.dtype == torch.float32))

    def _host_linears(self) -> list:
        """Each routed expert's (w1, w3, w2) where the layout lets `_routed_host` run, else []: every expert held
        here, no bias, one block size, every hidden and output width whole vector chunks of ATen's elementwise loops
        (so silu computes each element as in the loop, whatever the rows beside it) and w2's input whole blocks.
        Read again only when the experts held change (parallel.py shards them after the model is built)."""
        held_now = tuple(self.experts._modules.values())
        if self._layout is None or self._layout[0] != held_now:
            held = all(e is not None for e in held_now)
            linears = [(e.w1, e.w3, e.w2) for e in self.experts] if held else []
            first = linears[0] if linears else None
            if first is None or (first[0].out_features % reference.VECTOR_CHUNK
                                 or first[2].out_features % reference.VECTOR_CHUNK
                                 or first[2].in_features % first[2].block
                                 or any(lin.bias is not None or lin.block != first[0].block
                                        for trio in linears for lin in trio)):
                linears = []
            shared = self.shared_experts
            trio = (shared.w1, shared.w3, shared.w2)
            # the shared expert joins the two-call path (_every_row_host) where it has the routed experts' block,
            # hidden width and limit and is quantized for inference
            same = linears and shared.limit == self.experts[0].limit and trio[0].out_features == first[0].out_features
            same = same and all(lin.block == first[0].block and lin.bias is None and lin.kind != "dense"
                                and not lin.trainable for lin in trio)
            self._layout = (held_now, linears, trio if same else None)
        return self._layout[1]

    def _routed_host(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, counts: list[int],
                     used: list[int]) -> torch.Tensor:
        """`routed`'s loop with its bits in a dozen operators instead of a dozen per expert (the CPU decode step's
        largest share of operator launches): the (token, slot) assignments sorted by expert (stable, so each
        expert's rows come in the loop's ascending order), every expert's w1/w3 pair and its w2 in one C call each
        over its own consecutive rows (host.fp8_linear_grouped: each group the bits of the loop's call on it),
        the SwiGLU between them on all rows at once (elementwise), and each token's expert outputs added to 0 in
        ascending expert order, as the loop's accumulating index_put_ adds them."""
        n_tok, k = indices.shape
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        rows = torch.div(order, k, rounding_mode="floor")
        trios = [self._layout[1][e] for e in used]  # (w1, w3, w2), their transposed weights kept (_host_experts)
        counts_used = [counts[e] for e in used]
        w1, w3, w2 = trios[0]
        gate, up = host.fp8_linear_grouped(x[rows], w1.block, counts_used, [t[0]._dequantized[4] for t in trios],
                                           w1.out_features, [t[1]._dequantized[4] for t in trios], w3.out_features)
        h = self.experts[used[0]]._hidden(gate.float(), up.float(), weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
        out = host.fp8_linear_grouped(h, w2.block, counts_used, [t[2]._dequantized[4] for t in trios],
                                      w2.out_features).float()
        y = torch.zeros(n_tok, self.dim, dtype=torch.float32)
        if n_tok == 1:  # one token (a one-sequence decode step): its slots are out's rows already, by expert
            for j in range(k):
                y += out[j:j + 1]
            return y
        place = torch.empty_like(order)
        place[order] = torch.arange(order.numel())
        place = place.view(n_tok, k).gather(1, indices.argsort(dim=-1, stable=True))  # each token's slots by expert
        for j in range(k):
            y += out[place[:, j]]
        return y

    def every_row(self, x: torch.Tensor, rows_in_use: int | None = None) -> torch.Tensor:
        """`forward` for a decode step of a continuous batch (model/batch_cache.py), whose rows must not depend
        on each other. Where the expert GEMMs sum each row alone (the CPU's fixed-order host GEMMs:
        `_sums_rows_alone`) that is the routed loop on the rows in use. Elsewhere (MKL's F.linear, whose sums
        for a row depend on how many rows the GEMM has) each expert that any row chose runs on every row, with
        weight 0 where the row did not choose it, so every expert GEMM has the batch's row count; the unchosen
        experts add exact zeros. Either way each row gets `forward`'s values. rows_in_use: only the first
        rows' choices decide which experts run (the rest pad the step: batch_cache.py)."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x, fixed_rows=True)
        n = x.size(0) if rows_in_use is None else rows_in_use
        if self._sums_rows_alone(x):
            y = self._every_row_host(x, weights, indices, n)
            if y is not None:
                return y.reshape(shape)
            # every expert GEMM sums each row on its own here (the host's fixed-order GEMMs), so the routed loop
            # (each chosen expert on its own rows) gives every row the bits above without running each chosen
            # expert on every row: k expert-rows a row instead of up to n_routed
            y = self.routed(x[:n], weights[:n], indices[:n])
            if n < x.size(0):
                y = torch.cat([y, y.new_zeros(x.size(0) - n, self.dim)])
        else:
            y = self.routed(x, weights, indices, every_row=n)
        y += self.shared_experts(x).float()
        return y.to(x.dtype).reshape(shape)

    def _every_row_host(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                        n: int) -> torch.Tensor | None:
        """`every_row`'s host path (`_routed_host` for the first n rows, the shared expert on all, their sum) in two
        C calls around torch's silu, the one operator whose bits C does not have (ATen's vector code): host.moe_up
        (the expert sort, each expert's rows and the shared expert through w1 and w3, the clamps), F.silu on all of
        them at once (whole vector chunks: each element as computed alone; `_host_linears`), host.moe_down (the
        products, the routing weights, w2, each token's sum in expert order, the shared output). The same bits as
        the path it replaces (tests/test_host_kernels.py); None where it does not apply (`_host_experts`' checks,
        the shared expert on the host path with the routed experts' block, width and limit, fp32 weights)."""
        linears = self._host_linears()
        if (not self._host_input(x, linears) or self._layout[2] is None or weights.dtype != torch.float32
                or not indices.is_contiguous()):
            return None
        s1, s3, s2 = self._layout[2]
        if not (s1._host_current() and s3._host_current() and s2._host_current()):
            return None
        w1 = linears[0][0]
        block = w1.block
        if n < indices.size(0):
            indices, weights = indices[:n], weights[:n]
        used = set(indices.flatten().tolist())
        E = len(linears)
        p1, p3, p2 = [None] * E, [None] * E, [None] * E
        for e in used:
            a, b, c = linears[e]
            if not (a._host_current() and b._host_current() and c._host_current()):
                return None
            p1[e], p3[e], p2[e] = a._dequantized[4], b._dequantized[4], c._dequantized[4]
        gate, up, order = host.moe_up(x, indices, block, p1, p3, s1._dequantized[4], s3._dequantized[4],
                                      w1.out_features, self.shared_experts.limit)
        return host.moe_down(F.silu(gate), up, weights.contiguous(), indices, order, block, p2, s2._dequantized[4],
                             self.dim, x.dtype)

    def _sums_rows_alone(self, x: torch.Tensor) -> bool:
        """Whether each routed expert's three GEMMs sum a row's outputs independently of the other rows: every
        expert quantized for inference and x on Linear's host path (layers.host_path_applies). Not on CUDA or
        under the Triton interpreter (kernels), with dense experts or in the "exact" GEMM mode (F.linear), or
        without the C library."""
        if self._quantized_experts is None:
            self._quantized_experts = all(lin.kind != "dense" and not lin.trainable for e in self.experts
                                          if e is not None for lin in (e.w1, e.w2, e.w3))
        return self._quantized_experts and host_path_applies(x)

    def _trainable(self) -> bool:
        return any(e is not None and e.w1.trainable for e in self.experts)

    def _routed_trainable(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`routed` for QAT masters with the loop's exact numbers (forward and gradients, bit for bit) and
        a fraction of its host work: a training step of the tiny recipe is bound by operator launches and
        syncs (docs/performance.md, "Training step").

        * One host sync per layer instead of one per expert plus one: the assignments are sorted by expert
          once (a stable sort, so each expert's rows come in the ascending order torch.where gave) and
          only the counts are read back.
        * Each of w1, w2, w3 is rounded to its grid once for all experts in use, stacked (the rounding is
          per row or per tile, so stacking changes no value). Experts nobody chose stay out of the graph
          and keep no gradient, as in the loop.
        * w1 and w3 of an expert share one FP8 rounding of its rows (the gradient reaching the rows is
          the same two-term sum).

        (Every expert on every token with a dense routing matrix would need no sync at all and still fewer
        operators, but its gradients differ in the last bits and idle experts get zero gradients, which
        AdamW treats differently from none; training trajectories then drift apart.)"""
        k = indices.size(-1)
        order = torch.argsort(indices.flatten(), stable=True)
        counts = torch.zeros(self.n_routed, dtype=torch.int64, device=x.device).scatter_add_(
            0, indices.flatten(), torch.ones_like(order)).tolist()  # the one sync
        rows_sorted, slot_sorted = order // k, order % k
        used = [e for e, n in enumerate(counts) if n and self.experts[e] is not None]
        if not used:
            return torch.zeros_like(x, dtype=torch.float32)
        grids = {name: self._stacked_grid(name, used) for name in ("w1", "w2", "w3")}
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        y = torch.zeros_like(x, dtype=torch.float32)
        for i, e in enumerate(used):
            rows = rows_sorted[offsets[e]:offsets[e + 1]]
            slot = slot_sorted[offsets[e]:offsets[e + 1]]
            w1, w2, w3 = grids["w1"][i], grids["w2"][i], grids["w3"][i]
            y[rows] += self.experts[e].qat_forward(x[rows], weights[rows, slot, None], w1, w2, w3).float()
        return y

    def _stacked_grid(self, name: str, used: list[int]) -> tuple[torch.Tensor, ...]:
        """The masters `name` of the experts `used`, rounded to their storage grid in one call, one fp32
        [out, in] per expert (straight-through to each master)."""
        lin = getattr(self.experts[used[0]], name)
        w = torch.stack([getattr(self.experts[e], name).weight for e in used])
        return qat(lambda v: weight_grid(lin.kind, v, lin.block), w).unbind(0)

    def _swiglu_limit(self) -> float:
        return next(e for e in self.experts if e is not None).limit

    # the kernels reach the experts' weights through a table of addresses (model/kernels/experts.py):
    # moving or loading the weights drops it
    def _apply(self, fn, *args, **kwargs):
        expert_kernels.forget(self)
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        expert_kernels.forget(self)
        super()._load_from_state_dict(*args, **kwargs)
