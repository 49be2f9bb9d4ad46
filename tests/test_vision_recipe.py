"""The bundled model's vision recipe: synthetic pictures, their encoding for training, and scoring."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("PIL.Image")

from dsv41.recipes.tiny.vision import accuracy as A  # noqa: E402
from dsv41.recipes.tiny.vision import data as D  # noqa: E402


def test_examples_are_reproducible_and_say_what_is_drawn():
    a = D.make_example(random.Random(5), kind="shape", question_type="describe", size=(84, 112))
    b = D.make_example(random.Random(5), kind="shape", question_type="describe", size=(84, 112))
    assert a.image.tobytes() == b.image.tobytes() and a.answer == b.answer
    assert a.image.size == (84, 112)
    assert a.facts["colour"] in a.answer.lower() and a.facts["shape"] in a.answer
    # the drawn colour dominates the non-background pixels
    import numpy as np

    pixels = np.asarray(a.image).reshape(-1, 3).astype(float)
    mean = pixels[pixels.min(axis=1) < 200].mean(axis=0)
    want = D.COLOURS[a.facts["colour"]]
    assert all(abs(m - w) < 30 for m, w in zip(mean, want))
    counted = D.make_example(random.Random(1), kind="count", question_type="count")
    assert counted.answer == D.NUMBER_WORDS[counted.facts["count"]].capitalize() + "."


def test_scoring_accepts_the_gold_answer_only():
    for qt in A.QUESTION_TYPES:
        for example in A.heldout_examples(qt, 5):
            assert A.score(qt, example, example.answer), (qt, example.answer)
    ex = A.heldout_examples("describe", 1)[0]
    other_colour = next(c for c in D.COLOURS if c != ex.facts["colour"])
    assert not A.score("describe", ex, f"A {other_colour} {ex.facts['shape']}.")
    assert not A.score("colour", ex, f"{ex.facts['colour']} or {other_colour}")  # hedging is wrong
    assert not A.score("shape", ex, "Nothing.")


def test_answered_label_agrees_with_the_score():
    ex = A.heldout_examples("shape", 1)[0]
    true, other = ex.facts["shape"], next(s for s in D.SHAPES if s != ex.facts["shape"])
    for reply, label in [(f"It is a {true}.", true), (f"A {other}.", other), ("Nothing.", "none"),
                         (f"A {true} or a {other}.", "several"), (f"Two {true}s.", true)]:
        assert A.answered("shape", reply) == label
        assert A.score("shape", ex, reply) == (label == true)
    assert A.answered("colour", "The shape is red.") == "red"
    assert A.answered("count", "Three.") is None


def test_heldout_pictures_differ_from_training_pictures():
    held = {A.heldout_examples(qt, 20)[i].image.tobytes() for qt in ("colour", "shape") for i in range(20)}
    rng = random.Random(0)  # the training stream of seed 0
    train = {D.make_example(rng, size=(84, 84)).image.tobytes() for _ in range(200)}
    assert not held & train


def test_training_sequences_match_the_cli_prompt():
    from dsv41.model.config import ModelArgs
    from dsv41.model.encoding import encode_messages_with_images
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.vision.train import VISION, encode_example

    tok = load_tokenizer()
    args = ModelArgs().replace(**VISION)
    ex = D.make_example(random.Random(3), kind="shape", question_type="colour", size=(84, 84))
    ids, types, inputs, reply_at = encode_example(ex, "thinking", 75, tok, args)
    # the prompt part is what `dsv41 generate --image x.png "question"` encodes (image first)
    prompt, _ = encode_messages_with_images([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x.png"}}, {"type": "text", "text": ex.question}]}], mode="thinking")
    placeholder = tok.encode(prompt)
    n = inputs[0].types.numel()
    assert ids[:reply_at] == placeholder[: inputs[0].start] + [args.image_token_id] * n + placeholder[inputs[0].start + 1:]
    assert tok.decode(ids[reply_at:]) == f"{ex.reasoning}</think>{ex.answer}<｜end▁of▁sentence｜>"
    # 84x84 -> 6x6 patches -> 2x2 tokens -> 8 positions
    assert n == 8 and types[inputs[0].start: inputs[0].end] == [0, 1, 1, 2, 1, 1, 2, 3]


def test_continuing_a_tower_trains_only_the_image_path(tmp_path):
    """`dsv41.recipes.tiny.vision.train --continue-tower`: the checkpoint's own tower, aligner and span embeddings
    become fp32 masters with gradients; every language-model tensor stays frozen as stored."""
    from pathlib import Path

    from tests.checkpoints import make_small_checkpoint
    from dsv41.recipes.tiny.vision.train import TRAINED_PREFIXES, build

    bundled = Path(__file__).resolve().parents[1] / "model" / "assets" / "dsv41-tiny"
    model, args, _, names = build(bundled, keep_tower=True)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(TRAINED_PREFIXES) for n in trained)
    assert {"image_start", "image_newline", "image_end"} <= trained
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trained)
    assert any(n.startswith("layers.") for n in names) and not any(n.startswith("layers.") for n in trained)
    with pytest.raises(SystemExit, match="no vision tower"):
        build(make_small_checkpoint(tmp_path / "text"), keep_tower=True)
    with pytest.raises(SystemExit, match="already has a vision tower"):
        build(bundled)


def test_padded_sides_are_padded_and_never_held_out():
    from dsv41.model.config import ModelArgs
    from dsv41.model.image_processor import plan_image_grid
    from dsv41.recipes.tiny.vision.train import VISION

    args = ModelArgs().replace(**VISION)
    padded = D.PADDED_SIDES + D.LARGE_SIDES
    assert not set(padded) & set(A.EVAL_SIDES) and not set(padded) & set(D.SIDES)
    for side in padded:
        assert side % 14 and plan_image_grid(side, side, args).width % 14 == 0  # rounded up: grey around it


def test_a_stage_two_step_with_probes_moves_only_the_image_path(monkeypatch):
    """One `train()` step with the probe loss added (--probe-weight) on padded canvases: the tower and the
    aligner change, no language-model tensor does, and the probes are not part of the model."""
    from pathlib import Path

    from dsv41.recipes.tiny.vision import train as vision_train
    from dsv41.recipes.tiny.vision.train import build, train

    monkeypatch.setattr(vision_train, "lr_at", lambda frac, peak: peak)  # no warmup: one step must move
    bundled = Path(__file__).resolve().parents[1] / "model" / "assets" / "dsv41-tiny"
    model, args, tok, _ = build(bundled, keep_tower=True)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    history = train(model, args, tok, seconds=1e9, batch=2, lr=1e-3, gamma=1e-3, seed=0, max_steps=1,
                    sides=D.PADDED_SIDES, probe_weight=1.0, probe_batch=4, log=lambda line: None)
    after = model.state_dict()
    assert history[0]["step"] == 1 and set(after) == set(before)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(n.startswith("vision.") for n in changed) and any(n.startswith("aligner.") for n in changed)
    assert all(n.startswith(("vision.", "aligner.", "image_")) or n.endswith("bias_vl") for n in changed)
