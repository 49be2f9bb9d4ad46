"""The "checked" trace style of tiny-reasoning (issue #25): the "graded" tiers, with an effort-90-100 check that adds
each number of the pass to its own sum and closes with that sum, so that a slip of the pass changes the answer."""

import itertools
import random
import re

import pytest
from dsv41.evals.tasks import tiny_reasoning as task


def _check_values(trace: str) -> list[tuple[int, int, int | None]]:
    """(number, new sum, the pass's value when marked) per step of the Check line."""
    line = next(ln for ln in trace.splitlines() if ln.startswith("Check: "))
    steps = re.findall(r"\+(\d+)=(\d+)(?: not (\d+))?", line)
    return [(int(n), int(s), int(w) if w else None) for n, s, w in steps]


def _assert_lower_tiers_are_graded(style: str, numbers: list[int]) -> None:
    for effort in (1, 19, 20, 44, 45, 69, 70, 89):
        assert task.reasoning_trace(numbers, effort, style) == task.reasoning_trace(numbers, effort, "graded")


def test_tiers_below_the_top_are_the_graded_ones_and_the_top_checks_every_step():
    numbers = [7, 3, 9, 2, 5]
    _assert_lower_tiers_are_graded("checked", numbers)
    top = task.reasoning_trace(numbers, 100, "checked")
    assert top == task.reasoning_trace(numbers, 90, "checked") == (
        "Sum: 7+3=10, +9=19, +2=21, +5=26\nCheck: 7+3=10, +9=19, +2=21, +5=26\nSo the sum is 26.")
    # stage 37's check (not kept): every step a full equation
    equations = "".join(s.text for s in task.checked_segments(numbers, (2, -1), form="equations"))
    assert equations.endswith("Check: 7+3=10, 10+9=19 not 18, 19+2=21 not 20, 21+5=26 not 25\nSo 26.")
    assert top.split(":")[0] == task.reasoning_trace(numbers, 100, "graded").split(":")[0]  # the tier's first token


@pytest.mark.parametrize("seed", range(40))
def test_a_slip_of_the_pass_is_marked_and_repaired_and_is_never_a_target(seed):
    rng = random.Random(seed)
    numbers = task.random_numbers(rng)
    step, delta = task.random_check_slip(numbers, rng)
    segments = task.checked_segments(numbers, (step, delta))
    text = "".join(s.text for s in segments)
    # the pass is right before the slip (trained), then off by delta from the slip to its end (untrained)
    trained_pass, untrained_pass = segments[0].text, segments[1].text
    assert segments[0].train and not segments[1].train and all(s.train for s in segments[2:])
    sums = [int(v) for v in re.findall(r"=(\d+)", (trained_pass + untrained_pass).split("\n")[0])]
    right = [sum(numbers[:k + 1]) for k in range(1, len(numbers))]
    assert sums == [r + (delta if k + 1 >= step else 0) for k, r in enumerate(right)]
    assert len(re.findall(r"=(\d+)", trained_pass)) == step - 1
    # the check adds the pass's numbers to its own sums, marks each step whose value the pass wrote otherwise,
    # and closes with its own sum: the answer changes from the pass's to the true one
    check = _check_values(text)
    assert [s for _, s, _ in check] == right
    assert [w for *_, w in check] == [w if w != r else None for w, r in zip(sums, right)]
    assert [n for n, _, _ in check] == numbers[1:]
    assert text.endswith(f"\nSo the sum is {sum(numbers)}.") and sums[-1] != sum(numbers)


def test_slips_stay_at_or_above_zero():
    with pytest.raises(ValueError):
        task.checked_segments([0, 0, 1, 2], (1, -10))
    for seed in range(200):
        rng = random.Random(seed)
        numbers = [rng.randint(0, 2) for _ in range(4)]
        task.checked_segments(numbers, task.random_check_slip(numbers, rng))  # never raises


@pytest.mark.parametrize("style", ["checked", "checked-inline"])
def test_lengths_rise_strictly_at_every_list_length(style):
    from dsv41.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    rng = random.Random(0)
    for length in range(task.MIN_NUMBERS, task.MAX_NUMBERS + 1):
        for _ in range(20):
            numbers = [rng.randint(0, 9) for _ in range(length)]
            lengths = [len(tok.encode(task.reasoning_trace(numbers, e, style))) for e in task.SWEEP_EFFORTS]
            assert lengths == sorted(set(lengths)), (numbers, lengths)


