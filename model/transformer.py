"""The whole V4.1 model (spec §4.2), reading top to bottom like the forward pass:

    h = embed(ids)                                   image positions take vision embeddings
    X = [h, h, h, h]; pre = one-hot(stream 0)        four residual streams (mHC)
    rows = engram hashes of the ids                  computed once, used at the Engram layers
    for l in 0..L-1:
        X = Engram_l(X, rows)                        only before layers 1 and 14
        X, pre = Block_l(X, pre)                     attention then MoE, single-pass mHC
    logits = head(RMSNorm(sum_j pre_j X_j))          fp32

`Transformer.forward` is both the full-sequence reference (start_pos 0, no cache given) and the
incremental step (a `KVCache` carried across calls); one code path serves both.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import formats, mhc
from dsv41.model.block import Block, SharedState  # one layer (model/block.py); importable from here as before
from dsv41.model.cache import KVCache
from dsv41.model.config import ModelArgs
from dsv41.model.kernels import host
from dsv41.model.kernels import reference as kernels_reference
from dsv41.model.layers import Linear, RMSNorm


class Head(nn.Module):
    """Output projection; stored bf16, applied in fp32 so logits come out fp32.

    On the CPU each logit is summed over the hidden size in a fixed order (reference.head_logits, host.head_logits
    in C): a row's logits depend neither on the rows computed with it nor on the CPU, so a decode step computes
    the head on its rows in use only (`row_independent`); gradients, where wanted, come from the GEMMs of the
    same product. On CUDA it is one GEMM with fp32 sums: on bf16 inputs cuBLAS's bf16 GEMM with fp32 output,
    which forms the same exact products from the stored weight (widening bf16 to fp32 is exact) and reads half
    the bytes of an fp32 GEMM on the widened weight (the head was a decode step's largest kernel: 623 against
    304 µs at V4.1-Flash's shape on an H200, benchmarks/bench_decode_gemms.py); only the fp32 summation order
    differs, as between any two BLAS libraries."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim, dtype=torch.bfloat16))
        self._fp32: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        if not self.row_independent(x):
            if x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and not wants_grad:
                return torch.mm(x.reshape(-1, x.size(-1)), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
            return F.linear(x.float(), self.fp32_weight())
        if wants_grad:
            return _FixedOrderHead.apply(x, w, self.host_weight())
        rows = x.numel() // x.size(-1)
        if self.weight.dtype == torch.bfloat16 and host.available() and rows <= host.head_bf16_max_rows():
            # a decode step of one or a few sequences: the bf16 weight read in column blocks, the same sums
            xf = x.detach().float().reshape(rows, -1).contiguous()
            V = self.weight.size(0)
            return host.head_logits_bf16(xf, host.head_blocks(self.weight), V).view(*x.shape[:-1], V)
        return fixed_order_logits(x, self.host_weight())

    @staticmethod
    def row_independent(x: torch.Tensor) -> bool:
        """True when forward(x) computes each row on its own, in an order fixed for every CPU."""
        return x.device.type == "cpu"

    def fp32_weight(self) -> torch.Tensor:
        """The weight widened to fp32, kept until the weight changes (widening the vocabulary-sized matrix
        took most of a decode step of the bundled model). Training widens it on the fly (gradients)."""
        w = self.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return w.float()
        self._fp32 = self._kept(self._fp32, lambda: w.detach().float())
        return self._fp32[1]

    def host_weight(self) -> torch.Tensor:
        """The weight widened to fp32 and transposed, [dim, vocab] (host.head_logits walks the vocabulary
        contiguously), kept until the weight changes: host.transposed, the cache every fixed-order GEMM uses."""
        return host.transposed(self.weight)

    def _kept(self, cached: tuple | None, make) -> tuple:
        w = self.weight
        key = (w._version, w.data_ptr(), w.device)
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # an ordinary tensor, usable anywhere
                cached = (key, make())
        return cached


def fixed_order_logits(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 logits [..., V] on the CPU, wt = the weight widened and transposed [K, V]."""
    xf = x.detach().float().reshape(-1, x.size(-1)).contiguous()
    fn = host.head_logits if host.available() else kernels_reference.head_logits
    return fn(xf, wt).view(*x.shape[:-1], -1)


class _FixedOrderHead(torch.autograd.Function):
    """fixed_order_logits in the forward; the gradients of x W^T (the sum's order does not change them)."""

    @staticmethod
    def forward(ctx, x, weight, wt):
        ctx.save_for_backward(x, weight)
        return fixed_order_logits(x, wt)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1))
        gx = (g @ weight.float()).view(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.detach().float().reshape(-1, x.size(-1))).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, tokenizer=None):
        super().__init__()
        if args.family != "v4.1":
            raise ValueError("the forward pass implements DeepSeek-V4.1; V4 configs are supported by the "
                             "ledgers (dsv41 info) only")
        self.args = args
        self.plan = args.plan
        self.embed = nn.Embedding(args.vocab_size, args.dim, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(Block(args, spec) for spec in self.plan.layers)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = Head(args.vocab_size, args.dim)
        self.mtp = nn.ModuleList()
        if args.dspark_enabled:
            from dsv41.model.dspark import DSparkStage

            self.mtp.extend(DSparkStage(args, spec, k) for k, spec in enumerate(self.plan.extra))
        if args.vision_enabled:
            from dsv41.model.vision import Aligner, VisionTransformer

            self.vision = VisionTransformer(args)
            self.aligner = Aligner(args)
            self.image_start = nn.Parameter(torch.zeros(args.dim, dtype=torch.bfloat16))
            self.image_end = nn.Parameter(torch.zeros(args.dim, dtype=torch.bfloat16))
            self.image_newline = nn.Parameter(torch.zeros(args.dim, dtype=torch.bfloat16))
        # "bidirectional": inside an image span the sliding window sees the whole span (spec §4.4, as
        # vLLM serves V4.1); "causal": S0's reference forward, whose window stays causal over images
        self.image_attention = "bidirectional"
        self.batch_images = False  # training: one ViT call per image size (vision.encode_images)
        self._tokenizer = tokenizer
        self._hasher = None

    # ------------------------------------------------------------------ engram hashing
    @property
    def hasher(self):
        """Token ids -> Engram table rows; built on first use from the tokenizer (it needs the vocabulary)."""
        if self._hasher is None and self.args.engram_layer_ids:
            from dsv41.model.engram import NgramHasher
            from dsv41.model.tokenizer import load_tokenizer

            tok = self._tokenizer or load_tokenizer()
            self._hasher = NgramHasher.from_tokenizer(self.args, tok).to(self.embed.weight.device)
        return self._hasher

    # ------------------------------------------------------------------ images
    def merge_image_embeddings(self, h: torch.Tensor, images, start_pos: int = 0) -> torch.Tensor:
        """h [B, T, dim] with each image span replaced by its embeddings: START/NEWLINE/END learned,
        IMAGE slots the aligner rows of the ViT features (vision.py). Out of place, differentiable."""
        from dsv41.model import vision

        flat = [(b, img) for b, row in enumerate(images) for img in (row or ())]
        rows = vision.encode_images(self.vision, self.aligner, [img for _, img in flat], self.batch_images)
        batch_idx, pos_idx, values = [], [], []
        for (b, img), r in zip(flat, rows):
            n = img.types.numel()
            values.append(vision.span_embeddings(img.types, r, self.image_start, self.image_newline, self.image_end))
            batch_idx.append(torch.full((n,), b, dtype=torch.long))
            pos_idx.append(torch.arange(img.start - start_pos, img.end - start_pos))
        index = (torch.cat(batch_idx).to(h.device), torch.cat(pos_idx).to(h.device))
        return h.index_put(index, torch.cat(values).to(h.dtype))

    # ------------------------------------------------------------------ forward
    def _replay_split(self, ced: str, seqlen: int, images) -> int | None:
        """Where the decoder starts in a CED `replay` prefill (None: every layer sees every token)."""
        if ced not in ("full", "replay"):
            raise ValueError(f"ced must be 'full' or 'replay', not {ced!r}")
        if ced == "full" or seqlen <= self.args.window_size or self.args.family != "v4.1":
            return None
        if images is not None:
            raise ValueError("CED replay prefill does not take images (image spans need the full forward)")
        return seqlen - self.args.window_size

    def new_cache(self, batch_size: int, **kw) -> KVCache:
        return KVCache(self.args, batch_size, self.embed.weight.device, **kw)

    def new_batch_cache(self, n_rows: int, max_len: int):
        """The cache of a continuous batch (`decode`): n_rows sequences of up to max_len positions each."""
        from dsv41.model.batch_cache import BatchCache

        return BatchCache(self.args, n_rows, max_len, self.embed.weight.device)

    def forward(self, ids: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                image_mask: torch.Tensor | None = None, all_logits: bool = False,
                return_taps: bool = False, aux: dict | None = None, images=None, ced: str = "full",
                bounded_replay: bool = False, head: bool = True):
        """ids [B, T] at positions start_pos..start_pos+T-1 -> logits [B, V] (last position) or
        [B, T, V] with all_logits. Without a cache the call is a full-sequence forward from position 0.
        With return_taps, also the DSpark taps [B, T, len(targets) * dim] (residual entering each
        target layer, averaged over streams). `aux` (training) collects auxiliary losses.

        images: per sequence of the batch, the `vision.ImageInput`s whose spans lie in this chunk
        (absolute positions; `vision.expand_image_placeholders` builds them). Their positions take the
        vision embeddings, route with `bias_vl`, are dead to Engram and see their whole span in the
        sliding window. image_mask [B, T] (True inside image spans) defaults to the spans of `images`.

        ced: "full" runs every layer on every token (exact). "replay" (spec §4.5, CED prefill) runs the
        encoder on every token, builds the decoder's global KV from layer L/2's projection of the encoder
        output for every token, and runs the decoder only on the last `window_size` tokens with
        truncated SWA (Decoder SWA Bounded Replay); logits and taps then cover those tokens only.

        bounded_replay: these tokens are already in the cache's global KV (a persistent prefix-cache
        hit without its SWA state): rebuild the window rings by running every layer on them with
        truncated SWA (windows start at start_pos), without writing compressed entries again.

        head: False returns the final-normed hidden states [B, T, dim] (or [B, dim]) instead of logits, for
        callers that need logits only at some positions and apply `self.head` to them in blocks (scoring:
        evals/bpb.py), rather than materialize [B, T, vocab].

        Inference callers should run under torch.inference_mode(); gradients flow when they are enabled."""
        if cache is None:
            if start_pos != 0:
                raise ValueError("a forward from start_pos > 0 needs the cache of the earlier positions")
            cache = self.new_cache(ids.size(0))
        if start_pos != cache.pos:
            raise ValueError(f"cache holds {cache.pos} positions but the input starts at {start_pos}")
        shared = SharedState(aux=aux)
        if bounded_replay:
            shared.precompressed = frozenset(self.args.kv_source_layers)
            for spec in self.plan.layers:
                cache.set_window_floor(spec.id, start_pos)
        if images is not None and not any(images):
            images = None
        if images is not None:
            from dsv41.model import vision  # text-only forwards never load the vision code

            if isinstance(images[0], vision.ImageInput):  # a flat list: the images of a one-sequence batch
                images = [images]
            if not self.args.vision_enabled:
                raise ValueError("this model has no vision tower (vision_n_layers = 0) but images were given")
            vision.check_spans_in_chunk(images, start_pos, ids.size(1))
            if image_mask is None:
                image_mask = vision.image_mask_from_inputs(images, ids.size(0), start_pos, ids.size(1), ids.device)
            if self.image_attention == "bidirectional":
                n_prev = min(start_pos, self.args.window_size)  # what cache.window_before hands attention
                shared.image_window = vision.image_window_indices(images, start_pos, ids.size(1), n_prev,
                                                                  self.args.window_size, ids.device)
        rows = None
        if self.hasher is not None:
            rows, cache.engram_history = self.hasher(ids, image_mask, cache.engram_history)
        engram_mask = None if image_mask is None else ~image_mask
        x = self.embed(ids if images is None else ids.masked_fill(image_mask, 0))  # span ids are overwritten
        if images is not None:
            x = self.merge_image_embeddings(x, images, start_pos)
        x = x.unsqueeze(2).repeat(1, 1, self.args.hc_mult, 1)
        pre = mhc.identity_pre(x)
        taps = []
        replay_at = self._replay_split(ced, ids.size(1), images)
        block_start = start_pos
        for block in self.layers:
            spec = block.spec
            if replay_at is not None and spec.id == self.args.n_layers // 2:
                # CED: layer L/2 projects the encoder output of every token to the decoder's global KV;
                # the decoder itself then runs on the tail only, its windows starting at the tail
                block.attn.compress(block.attn_norm(mhc.collapse(x, pre)), start_pos, cache)
                shared.precompressed = frozenset({spec.id})
                x, pre = x[:, replay_at:], pre[:, replay_at:]
                rows = None if rows is None else rows[:, replay_at:]
                engram_mask = None if engram_mask is None else engram_mask[:, replay_at:]
                block_start = start_pos + replay_at
                for later in self.plan.layers[spec.id:]:
                    cache.set_window_floor(later.id, block_start)
            if block.engram is not None:
                x = block.engram(x, rows[:, :, spec.engram], engram_mask)
            if spec.dspark_tap:
                taps.append(x.float().mean(dim=2).to(x.dtype))
            x, pre = block(x, pre, block_start, cache, shared, image_mask)
        cache.pos = start_pos + ids.size(1)
        u = mhc.collapse(x, pre)
        if not all_logits:
            u = u[:, -1]
        logits = self.head(self.norm(u)) if head else self.norm(u)
        if return_taps:
            return logits, (torch.cat(taps, dim=-1) if taps else None)
        return logits


    def decode(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One token for each of the rows in use 0..B-1 of a continuous batch, each at its own position:
        ids [B] -> logits [B, V] (fp32). `cache` is a `BatchCache` (model/batch_cache.py); those rows advance
        by one. The step computes the rows BatchCache.prepare_step says (the rows in use, padded with free
        rows where the CPU's GEMMs are MKL's, see there); the head, whose rows are independent on the CPU
        (Head), only the B rows in use."""
        B = ids.size(0)
        R = cache.prepare_step(B)
        if R > B:
            ids = torch.cat([ids, ids.new_zeros(R - B)])
        logits = self.decode_rows(ids, cache, head_rows=B)
        cache.advance()
        return logits[:B]

    def decode_rows(self, ids: torch.Tensor, cache, head_rows: int | None = None) -> torch.Tensor:
        """The device work of `decode` on all the step's rows (ids [R] -> logits [R, V]), no host reads: the
        part a CUDA graph captures (model/engine.py). The same layers as `forward`, their attention in its
        per-row form (`Block.decode`). head_rows: compute the logits of the first head_rows rows only, where
        the head's rows are independent (else every row: the GEMMs' row count is the cache's, batch_cache.py)."""
        # on the CPU a row's sigmoid/softplus bits whatever the row count (reference.per_row: ATen's vector/scalar
        # rounding split is the CPU's)
        with kernels_reference.row_invariant() if ids.device.type == "cpu" else contextlib.nullcontext():
            return self._decode_rows(ids, cache, head_rows)

    def _decode_rows(self, ids: torch.Tensor, cache, head_rows: int | None) -> torch.Tensor:
        ids = ids.view(-1, 1)
        R = ids.size(0)
        cache.begin_step()
        rows = None
        if self.hasher is not None:
            rows, cache.engram_history[:R] = self.hasher(ids, None, cache.engram_history[:R])
        x = self.embed(ids).unsqueeze(2).repeat(1, 1, self.args.hc_mult, 1)
        pre = mhc.identity_pre(x)
        shared = SharedState()
        for block in self.layers:
            if block.engram is not None:
                x = block.engram(x, rows[:, :, block.spec.engram], None)
            x, pre = block.decode(x, pre, cache, shared)
        cache.advance_positions()
        hidden = self.norm(mhc.collapse(x, pre)[:, -1])
        if head_rows is not None and head_rows < R and Head.row_independent(hidden):
            hidden = hidden[:head_rows]
        return self.head(hidden)

# ---------------------------------------------------------------------------------- random weights
@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill every parameter with random values of sensible scale, quantized into its storage format
    (FP8 + UE8M0 block scales, packed FP4 + UE8M0): a stand-in checkpoint for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, s=std):
        return torch.randn(shape, generator=g) * s

    for name, module in model.named_modules():
        if isinstance(module, Linear):
            w = normal((module.out_features, module.in_features), std * (module.in_features / 32) ** -0.25)
            if module.trainable:
                module.weight.copy_(w)
            elif module.kind == "fp8":
                q, s = formats.quant_fp8_weight(w, module.block)
                module.weight.copy_(q), module.scale.copy_(s)
            elif module.kind == "fp4":
                q, s = formats.quant_fp4_weight(w, 32)
                module.weight.copy_(q.view(torch.int8)), module.scale.copy_(s)
            else:
                module.weight.copy_(w.to(module.weight.dtype))
            if module.bias is not None:
                module.bias.copy_(normal(module.bias.shape).to(module.bias.dtype))
    for name, p in model.named_parameters():
        if p.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu) and "engram.embed" not in name:
            continue  # quantized linears were filled above
        init_random_param_(model, name, p, normal, std)
    return model


@torch.no_grad()
def init_random_param_(model: nn.Module, name: str, p: torch.Tensor, normal, std: float) -> bool:
    """The random value of one parameter that is not a Linear's weight (norms, mHC, sinks, biases,
    Engram rows, embeddings, ...), drawn with `normal(shape, scale)`. False when no rule applies (a
    Linear's own parameter, or one this function does not know)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
        p.copy_(1.0 + normal(p.shape, 0.1))
    elif "_fn" in leaf:
        p.copy_(normal(p.shape, 0.5 / p.shape[1] ** 0.5))
    elif leaf.endswith("_scale") and leaf.startswith("hc_"):
        p.fill_(0.5)
    elif leaf.endswith("_base"):
        p.copy_(normal(p.shape, 0.5))
    elif leaf == "attn_sink":
        p.copy_(normal(p.shape, 1.0))
    elif leaf in ("bias", "bias_vl") and p.dtype == torch.float32:
        p.copy_(normal(p.shape, 0.1))
    elif "engram.embed" in name:
        if leaf == "weight" and p.dtype == torch.float32:  # trainable master copy
            p.copy_(normal(p.shape, 1.0))
        elif leaf == "weight":
            q, s = _quant_rows_fp8(normal(p.shape, 1.0))
            p.copy_(q)
            model.get_parameter(name[: -len("weight")] + "scale").copy_(s)
    elif leaf in ("q_weight", "k_weight"):
        p.copy_(1.0 + normal(p.shape, 0.1))
    elif p.dtype in (torch.bfloat16, torch.float32) and not _is_linear_param(model, name):
        p.copy_(normal(p.shape, 1.0 if "embed" in name or "image_" in name else std).to(p.dtype))
    else:
        return False
    return True


def _quant_rows_fp8(rows: torch.Tensor, block: int = 32):
    """Per-row FP8 with one UE8M0 scale per `block` values (the Engram table's format)."""
    q, s = formats.pack_fp8_ue8m0(rows, block)
    return q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def _is_linear_param(model: nn.Module, name: str) -> bool:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return isinstance(owner, Linear)
