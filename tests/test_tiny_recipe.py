"""The dsv41-tiny recipe: the tiny-reasoning task, the training losses, the export to the official
layout, the evaluation arithmetic, and (when present) the bundled checkpoint itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsv41.evals.tasks import tiny_reasoning as task

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ the task
def test_effort_tiers_and_strictly_longer_traces():
    from dsv41.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    assert [task.effort_tier(e) for e in (1, 19, 20, 44, 45, 69, 70, 89, 90, 100)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError):
        task.effort_tier(0)
    for numbers in ([7, 3, 9, 2], [0, 0, 0, 0, 0, 0, 0, 0], [9, 9, 9, 9, 9, 9, 9, 9]):
        for style in task.TRACE_STYLES:
            lengths = [len(tok.encode(task.reasoning_trace(numbers, e, style))) for e in task.SWEEP_EFFORTS]
            assert lengths[0] == 0
            assert all(a < b for a, b in zip(lengths, lengths[1:])), (style, lengths)


def test_traces_are_arithmetically_right():
    numbers = [7, 3, 9, 2, 5]
    assert task.reasoning_trace(numbers, 30) == "7+3=10, +9=19, +2=21, +5=26"
    assert task.reasoning_trace(numbers, 50).splitlines() == ["7+3=10", "10+9=19", "19+2=21", "21+5=26"]
    full = task.reasoning_trace(numbers, 100)
    assert full.startswith("Numbers: 7, 3, 9, 2, 5 (5 numbers).")
    assert "Step 4: 21+5=26" in full and "5+2=7" in full and full.endswith("Both give 26.")
    assert "Check" not in task.reasoning_trace(numbers, 89)


def test_carry_traces_carry_the_numbers_left_and_check_each_step():
    numbers = [7, 3, 9, 2, 5]
    for effort in (1, 25, 50, 69):  # the styles differ only at 70-100
        assert task.reasoning_trace(numbers, effort, "carry") == task.reasoning_trace(numbers, effort)
    assert task.reasoning_trace(numbers, 75, "carry").splitlines() == [
        "Step 1: 7+3=10, left 9 2 5", "Step 2: 10+9=19, left 2 5", "Step 3: 19+2=21, left 5",
        "Step 4: 21+5=26, left none"]
    assert task.reasoning_trace(numbers, 100, "carry").splitlines() == [
        "Step 1: 7+3=10, check 10-3=7, left 9 2 5", "Step 2: 10+9=19, check 19-9=10, left 2 5",
        "Step 3: 19+2=21, check 21-2=19, left 5", "Step 4: 21+5=26, check 26-5=21, left none"]
    with pytest.raises(ValueError):
        task.reasoning_trace(numbers, 75, "careful")
    text = task.training_conversation(numbers, 90, "carry")
    assert "<think>Step 1: 7+3=10, check 10-3=7, left 9 2 5\n" in text and text.endswith(
        "left none</think>Answer: 26<｜end▁of▁sentence｜>")


def test_twice_traces_recompute_the_terse_sums():
    numbers = [7, 3, 9, 2, 5]
    for effort in (1, 25, 50, 69):
        assert task.reasoning_trace(numbers, effort, "twice") == task.reasoning_trace(numbers, effort)
    terse = "7+3=10, +9=19, +2=21, +5=26"
    assert task.reasoning_trace(numbers, 30) == terse
    assert task.reasoning_trace(numbers, 89, "twice").splitlines() == [terse, "Again: " + terse]
    assert task.reasoning_trace(numbers, 90, "twice").splitlines() == [terse, "Check: " + terse, "Both give 26."]


TERSE = "7+3=10, +9=19, +2=21, +5=26"


@pytest.mark.parametrize("style, tier3, tier4", [
    ("labelled", ["First: " + TERSE, "Again: " + TERSE], ["Sum: " + TERSE, "Check: " + TERSE, "Both give 26."]),
    ("undo", ["First: " + TERSE, "Undo: 26-5=21, -2=19, -9=10, -3=7", "So 26."],
     ["Sum: " + TERSE, "Check: 26-5=21, -2=19, -9=10, -3=7", "Back to 7, so the sum is 26."]),
])
def test_labelled_styles_name_the_tier_in_their_first_token(style, tier3, tier4):
    """"labelled" and "undo": efforts 70-89 and 90-100 start with their own word, so the effort line decides
    the tier at the first reasoning token (tiers 1 and 2 both start with the first number); "undo" checks
    the first pass by undoing its sums from the end, back to the first number."""
    from dsv41.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    numbers = [7, 3, 9, 2, 5]
    for effort in (1, 25, 50, 69):
        assert task.reasoning_trace(numbers, effort, style) == task.reasoning_trace(numbers, effort)
    assert task.reasoning_trace(numbers, 70, style).splitlines() == tier3
    assert task.reasoning_trace(numbers, 89, style).splitlines() == tier3
    assert task.reasoning_trace(numbers, 90, style).splitlines() == tier4
    assert task.reasoning_trace(numbers, 100, style).splitlines() == tier4
    firsts = {e: tok.encode(task.reasoning_trace(numbers, e, style))[0] for e in (25, 50, 75, 100)}
    assert firsts[25] == firsts[50] and len({firsts[25], firsts[75], firsts[100]}) == 3
    if style == "undo":
        assert task.reasoning_trace([4, 0, 0, 1], 100, "undo").splitlines()[1] == "Check: 5-1=4, -0=4, -0=4"


def test_both_trace_styles_hold_the_same_problems(tmp_path):
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny import build_data as B
    from dsv41.recipes.tiny.train import load_streams

    tok = load_tokenizer()
    held = task.load_items()
    for style in task.TRACE_STYLES:
        info = B.build_reasoning(tmp_path, tok, held, 40, style)
        assert info["train_documents"] == 40 and info["trace_style"] == style
    streams = load_streams(tmp_path, ["reasoning", "reasoning_carry"])
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    convos = {}
    for name, ids in streams.items():
        cut = (ids == bos).nonzero().flatten().tolist() + [ids.numel()]
        convos[name] = [tok.decode(ids[a:b].tolist()) for a, b in zip(cut, cut[1:])]
    assert len(convos["reasoning"]) == len(convos["reasoning_carry"]) == 40
    held_lists = {tuple(it["numbers"]) for it in held}
    for old, new in zip(convos["reasoning"], convos["reasoning_carry"]):
        assert old.split("<｜Assistant｜>")[0] == new.split("<｜Assistant｜>")[0]  # same effort, same list
        assert old.split("</think>")[1] == new.split("</think>")[1]  # same answer
        numbers = tuple(int(x) for x in old.split("Add: ")[1].split("<")[0].split())
        assert numbers not in held_lists
        effort = int(old.split("Reasoning Effort: ")[1].split()[0].rstrip("."))
        assert (old == new) == (effort < 70)
    with pytest.raises(SystemExit, match="reasoning_sideways"):
        load_streams(tmp_path, ["reasoning_sideways"])


def test_training_conversation_uses_the_v41_encoding():
    text = task.training_conversation([1, 2, 3, 4], effort=37)
    assert text.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 37 ")
    assert "<｜User｜>Add: 1 2 3 4<｜Assistant｜><think>1+2=3, +3=6, +4=10</think>Answer: 10<｜end▁of▁sentence｜>" in text
    quick = task.training_conversation([1, 2, 3, 4], effort=5)
    assert "<think></think>Answer: 10<｜end▁of▁sentence｜>" in quick


def test_scorer_reads_the_last_number_after_think():
    item = {"answer": 26}
    assert task.score("7+3=10 ...</think>Answer: 26", item)
    assert task.score("</think>It is 25, no, 26", item)
    assert not task.score("</think>Answer: 25", item)
    assert not task.score("26 26 26", item)  # never closed its reasoning: no answer
    assert not task.score("</think>no idea", item)
    assert task.split_completion("a</think>b") == ("a", "b")


def test_heldout_set_ships_and_is_effort_free():
    items = task.load_items()
    assert len(items) == 300
    assert len({tuple(i["numbers"]) for i in items}) == 300
    for it in items:
        assert it["answer"] == sum(it["numbers"])
        assert task.MIN_NUMBERS <= len(it["numbers"]) <= task.MAX_NUMBERS
        assert it["messages"] == [{"role": "user", "content": task.question(it["numbers"])}]
    prompt = task.prompt_text(items[0], 75)
    assert "Reasoning Effort: 75 " in prompt and prompt.endswith("<｜Assistant｜><think>")


def test_generate_items_excludes_heldout_lists():
    held = task.generate_items(50, seed=1)
    excluded = {tuple(i["numbers"]) for i in held}
    fresh = task.generate_items(200, seed=1, exclude=excluded)
    assert not excluded & {tuple(i["numbers"]) for i in fresh}


# ------------------------------------------------------------------------------------ training pieces
@pytest.fixture(scope="module")
def trainable_tiny():
    """preset('tiny') as a trainable fp32 model, through the recipe's own builder."""
    from dsv41.model.config import preset
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.train import build_trainable

    args = preset("tiny").replace(trainable=True)
    token_map, _ = build_compressed_token_map(load_tokenizer())
    return build_trainable(args, token_map, "cpu", seed=5)


