"""Give the bundled dsv41-tiny a vision tower: train the ViT, the aligner and the image span
embeddings on synthetic pictures (recipes/tiny/vision/data.py) with the language model frozen, then
write the checkpoint with the vision tensors added.

    python -m dsv41.recipes.tiny.vision.train --base model/assets/dsv41-tiny --out runs/dsv41-tiny-vision \
        [--seconds 1200] [--install]

What trains (everything else is the text checkpoint, bit for bit):
    vision.*  aligner.*  image_start / image_newline / image_end     AdamW on fp32 masters, saved bf16
    layers.*.ffn.gate.bias_vl      the image tokens' expert-selection bias, by the aux-loss-free rule
                                   b_vl += gamma * sign(mean load - load) over image positions only
                                   (starting from the text bias)

The loss is next-token cross-entropy on the reply only, in both chat formats of V4.1:
    thinking  BOS <System>Reasoning Effort: e ...  <User> IMAGE \\n\\n question <Assistant><think>
              -> reasoning </think> answer EOS           (effort uniform in 1..100)
    chat      BOS <User> IMAGE \\n\\n question <Assistant></think>  -> answer EOS
exactly as `dsv41 generate --image PATH "question"` encodes its prompt. The language model is the
inference model as shipped (FP8 / FP4 weights, straight-through activation rounding), so the tower
learns against exactly the computation that will read it. A batch shares one canvas size, so its
images share a patch grid and go through the ViT in one call.

--install then replaces the --base directory with the result (the text-only one moves beside --out).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.recipes.tiny.vision import data as D

REPO = Path(__file__).resolve().parents[3]

from dsv41.recipes.tiny.config import VISION  # noqa: E402  (the tower's shape lives with the text config)
TRAINED_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")


# ------------------------------------------------------------------------------------ model
def build(base: Path, keep_tower: bool = False):
    """(model, args, tokenizer, names from the checkpoint): the text checkpoint at `base` plus a fresh
    vision tower (or, with keep_tower, the tower `base` already has), the trained parts as fp32 masters,
    everything else frozen as stored."""
    from dsv41.model.checkpoint import load_state_dict
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.model.transformer import Transformer

    state, args = load_state_dict(base)
    if keep_tower != args.vision_enabled:
        raise SystemExit(f"{base} has no vision tower to continue from" if keep_tower else
                         f"{base} already has a vision tower (vision_n_layers = {args.vision_n_layers})")
    if not keep_tower:
        args = args.replace(**VISION)
    tokenizer = load_tokenizer(base)
    placeholder = tokenizer.token_to_id("<｜deepseek_image｜>")
    if placeholder != args.image_token_id:
        raise SystemExit(f"the tokenizer's image placeholder is id {placeholder}, not {args.image_token_id}")
    torch.manual_seed(0)
    model = Transformer(args, tokenizer)
    missing, unexpected = model.load_state_dict(state, strict=keep_tower)
    if unexpected or any(not (n.startswith(TRAINED_PREFIXES) or n.endswith("bias_vl")) for n in missing):
        raise SystemExit(f"the text checkpoint does not fit: unexpected {unexpected[:3]}, missing {missing[:3]}")
    if not keep_tower:  # a fresh tower: span embeddings at the token embeddings' scale, images balanced as text
        with torch.no_grad():
            scale = model.embed.weight.float().std()
            for name in ("image_start", "image_newline", "image_end"):
                getattr(model, name).copy_(torch.randn(args.dim) * scale)
            for module in model.modules():
                gate = getattr(module, "gate", None)
                if gate is not None and getattr(gate, "bias_vl", None) is not None:
                    gate.bias_vl.copy_(gate.bias)  # images start from the text balance
    model.requires_grad_(False).eval()
    model.vision.float().requires_grad_(True)
    model.aligner.float().requires_grad_(True)
    for name in ("image_start", "image_newline", "image_end"):
        setattr(model, name, nn.Parameter(getattr(model, name).detach().float()))
    model.batch_images = True
    return model, args, tokenizer, set(state)


class PickedHead(nn.Module):
    """The output head applied only where the loss needs logits (a [B, T, 129280] fp32 tensor would
    dwarf everything else): set `where` [B, T] before the forward."""

    def __init__(self, head):
        super().__init__()
        self.head = head
        self.where: torch.Tensor | None = None

    def forward(self, u):
        return self.head(u[self.where])


# ------------------------------------------------------------------------------------ data
def encode_example(example: D.Example, mode: str, effort: int, tokenizer, args):
    """(ids, token types, image inputs, index of the first reply token) of one training sequence."""
    from dsv41.model.encoding import EOS, THINK_END, encode_messages_with_images
    from dsv41.model.vision import expand_image_placeholders

    messages = [{"role": "user", "content": [{"type": "image", "data": b"-"},  # stands for example.image
                                             {"type": "text", "text": example.question}]}]
    prompt, records = encode_messages_with_images(messages, mode=mode, effort=effort)
    reply = (example.reasoning + THINK_END if mode == "thinking" else "") + example.answer + EOS
    prompt_ids = tokenizer.encode(prompt, allow_special=True)
    ids, types, inputs = expand_image_placeholders(prompt_ids, [example.image] * len(records), args)
    return ids + tokenizer.encode(reply, allow_special=True), types, inputs, len(ids)


def batch_size_px(rng: random.Random, sides, variety: bool) -> tuple[int, int]:
    """The canvas (width, height) one batch shares: from `sides`, or with variety log-uniform in 32-1024 px."""
    return D.variety_size(rng) if variety else (rng.choice(sides), rng.choice(sides))


def make_batch(rng: random.Random, batch: int, tokenizer, args, pad_id: int, sides=D.SIDES, variety: bool = False):
    """variety=True draws the v2 pictures and questions (data.variety_example) at canvas sides of 32-1024 px."""
    size = batch_size_px(rng, sides, variety)
    rows, images, starts = [], [], []
    for _ in range(batch):
        example = D.make_example(rng, size=size, variety=variety)
        mode = "thinking" if rng.random() < 0.5 else "chat"
        ids, _, inputs, reply_at = encode_example(example, mode, rng.randint(1, 100), tokenizer, args)
        rows.append(ids)
        images.append(inputs)
        starts.append(reply_at)
    T = max(len(r) for r in rows)
    ids = torch.full((batch, T), pad_id, dtype=torch.long)
    target = torch.zeros(batch, T, dtype=torch.bool)  # position t predicts token t+1
    for b, (r, s) in enumerate(zip(rows, starts)):
        ids[b, : len(r)] = torch.tensor(r)
        target[b, s - 1: len(r) - 1] = True
    return ids, images, target


# ------------------------------------------------------------------------------------ stage 1: the tower alone
class Probe(nn.Module):
    """Linear read-outs of the mean and max ViT features: what kind of picture, its colour, shape, count and
    word (class 0 = not applicable). Used only to pretrain the tower; never saved."""

    LABELS = {"kind": ["shape", "count", "text"], "colour": [None] + sorted(D.COLOURS),
              "shape": [None, *D.SHAPES], "count": [None, 1, 2, 3, 4], "word": [None, *D.WORDS]}

    def __init__(self, width: int):
        super().__init__()
        self.heads = nn.ModuleDict({k: nn.Linear(2 * width, len(v)) for k, v in self.LABELS.items()})

    @classmethod
    def targets(cls, example: D.Example) -> dict[str, int]:
        facts = {"kind": example.kind, **example.facts}
        return {k: v.index(facts.get(k)) for k, v in cls.LABELS.items()}

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        features = features.float()
        pooled = torch.cat([features.mean(dim=-2), features.amax(dim=-2)], dim=-1)  # max: where edges and corners are
        return {k: head(pooled) for k, head in self.heads.items()}


def probe_inputs(rng: random.Random, batch: int, args, sides=D.SIDES, variety: bool = False):
    """One probe batch drawn and preprocessed on the CPU: (pixels [B, ...], patch grid, labels {name: [B]}),
    the pictures of one canvas size."""
    from dsv41.model.image_processor import preprocess

    size = batch_size_px(rng, sides, variety)
    examples = [D.make_example(rng, size=size, variety=variety) for _ in range(batch)]
    prepared = [preprocess(e.image, args) for e in examples]
    targets = [Probe.targets(e) for e in examples]
    labels = {k: torch.tensor([t[k] for t in targets]) for k in Probe.LABELS}
    return torch.stack([p for p, _ in prepared]), prepared[0][1], labels


def probe_loss_on(model, probe: Probe, pixels: torch.Tensor, grid, labels: dict):
    """(loss, logits, labels) of the linear probes on prepared pictures (`probe_inputs`)."""
    device = model.vision.patch_embed.proj.weight.device
    features = model.vision(pixels.to(device, non_blocking=True), grid.vit_h, grid.vit_w)
    logits = probe(features)
    labels = {k: v.to(device, non_blocking=True) for k, v in labels.items()}
    return sum(F.cross_entropy(logits[k], labels[k]) for k in Probe.LABELS), logits, labels


def probe_loss(model, probe: Probe, args, rng: random.Random, batch: int, sides=D.SIDES, variety: bool = False):
    """(loss, logits, labels) of the linear probes on one batch of pictures of one canvas size."""
    return probe_loss_on(model, probe, *probe_inputs(rng, batch, args, sides, variety))


class ProbeBatches(torch.utils.data.IterableDataset):
    """Endless probe batches (`probe_inputs`) drawn in DataLoader workers, each with a seed of its own, so
    that drawing overlaps the GPU step; `variety` is the share of v2 batches (`variety_step`)."""

    def __init__(self, args, batch: int, seed: int = 0, variety: float = 0.0, style: int = 1):
        self.args, self.batch, self.seed, self.variety, self.style = args, batch, seed, variety, style

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info else 0
        rng, mix_rng = random.Random(1000 * self.seed + 7 + worker), random.Random(1000 * self.seed + 707 + worker)
        while True:
            yield probe_inputs(rng, self.batch, self.args, variety=variety_step(mix_rng, self.variety) and self.style)


def probe_batches(args, batch: int, seed: int, variety: float, workers: int, style: int = 1):
    """An endless iterator of probe batches: drawn in `workers` processes (0: in this one); `style`: what a v2
    batch draws (data.make_example's variety, 1 or 2)."""
    dataset = ProbeBatches(args, batch, seed, variety, style)
    if not workers:
        return iter(dataset)
    return iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=4,
                                            persistent_workers=True))


