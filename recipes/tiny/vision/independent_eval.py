"""Colour and shape accuracy on the independent evaluation set (`independent.py`, pictures drawn by code the
training generator does not share).

    python -m dsv41.recipes.tiny.vision.independent_eval [--model DIR] [--n 200] [--modes thinking,chat]
        [--output report.json]

Every picture is asked one colour and one shape question (its phrasing from the set's five per question), in
each mode: thinking (the default effort, as `dsv41 generate` encodes it) and chat. Prompts are encoded exactly
as `dsv41 generate --image PATH "question"` encodes them (image first, then the text) and run through the
project's generation engine (`dsv41.model.engine.Generator.generate_many`, continuous batching, greedy),
24 new tokens at most. The reply's content after `</think>` is scored by `accuracy.score`: the right colour
(shape) word and no other. The report has accuracy overall, by the picture's size bucket (the side it was drawn
from: 32-1024 px), by phrasing, by background and by true label, with 95% Wilson intervals for the overall
numbers, and a confusion table (true label -> what the reply named).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from dsv41.recipes.tiny.vision import independent as I

QUESTIONS = ("colour", "shape")


def wilson(k: int, n: int, z: float = 1.959964) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(max(0.0, c - half), 4), round(min(1.0, c + half), 4)]


class Tally:
    def __init__(self):
        self.groups: dict[str, dict[str, list[int]]] = {}

    def add(self, group: str, key, ok: bool) -> None:
        cell = self.groups.setdefault(group, {}).setdefault(str(key), [0, 0])
        cell[0] += int(ok)
        cell[1] += 1

    def table(self, group: str, order=None) -> dict:
        cells = self.groups.get(group, {})
        keys = [str(k) for k in order if str(k) in cells] if order else sorted(cells)
        return {k: {"right": cells[k][0], "n": cells[k][1], "accuracy": round(cells[k][0] / cells[k][1], 4)}
                for k in keys}


def build_requests(pictures, mode: str, question: str, tokenizer, args, max_new_tokens: int):
    from dsv41.model.encoding import encode_messages_with_images
    from dsv41.model.engine import GenerationConfig, Request, SamplingConfig
    from dsv41.model.vision import expand_image_placeholders

    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_ids=(tokenizer.eos_id,),
                              sampling=SamplingConfig(0.0, 1.0, seed=0))
    requests = []
    for p in pictures:
        messages = [{"role": "user", "content": [{"type": "image", "data": b"-"},
                                                 {"type": "text", "text": p.questions[question]}]}]
        prompt, _ = encode_messages_with_images(messages, mode=mode)  # the default effort, as dsv41 generate
        ids, _, inputs = expand_image_placeholders(tokenizer.encode(prompt), [p.image], args)
        requests.append(Request(ids, config, inputs))
    return requests


def evaluate(model_dir: Path, n: int = 200, modes=("thinking", "chat"), max_new_tokens: int = 24,
             batch: int = 32, log=None) -> dict:
    from dsv41.model.checkpoint import load_model

    from dsv41_cli.common import tune_threads

    model, args, tokenizer = load_model(model_dir)  # outside inference mode: the weights stay ordinary tensors
    if not args.vision_enabled:
        raise SystemExit(f"{model_dir} has no vision tower")
    tune_threads(args, "cpu")  # as `dsv41 generate` does
    return _evaluate(model, args, tokenizer, model_dir, n, modes, max_new_tokens, batch, log)


@torch.inference_mode()
def _evaluate(model, args, tokenizer, model_dir, n, modes, max_new_tokens, batch, log) -> dict:
    from dsv41.model.completion import parse_completion
    from dsv41.model.engine import Generator
    from dsv41.recipes.tiny.vision.accuracy import answered, score

    t0 = time.time()
    pictures = I.evaluation_set(n)
    draw_s = time.time() - t0
    engine = Generator(model, tokenizer)
    tally, confusion, samples, summary = Tally(), {}, {}, {}
    for mode in modes:
        for q in QUESTIONS:
            t1 = time.time()
            results = engine.generate_many(build_requests(pictures, mode, q, tokenizer, args, max_new_tokens),
                                           max_batch_size=batch)
            right = 0
            for p, result in zip(pictures, results):
                text = tokenizer.decode(result.output_ids)
                content = parse_completion(text, mode, finished=result.finish_reason == "stop").content
                ok = score(q, p, content)
                right += ok
                key = f"{mode}/{q}"
                for group, value in (("size", p.size_bucket), ("phrasing", p.questions[q]),
                                     ("background", p.background), ("label", p.facts[q])):
                    tally.add(f"{key}/{group}", value, ok)
                label = answered(q, content)
                row = confusion.setdefault(key, {}).setdefault(p.facts[q], {})
                row[label] = row.get(label, 0) + 1
                if not ok and len(samples.setdefault(key, [])) < 8:
                    samples[key].append({"picture": p.facts, "rgb": p.rgb, "background": p.background,
                                         "size": list(p.image.size), "question": p.questions[q], "reply": text})
            summary[f"{mode}/{q}"] = {"right": right, "n": len(pictures), "accuracy": round(right / len(pictures), 4),
                                      "ci95": wilson(right, len(pictures)), "seconds": round(time.time() - t1, 1)}
            if log:
                log(f"{mode}/{q}: {right}/{len(pictures)} = {right / len(pictures):.3f} ({time.time() - t1:.0f} s)")
    groups = {}
    for key in summary:
        groups[key] = {"by_size": tally.table(f"{key}/size", I.SIZE_BUCKETS),
                       "by_phrasing": tally.table(f"{key}/phrasing",
                                                  I.COLOUR_PHRASINGS if key.endswith("colour") else I.SHAPE_PHRASINGS),
                       "by_background": tally.table(f"{key}/background", I.BACKGROUNDS),
                       "by_label": tally.table(f"{key}/label")}
    return {"model": str(model_dir), "pictures": len(pictures), "generator": "recipes/tiny/vision/independent.py",
            "seed": I.SEED, "max_new_tokens": max_new_tokens, "greedy": True, "accuracy": summary,
            "breakdown": groups, "confusion": confusion, "misses": samples, "draw_seconds": round(draw_s, 1),
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    from dsv41.model.assets import bundled_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--n", type=int, default=200, help="pictures (each asked a colour and a shape question)")
    ap.add_argument("--modes", default="thinking,chat")
    ap.add_argument("--batch", type=int, default=32, help="the engine's max_batch_size")
    ap.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    a = ap.parse_args(argv)
    model_dir = a.model or bundled_model_dir()
    if model_dir is None:
        raise SystemExit("no bundled model: pass --model DIR")
    report = evaluate(model_dir, a.n, tuple(a.modes.split(",")), batch=a.batch, log=print)
    text = json.dumps(report, indent=1)
    if a.output:
        a.output.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