def test_build_data_writes_the_checked_family_with_its_loss_mask(tmp_path):
    import numpy as np
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny import build_data as B

    tok = load_tokenizer()
    held = task.load_items()
    info = B.build_reasoning(tmp_path, tok, held, 300, "checked")
    assert info["trace_style"] == "checked" and info["train_documents"] == 300
    ids = B.load_tokens(tmp_path / "reasoning_checked.u32.xz")
    mask = B.load_tokens(tmp_path / "reasoning_checked.mask.u8.xz", np.uint8)
    assert ids.size == mask.size == info["train_tokens"] and info["untrained_tokens"] == int((mask == 0).sum()) > 0
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    cuts = np.flatnonzero(ids == bos).tolist() + [ids.size]
    held_lists, slipped, top = {tuple(it["numbers"]) for it in held}, 0, 0
    for a, b in itertools.pairwise(cuts):
        text = tok.decode(ids[a:b].tolist())
        untrained = tok.decode(ids[a:b][mask[a:b] == 0].tolist())
        numbers = [int(n) for n in re.search(r"Add: ([\d ]+)", text).group(1).split()]
        assert tuple(numbers) not in held_lists
        assert text.endswith(f"</think>Answer: {sum(numbers)}<｜end▁of▁sentence｜>")
        reasoning = text.split("<think>")[-1].split("</think>")[0]
        top += reasoning.startswith("Sum:")
        if " not " in reasoning:  # a slipped pass: its sums from the slip on are never targets; the check is
            slipped += 1
            assert untrained and untrained in reasoning.split("\n")[0] and "Check" not in untrained
            assert reasoning.endswith(f"So the sum is {sum(numbers)}.")
        else:
            assert not untrained
    assert slipped == info["conversations_with_a_repaired_slip"] > 0
    assert top > 300 * B.CHECKED_TOP_SHARE  # the top tier is oversampled


def test_check_repair_reads_the_pass_and_the_check():
    from dsv41.recipes.tiny import check_repair as C

    numbers = [7, 3, 9, 2, 5]
    assert C.forced_pass(numbers, None) == "Sum: 7+3=10, +9=19, +2=21, +5=26\nCheck: "
    assert C.forced_pass(numbers, (2, -1)) == "Sum: 7+3=10, +9=18, +2=20, +5=25\nCheck: "
    slipped = "".join(s.text for s in task.checked_segments(numbers, (2, -1)))
    assert C.classify(slipped, True, 26) == {"pass_right": False, "checked": True, "marked": True,
                                             "answer_right": True}
    rows = [C.classify(slipped, True, 26), C.classify(task.reasoning_trace(numbers, 100, "checked"), False, 26)]
    summary = C.summarize(rows)
    assert summary["repaired"] == 1 and summary["broken"] == 1 and summary["marked"] == 1


# The "checked-inline" style (stage 39): every step of the pass undone where it is written.

def test_inline_top_tier_undoes_every_step_where_it_is_written():
    numbers = [7, 3, 9, 2, 5]
    _assert_lower_tiers_are_graded("checked-inline", numbers)
    top = task.reasoning_trace(numbers, 100, "checked-inline")
    assert top == task.reasoning_trace(numbers, 90, "checked-inline") == (
        "Sum: 7+3=10 (10-3=7 ok), +9=19 (19-9=10 ok), +2=21 (21-2=19 ok), +5=26 (26-5=21 ok)\nSo the sum is 26.")
    assert "".join(s.text for s in task.checked_segments(numbers, None, "inline")) == top
    with pytest.raises(ValueError):
        task.checked_segments(numbers, None, "backwards")


_STEP = re.compile(r"(\d+)=(\d+) \((\d+)-(\d+)=(\d+) (ok|not (\d+))\)")