def pretrain_tower(model, args, seconds: float, batch: int, lr: float, seed: int, log=print,
                   variety: float = 0.0, workers: int = 0, probe: Probe | None = None, style: int = 1) -> list[dict]:
    """Stage 1: the ViT learns to see (colour, shape, count, word) through linear probes, cheaply,
    before stage 2 teaches the aligner to say it through the frozen language model. `variety`: the share of
    v2 batches (True: all); `workers` > 0 draws the pictures in that many processes (the GPU stages);
    `probe`: probes to train and keep using afterwards (default: new ones, dropped)."""
    rng = random.Random(seed + 1)
    mix_rng = random.Random(seed + 4)
    batches = probe_batches(args, batch, seed, variety, workers, style) if workers else None
    device = model.vision.patch_embed.proj.weight.device
    probe = probe if probe is not None else Probe(args.vision_dim).to(device)
    params = list(model.vision.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    history, start, step, smoothed = [], time.time(), 0, None
    while (frac := (time.time() - start) / seconds) < 1:
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, lr)
        if batches is not None:
            loss, logits, labels = probe_loss_on(model, probe, *next(batches))
        else:  # shares 0 and 1 draw nothing from mix_rng: the stages before the mix replay step for step
            loss, logits, labels = probe_loss(model, probe, args, rng, batch,
                                              variety=variety_step(mix_rng, variety) and style)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % 100 == 0:
            right = {k: (logits[k].argmax(-1) == labels[k]).float().mean().item()
                     for k in Probe.LABELS}
            entry = {"stage": 1, "step": step, "seconds": round(time.time() - start, 1), "loss": round(smoothed, 4),
                     "batch_accuracy": {k: round(v, 2) for k, v in right.items()}}
            history.append(entry)
            log(json.dumps(entry))
    return history


