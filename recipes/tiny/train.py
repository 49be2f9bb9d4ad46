"""Train dsv41-tiny and write it as an official-layout checkpoint.

    python -m dsv41.recipes.tiny.train --data .tinydata --out model/assets/dsv41-tiny \
        --backbone-seconds 300 --dspark-seconds 75            # on one H200 (see README.md)

Two phases, as the V4.1 report trains its drafter:

1. Backbone. Next-token cross-entropy on 512-token windows sampled from the four families
   (prose 28%, code 28%, literature 22%, reasoning 22% of rows), plus the indexer's KL loss against
   the main attention (`aux["indexer_kl"]`, weight 0.1). Every FP8/FP4 linear and both Engram tables
   train as fp32 masters with quantization-aware rounding onto their storage grids (`trainable=True`),
   so the exported checkpoint computes what training computed. The MoE selection bias is kept out of
   the optimizer and updated by the aux-loss-free rule b += gamma * sign(mean load - load), gamma 5e-3
   (large for a run of a few hundred steps).
2. DSpark. The backbone is frozen (its bf16 parameters first rounded to bf16, so the drafter trains
   against exactly the shipped backbone). For many anchors per sequence in parallel: the block is
   [token at P+1, noise x4] at positions P+1..P+5, its context the stage window KV of the target's
   taps at positions P-63..P; labels are the tokens at P+2..P+6. Loss: cross-entropy on the
   teacher-forced Markov logits plus BCE for the confidence head, whose target is whether that
   position's argmax equals its label (detached).

`--init-from CKPT` continues from an exported checkpoint (masters start at the stored values) and
`--mix` changes the family weights: each stage of the bundled model after the first continues the one
before (README.md, "Training run").

Schedules run on wall-clock budgets (the learning rate follows the fraction of the budget spent), so
a run fits its time slot on any machine; the step counts reached are logged. The output head's
cross-entropy is computed in row chunks under activation checkpointing: the full [tokens, 129280]
logits of a 64K-token batch would not fit.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

REPO = Path(__file__).resolve().parents[2]
FAMILY_WEIGHTS = {"prose": 0.28, "code": 0.28, "literature": 0.22, "reasoning": 0.22}
MAX_SHARD_BYTES = 15 << 20  # every shard under 16 MiB


# ------------------------------------------------------------------------------------ data
def load_streams(data_dir: Path, names=FAMILY_WEIGHTS) -> dict[str, torch.Tensor]:
    """The token streams of the named families (e.g. `reasoning_undo`, the reasoning task in its "undo"
    trace style, which `build_data --reasoning-only undo` adds)."""
    from dsv41.recipes.tiny.build_data import load_tokens

    missing = [name for name in names if not (data_dir / f"{name}.u32.xz").exists()]
    if missing:
        raise SystemExit(f"no training stream for {', '.join(missing)} in {data_dir} (python -m dsv41.recipes.tiny.build_data)")
    return {name: torch.from_numpy(load_tokens(data_dir / f"{name}.u32.xz").astype(np.int64)) for name in names}


def parse_mix(text: str) -> dict[str, float]:
    """'prose=0.15,code=0.35' -> {'prose': 0.15, 'code': 0.35} (--mix, --mask-weight)."""
    try:
        return {k: float(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise SystemExit(f"expected name=number pairs separated by commas, got {text!r}") from None


def load_masks(data_dir: Path, names, scale: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The per-token loss masks of the families that have one (`{name}.mask.u8.xz`, as long as the stream: 1 =
    a target trained on, 0 = context only; the v2 reasoning family marks its injected slips so, the tool-call
    family everything but the assistant's turns). `scale[name]` multiplies a family's trained targets
    (`--mask-weight`): the loss divides by every token of a row, so a family whose rows are mostly context
    otherwise gets a fraction of a plain row's gradient."""
    from dsv41.recipes.tiny.build_data import load_tokens

    out = {}
    scale = scale or {}
    for name in names:
        path = data_dir / f"{name}.mask.u8.xz"
        if path.exists():
            out[name] = torch.from_numpy(load_tokens(path, np.uint8).astype(np.float32)) * scale.get(name, 1.0)
    unmasked = sorted(set(scale) - set(out))
    if unmasked:
        raise SystemExit(f"--mask-weight {', '.join(unmasked)}: not a family of the mix with a loss mask in {data_dir}")
    return out


def load_token_map(data_dir: Path) -> torch.Tensor:
    from dsv41.recipes.tiny.build_data import load_tokens

    return torch.from_numpy(load_tokens(data_dir / "engram_token_map.i32.xz", np.int32).astype(np.int64))


class WindowSampler:
    """Rows of `length` consecutive tokens from the family streams, families drawn by weight."""

    def __init__(self, streams: dict[str, torch.Tensor], weights: dict[str, float], seed: int = 0,
                 masks: dict[str, torch.Tensor] | None = None):
        self.names = list(weights)
        self.streams = [streams[n] for n in self.names]
        self.masks = [(masks or {}).get(n) for n in self.names]
        for name, s, m in zip(self.names, self.streams, self.masks):
            if m is not None and m.numel() != s.numel():
                raise ValueError(f"{name}: the loss mask has {m.numel()} entries for {s.numel()} tokens")
        self.probs = torch.tensor([weights[n] for n in self.names], dtype=torch.float64)
        self.g = torch.Generator().manual_seed(seed)
        self.last_mask: torch.Tensor | None = None  # [B, length] of the last sample when any family has a mask

    def sample(self, batch: int, length: int) -> torch.Tensor:
        fam = torch.multinomial(self.probs, batch, replacement=True, generator=self.g)
        rows, masks = [], []
        for f in fam.tolist():
            s = self.streams[f]
            start = int(torch.randint(0, s.numel() - length, (1,), generator=self.g))
            rows.append(s[start:start + length])
            m = self.masks[f]
            masks.append(m[start:start + length] if m is not None else torch.ones(length))
        self.last_mask = torch.stack(masks) if any(m is not None for m in self.masks) else None
        return torch.stack(rows)


