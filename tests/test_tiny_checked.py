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


@pytest.mark.parametrize("style", ["checked", "checked-inline", "checked-carried", "checked-compared",
                                   "checked-tagged"])
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
    # a wrong pass that ends right without a check disagreeing is repaired, but not by the check
    unmarked = {"pass_right": False, "checked": True, "marked": False, "answer_right": True}
    assert C.summarize(rows + [unmarked])["repaired"] == 2 and C.summarize(rows + [unmarked])["marked_repaired"] == 1


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
        marks = re.findall(r"=(\d+) \(\d+-\d+=\d+ (?:not \d+|vs \d+ not)\)", reasoning)
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
                                                                 "marked": True, "answer_right": True,
                                                                 "origin": "sum"}
    clean = task.reasoning_trace(numbers, 100, "checked-inline")
    assert C.classify(clean, False, 26, numbers, "inline") == {"pass_right": True, "checked": True,
                                                                "marked": False, "answer_right": False,
                                                                "origin": None}
    # a check that wrongly disagrees on a right pass: marked, the pass still right
    false_alarm = clean.replace("(19-9=10 ok)", "(19-9=11 not 10) +9=19 (19-9=10 ok)")
    assert C.inline_pass(false_alarm) == ([10, 19, 21, 26], True)


def test_build_data_refuses_a_top_share_outside_0_1(tmp_path):
    from dsv41.recipes.tiny import build_data as B

    with pytest.raises(SystemExit) as exit_info:
        B.main(["--out", str(tmp_path / "data"), "--reasoning-only", "checked", "--checked-top-share", "1.5"])
    assert exit_info.value.code == 2 and not (tmp_path / "data").exists()


def test_carried_top_tier_writes_the_numbers_still_to_add_after_each_step():
    numbers = [7, 3, 9, 2, 5]
    _assert_lower_tiers_are_graded("checked-carried", numbers)
    top = task.reasoning_trace(numbers, 100, "checked-carried")
    assert top == task.reasoning_trace(numbers, 90, "checked-carried") == (
        "Sum: 7+3=10 (10-3=7 ok) left 9 2 5, +9=19 (19-9=10 ok) left 2 5, +2=21 (21-2=19 ok) left 5, "
        "+5=26 (26-5=21 ok)\nSo the sum is 26.")
    # the same steps and checks as the inline form, with the carried lists taken out
    assert re.sub(r" left[\d ]+", "", top) == task.reasoning_trace(numbers, 100, "checked-inline")


def test_compared_top_tier_copies_the_sum_before_beside_each_check():
    numbers = [7, 3, 9, 2, 5]
    _assert_lower_tiers_are_graded("checked-compared", numbers)
    top = task.reasoning_trace(numbers, 100, "checked-compared")
    assert top == (
        "Sum: 7+3=10 (10-3=7 vs 7 ok) left 9 2 5, +9=19 (19-9=10 vs 10 ok) left 2 5, +2=21 (21-2=19 vs 19 ok) "
        "left 5, +5=26 (26-5=21 vs 21 ok)\nSo the sum is 26.")
    assert re.sub(r" vs \d+", "", top) == task.reasoning_trace(numbers, 100, "checked-carried")
    slipped = "".join(s.text for s in task.checked_segments(numbers, (2, -1), "compared"))
    assert "+9=18 (18-9=9 vs 10 not) +9=19 (19-9=10 vs 10 ok) left 2 5" in slipped


def test_tagged_top_tier_writes_each_carried_number_after_the_letter_of_its_place():
    from dsv41.model.tokenizer import load_tokenizer

    numbers = [7, 3, 9, 2, 5]
    _assert_lower_tiers_are_graded("checked-tagged", numbers)
    top = task.reasoning_trace(numbers, 100, "checked-tagged")
    assert top == (
        "Sum: 7+3=10 (10-3=7 vs 7 ok) left c9 d2 e5, +9=19 (19-9=10 vs 10 ok) left d2 e5, +2=21 (21-2=19 vs 19 ok) "
        "left e5, +5=26 (26-5=21 vs 21 ok)\nSo the sum is 26.")
    assert re.sub(r"(?<= )[a-z](?=\d)", "", top) == task.reasoning_trace(numbers, 100, "checked-compared")
    # a letter and its number are two tokens, as a space and a number are: the tags cost no tokens
    tok = load_tokenizer()
    rng = random.Random(3)
    for _ in range(50):
        numbers = task.random_numbers(rng)
        tagged, compared = (task.reasoning_trace(numbers, 100, s) for s in ("checked-tagged", "checked-compared"))
        assert len(tok.encode(tagged)) == len(tok.encode(compared))
        # every occurrence of a letter in the trace is followed by the number of its place
        for letter, digit in re.findall(r" ([a-z])(\d)", tagged):
            assert numbers[ord(letter) - ord("a")] == int(digit)