# ------------------------------------------------------------------------------------ stage 2: through the LM
class ImageLoad:
    """Counts, per MoE gate, how many image positions picked each expert (forward hooks)."""

    def __init__(self, model):
        from dsv41.model.moe import Gate

        self.gates = [m for m in model.layers.modules() if isinstance(m, Gate)]
        self.counts = {g: torch.zeros(g.bias.numel()) for g in self.gates}
        self.hooks = [g.register_forward_hook(self._hook) for g in self.gates]

    def _hook(self, gate, inputs, output):
        image_mask = inputs[1] if len(inputs) > 1 else None
        if image_mask is not None:
            picked = torch.bincount(output[1][image_mask].flatten(), minlength=gate.bias.numel()).float()
            self.counts[gate] = self.counts[gate].to(picked.device) + picked

    @torch.no_grad()
    def update(self, gamma: float) -> None:
        """Aux-loss-free balancing of the image modality: b_vl += gamma * sign(mean load - load)."""
        for gate, load in self.counts.items():
            if load.sum() > 0:
                gate.bias_vl.add_(gamma * torch.sign(load.mean() - load))
            load.zero_()


def variety_step(rng: random.Random, share: float) -> bool:
    """Whether this step's batch is v2 pictures; draws from `rng` only for a share strictly between 0 and 1."""
    share = float(share)
    if share <= 0 or share >= 1:
        return share >= 1
    return rng.random() < share


