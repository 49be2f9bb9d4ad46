"""CSA2 attention (spec §4.4): a sliding window of raw KV plus Top-K entries of a compressed,
cross-layer shared KV, attended together in one sparse softmax with a per-head sink.

Per layer (mode from the layer plan):
    q     = RoPE(W_qb RMSNorm_q(W_qa x), t)                       [H, D]   (rope on the last r dims)
    c_t   = FP8(RoPE(RMSNorm_kv(W_kv x_t), t))                    window KV, a ring of `window_size`
  kv-source layers (Full) also compress, m tokens -> one entry:
    m=2:  c_g = RMSNorm_c(bf16(sum_i softmax_i(W_gate x_i) * W_ckv x_i))   per-channel softmax gate
    m=1:  c_g = RMSNorm_c(W_ckv x_g)
    C_g   = FP4(RoPE(c_g, g m))  (E2M1, one E4M3 scale per 16)    the shared main KV entry
    k_g   = indexer keys from the pre-RoPE c_g (indexer.py)
  index-source layers (Full, Reindex) run the indexer -> Top-K; Reuse layers take the latest Top-K.
    o     = sparse_attention(q, [window ; C], sink, [window idx ; Top-K])
    out   = W_ob( W_oa^g (RoPE^-1(o, t)) for each of G head groups )

Keys and values are the same latent (MQA with one 512-wide head); the attention output is rotated
back to position 0 so the shared cache can keep one rotated form.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dsv41.model import formats
from dsv41.model.cache import FP4_E4M3, INDEX_KEY_CODEC, WINDOW_CODEC
from dsv41.model.config import LayerSpec, ModelArgs
from dsv41.model.indexer import Indexer
from dsv41.model.kernels import host, reference
from dsv41.model.kernels import sparse_attention as kernels_attention
from dsv41.model.layers import Linear, RMSNorm, qat, rope_frequencies_on, rope_tail, storage_dtype


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Sparse MQA with a sink. q [B,T,H,D], kv [B,N,D] (K = V), sink [H] (fp32 logit that
    joins the denominator only), idx [B,T,K] with -1 = empty. A row with no valid index gives 0.

        o = sum_j e^{l_j - M} kv_j / (sum_j e^{l_j - M} + e^{sink - M}),   l_j = scale q.kv_{idx_j}

    (An empty row: the denominator is e^{sink + 1e30}, i.e. 0/0 avoided as in REF: acc stays 0.)

    On CUDA with bf16 q and kv, no gradient wanted and Triton installed, this runs the Triton kernel
    (model/kernels/sparse_attention.py; same result within bf16 rounding of the probabilities);
    DSV41_DISABLE_TRITON=1 keeps the reference. CPU always takes the reference (model/kernels/reference.py:
    REF's kernel step for step, its bf16 rounding of the probabilities included).
    """
    if q.is_cuda and q.dtype == kv.dtype == torch.bfloat16 and not (
            torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or sink.requires_grad)):
        from dsv41.model.kernels import sparse_attention as kernels, use_triton

        if use_triton(q, kv) and kernels.supported(q, kv.size(-1)):
            return kernels.sparse_attention(q, kv, sink, idx, scale)
    return reference.sparse_attention(q, kv, sink, idx, scale)


def window_indices(start_pos: int, seqlen: int, n_prev: int, window: int, device) -> torch.Tensor:
    """For queries at start_pos..start_pos+T-1 over window KV laid out as [n_prev cached ; T new]
    (the cached part holding positions start_pos-n_prev..start_pos-1): the causal window
    [t-window+1, t] as indices into that layout, -1 where the window reaches before position 0. [T, min(window, n_prev+T)]
    A decode step's (T = 1) on a GPU is kept for the step's other layers (read only): seven launches each."""
    if seqlen == 1 and torch.device(device).type != "cpu":
        return _decode_window_indices(start_pos, n_prev, window, torch.device(device))
    return _window_indices(start_pos, seqlen, n_prev, window, device)


