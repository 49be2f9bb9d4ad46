"""Held-out accuracy of a checkpoint's vision pathway on synthetic image questions.

    python -m dsv41.recipes.tiny.vision.accuracy [--model model/assets/dsv41-tiny] [--n 100] [--json]

The held-out pictures are drawn from seeds that training never uses (training draws from
random.Random(seed) streams; these come from random.Random(HELDOUT_SEED + i), one per example) at
canvas sizes both inside and outside the training set of sides. Each question is encoded exactly as
`dsv41 generate --image PATH "question"` encodes it (image first, then the text), the reply is
generated greedily by default (thinking mode at the default effort, and chat mode; --temperature 0.6
--top-p 0.95 samples as `dsv41 generate` does, seeded), and the content after `</think>` is scored:

    colour     "What color is the shape?"   the right colour word, and no other colour word
    shape      "What shape is this?"        the right shape word, and no other shape word
    describe   "What is in the image?"      both (a single shape)
    count      "How many shapes ...?"       the right number word (2-4 shapes)
    read       "What does the text say?"    the right word (8-word vocabulary)

colour and shape (and describe) are the questions the bundled model is meant to answer; count and
read are reported as well. For colour and shape the report also has a confusion table (true label ->
what the reply named: the one label, "none", or "several") and the accuracy by the picture's smaller
side, which say where the misses are.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

from dsv41.recipes.tiny.vision import data as D

HELDOUT_SEED = 9_000_000
EVAL_SIDES = (56, 84, 100, 112, 150, 224)  # 100, 150 and 224 are sizes training never drew
QUESTION_TYPES = {  # question type -> (kind of picture, the question asked)
    "colour": ("shape", "What color is the shape?"),
    "shape": ("shape", "What shape is this?"),
    "describe": ("shape", "What is in the image?"),
    "count": ("count", "How many shapes are there?"),
    "read": ("text", "What does the text say?"),
}


def heldout_examples(question_type: str, n: int) -> list[D.Example]:
    kind, question = QUESTION_TYPES[question_type]
    out = []
    for i in range(n):
        rng = random.Random(HELDOUT_SEED + 1000 * list(QUESTION_TYPES).index(question_type) + i)
        size = (rng.choice(EVAL_SIDES), rng.choice(EVAL_SIDES))
        example = D.make_example(rng, kind=kind, question_type=question_type, size=size)
        example.question = question
        out.append(example)
    return out


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _named(question_type: str, words: set[str]) -> set[str]:
    """The colour words ("colour") or shape words ("shape", plurals folded) among a reply's words."""
    if question_type == "colour":
        return words & set(D.COLOURS)
    return {w.rstrip("s") for w in words} & set(D.SHAPES)


def score(question_type: str, example: D.Example, content: str) -> bool:
    words = _words(content)
    facts = example.facts
    if question_type in ("colour", "shape"):
        return _named(question_type, words) == {facts[question_type]}
    if question_type == "describe":
        return _named("colour", words) == {facts["colour"]} and _named("shape", words) == {facts["shape"]}
    if question_type == "count":
        return (words & set(D.NUMBER_WORDS.values())) == {D.NUMBER_WORDS[facts["count"]]}
    if question_type == "read":
        return facts["word"].lower() in words and len(words & {w.lower() for w in D.WORDS}) == 1
    raise ValueError(question_type)


def answered(question_type: str, content: str) -> str | None:
    """The label a colour or shape reply names: the single colour/shape word, "none" or "several"
    (None for the other question types). It agrees with `score`: correct iff it equals the true label."""
    if question_type not in ("colour", "shape"):
        return None
    named = _named(question_type, _words(content))
    return "none" if not named else next(iter(named)) if len(named) == 1 else "several"