@pytest.mark.parametrize("seed", range(40))
def test_an_inline_slip_is_only_context_and_its_check_redoes_the_step(seed):
    rng = random.Random(seed)
    numbers = task.random_numbers(rng)
    step, delta = task.random_check_slip(numbers, rng, "inline")
    segments = task.checked_segments(numbers, (step, delta), "inline")
    right = [sum(numbers[:k + 1]) for k in range(1, len(numbers))]
    # one untrained segment: the slipped sum's digits, nothing else
    assert [s.train for s in segments] == [True, False, True]
    assert segments[1].text == str(right[step - 1] + delta)
    text = "".join(s.text for s in segments)
    attempts = [(int(n), int(w), int(a), int(b), int(c), v) for n, w, a, b, c, v, _ in _STEP.findall(text)]
    assert len(attempts) == len(numbers)  # every step once, the slipped one twice
    before = [numbers[0]] + right[:-1]
    for i, (n, w, a, b, c, verdict) in enumerate(attempts):
        k = i if i < step else i - 1  # the step this attempt does
        assert n == numbers[k + 1] and a == w and b == n and c == w - n
        if i == step - 1:  # the slip: its check finds another number than the sum before, and says which
            assert w == right[k] + delta and verdict == f"not {before[k]}"
        else:
            assert w == right[k] and verdict == "ok"
    assert text.endswith(f"\nSo the sum is {sum(numbers)}.")


def test_inline_slips_keep_every_value_at_or_above_zero():
    with pytest.raises(ValueError):
        task.checked_segments([5, 2, 1, 2], (1, -10), "inline")  # 7 - 10 < 0
    with pytest.raises(ValueError):
        task.checked_segments([5, 9, 1, 2], (1, -10), "inline")  # 14 - 10 = 4, then 4 - 9 < 0
    for seed in range(200):
        rng = random.Random(seed)
        numbers = [rng.randint(0, 3) for _ in range(4)]
        task.checked_segments(numbers, task.random_check_slip(numbers, rng, "inline"), "inline")  # never raises


def test_build_data_writes_the_inline_family_whose_only_context_is_the_slipped_sums(tmp_path):
    import numpy as np
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny import build_data as B

    tok = load_tokenizer()
    info = B.build_reasoning(tmp_path, tok, task.load_items(), 300, "checked-inline")
    assert info["trace_style"] == "checked-inline" and info["check_form"] == "inline"
    ids = B.load_tokens(tmp_path / "reasoning_checked_inline.u32.xz")
    mask = B.load_tokens(tmp_path / "reasoning_checked_inline.mask.u8.xz", np.uint8)
    assert ids.size == mask.size == info["train_tokens"]
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    cuts = np.flatnonzero(ids == bos).tolist() + [ids.size]
    slipped = 0
    for a, b in itertools.pairwise(cuts):
        text = tok.decode(ids[a:b].tolist())
        reasoning = text.split("<think>")[-1].split("</think>")[0]
        untrained = [tok.decode([t]) for t in ids[a:b][mask[a:b] == 0].tolist()]
        marks = re.findall(r"=(\d+) \(\d+-\d+=\d+ not \d+\)", reasoning)
        slipped += bool(marks)
        assert "".join(untrained) == "".join(marks) and all(u.isdigit() for u in untrained)
    assert slipped == info["conversations_with_a_repaired_slip"] > 0


def test_check_repair_reads_inline_traces():
    from dsv41.recipes.tiny import check_repair as C

    numbers = [7, 3, 9, 2, 5]
    assert C.forced_pass(numbers, (2, -1), "inline") == "Sum: 7+3=10 (10-3=7 ok), +9=18"
    assert C.forced_pass(numbers, None, "inline", 2) == "Sum: 7+3=10 (10-3=7 ok), +9=19"
    slipped = "".join(s.text for s in task.checked_segments(numbers, (2, -1), "inline"))
    assert C.inline_pass(slipped) == ([10, 18, 21, 26], True)
    assert C.classify(slipped, True, 26, numbers, "inline") == {"pass_right": False, "checked": True,
                                                                 "marked": True, "answer_right": True}
    clean = task.reasoning_trace(numbers, 100, "checked-inline")
    assert C.classify(clean, False, 26, numbers, "inline") == {"pass_right": True, "checked": True,
                                                                "marked": False, "answer_right": False}
    # a check that wrongly disagrees on a right pass: marked, the pass still right
    false_alarm = clean.replace("(19-9=10 ok)", "(19-9=11 not 10) +9=19 (19-9=10 ok)")
    assert C.inline_pass(false_alarm) == ([10, 19, 21, 26], True)


def test_build_data_refuses_a_top_share_outside_0_1(tmp_path):
    from dsv41.recipes.tiny import build_data as B

    with pytest.raises(SystemExit) as exit_info:
        B.main(["--out", str(tmp_path / "data"), "--reasoning-only", "checked", "--checked-top-share", "1.5"])
    assert exit_info.value.code == 2 and not (tmp_path / "data").exists()