def lr_at(frac: float, peak: float, warmup: float = 0.05, floor: float = 0.05) -> float:
    if frac < warmup:
        return peak * frac / warmup
    progress = min(1.0, (frac - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, args, tokenizer, seconds: float, batch: int, lr: float, gamma: float, seed: int,
          max_steps: int | None = None, tower_lr_scale: float = 0.3, sides=D.SIDES, probe_weight: float = 0.0,
          probe_batch: int = 64, log=print, variety: float = 0.0) -> list[dict]:
    """Stage 2: the aligner (and, more slowly, the tower) learn to say what the tower sees, through the
    frozen language model. With probe_weight > 0 every step also adds the linear probes' loss on a batch of
    pictures (stage 1's objective), which keeps pushing the tower to tell the shapes apart while the
    aligner follows it. `variety` is the share of steps whose batches are v2 pictures (True: all of them);
    between 0 and 1 each step draws its kind from a generator of its own, so that 0 and 1 replay the
    stages trained before the mix existed step for step."""
    rng = random.Random(seed)
    probe_rng = random.Random(seed + 2)
    mix_rng = random.Random(seed + 3)
    head = model.head
    picked = PickedHead(head)
    model.head = picked
    probe = Probe(args.vision_dim).to(model.vision.patch_embed.proj.weight.device) if probe_weight > 0 else None
    params = [p for p in model.parameters() if p.requires_grad] + (list(probe.parameters()) if probe else [])
    tower = {id(p) for p in model.vision.parameters()}
    groups = []
    for in_tower, scale in ((True, tower_lr_scale), (False, 1.0)):  # the pretrained tower moves more slowly
        mine = [p for p in params if (id(p) in tower) == in_tower]
        groups += [{"params": [p for p in mine if p.dim() >= 2], "weight_decay": 0.01, "scale": scale},
                   {"params": [p for p in mine if p.dim() < 2], "weight_decay": 0.0, "scale": scale}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))
    load = ImageLoad(model)
    history, start, step, smoothed = [], time.time(), 0, None
    try:
        while True:
            frac = (time.time() - start) / seconds
            if frac >= 1 or (max_steps is not None and step >= max_steps):
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(frac, lr) * group["scale"]
            v2 = variety_step(mix_rng, variety)
            ids, images, target = make_batch(rng, batch, tokenizer, args, tokenizer.eos_id, sides, v2)
            picked.where = target
            logits = model(ids, all_logits=True, images=images)
            loss = F.cross_entropy(logits.float(), ids[:, 1:][target[:, :-1]])
            total = loss
            if probe is not None:
                total = loss + probe_weight * probe_loss(model, probe, args, probe_rng, probe_batch, sides, v2)[0]
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            load.update(gamma)
            step += 1
            smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
            if step % 25 == 0 or step == 1:
                entry = {"stage": 2, "step": step, "seconds": round(time.time() - start, 1), "loss": round(smoothed, 4),
                         "lr": round(opt.param_groups[-1]["lr"], 6)}
                history.append(entry)
                log(json.dumps(entry))
    finally:
        model.head = head
        for h in load.hooks:
            h.remove()
    return history


# ------------------------------------------------------------------------------------ export
def vision_state(model, args) -> dict[str, torch.Tensor]:
    """The trained tensors in their checkpoint dtypes (those of a freshly built inference model)."""
    from dsv41.model.transformer import Transformer

    with torch.device("meta"):
        ref = Transformer(args).state_dict()
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith(TRAINED_PREFIXES) or name.endswith("bias_vl"):
            out[name] = t.detach().to(ref[name].dtype).contiguous()
    return out