# one attempt at a step of the carried, compared and tagged forms: sum written, undone, the verdict, the numbers left
_CARRIED_STEP = re.compile(r"(\d+)=(\d+) \((\d+)-(\d+)=(\d+) (?:vs (\d+) )?(ok|not)(?: (\d+))?\)( left [a-z\d ]+)?")


@pytest.mark.parametrize("form", ["carried", "compared", "tagged"])
@pytest.mark.parametrize("seed", range(40))
def test_several_slips_are_each_only_context_and_each_check_redoes_its_step(seed, form):
    rng = random.Random(seed)
    numbers = task.random_numbers(rng)
    slips = task.random_check_slips(numbers, rng, form, 0.5)
    assert slips and all(1 <= k < len(numbers) and d in task.CHECK_SLIP_DELTAS for k, d in slips.items())
    segments = task.checked_segments(numbers, slips, form)
    right = [sum(numbers[:k + 1]) for k in range(1, len(numbers))]
    # one untrained segment per slip, each the slipped sum's digits; everything else trained
    untrained = [s.text for s in segments if not s.train]
    assert untrained == [str(right[k - 1] + slips[k]) for k in sorted(slips)]
    text = "".join(s.text for s in segments)
    attempts = _CARRIED_STEP.findall(text)
    assert len(attempts) == len(numbers) - 1 + len(slips)
    before, k, redo = [numbers[0]] + right[:-1], 0, False
    for _, w, _, n, c, compared, verdict, named, left in attempts:  # a slipped step's first attempt, then again
        step, w, n, c = k + 1, int(w), int(n), int(c)
        assert n == numbers[step] and c == w - n
        # the compared forms copy the sum before beside the undoing; the carried form names it on a slip
        assert (compared if form != "carried" else named or str(before[k])) == str(before[k])
        if step in slips and not redo:
            assert w == right[k] + slips[step] and verdict == "not" and not left
            redo = True
            continue
        assert w == right[k] and verdict == "ok" and not named
        tag = (lambda j: chr(ord("a") + j)) if form == "tagged" else (lambda j: "")
        carried = " ".join(f"{tag(j)}{x}" for j, x in enumerate(numbers[step + 1:], step + 1))
        assert (left or None) == (f" left {carried}" if step < len(numbers) - 1 else None)
        redo, k = False, k + 1
    assert text.endswith(f"\nSo the sum is {sum(numbers)}.")


def test_random_check_slips_slips_about_the_step_rate_of_the_steps():
    rng = random.Random(7)
    counts = [len(task.random_check_slips([5, 6, 7, 8, 9, 9, 9, 9], rng, "carried", 0.35)) for _ in range(2000)]
    assert min(counts) >= 1
    assert 0.30 < sum(counts) / (7 * len(counts)) < 0.42  # 7 steps, 0.35 each, at least one


@pytest.mark.parametrize("style", ["checked-carried", "checked-tagged"])
def test_build_data_writes_the_carried_family_with_several_slips_a_pass(tmp_path, style):
    import numpy as np
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny import build_data as B

    tok = load_tokenizer()
    info = B.build_reasoning(tmp_path, tok, task.load_items(), 300, style, top_share=0.6,
                             slip_rate=0.8, step_slip_rate=0.5)
    assert (info["trace_style"], info["check_form"], info["step_slip_rate"]) == (
        style, task.CHECK_FORM_OF_STYLE[style], 0.5)
    family = B.reasoning_family(style)
    ids = B.load_tokens(tmp_path / f"{family}.u32.xz")
    mask = B.load_tokens(tmp_path / f"{family}.mask.u8.xz", np.uint8)
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    cuts = np.flatnonzero(ids == bos).tolist() + [ids.size]
    several = 0
    for a, b in itertools.pairwise(cuts):
        reasoning = tok.decode(ids[a:b].tolist()).split("<think>")[-1].split("</think>")[0]
        marks = re.findall(r"=(\d+) \(\d+-\d+=\d+ (?:not \d+|vs \d+ not)\)", reasoning)
        several += len(marks) > 1
        assert "".join(tok.decode([t]) for t in ids[a:b][mask[a:b] == 0].tolist()) == "".join(marks)
    assert several > 0
    with pytest.raises(ValueError):
        B.build_reasoning(tmp_path, tok, task.load_items(), 10, "checked", step_slip_rate=0.5)


def test_check_repair_reads_carried_and_compared_traces():
    from dsv41.recipes.tiny import check_repair as C

    numbers = [7, 3, 9, 2, 5]
    compared = "".join(s.text for s in task.checked_segments(numbers, {1: 10, 3: -1}, "compared"))
    assert C.inline_pass(compared) == ([20, 19, 20, 26], True)
    assert C.inline_pass(task.reasoning_trace(numbers, 100, "checked-compared")) == ([10, 19, 21, 26], False)
    assert C.forced_pass(numbers, (1, 10), "compared") == "Sum: 7+3=20"
    assert C.forced_pass(numbers, (2, -1), "carried") == "Sum: 7+3=10 (10-3=7 ok) left 9 2 5, +9=18"
    assert C.forced_pass(numbers, None, "carried", 2) == "Sum: 7+3=10 (10-3=7 ok) left 9 2 5, +9=19"
    slipped = "".join(s.text for s in task.checked_segments(numbers, {2: -1, 4: 10}, "carried"))
    assert C.inline_pass(slipped) == ([10, 18, 21, 36], True)
    assert C.classify(slipped, True, 26, numbers, "carried")["pass_right"] is False