class ImageBatches(torch.utils.data.IterableDataset):
    """Endless batches of synthetic picture questions (recipes/tiny/vision/data.py) in both V4.1 chat
    formats, as (ids [B, T], image inputs, reply mask [B, T]); each DataLoader worker draws with its own
    seed, so drawing and preprocessing (CPU) overlap the GPU step. `variety`: the share of batches of v2
    pictures (True: all; vision/train.py variety_step)."""

    def __init__(self, tokenizer_dir: Path, args, batch: int, seed: int = 0, variety: float = 0.0, style: int = 1):
        self.tokenizer_dir, self.args, self.batch, self.seed, self.variety = tokenizer_dir, args, batch, seed, variety
        self.style = style  # what a v2 batch draws: data.make_example's variety (2: shapes at any orientation)

    def __iter__(self):
        from dsv41.model.tokenizer import load_tokenizer
        from dsv41.recipes.tiny.vision.train import make_batch, variety_step

        info = torch.utils.data.get_worker_info()
        rng = random.Random(1000 * self.seed + 1 + (info.id if info else 0))
        mix_rng = random.Random(1000 * self.seed + 501 + (info.id if info else 0))
        tokenizer = load_tokenizer(self.tokenizer_dir)
        while True:
            yield make_batch(rng, self.batch, tokenizer, self.args, tokenizer.eos_id,
                             variety=variety_step(mix_rng, self.variety) and self.style)


class VisionJob:
    """What the backbone loop needs for joint image training: the batches, every how many steps an
    image batch joins the step, and its loss weight. `bias_vl` follows the aux-loss-free rule over
    image positions only (recipes/tiny/vision/train.py, ImageLoad)."""

    def __init__(self, tokenizer_dir: Path, args, batch: int, every: int, weight: float, seed: int = 0,
                 workers: int = 4, variety: float = 0.0, style: int = 1):
        self.every, self.weight, self.style = every, weight, style
        loader = torch.utils.data.DataLoader(ImageBatches(tokenizer_dir, args, batch, seed, variety, style),
                                             batch_size=None,
                                             num_workers=workers, prefetch_factor=4 if workers else None,
                                             persistent_workers=bool(workers))
        self.batches = iter(loader)
        self.probe = None

    def add_probe(self, model, args, batch: int, weight: float, lr: float, seed: int = 0, workers: int = 4,
                  variety: float = 0.0) -> None:
        """Every image step also adds `weight` x the linear probes' loss on a batch of pictures (colour, shape,
        count, word read straight off the tower's features: recipes/tiny/vision/train.py), which keeps pushing
        the tower to tell the pictures apart while the language model learns to name them. The probes have an
        AdamW of their own at `lr` and are never saved."""
        from dsv41.recipes.tiny.vision.train import Probe, probe_batches

        self.probe = Probe(args.vision_dim).to(model.vision.patch_embed.proj.weight.device)
        self.probe_weight = weight
        self.probe_opt = torch.optim.AdamW(self.probe.parameters(), lr=lr, weight_decay=0.01)
        self.probe_batches = probe_batches(args, batch, seed + 11, variety, workers, self.style)


# ------------------------------------------------------------------------------------ model
class NormedHidden(nn.Module):
    """Stands in for the output head during training: the forward then returns the normalized
    hidden states, and the loss applies the head weight chunk by chunk (see `chunked_ce`)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def build_trainable(args, token_map: torch.Tensor, device, seed: int = 0):
    """The trainable model (fp32 everywhere) with its Engram hasher built from the precomputed map."""
    from dsv41.model.engram import NgramHasher
    from dsv41.model.transformer import Transformer, init_random_

    model = Transformer(args)
    init_random_(model, seed)
    model.float()
    model._hasher = NgramHasher(args, token_map)
    model.to(device)
    model.head = NormedHidden(model.head.weight)
    model.batch_images = True  # one ViT call per image size
    return model


@torch.no_grad()
def load_into_trainable_(model, ckpt_dir: Path) -> bool:
    """Continue training from an exported checkpoint: each master takes the exact real value of its
    stored weight (FP8/FP4 dequantized, Engram rows unpacked), so QAT resumes on the same grid points.
    Returns True when the checkpoint had no vision tower and the model's tower starts fresh."""
    from dsv41.model import formats
    from dsv41.model.checkpoint import load_state_dict

    state, _ = load_state_dict(ckpt_dir)
    fresh = []
    for name, (kind, tensor) in _export_targets(model).items():
        if name not in state and _is_vision_tensor(name):
            fresh.append(name)  # a text-only checkpoint gains a vision tower: it starts from the random init
            continue
        w = state[name]
        scale = state.get(name[: -len("weight")] + "scale")
        if kind == "fp8":
            w = formats.dequant_fp8_weight(w, scale, model.args.fp8_block_size)
        elif kind == "fp4":
            w = formats.dequant_fp4_weight(w, scale, 32)
        elif kind == "engram":
            w = formats.unpack_fp8_ue8m0(w, scale, 32)
        tensor.copy_(w.float().to(tensor.device))
    for name in fresh:
        if name.endswith("bias_vl"):  # images start from the text balance
            model.get_parameter(name).copy_(model.get_parameter(name[: -len("_vl")]))
    return bool(fresh)


VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")


def _is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES) or name.endswith("bias_vl")


def _ce_chunk(h, w, targets):
    return F.cross_entropy(F.linear(h, w), targets, reduction="sum")


def _weighted_ce_chunk(h, w, targets, token_weights):
    return (F.cross_entropy(F.linear(h, w), targets, reduction="none") * token_weights).sum()


def chunked_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 8192,
               token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of head(hidden) against targets without materializing all the logits.
    token_weights (same shape as targets) scale single tokens' terms; the mean still divides by the
    number of tokens, so unweighted tokens keep their gradient."""
    h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    tw = None if token_weights is None else token_weights.reshape(-1).to(torch.float32)
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, h.size(0), chunk):
        if tw is None:
            total = total + checkpoint(_ce_chunk, h[i:i + chunk], weight, t[i:i + chunk], use_reentrant=False)
        else:
            total = total + checkpoint(_weighted_ce_chunk, h[i:i + chunk], weight, t[i:i + chunk], tw[i:i + chunk],
                                       use_reentrant=False)
    return total / h.size(0)


def think_start_weights(inputs: torch.Tensor, think_id: int, weight: float) -> torch.Tensor | None:
    """Loss weights for next-token targets: `weight` where the input token is `<think>`, i.e. for the
    first reasoning token, which is the one the effort line decides (`</think>` at effort 1-19, a
    running sum at 20-69, "Numbers" at 70-100: evals/tasks/tiny_reasoning). None when weight is 1."""
    if weight == 1.0:
        return None
    return torch.where(inputs == think_id, weight, 1.0).to(torch.float32)


def think_end_weights(targets: torch.Tensor, end_id: int, newline_id: int, check_id: int,
                      weight: float) -> torch.Tensor | None:
    """Loss weights for the targets that end the reasoning or go on to the verification pass of effort
    90-100: `weight` where the target is `</think>`, "Check", or the newline right before "Check". After
    the last step the trace either ends (efforts 20-89) or goes on ("\nCheck in reverse:"), and the effort
    line that decides is 60-80 tokens back, beyond the 64-token window, so the choice has to come through
    the compressed KV. None when weight is 1."""
    if weight == 1.0:
        return None
    following = F.pad(targets[:, 1:], (0, 1), value=-1)
    decides = (targets == end_id) | (targets == check_id) | ((targets == newline_id) & (following == check_id))
    return torch.where(decides, weight, 1.0).to(torch.float32)


def closing_sum_weights(targets: torch.Tensor, period_id: int, end_id: int, weight: float) -> torch.Tensor | None:
    """Loss weights for next-token targets: `weight` on the sum that closes a trace ("So 26.</think>",
    "... so the sum is 26.</think>": the target followed by "." and `</think>`). The long traces compute
    the sum in their first pass and must carry it, 20-50 tokens later, into the closing line, from which
    the answer copies it; that copy is where the top tiers lose most of their right answers
    (recipes/tiny/README.md, stage 14). None when weight is 1."""
    if weight == 1.0:
        return None
    then = F.pad(targets[:, 1:], (0, 1), value=-1)
    after = F.pad(targets[:, 2:], (0, 2), value=-1)
    return torch.where((then == period_id) & (after == end_id), weight, 1.0).to(torch.float32)


def reasoning_weights(tok, start_weight: float, end_weight: float, closing_weight: float = 1.0):
    """`--think-start-weight`, `--think-end-weight` and `--closing-sum-weight` as one function of a sampled
    row [B, T+1] -> loss weights of its targets [B, T] (the largest where several apply: at effort 1-19 the
    first reasoning token is `</think>`); None when all are 1."""
    if start_weight == 1.0 and end_weight == 1.0 and closing_weight == 1.0:
        return None
    from dsv41.evals.tasks.tiny_reasoning import reasoning_trace

    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    trace = tok.encode(reasoning_trace([1, 2, 3, 4], 100))
    check = tok.token_to_id("Check")
    at = trace.index(check)  # the verification line as the task writes it: newline, then "Check"
    newline = trace[at - 1]
    if tok.decode([newline]) != "\n":
        raise ValueError("the tokenizer does not split the verification line as newline + 'Check'")

    period = tok.encode(".")
    if len(period) != 1 or tok.encode("26.") != tok.encode("26") + period:
        raise ValueError("the tokenizer does not split a closing sum as number + '.'")

    def weights(ids: torch.Tensor) -> torch.Tensor | None:
        parts = [w for w in (think_start_weights(ids[:, :-1], think, start_weight),
                             think_end_weights(ids[:, 1:], end, newline, check, end_weight),
                             closing_sum_weights(ids[:, 1:], period[0], end, closing_weight)) if w is not None]
        return functools.reduce(torch.maximum, parts)

    return weights


def moe_layers(model, part: str):
    from dsv41.model.moe import MoE

    root = model.layers if part == "backbone" else model.mtp
    return [m for m in root.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_selection_bias(moes, gamma: float) -> None:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded."""
    for moe in moes:
        load = moe.load.float()
        moe.gate.bias.add_(gamma * torch.sign(load.mean() - load))