def export(model, args, base: Path, out: Path) -> list[str]:
    """base's tensors as stored plus the vision tensors, written with the text recipe's writer
    (shards under 16 MiB, index, config.json with the vision_config, the tokenizer files)."""
    from dsv41.model.checkpoint import load_state_dict
    from dsv41.recipes.tiny.train import write_official

    state, _ = load_state_dict(base)
    merged = {**{n: t.contiguous() for n, t in state.items()}, **vision_state(model, args)}
    with torch.device("meta"):
        from dsv41.model.transformer import Transformer

        order = list(Transformer(args).state_dict())
    if set(order) != set(merged):
        raise RuntimeError(f"export mismatch: {sorted(set(order) ^ set(merged))[:3]}")
    return write_official({n: merged[n] for n in order}, args, out, base)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Train the bundled model's vision tower (language model frozen).")
    ap.add_argument("--base", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tower-seconds", type=float, default=None,
                    help="stage 1: the ViT with linear probes (default 300 s for a new tower, 0 with --continue-tower)")
    ap.add_argument("--tower-batch", type=int, default=64)
    ap.add_argument("--tower-lr", type=float, default=3e-3)
    ap.add_argument("--seconds", type=float, default=1200.0, help="stage 2: through the frozen language model")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=1e-3, help="bias_vl update speed (aux-loss-free rule)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (a small model runs best on one)")
    ap.add_argument("--eval-examples", type=int, default=60, help="per question type, after training")
    ap.add_argument("--tower-lr-scale", type=float, default=0.3, help="stage 2: the tower's lr relative to --lr")
    ap.add_argument("--probe-weight", type=float, default=0.0,
                    help="stage 2: add the linear probes' loss on a batch of pictures to every step, times this")
    ap.add_argument("--padded-sides", action="store_true",
                    help="draw canvases from data.PADDED_SIDES too (not multiples of 14: the preprocessor pads them)")
    ap.add_argument("--large-sides", action="store_true",
                    help="draw canvases from data.LARGE_SIDES too (padded, up to 6 image tokens per side)")
    ap.add_argument("--variety", action="store_true",
                    help="v2 pictures and questions: shades, backgrounds, 32-1024 px canvases, many phrasings, one "
                         "answer form (data.variety_example); overrides the side options")
    ap.add_argument("--variety-share", type=float, default=None,
                    help="stage 2: the share of steps on v2 pictures, the others on the v1 sides the side options "
                         "give (--variety is 1)")
    ap.add_argument("--install", action="store_true", help="replace --base with the result")
    ap.add_argument("--continue-tower", action="store_true",
                    help="train the tower --base already has further (stage 1 only if --tower-seconds is given)")
    a = ap.parse_args(argv)
    share = a.variety_share if a.variety_share is not None else float(a.variety)
    if not 0 <= share <= 1:
        ap.error(f"--variety-share must be in [0, 1], not {share}")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.out.exists():
        raise SystemExit(f"{a.out} already exists")
    model, args, tokenizer, _ = build(a.base, keep_tower=a.continue_tower)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(json.dumps({"trained_parameters": n_trained, "vision": VISION}), flush=True)
    tower_seconds = a.tower_seconds if a.tower_seconds is not None else (0.0 if a.continue_tower else 300.0)
    history = (pretrain_tower(model, args, tower_seconds, a.tower_batch, a.tower_lr, a.seed, variety=float(share >= 1))
               if tower_seconds else [])
    sides = D.SIDES + (D.PADDED_SIDES if a.padded_sides else ()) + (D.LARGE_SIDES if a.large_sides else ())
    history += train(model, args, tokenizer, a.seconds, a.batch, a.lr, a.gamma, a.seed, a.max_steps,
                     tower_lr_scale=a.tower_lr_scale, sides=sides, probe_weight=a.probe_weight, variety=share)
    files = export(model, args, a.base, a.out)
    from dsv41.recipes.tiny.vision.accuracy import evaluate

    report = evaluate(a.out, n=a.eval_examples, modes=("thinking",))
    summary = {"steps": history[-1]["step"] if history else 0, "history": history, "files": files,
               "quick_eval": report["accuracy"]}
    (a.out / "vision_train.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"quick_eval": report["accuracy"]}), flush=True)
    if a.install:
        install(a.out, a.base)
    return summary


def install(new: Path, base: Path) -> None:
    """Replace `base` with `new`; the text-only directory moves beside `new` as <new>.text-only."""
    keep = new.with_name(new.name + ".text-only")
    if keep.exists():
        shutil.rmtree(keep)
    shutil.move(str(base), str(keep))
    shutil.copytree(new, base, ignore=shutil.ignore_patterns("vision_train.json"))
    print(f"installed {new} as {base} (the text-only checkpoint moved to {keep})", flush=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