def test_chunked_ce_matches_full_cross_entropy():
    from dsv41.recipes.tiny.train import chunked_ce

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (3, 7), generator=g)
    ref = F.cross_entropy(F.linear(h, w).reshape(-1, 50), t.reshape(-1))
    got = chunked_ce(h, w, t, chunk=4)
    assert torch.allclose(got, ref, atol=1e-6)
    gh, gw = torch.autograd.grad(got, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(gh, rh, atol=1e-6) and torch.allclose(gw, rw, atol=1e-6)


def test_weighted_ce_scales_only_the_weighted_tokens():
    from dsv41.recipes.tiny.train import chunked_ce, think_start_weights

    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 16, generator=g)
    w = torch.randn(50, 16, generator=g)
    inputs = torch.tensor([[7, 3, 9, 3, 1], [3, 3, 0, 2, 8]])
    t = torch.randint(0, 50, (2, 5), generator=g)
    assert think_start_weights(inputs, 3, 1.0) is None  # weight 1: the plain loss
    tw = think_start_weights(inputs, 3, 10.0)
    assert tw.tolist() == [[1, 10, 1, 10, 1], [10, 10, 1, 1, 1]]
    per_token = F.cross_entropy(F.linear(h, w).reshape(-1, 50), t.reshape(-1), reduction="none")
    got = chunked_ce(h, w, t, chunk=3, token_weights=tw)
    assert torch.allclose(got, (per_token * tw.reshape(-1)).sum() / 10, atol=1e-6)
    assert torch.allclose(chunked_ce(h, w, t, chunk=3, token_weights=torch.ones(2, 5)), per_token.mean(), atol=1e-6)


