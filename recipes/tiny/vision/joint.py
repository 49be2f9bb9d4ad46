"""Vision training with the language model learning too (the alternative to `train.py`'s frozen LM).

    python -m recipes.tiny.vision.joint --base model/assets/dsv41-tiny --out /tmp/dsv41-tiny-joint \
        [--tower-seconds 300] [--seconds 1500] [--text-data .tinydata]

Why: with the bundled text model frozen, image embeddings barely move its replies (measured in
docs/vision.md: swapping the image span for random vectors changes the reply-token distribution by
0.03-0.10 nats KL, and even free per-example span embeddings optimized directly plateau near 6.9
nats per reply token), so the frozen recipe cannot teach it to answer. Here the backbone trains as
well, at a low learning rate, on batches that mix image questions with text windows of the text
recipe's own corpus (`recipes/tiny/build_data.py`), so it learns to read the image span while it keeps
its text. The DSpark drafter stays as it was.

Stage 1 is train.py's (the ViT alone with linear probes). Stage 2 trains everything but the drafter:
loss = CE(image replies) + text_weight * CE(text windows); the backbone in QAT form (fp32 masters
rounded onto their FP8/FP4 grids in every forward, as recipes/tiny/train.py trains it), the MoE
`bias` and `bias_vl` by the aux-loss-free rule on text and image positions respectively. The result
is a complete checkpoint whose text weights differ from --base: installing it is the text model
owner's decision (it changes what the text model measures).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

from recipes.tiny.vision import train as V

REPO = Path(__file__).resolve().parents[3]


class Hidden(nn.Module):
    """Stands in for the head: the forward returns the normalized hidden states (the loss applies the
    head weight to the positions it needs)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x.float()


def build_joint(base: Path, seed: int = 0):
    """The trainable model (fp32 masters) with the text weights of `base` and a fresh vision tower."""
    from model import formats
    from model.checkpoint import load_state_dict
    from model.engram import NgramHasher
    from model.tokenizer import load_tokenizer
    from model.transformer import Transformer, init_random_
    from recipes.tiny.train import _export_targets

    state, text_args = load_state_dict(base)
    args = text_args.replace(**V.VISION, trainable=True)
    tokenizer = load_tokenizer(base)
    model = Transformer(args)
    init_random_(model, seed)
    model.float()
    model._hasher = NgramHasher.from_tokenizer(args, tokenizer)
    with torch.no_grad():
        loaded = 0
        for name, (kind, tensor) in _export_targets(model).items():
            if name not in state:
                continue
            w, scale = state[name], state.get(name[: -len("weight")] + "scale")
            if kind == "fp8":
                w = formats.dequant_fp8_weight(w, scale, args.fp8_block_size)
            elif kind == "fp4":
                w = formats.dequant_fp4_weight(w, scale, 32)
            elif kind == "engram":
                w = formats.unpack_fp8_ue8m0(w, scale, 32)
            tensor.copy_(w.float())
            loaded += 1
        for name, p in model.named_parameters():
            if name.endswith("bias_vl"):
                p.copy_(model.get_parameter(name[: -len("_vl")]))
            if name in ("image_start", "image_newline", "image_end"):
                p.copy_(torch.randn(args.dim) * model.embed.weight.std())
    model.batch_images = True
    model.head = Hidden(model.head.weight)
    return model, args, tokenizer