@functools.lru_cache(maxsize=16)
def _decode_window_indices(start_pos: int, n_prev: int, window: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # an ordinary tensor: usable by a later forward that records gradients
        return _window_indices(start_pos, 1, n_prev, window, device)


def _window_indices(start_pos: int, seqlen: int, n_prev: int, window: int, device) -> torch.Tensor:
    base = start_pos - n_prev
    t = torch.arange(start_pos, start_pos + seqlen, device=device).unsqueeze(1)
    width = min(window, n_prev + seqlen)
    pos = t - width + 1 + torch.arange(width, device=device)
    return torch.where(pos >= max(base, 0), pos - base, -1)


def _per_sequence_linear(xf: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(xf, w) in fp32, xf [B, T, dim], each sequence's GEMM on its own on the CPU: MKL's sgemm sums a
    row in an order that depends on the GEMM's row count (T = 3 and B * T = 21 differ in the last bit), and a
    batched prefill (model/engine.py, Scheduler) must give each sequence the bits of its prefill alone."""
    w = w.float()
    if xf.size(0) == 1 or xf.is_cuda:
        return torch.nn.functional.linear(xf, w)
    return torch.cat([torch.nn.functional.linear(xf[b:b + 1], w) for b in range(xf.size(0))])


class Compressor(nn.Module):
    """m tokens -> one pre-RoPE latent. A trailing incomplete group waits in the cache's compressor
    state and is emitted when its last token arrives, so entries appear only when complete."""

    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.ratio, self.head_dim = spec.compress_ratio, args.head_dim
        self.wkv = Linear(args.dim, args.head_dim, torch.bfloat16)
        if self.ratio > 1:
            self.wgate = Linear(args.dim, args.head_dim, torch.bfloat16)
        self.norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, state) -> torch.Tensor | None:
        """x [B,T,dim] -> latents of the groups completed by these tokens, [B,G,head_dim] (None if G=0).
        `state` (from the cache) holds the pending partial group's projections for m > 1."""
        if self.ratio == 1:  # nothing to pool: no gate, no fp32
            return self.norm(self.wkv(x))
        xf = x.float()
        kv, score = _per_sequence_linear(xf, self.wkv.weight), _per_sequence_linear(xf, self.wgate.weight)
        kv, score = state.take(kv, score, self.ratio)
        if kv is None:
            return None
        kv = kv.unflatten(1, (-1, self.ratio))
        score = score.unflatten(1, (-1, self.ratio))
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # per-channel softmax over the group's tokens
        return self.norm(pooled.to(x.dtype))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.window = args.window_size
        self.scale = args.head_dim ** -0.5
        dense, block, tr = storage_dtype(args.dtype), args.fp8_block_size, args.trainable

        self.attn_sink = nn.Parameter(torch.zeros(args.n_heads, dtype=torch.float32))
        self.wq_a = Linear(args.dim, args.q_lora_rank, dense, block, trainable=tr)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, args.n_heads * args.head_dim, dense, block, trainable=tr)
        self.wkv = Linear(args.dim, args.head_dim, dense, block, trainable=tr)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        # wo_a is FP8 in the official checkpoint and bf16 after conversion (REF dequantizes it)
        self.wo_a = Linear(args.n_heads * args.head_dim // args.o_groups, args.o_groups * args.o_lora_rank,
                           storage_dtype(args.wo_a_dtype or args.dtype), block, trainable=tr)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.dim, dense, block, trainable=tr)
        self.compressor = Compressor(args, spec) if spec.owns_kv else None
        self.indexer = Indexer(args, spec) if (spec.owns_kv or spec.owns_index) else None

        # compressing layers rotate at compress_rope_theta with YaRN; window-only layers at rope_theta without
        if spec.compress_ratio:
            rope = (args.compress_rope_theta, args.original_seq_len, args.rope_factor)
        else:
            rope = (args.rope_theta, 0, 1.0)
        self.rope = (args.rope_head_dim, args.max_position_embeddings, rope[0], rope[1], rope[2],
                     args.beta_fast, args.beta_slow)

    def freqs(self, positions: slice | torch.Tensor, device, stop: int | None = None) -> torch.Tensor:
        """RoPE rows of `positions` on `device`. For a tensor of positions `stop` (> their maximum)
        saves reading the maximum back from the device."""
        rd, _, base, orig, factor, bf, bs = self.rope
        # a table as long as the positions in use, grown in powers of two (1M rows would be 256 MB)
        if isinstance(positions, slice):
            stop = positions.stop
        elif stop is None:
            stop = int(positions.max()) + 1
        length = 1 << max(stop - 1, 1).bit_length()
        table = rope_frequencies_on(device, rd, max(length, 64), base, orig, factor, bf, bs)
        if isinstance(positions, torch.Tensor) and positions.device != table.device:
            positions = positions.to(table.device)
        return table[positions]

    # ---------------------------------------------------------------- pieces of the forward
    def query(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return qr, rope_tail(q, freqs, self.rope_dim)

    def window_latent(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Window KV before FP8 rounding, RoPE(RMSNorm_kv(W_kv x)): what the cache's FP8 ring packs."""
        return rope_tail(self.kv_norm(self.wkv(x)), freqs, self.rope_dim)

    def window_kv(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return qat(formats.fp8_fake_quant, self.window_latent(x, freqs), 32)  # all 512 dims, rope tail included

    def compress(self, x: torch.Tensor, start_pos: int, cache) -> None:
        """kv-source layers: emit completed groups into the shared main KV and index-key caches."""
        layer = cache.layer(self.spec.id)
        latent = self.compressor(x, layer.compressor_state)
        if latent is None:
            return
        m = self.spec.compress_ratio
        first = layer.n_compressed
        positions = torch.arange(first, first + latent.size(1), device=x.device) * m  # each group at its first token
        freqs = self.freqs(positions, x.device, stop=(first + latent.size(1) - 1) * m + 1)
        # The cache rounds both to their storage grids and attention reads them back from it: the keys
        # to MXFP4, the main entries to C_g = FP4(RoPE(c_g)) (cache.quantize_main: FP8 or bf16 in a
        # comparison cache). Handing over unrounded values keeps packed == fake-quantized, bit for bit.
        cache.write_index_keys(self.spec.id, self.indexer.key_latent(latent, freqs))  # keys use the pre-RoPE latent
        cache.write_compressed(self.spec.id, rope_tail(latent, freqs, self.rope_dim))

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        o = rope_tail(o, freqs, self.rope_dim, inverse=True)
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.n_groups, -1)
        if not self.wo_a.trainable and host.fixed_order_applies(o, self.wo_a.weight):
            # CPU inference: each group's product summed in a fixed order (a row's numbers do not depend on
            # the rows beside it, model/batch_cache.py), from the cached fp32 weight
            w = self.wo_a.weight if self.wo_a.kind == "dense" else self.wo_a.dequantized_weight()
            o = host.fixed_order_grouped_linear(o, w, self.n_groups).to(o.dtype)
        else:
            wo_a = self.wo_a.dequantized_weight(o.dtype).view(self.n_groups, self.o_lora_rank, -1)
            o = torch.einsum("btgd,grd->btgr", o, wo_a)  # block-diagonal: each group projects only its heads
        return self.wo_b(o.flatten(2))

    def block_attention(self, x: torch.Tensor, positions: torch.Tensor, context_kv: torch.Tensor,
                        context_idx: torch.Tensor) -> torch.Tensor:
        """DSpark drafting: N blocks of S tokens at positions [N, S] attend to their context (window KV
        built from the target model's taps, context_kv [N, R, D] with context_idx [N, R], -1 = empty)
        plus every position of their own block (non-causal inside the block)."""
        N, S, _ = x.shape
        freqs = self.freqs(positions.flatten(), x.device).view(N, S, -1)
        _, q = self.query(x, freqs)
        kv = torch.cat([context_kv.to(x.dtype), self.window_kv(x, freqs)], dim=1)
        R = context_kv.size(1)
        own = torch.arange(R, R + S, device=x.device).expand(N, S, S)
        idx = torch.cat([context_idx.unsqueeze(1).expand(N, S, R), own], dim=-1)
        o = sparse_attention(q, kv, self.attn_sink, idx, self.scale)
        return self.output(o, freqs)

    def indexer_kl(self, q: torch.Tensor, compressed: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Training signal for the indexer (as DeepSeek-V3.2 trains its lightning indexer): KL from the
        main attention's distribution over the compressed entries, summed over heads and renormalized
        (a detached target), to the softmax of the indexer scores. Only queries that see an entry count."""
        logits = torch.einsum("bthd,bnd->bthn", q.float(), compressed.float()) * self.scale
        visible = torch.isfinite(scores)  # invisible entries (and those outside the pool) are -inf
        logits = logits.masked_fill(~visible.unsqueeze(2), -torch.inf)
        rows = visible.any(-1)
        if not rows.any():
            return scores.new_zeros(())
        target = torch.softmax(logits[rows], dim=-1).sum(dim=1).detach()  # [N, n]
        target = target / target.sum(-1, keepdim=True)
        log_p = torch.log_softmax(scores[rows], dim=-1)
        return (target * (torch.log(target.clamp_min(1e-30)) - log_p.clamp_min(-1e4))).sum(-1).mean()

    def decode(self, x: torch.Tensor, cache, shared) -> torch.Tensor:
        """One token per row of a continuous batch: x [R,1,dim] normalized sub-layer input, row b at its own
        position p_b (model/batch_cache.py). The same equations as `forward` over the same stored bytes,
        with per-row positions and REF's decode widths: each row attends to its W window slots (-1 past
        its newest) and `index_topk` main entries (-1 where fewer are visible), whatever the other rows hold."""
        stop = cache.rope_stop()
        freqs = cache.step_memo(("freqs", self.rope, stop),  # the same rows for every layer of one RoPE
                                lambda: self.freqs(cache.positions[:cache.rows].unsqueeze(1), x.device, stop=stop))
        qr, q, latent = self.decode_inputs(x, freqs)
        cache.write_window(self.spec.id, WINDOW_CODEC.pack(latent))
        main_codes = main_scales = top = None
        if self.spec.compress_ratio:
            if self.spec.owns_kv:
                self.compress_step(x, cache, stop)
            src = self.spec.kv_source
            n = cache.entries(src)
            if self.spec.owns_index:
                shared.topk = (self.indexer.decode(x, qr, cache.index_key_rows(src, n), freqs, cache.visible(src),
                                                   shared) if n else
                               torch.full((x.size(0), 1, self.indexer.topk), -1, dtype=torch.long, device=x.device))
            if n:
                (main_codes, main_scales), top = cache.main_rows(src, n), shared.topk
        o = kernels_attention.sparse_attention_packed(q, *cache.window_rows(self.spec.id), main_codes, main_scales,
                                                      self.attn_sink, cache.window_index(self.spec.id), top,
                                                      self.scale, window_values=cache.window_decoded(self.spec.id))
        return self.decode_output(o, freqs)

    def decode_inputs(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qr, q) = query(x, freqs) and window_latent(x, freqs) of a decode step: on the CPU one C call
        (host.attention_inputs: the same calls in one; benchmarks/results/cpu-fused-calls), where every piece
        takes the host path it takes alone; else the two methods."""
        wq_a, wq_b, wkv = self.wq_a.host_matrix(), self.wq_b.host_matrix(), self.wkv.host_matrix()
        block = self.wq_a.block
        if (wq_a is not None and wq_b is not None and wkv is not None
                and host.takes(x, self.q_norm.weight, self.kv_norm.weight)
                and self.wq_b.block == block and self.wkv.block == block and x.size(-1) % block == 0
                and self.wq_a.out_features % block == 0 and x.dim() == 3 and x.size(1) == 1
                and min(self.wq_a.out_features, self.head_dim) >= host.SUM_LANES and host.rope_fits(x, freqs)):
            return host.attention_inputs(x, block, wq_a, self.wq_a.out_features, self.q_norm.weight, self.q_norm.eps,
                                         wq_b, self.n_heads, self.head_dim, wkv, self.kv_norm.weight,
                                         self.kv_norm.eps, freqs, self.rope_dim)
        return (*self.query(x, freqs), self.window_latent(x, freqs))

    def decode_output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """output(o, freqs) of a decode step: on the CPU one C call (host.attention_output: the same calls in one),
        where each piece takes the host path it takes alone; else `output`."""
        wo_b = self.wo_b.host_matrix()
        G = self.n_groups
        if (wo_b is not None and not self.wo_a.trainable and host.takes(o) and o.dim() == 4 and o.size(1) == 1
                and host.rope_fits(o, freqs) and (self.n_heads * self.head_dim) % G == 0
                and (G * self.o_lora_rank) % self.wo_b.block == 0):
            w = self.wo_a.weight if self.wo_a.kind == "dense" else self.wo_a.dequantized_weight()
            return host.attention_output(o, freqs, self.rope_dim, w, G, self.wo_b.block, wo_b, self.wo_b.out_features)
        return self.output(o, freqs)

    def compress_step(self, x: torch.Tensor, cache, stop: int) -> None:
        """kv-source layers in a decode step: this token's projection joins each row's open group; every
        row writes its group's entry at its next index, counted where the group completes (batch_cache.py)."""
        c = self.compressor
        if c.ratio == 1:
            latent = c.norm(c.wkv(x))
        else:
            # the fp32 projections in the fixed order on the CPU (host.fixed_order_linear; elsewhere on a fixed row
            # count where host.FIXED_ROWS is set): MKL's sgemm and cuBLAS's sum a row differently when the step has
            # one row (a GEMV) and when it has more, so a row's group latent, and from it the row's tokens, would
            # depend on the batch (found 2026-12-03 on the CPU: 1 row of 32 requests)
            xf = x.float()
            kv, score = cache.open_group(self.spec.id, host.fixed_order_linear(xf, c.wkv.weight, fixed_rows=True),
                                         host.fixed_order_linear(xf, c.wgate.weight, fixed_rows=True))
            latent = c.norm((kv * score.softmax(dim=1)).sum(dim=1, keepdim=True).to(x.dtype))
        freqs = self.freqs(cache.entry_positions(self.spec.id).unsqueeze(1), x.device, stop=stop)
        keys = INDEX_KEY_CODEC.pack(self.indexer.key_latent(latent, freqs))
        cache.append_entry(self.spec.id, FP4_E4M3.pack(rope_tail(latent, freqs, self.rope_dim)), keys)

    def forward(self, x: torch.Tensor, start_pos: int, cache, shared) -> torch.Tensor:
        """x [B,T,dim] normalized sub-layer input at positions start_pos..start_pos+T-1.

        Inference reads the cache's stored bytes (FP8 window rows, FP4 main entries, MXFP4 index keys) and
        hands them to model/kernels/ (decoded in the Triton kernels on CUDA; unpacked to the same values by
        their references elsewhere). Training, and the comparison main formats, read values."""
        B, T, _ = x.shape
        freqs = self.freqs(slice(start_pos, start_pos + T), x.device)
        qr, q = self.query(x, freqs)
        window_latent = self.window_latent(x, freqs)
        packed = cache.reads_packed(self.spec.id, window_latent)
        if packed:  # [cached ring rows ; these tokens], FP8 bytes; the fused packer runs once for both uses
            new_rows = WINDOW_CODEC.pack(window_latent)
            window = tuple(torch.cat(pair, dim=1) for pair in zip(cache.window_bytes_before(self.spec.id, start_pos),
                                                                    new_rows))
            n_window = window[0].size(1)
        else:  # = what the FP8 ring returns for them
            new_rows = None
            window = torch.cat([cache.window_before(self.spec.id, start_pos),
                                qat(formats.fp8_fake_quant, window_latent, 32)], dim=1)
            n_window = window.size(1)
        idx = window_indices(start_pos, T, n_window - T, self.window, x.device).expand(B, -1, -1)
        if shared.image_window is not None:  # image spans also see their later positions (vision.py)
            idx = torch.cat([idx, shared.image_window], dim=-1)
        cache.write_window(self.spec.id, window_latent, start_pos, new_rows)

        top = None
        if self.spec.compress_ratio:
            if self.spec.owns_kv and self.spec.id not in shared.precompressed:
                self.compress(x, start_pos, cache)
            src = self.spec.kv_source
            if self.spec.owns_index:
                if cache.layer(src).n_compressed == 0:
                    shared.topk = torch.full((B, T, 0), -1, dtype=torch.long, device=x.device)
                else:
                    keys = cache.index_key_bytes(src) if packed else cache.index_keys_for(src)
                    shared.topk, scores = self.indexer(x, qr, keys, freqs, start_pos, shared)
                    if shared.aux is not None:
                        shared.aux.setdefault("indexer_kl", []).append(
                            self.indexer_kl(q, cache.compressed(src), scores))
            top = shared.topk

        if packed:
            main_codes = main_scales = main_idx = None  # window only
            if top is not None and top.size(-1):  # columns in the Top-K: the source has entries
                (main_codes, main_scales), main_idx = cache.main_bytes(src), top
            o = kernels_attention.sparse_attention_packed(q, *window, main_codes, main_scales, self.attn_sink, idx,
                                                          main_idx, self.scale)
        else:
            kv = window
            if top is not None:
                idx = torch.cat([idx, torch.where(top >= 0, top + kv.size(1), -1)], dim=-1)
                kv = torch.cat([kv, cache.compressed(src).to(kv.dtype)], dim=1)
            o = sparse_attention(q, kv, self.attn_sink, idx, self.scale)
        return self.output(o, freqs)