def test_think_end_weights_mark_the_stop_or_verify_decision():
    from dsv41.recipes.tiny.train import think_end_weights

    END, NL, CHECK, STEP = 9, 5, 7, 6
    targets = torch.tensor([[STEP, 1, NL, STEP, 1, NL, CHECK, 2, NL, 3],   # a step, then the verification pass
                            [STEP, 1, NL, STEP, 1, END, 4, NL, 1, NL]])    # the trace ends; a newline at the row end
    assert think_end_weights(targets, END, NL, CHECK, 1.0) is None
    w = think_end_weights(targets, END, NL, CHECK, 3.0)
    assert w.tolist() == [[1, 1, 1, 1, 1, 3, 3, 1, 1, 1], [1, 1, 1, 1, 1, 3, 1, 1, 1, 1]]


def test_reasoning_weights_on_real_traces():
    """With the real tokenizer: effort 100 weights the newline and "Check" that start the verification pass,
    effort 75 the `</think>` after its last step, effort 1 the first reasoning token (`</think>`) by the
    larger of the two weights; rows without reasoning are unweighted."""
    from dsv41.evals.tasks import tiny_reasoning as task
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.train import reasoning_weights

    tok = load_tokenizer()
    assert reasoning_weights(tok, 1.0, 1.0) is None
    weights = reasoning_weights(tok, 4.0, 3.0)
    for effort, want in ((100, ["\n", "Check", "</think>"]), (75, ["</think>"]), (1, ["</think>"])):
        ids = torch.tensor([tok.encode(task.training_conversation([3, 8, 1, 6, 2], effort))])
        w = weights(ids)[0]
        heavy = [tok.decode([t]) for t, x in zip(ids[0, 1:].tolist(), w.tolist()) if x > 1]
        first = ids[0, :-1].tolist().index(tok.token_to_id("<think>"))
        assert w[first] == 4.0  # the first reasoning token: the start weight (the larger one at effort 1)
        # the end weights: the last weighted targets (effort 1: the first reasoning token is the only one)
        assert (heavy == want) if effort == 1 else (heavy[1:] == want), (effort, heavy)
    # a side effect, kept small: a literal "Check" in other text (and a newline before it) is weighted too
    prose = torch.tensor([tok.encode("Check the value.\nCheck it again.")])
    assert (weights(prose) > 1).sum() <= 2