def evaluate(model_dir: Path, n: int = 100, modes=("thinking", "chat"), question_types=None,
             max_new_tokens: int = 24, temperature: float = 0.0, top_p: float = 1.0, log=None) -> dict:
    from dsv41.model.checkpoint import load_model

    from dsv41_cli.common import tune_threads

    model, args, tokenizer = load_model(model_dir)  # outside inference mode: the weights stay ordinary tensors
    if not args.vision_enabled:
        raise SystemExit(f"{model_dir} has no vision tower")
    tune_threads(args, "cpu")  # as `dsv41 generate` does: one thread for a small model
    return _evaluate(model, args, tokenizer, str(model_dir), n, modes, question_types, max_new_tokens,
                     temperature, top_p, log)


@torch.inference_mode()
def _evaluate(model, args, tokenizer, name, n, modes, question_types, max_new_tokens, temperature, top_p,
              log) -> dict:
    from dsv41.model.completion import parse_completion
    from dsv41.model.encoding import encode_messages_with_images
    from dsv41.model.engine import GenerationConfig, Generator, SamplingConfig
    from dsv41.model.vision import expand_image_placeholders

    engine = Generator(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_ids=(tokenizer.eos_id,),
                              sampling=SamplingConfig(temperature, top_p, seed=0))
    accuracy, samples, confusion, by_side = {}, {}, {}, {}
    t0 = time.time()
    for mode in modes:
        for qt in question_types or QUESTION_TYPES:
            right = 0
            for i, example in enumerate(heldout_examples(qt, n)):
                messages = [{"role": "user", "content": [{"type": "image", "data": b"-"},
                                                         {"type": "text", "text": example.question}]}]
                prompt, records = encode_messages_with_images(messages, mode=mode)  # default effort (high)
                ids, _, inputs = expand_image_placeholders(tokenizer.encode(prompt), [example.image], args)
                result = engine.generate(ids, config, images=inputs)
                text = tokenizer.decode(result.output_ids)
                content = parse_completion(text, mode, finished=result.finish_reason == "stop").content
                ok = score(qt, example, content)
                right += ok
                label = answered(qt, content)
                if label is not None:
                    table = confusion.setdefault(f"{mode}/{qt}", {}).setdefault(example.facts[qt], {})
                    table[label] = table.get(label, 0) + 1
                    side = by_side.setdefault(f"{mode}/{qt}", {}).setdefault(str(min(example.image.size)), [0, 0])
                    side[0] += ok
                    side[1] += 1
                if i < 3:
                    samples.setdefault(f"{mode}/{qt}", []).append({"facts": example.facts, "reply": text, "correct": ok})
            accuracy[f"{mode}/{qt}"] = right / n
            if log:
                log(f"{mode}/{qt}: {right}/{n} = {right / n:.3f}")
    accuracy_by_side = {key: {side: round(r / t, 3) for side, (r, t) in sorted(sides.items(), key=lambda kv: int(kv[0]))}
                        for key, sides in by_side.items()}
    return {"model": name, "examples_per_question": n, "temperature": temperature, "top_p": top_p, "accuracy": accuracy,
            "confusion": confusion, "accuracy_by_smaller_side": accuracy_by_side, "samples": samples,
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    from dsv41.model.assets import bundled_model_dir

    ap = argparse.ArgumentParser(description="Held-out accuracy on synthetic image questions.")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--n", type=int, default=100, help="held-out examples per question type and mode")
    ap.add_argument("--modes", default="thinking,chat")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; `dsv41 generate` samples at 0.6")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--questions", default=",".join(QUESTION_TYPES))
    ap.add_argument("--json", action="store_true", help="print the whole report as JSON")
    a = ap.parse_args(argv)
    model_dir = a.model or bundled_model_dir()
    if model_dir is None:
        raise SystemExit("no bundled model: pass --model DIR")
    report = evaluate(model_dir, a.n, tuple(a.modes.split(",")), tuple(a.questions.split(",")),
                      temperature=a.temperature, top_p=a.top_p, log=None if a.json else print)
    if a.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