def lr_at(frac: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    if frac < warmup:
        return peak * frac / warmup
    progress = min(1.0, (frac - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def budget_spent(start: float, seconds: float, step: int, max_steps: int | None) -> float | None:
    """The fraction of a phase's budget spent (wall clock, or steps when capped), None once it is
    used up: the schedules follow it, so a run fits its time slot on any machine."""
    elapsed = time.time() - start
    if elapsed >= seconds or (max_steps is not None and step >= max_steps):
        return None
    return max(elapsed / seconds, step / max_steps if max_steps else 0.0)


def make_optimizer(params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float):
    decay = [p for n, p in params if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in params if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _backbone_trains(name: str) -> bool:
    """The optimizer's share of phase 1: not the drafter, not the selection biases (they follow the
    aux-loss-free rule instead)."""
    return not name.startswith("mtp.") and not name.endswith(("gate.bias", "gate.bias_vl"))


def vision_style(a) -> int:
    """What a v2 image batch draws (data.make_example's variety): 1 as stages 17-30, 2 any turn, 3 robust."""
    return 2 if a.vision_any_turn else 3 if a.vision_robust else 1


def image_step_loss(model, vision: VisionJob, device) -> torch.Tensor:
    """Cross-entropy on the replies of one batch of image questions (the prompt is context only)."""
    ids, images, target = next(vision.batches)
    ids, target = ids.to(device, non_blocking=True), target.to(device, non_blocking=True)
    hidden = model(ids, all_logits=True, images=images)
    return chunked_ce(hidden[target], model.head.weight, ids[:, 1:][target[:, :-1]])


def probe_step_loss(model, vision: VisionJob) -> tuple[torch.Tensor, dict]:
    """The linear probes' loss on one probe batch (VisionJob.add_probe), and their accuracy on it."""
    from dsv41.recipes.tiny.vision.train import probe_loss_on

    loss, logits, labels = probe_loss_on(model, vision.probe, *next(vision.probe_batches))
    return loss, {k: (logits[k].argmax(-1) == labels[k]).float().mean() for k in ("colour", "shape")}


def train_backbone(model, sampler, device, seconds: float, batch: int, context: int, lr: float,
                   kl_weight: float = 0.1, gamma: float = 5e-3, max_steps: int | None = None, log=print,
                   vision: VisionJob | None = None, token_weights=None):
    """`token_weights`: sampled row [B, T+1] -> loss weights of its targets (reasoning_weights), or None."""
    params = [(n, p) for n, p in model.named_parameters() if _backbone_trains(n)]
    for n, p in model.named_parameters():
        p.requires_grad_(_backbone_trains(n))
    opt = make_optimizer(params, lr, 0.05)
    moes = moe_layers(model, "backbone")
    image_load = None
    if vision is not None:
        from dsv41.recipes.tiny.vision.train import ImageLoad

        image_load = ImageLoad(model)
    image_loss = probe = None
    history = []
    start, step, tokens = time.time(), 0, 0
    model.train()
    while (frac := budget_spent(start, seconds, step, max_steps)) is not None:
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, lr)
        ids = sampler.sample(batch, context + 1).to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        try:
            if vision is not None and step % vision.every == 0:
                # images first: the text forward below leaves `moe.load` for the text balance rule
                image_loss = image_step_loss(model, vision, device)
                (vision.weight * image_loss).backward()
                image_loss = image_loss.detach()
                image_load.update(gamma)
                if vision.probe is not None:
                    vision.probe_opt.zero_grad(set_to_none=True)
                    probe, probe_right = probe_step_loss(model, vision)
                    (vision.probe_weight * probe).backward()
                    vision.probe_opt.step()
                    probe = probe.detach()
            aux: dict = {}
            hidden = model(ids[:, :-1], all_logits=True, aux=aux)
            weights = token_weights(ids) if token_weights is not None else None
            mask = getattr(sampler, "last_mask", None)  # a family's loss mask: 0 on targets never trained
            if mask is not None:
                mask = mask[:, 1:].to(device, non_blocking=True)
                weights = mask if weights is None else weights * mask
            lm = chunked_ce(hidden, model.head.weight, ids[:, 1:], token_weights=weights)
            kl = torch.stack(aux["indexer_kl"]).mean() if aux.get("indexer_kl") else hidden.new_zeros(())
            loss = lm + kl_weight * kl
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            if step > 2 or batch == 1:
                raise
            hidden = lm = kl = loss = aux = None
            batch //= 2  # only the first steps may shrink the batch: later the memory use is known
            torch.cuda.empty_cache()
            log(json.dumps({"event": "oom", "phase": "backbone", "new_batch": batch}))
            continue
        gnorm = torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        update_selection_bias(moes, gamma)
        step += 1
        tokens += batch * context
        if step % 10 == 0 or step == 1:
            _sync(device)
            t = time.time() - start
            loads = torch.stack([m.load.float() for m in moes])
            imbalance = float((loads.max(1).values / loads.mean(1)).mean())
            rec = {"step": step, "time_s": round(t, 1), "batch": batch, "tokens": tokens, "lm_loss": round(float(lm.detach()), 4),
                   "indexer_kl": round(float(kl.detach()), 4), "grad_norm": round(float(gnorm), 3),
                   "lr": opt.param_groups[0]["lr"], "tok_per_s": round(tokens / max(t, 1e-9)),
                   "max_over_mean_expert_load": round(imbalance, 3)}
            if image_loss is not None:
                rec["image_reply_loss"] = round(float(image_loss), 4)
            if probe is not None:
                rec["probe_loss"] = round(float(probe), 4)
                rec["probe_batch_accuracy"] = {k: round(float(v), 2) for k, v in probe_right.items()}
            history.append(rec)
            log(json.dumps(rec))
    return history


@torch.no_grad()
def round_dense_to_bf16_(model) -> None:
    """Parameters the checkpoint stores as bf16 take their bf16 values, so phase 2 trains the drafter
    against exactly the backbone that ships (FP8/FP4 masters and Engram tables are already rounded
    onto their grids in every forward)."""
    stored = _stored_dtypes(model.args)
    for name, (kind, tensor) in _export_targets(model).items():
        if kind == "dense" and stored[name] == torch.bfloat16:
            tensor.copy_(tensor.to(torch.bfloat16).float())


def _stored_dtypes(args) -> dict[str, torch.dtype]:
    from dsv41.model.transformer import Transformer

    with torch.device("meta"):
        ref = Transformer(args.replace(trainable=False))
    return {n: t.dtype for n, t in ref.state_dict().items()}


@torch.no_grad()
def greedy_next(hidden: torch.Tensor, weight: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """argmax of head(hidden) [B, T] in row chunks (the full logits would not fit)."""
    h = hidden.reshape(-1, hidden.size(-1))
    out = torch.cat([F.linear(h[i:i + chunk], weight).argmax(-1) for i in range(0, h.size(0), chunk)])
    return out.view(hidden.shape[:-1])


def dspark_batch(model, ids: torch.Tensor, anchors_per_seq: int, g: torch.Generator, labels_from: str = "target"):
    """Blocks for many anchors of each sequence: returns (block hidden [N,S,dim], prev tokens [N,S],
    labels [N,S]). ids [B, T]; the anchor token sits at P+1 and P ranges over [0, T-S-2].

    labels_from "target": the target model's own greedy next tokens at P+1..P+S (self-distillation:
    verification accepts a draft exactly when it equals the target's greedy token, so that is what the
    drafter should predict); "data": the data tokens P+2..P+S+1."""
    from dsv41.model.dspark import block_hidden, main_x

    args = model.args
    S, W = args.dspark_block_size, args.window_size
    B, T = ids.shape
    with torch.no_grad():
        hidden_all, taps = model(ids, all_logits=True, return_taps=True)
        greedy = greedy_next(hidden_all, model.head.weight) if labels_from == "target" else None
        del hidden_all
    mx = main_x(model, taps)  # trainable: mtp.0.main_proj / main_norm
    positions = torch.arange(T, device=ids.device)
    P = torch.randint(0, T - S - 1, (B, anchors_per_seq), generator=g).to(ids.device)  # [B, A]
    rows = torch.arange(B, device=ids.device).view(B, 1).expand_as(P).reshape(-1)
    P = P.reshape(-1)
    ctx_pos = P.view(-1, 1) - W + 1 + torch.arange(W, device=ids.device)  # [N, W] oldest first
    ctx_idx = torch.where(ctx_pos >= 0, torch.arange(W, device=ids.device).expand_as(ctx_pos), -1)
    contexts = []
    for stage in model.mtp:
        kv = stage.context_kv(mx, positions)  # [B, T, D]
        contexts.append((kv[rows.view(-1, 1), ctx_pos.clamp_min(0)], ctx_idx))
    offs = torch.arange(S, device=ids.device)
    prev = ids[rows.view(-1, 1), P.view(-1, 1) + 1 + offs]  # y_0 = anchor (P+1), then P+2..P+S
    if greedy is not None:
        labels = greedy[rows.view(-1, 1), P.view(-1, 1) + 1 + offs]  # the target's picks for P+2..P+S+1
    else:
        labels = ids[rows.view(-1, 1), P.view(-1, 1) + 2 + offs]  # P+2..P+S+1
    hidden = block_hidden(model, prev[:, 0], P + 1, contexts)
    return hidden, prev, labels


def dspark_loss(model, hidden, prev, labels, chunk: int = 8192):
    """CE on teacher-forced Markov logits + BCE of the confidence head (target: argmax == label)."""
    from dsv41.model.dspark import base_logits, teacher_forced_logits

    head_w = model.head.weight
    N, S, _ = hidden.shape
    h, y, lab = hidden.reshape(N * S, -1), prev.reshape(-1), labels.reshape(-1)
    ce_total = hidden.new_zeros((), dtype=torch.float32)
    bce_total = hidden.new_zeros((), dtype=torch.float32)
    hits = 0
    for i in range(0, h.size(0), chunk):
        hc, yc, lc = h[i:i + chunk], y[i:i + chunk], lab[i:i + chunk]

        def piece(hc, yc, lc):
            normed = base_logits(model, hc.unsqueeze(1)).squeeze(1)  # the NormedHidden head returns x_p normed
            logits, conf = teacher_forced_logits(model, F.linear(normed, head_w.float()).unsqueeze(1),
                                                 hc.unsqueeze(1), yc.unsqueeze(1))
            logits, conf = logits.squeeze(1), conf.squeeze(1)
            hit = (logits.argmax(-1) == lc).float().detach()
            return (F.cross_entropy(logits, lc, reduction="sum"),
                    F.binary_cross_entropy_with_logits(conf, hit, reduction="sum"), hit.sum())

        ce, bce, hit = checkpoint(piece, hc, yc, lc, use_reentrant=False)
        ce_total, bce_total, hits = ce_total + ce, bce_total + bce, hits + hit
    n = h.size(0)
    return ce_total / n, bce_total / n, hits / n


def train_dspark(model, sampler, device, seconds: float, batch: int, context: int, anchors: int, lr: float,
                 gamma: float = 5e-3, max_steps: int | None = None, log=print, labels_from: str = "target"):
    round_dense_to_bf16_(model)
    model.zero_grad(set_to_none=True)  # the backbone's last gradients are not needed any more
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("mtp.") and not n.endswith("gate.bias"))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = make_optimizer(params, lr, 0.0)
    moes = moe_layers(model, "dspark")
    g = torch.Generator().manual_seed(1)
    history = []
    start, step = time.time(), 0
    model.train()
    while (frac := budget_spent(start, seconds, step, max_steps)) is not None:
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, lr, warmup=0.05)
        ids = sampler.sample(batch, context).to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        try:
            hidden, prev, labels = dspark_batch(model, ids, anchors, g, labels_from)
            ce, bce, acc = dspark_loss(model, hidden, prev, labels)
            loss = ce + bce
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            if step > 2 or batch == 1:
                raise
            hidden = prev = labels = ce = bce = acc = loss = None
            batch //= 2
            torch.cuda.empty_cache()
            log(json.dumps({"event": "oom", "phase": "dspark", "new_batch": batch}))
            continue
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        update_selection_bias(moes, gamma)
        step += 1
        if step % 10 == 0 or step == 1:
            _sync(device)
            rec = {"dspark_step": step, "time_s": round(time.time() - start, 1), "ce": round(float(ce.detach()), 4),
                   "bce": round(float(bce.detach()), 4), "teacher_forced_top1": round(float(acc), 4),
                   "lr": opt.param_groups[0]["lr"]}
            history.append(rec)
            log(json.dumps(rec))
    return history


# ------------------------------------------------------------------------------------ export
def _export_targets(model) -> dict:
    """name -> (kind, trained tensor) for every tensor the official checkpoint stores, where kind is
    'fp8' / 'fp4' (quantize with the layer's format, adds `.scale`), 'engram' (FP8 rows) or 'dense'
    (stored in the inference model's dtype, bf16 or fp32)."""
    from dsv41.model.engram import EngramEmbedding
    from dsv41.model.layers import Linear

    out = {}
    handled = set()
    for mname, module in model.named_modules():
        if isinstance(module, Linear) and module.trainable:
            out[f"{mname}.weight"] = (module.kind, module.weight)
            handled.add(f"{mname}.weight")
        elif isinstance(module, EngramEmbedding):
            out[f"{mname}.weight"] = ("engram", module.weight)
            handled.add(f"{mname}.weight")
    for name, p in model.named_parameters():
        if name in handled:
            continue
        out[name] = ("dense", p)
    return out


@torch.no_grad()
def official_state_dict(model, args) -> dict[str, torch.Tensor]:
    """Trained model -> tensors with the official names and storage dtypes (the inference model's
    state dict), checked against a freshly built inference model."""
    from dsv41.model import formats
    from dsv41.model.layers import Linear
    from dsv41.model.transformer import Transformer

    with torch.device("meta"):
        ref = Transformer(args.replace(trainable=False))
    expected = {n: t for n, t in ref.state_dict().items()}
    state = {}
    for name, (kind, w) in _export_targets(model).items():
        w = w.detach().float().cpu()
        if kind in ("fp8", "fp4"):
            owner = ref.get_submodule(name.rsplit(".", 1)[0])
            assert isinstance(owner, Linear)
            q, s = owner.quantize(w)
            state[name], state[name[: -len("weight")] + "scale"] = q, s
        elif kind == "engram":
            q, s = formats.pack_fp8_ue8m0(w, 32)
            state[name] = q.view(torch.float8_e4m3fn)
            state[name[: -len("weight")] + "scale"] = s.view(torch.float8_e8m0fnu)
        else:
            state[name] = w.to(expected[name].dtype)
    missing, extra = set(expected) - set(state), set(state) - set(expected)
    if missing or extra:
        raise RuntimeError(f"export mismatch: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
    for n, t in state.items():
        if t.shape != expected[n].shape or t.dtype != expected[n].dtype:
            raise RuntimeError(f"{n}: exported {t.dtype} {tuple(t.shape)}, model needs "
                               f"{expected[n].dtype} {tuple(expected[n].shape)}")
    return {n: state[n].contiguous() for n in expected}


def v41_tokenizer_json() -> str:
    """The bundled DeepSeek tokenizer.json with V4.1's token names (<｜System｜> at 128799), so the
    checkpoint directory's own tokenizer encodes the V4.1 chat format."""
    from dsv41.model.tokenizer import apply_v41_names, bundled_tokenizer_path

    spec = json.loads(bundled_tokenizer_path().read_text(encoding="utf-8"))
    apply_v41_names(spec)
    return json.dumps(spec, ensure_ascii=False, indent=2) + "\n"


def write_official(state: dict[str, torch.Tensor], args, out: Path, tokenizer_files: Path | None) -> list[str]:
    """config.json, shards model-0000k-of-0000n.safetensors (< 16 MiB each), the index, and the
    tokenizer files (copied from `tokenizer_files` when given)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    groups: list[list[str]] = []
    sizes: list[int] = []
    for name, t in state.items():  # first fit: a tensor joins the first shard with room for it
        nbytes = t.numel() * t.element_size()
        room = next((i for i, used in enumerate(sizes) if used + nbytes <= MAX_SHARD_BYTES), None)
        if room is None:  # (a tensor larger than the cap gets a shard of its own)
            groups.append([])
            sizes.append(0)
            room = len(groups) - 1
        groups[room].append(name)
        sizes[room] += nbytes
    n = len(groups)
    weight_map, files = {}, []
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file({k: state[k] for k in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(args.replace(trainable=False).to_hf_config(), indent=2) + "\n")
    if tokenizer_files is not None:
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_files / fname).is_file() and (tokenizer_files / fname).resolve() != (out / fname).resolve():
                shutil.copyfile(tokenizer_files / fname, out / fname)
    return files


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Train dsv41-tiny (backbone, then DSpark) and export it.")
    ap.add_argument("--data", type=Path, default=REPO / ".tinydata")
    ap.add_argument("--out", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--tokenizer-files", type=Path, default=None,
                    help="directory holding tokenizer.json/tokenizer_config.json to copy (default: DATA/tokenizer)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backbone-seconds", type=float, default=300.0)
    ap.add_argument("--dspark-seconds", type=float, default=75.0)
    ap.add_argument("--max-steps", type=int, default=None, help="cap both phases (smoke tests)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dspark-batch", type=int, default=64)
    ap.add_argument("--dspark-anchors", type=int, default=64)
    ap.add_argument("--dspark-lr", type=float, default=2e-3)
    ap.add_argument("--dspark-labels", choices=("target", "data"), default="target",
                    help="drafter labels: the target's greedy tokens (default) or the data tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", type=Path, default=None, help="continue from this exported checkpoint")
    ap.add_argument("--mix", default=None, help="family weights, e.g. prose=0.15,code=0.35,literature=0.08,reasoning=0.42 "
                    "(reasoning_undo: the reasoning task in the undo trace style; likewise _carry, _twice, _labelled; "
                    "reasoning_v2: the v2 task, whose loss mask OUT/reasoning_v2.mask.u8.xz is applied)")
    ap.add_argument("--no-vision", dest="vision", action="store_false",
                    help="text only (default: the vision tower trains jointly with the backbone)")
    ap.add_argument("--vision-every", type=int, default=2, help="an image batch joins every k-th backbone step")
    ap.add_argument("--vision-batch", type=int, default=128)
    ap.add_argument("--vision-weight", type=float, default=0.5)
    ap.add_argument("--vision-workers", type=int, default=4, help="CPU processes drawing the pictures")
    ap.add_argument("--vision-variety", action="store_true",
                    help="v2 pictures and questions (recipes/tiny/vision/data.py variety_example: shades, backgrounds, "
                         "32-1024 px canvases, many phrasings, one answer form); stages 1-16 ran without it")
    ap.add_argument("--vision-variety-share", type=float, default=None,
                    help="the share of image batches of v2 pictures, the others v1 (--vision-variety is 1)")
    ap.add_argument("--vision-any-turn", action="store_true",
                    help="v2 pictures turn their shapes to any orientation (data.ANY_TURN), not the small tilts of "
                         "stages 1-30")
    ap.add_argument("--vision-robust", action="store_true",
                    help="v2 pictures drawn less uniformly (data.ROBUST: any drawing scale, some blurred, more dark "
                         "and mid-grey canvases)")
    ap.add_argument("--tower-seconds", type=float, default=30.0,
                    help="a new tower first learns to see through linear probes (recipes/tiny/vision/train.py)")
    ap.add_argument("--retrain-tower", action="store_true",
                    help="the probe stage also for a tower that came with --init-from (its pictures: the "
                         "--vision-variety share, drawn by --vision-workers processes)")
    ap.add_argument("--tower-lr", type=float, default=3e-3, help="the probe stage's peak lr")
    ap.add_argument("--tower-batch", type=int, default=64, help="the probe stage's pictures per step")
    ap.add_argument("--probe-weight", type=float, default=0.0,
                    help="every image step also adds this x the linear probes' loss on a batch of pictures "
                         "(VisionJob.add_probe); 0 = off")
    ap.add_argument("--probe-batch", type=int, default=128, help="pictures per probe batch of --probe-weight")
    ap.add_argument("--think-start-weight", type=float, default=1.0,
                    help="loss weight of the first reasoning token (the one the effort line decides); 1 = off")
    ap.add_argument("--think-end-weight", type=float, default=1.0,
                    help="loss weight of the targets that end the reasoning or start the verification pass "
                         "(</think>, the newline before 'Check', 'Check'); 1 = off")
    ap.add_argument("--closing-sum-weight", type=float, default=1.0,
                    help="loss weight of the sum in a trace's closing line (the target before '.' and "
                         "</think>), which the answer copies; 1 = off")
    ap.add_argument("--mask-weight", default=None,
                    help="loss weight of a masked family's trained targets, e.g. tools=4 (see load_masks)")
    ap.add_argument("--log", type=Path, default=None, help="also append log lines to this file")
    ap.add_argument("--history", type=Path, default=None, help="write the loss history (JSON) here")
    a = ap.parse_args(argv)
    variety = a.vision_variety_share if a.vision_variety_share is not None else float(a.vision_variety)
    if not 0 <= variety <= 1:
        ap.error(f"--vision-variety-share must be in [0, 1], not {variety}")
    if a.probe_weight < 0 or a.tower_batch < 1 or a.probe_batch < 1:
        ap.error("--probe-weight must be >= 0 and --tower-batch, --probe-batch >= 1")
    if a.vision_any_turn and a.vision_robust:
        ap.error("--vision-any-turn and --vision-robust are two picture styles: give one")
    from dsv41.recipes.tiny.config import tiny_config

    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    logf = open(a.log, "a") if a.log else None

    def log(line: str) -> None:
        print(line, flush=True)
        if logf:
            logf.write(line + "\n")
            logf.flush()

    t0 = time.time()
    args = tiny_config(trainable=True, vision=a.vision)
    weights = dict(FAMILY_WEIGHTS)
    if a.mix:
        weights = parse_mix(a.mix)
    streams = load_streams(a.data, weights)
    mask_weight = parse_mix(a.mask_weight) if a.mask_weight else None
    sampler = WindowSampler(streams, weights, seed=a.seed, masks=load_masks(a.data, weights, mask_weight))
    model = build_trainable(args, load_token_map(a.data), a.device, a.seed)
    fresh_tower = args.vision_enabled
    if a.init_from:
        fresh_tower = load_into_trainable_(model, a.init_from) and args.vision_enabled
    tokenizer_files = a.tokenizer_files or (a.data / "tokenizer" if (a.data / "tokenizer").is_dir() else None)
    vision = None
    if args.vision_enabled:
        vision = VisionJob(tokenizer_files, args, a.vision_batch, a.vision_every, a.vision_weight, a.seed,
                           a.vision_workers, variety, style=vision_style(a))
        if fresh_tower and a.tower_seconds > 0:
            from dsv41.recipes.tiny.vision.train import pretrain_tower

            pretrain_tower(model, args, a.tower_seconds if a.max_steps is None else 1.0, 64, 3e-3, a.seed, log=log,
                           variety=float(variety >= 1))
        if a.probe_weight > 0:
            vision.add_probe(model, args, a.probe_batch, a.probe_weight, a.tower_lr, a.seed, a.vision_workers,
                             variety)
        if a.retrain_tower and not fresh_tower and a.tower_seconds > 0:
            from dsv41.recipes.tiny.vision.train import pretrain_tower

            # the probes trained here are the ones --probe-weight keeps using
            pretrain_tower(model, args, a.tower_seconds if a.max_steps is None else 1.0, a.tower_batch, a.tower_lr,
                           a.seed, log=log, variety=variety, workers=a.vision_workers, probe=vision.probe,
                           style=vision.style)
    n_params = sum(p.numel() for p in model.parameters())
    log(json.dumps({"event": "start", "device": a.device, "params": n_params, "mix": weights,
                    "init_from": str(a.init_from) if a.init_from else None,
                    "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
                    "train_tokens": {k: int(v.numel()) for k, v in streams.items()}}))
    t1 = time.time()
    token_weights = None
    if a.think_start_weight != 1.0 or a.think_end_weight != 1.0 or a.closing_sum_weight != 1.0:
        from dsv41.model.tokenizer import load_tokenizer

        token_weights = reasoning_weights(load_tokenizer(tokenizer_files), a.think_start_weight, a.think_end_weight,
                                          a.closing_sum_weight)
    backbone = train_backbone(model, sampler, a.device, a.backbone_seconds, a.batch, a.context, a.lr,
                              max_steps=a.max_steps, log=log, vision=vision, token_weights=token_weights)
    t2 = time.time()
    dspark = train_dspark(model, sampler, a.device, a.dspark_seconds, a.dspark_batch, a.context,
                          a.dspark_anchors, a.dspark_lr, max_steps=a.max_steps, log=log,
                          labels_from=a.dspark_labels)
    t3 = time.time()
    state = official_state_dict(model, args)
    files = write_official(state, args, a.out, tokenizer_files)
    summary = {"event": "done", "setup_s": round(t1 - t0, 1), "backbone_s": round(t2 - t1, 1),
               "dspark_s": round(t3 - t2, 1), "export_s": round(time.time() - t3, 1),
               "backbone_steps": backbone[-1]["step"] if backbone else 0,
               "backbone_tokens": backbone[-1]["tokens"] if backbone else 0,
               "dspark_steps": dspark[-1]["dspark_step"] if dspark else 0, "shards": files,
               "peak_gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if a.device.startswith("cuda") else None}
    log(json.dumps(summary))
    history = {"backbone": backbone, "dspark": dspark, "summary": summary}
    if a.history:
        a.history.write_text(json.dumps(history, indent=1) + "\n")
    if logf:
        logf.close()
    return history


if __name__ == "__main__":
    hist = main()