def test_closing_sum_weights_mark_the_sum_the_answer_copies():
    from dsv41.evals.tasks import tiny_reasoning as task
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.train import closing_sum_weights, reasoning_weights

    PERIOD, END = 8, 9
    targets = torch.tensor([[3, 4, 26, PERIOD, END, 1, 26], [26, PERIOD, 2, END, 1, 26, PERIOD]])
    assert closing_sum_weights(targets, PERIOD, END, 1.0) is None
    w = closing_sum_weights(targets, PERIOD, END, 5.0)
    assert w.tolist() == [[1, 1, 5, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]  # only number . </think>, not at a row end
    tok = load_tokenizer()
    weights = reasoning_weights(tok, 1.0, 1.0, 5.0)
    for effort, heavy_want in ((75, ["26"]), (100, ["26"]), (50, []), (25, [])):
        ids = torch.tensor([tok.encode(task.training_conversation([7, 3, 9, 2, 5], effort, "undo"))])
        heavy = [tok.decode([t]) for t, x in zip(ids[0, 1:].tolist(), weights(ids)[0].tolist()) if x > 1]
        assert heavy == heavy_want, (effort, heavy)


def test_selection_bias_rule_moves_toward_balance():
    from dsv41.recipes.tiny.train import update_selection_bias

    class Fake:
        pass

    moe = Fake()
    moe.gate = Fake()
    moe.gate.bias = torch.zeros(4)
    moe.load = torch.tensor([10, 2, 4, 4])
    update_selection_bias([moe], 0.01)
    assert moe.gate.bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def test_backbone_step_reduces_loss_and_keeps_bias_out_of_the_optimizer(trainable_tiny):
    from dsv41.recipes.tiny.train import WindowSampler, train_backbone

    model = trainable_tiny
    stream = torch.arange(2000) % 97 + 3  # a periodic sequence: learnable within a few steps
    sampler = WindowSampler({"prose": stream}, {"prose": 1.0})
    bias_before = model.layers[0].ffn.gate.bias.clone()
    history = train_backbone(model, sampler, "cpu", seconds=1e9, batch=4, context=32, lr=1e-2, max_steps=12,
                             gamma=1e-3, log=lambda _: None)
    assert history[0]["step"] == 1 and history[-1]["step"] == 10
    assert history[-1]["lm_loss"] < history[0]["lm_loss"]
    assert history[-1]["indexer_kl"] > 0  # the indexer is trained (pool-restricted layers included)
    moved = (model.layers[0].ffn.gate.bias - bias_before) / 1e-3
    # only the sign rule moves the bias (whole steps of gamma), never the optimizer
    assert moved.abs().sum() > 0 and moved.abs().max() <= 12 + 1e-3
    assert torch.allclose(moved, moved.round(), atol=1e-3)


def test_dspark_blocks_are_anchor_plus_next_tokens(trainable_tiny):
    from dsv41.recipes.tiny.train import dspark_batch, dspark_loss

    model = trainable_tiny
    model.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():  # phase 2: only the drafter learns
        p.requires_grad_(name.startswith("mtp."))
    S = model.args.dspark_block_size
    ids = torch.randint(3, 500, (2, 40))
    g = torch.Generator().manual_seed(0)
    hidden, prev, labels = dspark_batch(model, ids, 6, g, labels_from="data")
    assert hidden.shape == (12, S, model.args.dim)
    assert torch.equal(prev[:, 1:], labels[:, :-1])  # teacher forcing: y_i is the label of position i-1
    # every label block is a run of S consecutive tokens of its sequence, right after the anchor
    for row in range(12):
        seq = ids[row // 6]
        hits = [p for p in range(40 - S) if torch.equal(seq[p:p + S], prev[row])]
        assert hits and any(torch.equal(seq[p + 1:p + 1 + S], labels[row]) for p in hits)
    ce, bce, acc = dspark_loss(model, hidden, prev, labels, chunk=7)
    assert ce > 0 and bce > 0 and 0 <= float(acc) <= 1
    (ce + bce).backward()
    assert model.mtp[0].main_proj.weight.grad is not None  # main_x is trained through the context KV
    assert model.mtp[-1].markov_head.embed.weight.grad is not None
    assert model.layers[-1].attn.wq_a.weight.grad is None  # the backbone stays frozen


def test_dspark_target_labels_are_the_targets_greedy_tokens(trainable_tiny):
    """Self-distillation: the label of block position i is the target's argmax at the position whose
    next token it predicts, i.e. what greedy verification would accept there."""
    from dsv41.recipes.tiny.train import dspark_batch, greedy_next

    model = trainable_tiny
    S = model.args.dspark_block_size
    ids = torch.randint(3, 500, (2, 40))
    with torch.no_grad():
        greedy = greedy_next(model(ids, all_logits=True), model.head.weight)
    _, prev, labels = dspark_batch(model, ids, 6, torch.Generator().manual_seed(1), labels_from="target")
    data_labels_differ = False
    for row in range(12):
        seq, picks = ids[row // 6], greedy[row // 6]
        starts = [p for p in range(40 - S) if torch.equal(seq[p:p + S], prev[row])]
        assert any(torch.equal(picks[p:p + S], labels[row]) for p in starts)
        data_labels_differ |= not any(torch.equal(seq[p + 1:p + 1 + S], labels[row]) for p in starts)
    assert data_labels_differ  # an untrained model's picks are not the data


def test_text_checkpoint_grows_a_fresh_vision_tower(trainable_tiny, tmp_path):
    """--init-from a text-only checkpoint into the vision config: text tensors load as stored, the
    tower keeps its random init, and bias_vl starts from the text selection bias."""
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.fixtures import TINY_VISION
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.train import build_trainable, load_into_trainable_, official_state_dict, write_official

    text = trainable_tiny
    write_official(official_state_dict(text, text.args), text.args, tmp_path / "text", None)
    token_map, _ = build_compressed_token_map(load_tokenizer())
    both = build_trainable(text.args.replace(**TINY_VISION), token_map, "cpu", seed=6)
    tower_before = both.vision.patch_embed.proj.weight.detach().clone()
    saved_bias = text.layers[0].ffn.gate.bias.detach().clone()
    with torch.no_grad():
        text.layers[0].ffn.gate.bias.fill_(0.25)
    write_official(official_state_dict(text, text.args), text.args, tmp_path / "text2", None)
    with torch.no_grad():
        text.layers[0].ffn.gate.bias.copy_(saved_bias)  # the module-scoped fixture is shared
    assert load_into_trainable_(both, tmp_path / "text2") is True
    assert torch.equal(both.vision.patch_embed.proj.weight, tower_before)
    assert torch.equal(both.layers[0].ffn.gate.bias_vl, both.layers[0].ffn.gate.bias)
    assert float(both.layers[0].ffn.gate.bias[0].detach()) == 0.25
    assert load_into_trainable_(text, tmp_path / "text") is False  # same architecture: nothing fresh


def test_joint_image_steps_train_the_tower_and_balance_bias_vl(trainable_tiny):
    """Backbone steps with image batches: the reply loss is logged, the tower and the image-span
    embeddings learn, and bias_vl moves only by the aux-loss-free sign rule (whole steps of gamma)."""
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.fixtures import TINY_VISION
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.config import VISION
    from dsv41.recipes.tiny.train import VisionJob, WindowSampler, build_trainable, train_backbone

    args = trainable_tiny.args.replace(**{**VISION, **TINY_VISION})
    token_map, _ = build_compressed_token_map(load_tokenizer())
    model = build_trainable(args, token_map, "cpu", seed=7)
    tower = model.vision.patch_embed.proj.weight.detach().clone()
    start = model.image_start.detach().clone()
    bias_vl = model.layers[0].ffn.gate.bias_vl.detach().clone()
    vision = VisionJob(None, args, batch=2, every=1, weight=1.0, seed=3, workers=0)
    real = vision.batches  # the real tokenizer's ids, folded into the test model's small vocabulary
    vision.batches = ((ids % args.vocab_size, images, target) for ids, images, target in real)
    sampler = WindowSampler({"prose": torch.arange(2000) % 97 + 3}, {"prose": 1.0})
    history = train_backbone(model, sampler, "cpu", seconds=1e9, batch=2, context=32, lr=1e-2, max_steps=2,
                             gamma=1e-3, log=lambda _: None, vision=vision)
    assert history[0]["image_reply_loss"] > 0
    assert not torch.equal(model.vision.patch_embed.proj.weight, tower)
    assert not torch.equal(model.image_start, start)
    moved = (model.layers[0].ffn.gate.bias_vl - bias_vl) / 1e-3
    assert moved.abs().sum() > 0 and torch.allclose(moved, moved.round(), atol=1e-3) and moved.abs().max() <= 2 + 1e-3


def test_probe_stage_and_probe_loss_in_the_joint_steps(trainable_tiny):
    """--retrain-tower / --probe-weight: probe batches carry each picture's labels; the probe stage trains the
    probes it is given (kept for the joint steps); the joint steps then log the probes' loss and keep training
    both the probes and the tower."""
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.fixtures import TINY_VISION
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.config import VISION
    from dsv41.recipes.tiny.train import VisionJob, WindowSampler, build_trainable, train_backbone
    from dsv41.recipes.tiny.vision.train import Probe, pretrain_tower, probe_batches

    args = trainable_tiny.args.replace(**{**VISION, **TINY_VISION})
    pixels, _, labels = next(probe_batches(args, 3, seed=1, variety=0.5, workers=0, style=2))
    assert pixels.shape[0] == 3 and set(labels) == set(Probe.LABELS)
    assert all(v.shape == (3,) and v.dtype == torch.long for v in labels.values())
    assert labels["kind"].max() < 3 and labels["shape"].max() <= len(Probe.LABELS["shape"]) - 1
    token_map, _ = build_compressed_token_map(load_tokenizer())
    model = build_trainable(args, token_map, "cpu", seed=7)
    vision = VisionJob(None, args, batch=2, every=1, weight=1.0, seed=3, workers=0, variety=0.5, style=2)
    vision.add_probe(model, args, batch=2, weight=0.5, lr=1e-2, seed=3, workers=0, variety=0.5)
    probe_before = vision.probe.heads["shape"].weight.detach().clone()
    history = pretrain_tower(model, args, 1.0, 2, 1e-2, seed=3, log=lambda _: None, variety=0.5,
                             probe=vision.probe, style=2)
    assert isinstance(history, list)
    after_stage = vision.probe.heads["shape"].weight.detach().clone()
    assert not torch.equal(after_stage, probe_before)  # the stage trained the probes the joint steps keep
    tower = model.vision.patch_embed.proj.weight.detach().clone()
    real = vision.batches
    vision.batches = ((ids % args.vocab_size, images, target) for ids, images, target in real)
    sampler = WindowSampler({"prose": torch.arange(2000) % 97 + 3}, {"prose": 1.0})
    history = train_backbone(model, sampler, "cpu", seconds=1e9, batch=2, context=32, lr=1e-2, max_steps=2,
                             gamma=1e-3, log=lambda _: None, vision=vision)
    assert history[0]["probe_loss"] > 0 and set(history[0]["probe_batch_accuracy"]) == {"colour", "shape"}
    assert not torch.equal(vision.probe.heads["shape"].weight, after_stage)
    assert not torch.equal(model.vision.patch_embed.proj.weight, tower)


@pytest.mark.parametrize("flags", [["--probe-weight", "-1"], ["--tower-batch", "0"], ["--probe-batch", "0"]])
def test_bad_probe_options_are_usage_errors(flags, tmp_path, capsys):
    from dsv41.recipes.tiny import train

    with pytest.raises(SystemExit) as exit_:
        train.main([*flags, "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "--probe-weight must be" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_vision_style_flags(tmp_path, capsys):
    """--vision-any-turn draws style 2, --vision-robust style 3, neither style 1; both at once is a usage error."""
    import argparse

    from dsv41.recipes.tiny import train

    def style(**flags):
        return train.vision_style(argparse.Namespace(**{"vision_any_turn": False, "vision_robust": False, **flags}))

    assert (style(), style(vision_any_turn=True), style(vision_robust=True)) == (1, 2, 3)
    with pytest.raises(SystemExit) as exit_:
        train.main(["--vision-any-turn", "--vision-robust", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "two picture styles" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_export_is_the_official_layout_and_computes_what_training_computed(trainable_tiny, tmp_path):
    from dsv41.model.checkpoint import load_model
    from dsv41.recipes.tiny.train import official_state_dict, round_dense_to_bf16_, write_official

    model = trainable_tiny
    round_dense_to_bf16_(model)
    state = official_state_dict(model, model.args)
    assert state["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert state["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert state["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # packed FP4
    assert state["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert state["embed.weight"].dtype == torch.bfloat16
    files = write_official(state, model.args, tmp_path / "ckpt", None)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert all((tmp_path / "ckpt" / f).stat().st_size < 16 << 20 for f in files)
    loaded, args, _ = load_model(tmp_path / "ckpt")
    assert args.dim == model.args.dim and not args.trainable
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = F.linear(model(ids, all_logits=True), model.head.weight)
        shipped = loaded(ids, all_logits=True)
    # the shipped model runs bf16 activations where training ran fp32: close, not bit-equal. Measured after
    # the earlier tests' training steps: 3.2% of the logits' norm, the largest single gap 6.3% of the largest
    # logit (that one moves with the training trajectory, which fp32 summation order alone can shift)
    assert (trained - shipped).norm() < 0.05 * trained.norm()
    assert (trained - shipped).abs().max() < 0.1 * trained.abs().max()
    assert (trained.argmax(-1) == shipped.argmax(-1)).float().mean() > 0.9


# ------------------------------------------------------------------------------------ evaluation
def test_strided_bits_score_every_token_once(tiny_model):
    from dsv41.recipes.tiny.evaluate import document_bits

    class SmallVocab:  # the tiny preset has 512 ids: map text to ids below that
        bos_id = 0

        def encode(self, text, allow_special=False):
            return [3 + (ord(c) % 500) for c in text]

        def decode(self, ids):
            return self._text

    tok = SmallVocab()
    text = "abcdefghij" * 7
    tok._text = text
    ids = torch.tensor([[0] + tok.encode(text)])
    with torch.no_grad():
        logp = torch.log_softmax(tiny_model(ids[:, :-1], all_logits=True), -1)
    full_bits = float(-logp.gather(-1, ids[:, 1:, None]).sum()) / math.log(2)
    one_window = document_bits(tiny_model, tok, [text], ctx=128, stride=64)[0]
    assert one_window["tokens"] == len(text) and one_window["bytes"] == len(text)
    assert one_window["bits"] == pytest.approx(full_bits, rel=1e-4)
    strided = document_bits(tiny_model, tok, [text], ctx=32, stride=16)[0]
    assert strided["bits"] > 0 and strided["bits"] != pytest.approx(full_bits, rel=1e-6)


def test_wilson_interval_and_compressor_baselines():
    from dsv41.recipes.tiny.evaluate import compressor_bpb, wilson_interval

    lo, hi = wilson_interval(0.0, 100)
    assert lo == 0.0 and 0.0 < hi < 0.05
    b = compressor_bpb(b"the quick brown fox " * 200)
    assert set(b) == {"xz", "gzip", "bz2"} and all(0 < v < 1 for v in b.values())


# ------------------------------------------------------------------------------------ the bundled model
BUNDLED = REPO / "model" / "assets" / "dsv41-tiny"


def test_bundled_checkpoint_layout_and_size():
    # the checkpoint is committed: its absence is a defect, so this fails (never skips) without it
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.config import load_config
    from dsv41.recipes.tiny.config import tiny_config

    assert bundled_model_dir() == BUNDLED
    # the HF config carries no name; the bundled model has the recipe's vision tower
    assert load_config(BUNDLED).replace(name="dsv41-tiny") == tiny_config(vision=True)
    total = sum(p.stat().st_size for p in BUNDLED.iterdir() if p.is_file())
    assert total <= 48_000_000
    index = json.loads((BUNDLED / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in BUNDLED.glob("model-*-of-*.safetensors"))
    assert all((BUNDLED / s).stat().st_size < 16 << 20 for s in shards)
    assert (BUNDLED / "tokenizer.json").is_file() and (BUNDLED / "tokenizer_config.json").is_file()


def _generate_json(*args: str) -> dict:
    """`dsv41 generate ... --temperature 0 --json` on the bundled model, run as a user runs it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO), "DSV41_THREADS": "1"}
    env.pop("DSV41_MODEL", None)
    r = subprocess.run([sys.executable, "-m", "dsv41_cli", "generate", *args, "--temperature", "0", "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_bundled_checkpoint_loads_strictly_and_answers():
    """The README's main command, greedy: the bundled model loads (strictly, no --model) and gives the
    trace and the answer the README quotes. Checked on AVX-512/AMX and with oneDNN and ATen held to AVX2."""
    from dsv41.model.checkpoint import load_model

    model, args, tok = load_model(BUNDLED)
    assert tok.id_to_token(128799) == "<｜System｜>"
    out = _generate_json("--effort", "75", "--max-new-tokens", "256", "Add: 7 3 9 2 5")
    assert out["reasoning"].startswith("First: 7+3=10, +9=19, +2=21, +5=26\n")
    assert out["content"] == "Answer: 26" and out["finish_reason"] == "stop"


@pytest.mark.parametrize("mode,reasoning", [("thinking", "I see a green square."), ("chat", "")])
def test_bundled_model_names_the_colour_of_the_readme_picture(mode, reasoning):
    """docs/img/green-square.png is a held-out picture of the recipe's evaluation set (112 x 224 px)."""
    out = _generate_json("--image", str(REPO / "docs/img/green-square.png"), "--mode", mode,
                         "What color is the shape?")
    assert out["reasoning"] == reasoning and out["content"] == "Green."


def test_trace_forms_name_each_style_of_reply():
    from dsv41.recipes.tiny.trace_forms import trace_form

    numbers = [7, 3, 9, 2, 5]
    got = {(style, e): trace_form(task.reasoning_trace(numbers, e, style))
           for style in ("twice", "labelled", "undo") for e in (1, 25, 50, 75, 100)}
    assert [got["undo", e] for e in (1, 25, 50, 75, 100)] == ["none", "terse", "lines", "undo", "check"]
    assert got["twice", 75] == got["labelled", 75] == "again"
    assert got["twice", 100] == got["labelled", 100] == "check+both"