def train_joint(model, args, tokenizer, text_sampler, seconds: float, batch: int, text_batch: int,
                text_context: int, lr: float, lm_lr: float, text_weight: float, gamma: float, seed: int,
                log=print) -> list[dict]:
    from model.moe import MoE
    from recipes.tiny.train import chunked_ce

    rng = random.Random(seed)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("mtp.") and not name.endswith(("gate.bias", "gate.bias_vl")))
    vision = {id(p) for m in (model.vision, model.aligner) for p in m.parameters()}
    vision |= {id(getattr(model, n)) for n in ("image_start", "image_newline", "image_end")}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = []
    for is_vision, peak in ((True, lr), (False, lm_lr)):
        mine = [(n, p) for n, p in params if (id(p) in vision) == is_vision]
        decay = [p for n, p in mine if p.dim() >= 2 and "embed" not in n]
        other = [p for n, p in mine if not (p.dim() >= 2 and "embed" not in n)]
        groups += [{"params": decay, "weight_decay": 0.01, "peak": peak},
                   {"params": other, "weight_decay": 0.0, "peak": peak}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    moes = [m for m in model.layers.modules() if isinstance(m, MoE)]
    image_load = V.ImageLoad(model)
    history, start, step = [], time.time(), 0
    smooth = {}
    model.train()
    try:
        while (frac := (time.time() - start) / seconds) < 1:
            for group in opt.param_groups:
                group["lr"] = V.lr_at(frac, group["peak"])
            ids, images, target = V.make_batch(rng, batch, tokenizer, args, tokenizer.eos_id)
            hidden = model(ids, all_logits=True, images=images)
            image_loss = chunked_ce(hidden[target], model.head.weight, ids[:, 1:][target[:, :-1]])
            loss = image_loss
            text_loss = None
            if text_batch:
                text_ids = text_sampler.sample(text_batch, text_context + 1)
                text_hidden = model(text_ids[:, :-1], all_logits=True)
                text_loss = chunked_ce(text_hidden, model.head.weight, text_ids[:, 1:])
                loss = loss + text_weight * text_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
            opt.step()
            with torch.no_grad():
                for moe in moes:  # text balance from the text batch's load, image balance from image positions
                    moe.gate.bias.add_(gamma * torch.sign(moe.load.float().mean() - moe.load.float()))
            image_load.update(gamma)
            step += 1
            for key, value in (("image_loss", image_loss), ("text_loss", text_loss)):
                if value is not None:
                    smooth[key] = value.item() if key not in smooth else 0.95 * smooth[key] + 0.05 * value.item()
            if step % 10 == 0 or step == 1:
                entry = {"stage": "joint", "step": step, "seconds": round(time.time() - start, 1),
                         **{k: round(v, 4) for k, v in smooth.items()}}
                history.append(entry)
                log(json.dumps(entry))
    finally:
        for h in image_load.hooks:
            h.remove()
    return history


def export_joint(model, args, base: Path, out: Path) -> list[str]:
    """The trained masters in their storage formats (the text recipe's exporter), written with the text
    recipe's writer (shards under 16 MiB, index, config.json with the vision_config, tokenizer files)."""
    from recipes.tiny.train import official_state_dict, write_official

    return write_official(official_state_dict(model, args), args, out, base)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Vision training with the language model learning too.")
    ap.add_argument("--base", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--text-data", type=Path, default=REPO / ".tinydata")
    ap.add_argument("--tower-seconds", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=1500.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--text-batch", type=int, default=4)
    ap.add_argument("--text-context", type=int, default=128)
    ap.add_argument("--text-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-3, help="vision tower, aligner, span embeddings")
    ap.add_argument("--lm-lr", type=float, default=3e-4, help="the language model")
    ap.add_argument("--gamma", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--eval-examples", type=int, default=50)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.out.exists():
        raise SystemExit(f"{a.out} already exists")
    from recipes.tiny.train import FAMILY_WEIGHTS, WindowSampler, load_streams

    model, args, tokenizer = build_joint(a.base, a.seed)
    sampler = WindowSampler(load_streams(a.text_data), dict(FAMILY_WEIGHTS), seed=a.seed) if a.text_batch else None
    history = V.pretrain_tower(model, args, a.tower_seconds, 64, 3e-3, a.seed) if a.tower_seconds else []
    history += train_joint(model, args, tokenizer, sampler, a.seconds, a.batch, a.text_batch, a.text_context,
                           a.lr, a.lm_lr, a.text_weight, a.gamma, a.seed)
    files = export_joint(model, args, a.base, a.out)
    from recipes.tiny.vision.accuracy import evaluate

    report = evaluate(a.out, n=a.eval_examples, modes=("thinking", "chat"), question_types=("colour", "shape", "describe"))
    summary = {"history": history, "files": files, "quick_eval": report["accuracy"]}
    (a.out / "vision_joint.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"quick_eval": report["accuracy"]}), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