@pytest.mark.parametrize("flag", ["--checked-slip-rate", "--checked-step-slip-rate"])
def test_build_data_refuses_a_slip_rate_outside_0_1(tmp_path, flag):
    from dsv41.recipes.tiny import build_data as B

    with pytest.raises(SystemExit) as exit_info:
        B.main(["--out", str(tmp_path / "data"), "--reasoning-only", "checked-carried", flag, "-0.1"])
    assert exit_info.value.code == 2 and not (tmp_path / "data").exists()


def test_check_repair_names_where_a_pass_first_goes_wrong():
    from dsv41.recipes.tiny import check_repair as C

    numbers = [7, 3, 9, 2, 5]
    right = task.reasoning_trace(numbers, 100, "checked-compared")
    assert C.pass_origin(right, numbers) is None
    slipped = "".join(s.text for s in task.checked_segments(numbers, {2: -1}, "compared"))
    assert C.pass_origin(slipped, numbers) == "sum"
    # the carried list loses its order: the next step takes the list's first number, which is not the next one
    wrong_list = right.replace("left 2 5,", "left 5 2,").replace("+2=21 (21-2=19 vs 19 ok)", "+5=24 (24-5=19 vs 19 ok)")
    assert C.pass_origin(wrong_list, numbers) == "list"
    # the list is right and the step adds another number
    assert C.pass_origin(right.replace("+2=21 (21-2=19", "+5=24 (24-5=19"), numbers) == "read"
    assert C.pass_origin(right.replace("Sum: 7+3", "Sum: 3+7"), numbers) == "read"
    assert C.pass_origin(right.split(", +5=")[0], numbers) == "short"
    extra = right.replace("(26-5=21 vs 21 ok)", "(26-5=21 vs 21 ok) left 4, +4=30 (30-4=26 vs 26 ok)")
    assert C.pass_origin(extra, numbers) == "list"
    tagged = task.reasoning_trace(numbers, 100, "checked-tagged")
    assert C.pass_origin(tagged, numbers) is None
    assert C.pass_origin(tagged.replace("left d2 e5,", "left d5 e2,").replace("+2=21 (21-2", "+5=24 (24-5"),
                         numbers) == "list"
    rows = [C.classify(t, False, 26, numbers, "compared") for t in (right, slipped, wrong_list)]
    assert [r["origin"] for r in rows] == [None, "sum", "list"]
    assert C.summarize(rows)["wrong_pass_origin"] == {"list": 1, "sum": 1}


def test_build_data_moves_the_shortest_lists_to_the_top_tier_at_their_own_share(tmp_path):
    import numpy as np
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny import build_data as B

    tok = load_tokenizer()
    held = task.load_items()

    def build(name, **kw):
        B.build_reasoning(tmp_path / name, tok, held, 400, "checked-compared", top_share=0.25, slip_rate=1.0,
                          step_slip_rate=0.5, **kw)
        return (tmp_path / name / "reasoning_checked_compared.u32.xz").read_bytes()

    for name in ("default", "same", "all"):
        (tmp_path / name).mkdir()
    # the same draws: the shortest lists at the common share are the data of before, byte for byte
    assert build("default") == build("same", shortest_top_share=0.25)
    build("all", shortest_top_share=1.0)
    ids = B.load_tokens(tmp_path / "all" / "reasoning_checked_compared.u32.xz")
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    cuts = np.flatnonzero(ids == bos).tolist() + [ids.size]
    top = {True: [0, 0], False: [0, 0]}
    for a, b in itertools.pairwise(cuts):
        text = tok.decode(ids[a:b].tolist())
        shortest = len(re.search(r"Add: ([\d ]+)", text).group(1).split()) == task.MIN_NUMBERS
        top[shortest][0] += text.split("<think>")[-1].startswith("Sum:")
        top[shortest][1] += 1
    assert top[True][0] == top[True][1] > 0  # every shortest list at effort 90-100
    assert top[False][0] < 0.5 * top[False][1]  # the others about at the common share (0.25 + the draws of 90-100)


def test_build_data_refuses_a_shortest_top_share_without_a_checked_style(tmp_path):
    from dsv41.recipes.tiny import build_data as B

    for argv in (["--reasoning-only", "graded", "--checked-shortest-top-share", "0.5"],
                 ["--reasoning-only", "checked-compared", "--checked-shortest-top-share", "1.2"]):
        with pytest.raises(SystemExit) as exit_info:
            B.main(["--out", str(tmp_path / "data")] + argv)
        assert exit_info.value.code == 2 and not (tmp_path / "data").exists()
