"""`tiny-reasoning` v2: lists of varying difficulty, and a top tier whose check can change the answer.

Not yet shipped (recipes/tiny/README.md, "v2"). The items keep v1's schema and prompt ("Add: 7 3 9 2 5", the
answer the sum, scored by the last integer after `</think>`), so every consumer of the task runs them unchanged;
only the list lengths and the traces differ. The held-out items are `heldout_v2.jsonl` (`HELDOUT_V2`, 360
items: 40 of every length 2..10; `load_items(version=2)`).

Difficulty is the list length: short (2-3 numbers), medium (4-6), long (7-10). Tiers by effort:

    1-19    (none)                                   answer at once: right for short lists, a guess for long ones
    20-44   Pairs 10 11 5, total 26                  shortcut: pair sums, then the total in one guess
    45-69   Sum: 7+3=10, +9=19, +2=21, +5=26         computes: the terse running sums, reading the prompt
    70-89   List: 7 3 9 2 5                          copies the list first (while the prompt is inside the
            Sum: 7+3=10, +9=19, +2=21, +5=26         window), then computes over the copy
    90-100  Copy: 7 3 9 2 5                          copies, computes, computes again and compares; when the
            Sum: 7+3=10, +9=19, +2=21, +5=26         two differ a third pass decides ("25 and 26: differ.
            Again: 7+3=10, +9=19, +2=21, +5=26       Third: ... / 26 twice: 26.")
            26 and 26: same, 26.

Why this design (README, "v2"): a first design (stages 17-18: a backward second pass and a third pass by
pairs) was learnt only in its single-pass tier; its other passes read the list in new orders the model never
learnt in 380 steps, and on long lists read from beyond the 64-token sliding window. Here every pass is the one
form the model computes well (the forward running sum), the higher tiers read a copy of the list written a few
tokens above rather than the prompt 34+ tokens back, and the check is that same pass again: it cannot be
copied from the pass above it, because in training the pass above sometimes carries a slip. The comparison
line first writes both results, then its verdict, so the verdict compares two numbers a token apart (stages
20-22 trained an earlier form, `Same: 26.`, whose verdict came first: the model wrote it whatever the passes
gave). Each tier is named by its first reasoning token, so the choice reads text inside the window.

Training traces contain checks that catch and repair an error (`training_segments(..., error_rate=)`): in a
fraction of the top-tier traces the first or the second pass carries an injected slip of the kinds the model
makes (a number skipped, the previous number added again, a step's sum off by one or ten, carried on). The
comparison line then sees two different results, the third pass computes the sum, and the closing line takes
the value two passes give. The slip's tokens are marked not to be trained on (`Segment.train` False): the model
reads them as context but is never taught to write them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from . import Segment  # the task's own: v1's "checked" style writes segments too

HELDOUT_V2 = Path(__file__).resolve().parent / "heldout_v2.jsonl"
MIN_NUMBERS, MAX_NUMBERS = 2, 10
DIFFICULTY = {2: "short", 3: "short", 4: "medium", 5: "medium", 6: "medium",
              7: "long", 8: "long", 9: "long", 10: "long"}
EFFORT_TIERS = (20, 45, 70, 90)
TIER_LABELS = {1: "Pairs", 2: "Sum", 3: "List", 4: "Copy"}  # the first reasoning token names the tier
ERROR_KINDS = ("skip", "repeat", "slip")
HELDOUT_PER_LENGTH = 40
HELDOUT_SEED = 4242


def effort_tier(effort: int) -> int:
    if not 1 <= int(effort) <= 100:
        raise ValueError(f"effort must be in 1..100, got {effort}")
    return sum(int(effort) >= bound for bound in EFFORT_TIERS)


# ------------------------------------------------------------------------------------------ passes


def running_pass(numbers: list[int], error: tuple[str, int, int] | None = None) -> tuple[list[Segment], int]:
    """'7+3=10, +9=19, +2=21, +5=26' over `numbers` in the given order -> (segments, the result written).
    error = (kind, step, delta): at step k >= 1 (the k-th number added after the first) a slip of `kind`:
    'skip' leaves numbers[k] out (k < the last step), 'repeat' adds numbers[k-1] again in its place, 'slip' writes the sum off
    by `delta`; later steps carry on from what was written. Everything from the slip on is untrained."""
    if error and error[0] == "skip" and error[1] >= len(numbers) - 1:
        # a skipped last number would leave no slipped token to mask: the pass would just end early, and the
        # token after it would teach stopping early
        raise ValueError("a skip needs a number after the skipped one")
    if error and error[0] == "skip" and error[1] == 1:  # the line then starts with numbers[0] + numbers[2]
        segments, total = running_pass(numbers[:1] + numbers[2:])
        return [Segment("".join(s.text for s in segments), train=False)], total
    right: list[str] = []
    wrong: list[str] = []
    total = numbers[0]
    for k, n in enumerate(numbers[1:], 1):
        if error and k == error[1]:
            kind, _, delta = error
            if kind == "skip":
                wrong.append("")  # from here on the line is the slip's
                continue
            if kind == "repeat":
                n = numbers[k - 1]
            new = total + n + (delta if kind == "slip" else 0)
            if new < 0:
                raise ValueError("a slip below zero is not one the model makes")
        else:
            new = total + n
        (wrong if wrong or (error and k == error[1]) else right).append(
            f"{numbers[0]}+{n}={new}" if k == 1 else f"+{n}={new}")
        total = new
    wrong = [w for w in wrong if w]
    segments = [Segment(", ".join(right))] if right else []
    if wrong:
        segments.append(Segment((", " if right else "") + ", ".join(wrong), train=False))
    return segments, total


def pairs_shortcut(numbers: list[int]) -> str:
    """Tier 1: the pair sums, then the total named at once ('Pairs 10 11 5, total 26'; the task's own, shared
    with v1's "graded" style)."""
    from . import pairs_shortcut as shortcut

    return shortcut(numbers)


# ------------------------------------------------------------------------------------------ traces
def random_error(numbers: list[int], rng: random.Random) -> tuple[str, int, int]:
    """A slip that changes the pass's result (re-drawn until it does)."""
    for _ in range(100):
        kind = rng.choice(ERROR_KINDS)
        step = rng.randint(1, len(numbers) - 1)
        delta = rng.choice((-10, -1, 1, 10))
        if kind == "skip" and step >= len(numbers) - 1:
            continue
        try:
            _, got = running_pass(numbers, (kind, step, delta))
        except ValueError:
            continue
        if got != sum(numbers):
            return kind, step, delta
    return "slip", len(numbers) - 1, 1


def training_segments(numbers: list[int], effort: int, rng: random.Random | None = None,
                      error_rate: float = 0.0, error: dict | None = None) -> list[Segment]:
    """The reasoning of one training example as segments. For tier 4, with probability error_rate (or when
    `error` = {"pass": i, "kind": k, "step": s, "delta": d} is given) pass i (0 the first, 1 the second) carries
    a slip."""
    tier = effort_tier(effort)
    total = sum(numbers)
    if tier == 0:
        return []
    if tier == 1:
        return [Segment(pairs_shortcut(numbers))]
    if tier == 2:
        return [Segment(f"{TIER_LABELS[2]}: ")] + running_pass(numbers)[0]
    copy = " ".join(str(n) for n in numbers)
    if tier == 3:
        return [Segment(f"{TIER_LABELS[3]}: {copy}\nSum: ")] + running_pass(numbers)[0]
    if error is None and rng is not None and rng.random() < error_rate:
        which = rng.randrange(2)
        kind, step, delta = random_error(numbers, rng)
        error = {"pass": which, "kind": kind, "step": step, "delta": delta}
    if error is not None and error["pass"] not in (0, 1):
        raise ValueError("only the first or the second pass carries a slip")

    def one_pass(index: int) -> tuple[list[Segment], int]:
        if error is not None and error["pass"] == index:
            return running_pass(numbers, (error["kind"], error["step"], error["delta"]))
        return running_pass(numbers)

    first, first_total = one_pass(0)
    second, second_total = one_pass(1)
    out = [Segment(f"{TIER_LABELS[4]}: {copy}\nSum: ")] + first + [Segment("\nAgain: ")] + second
    if first_total == second_total:
        return out + [Segment(f"\n{first_total} and {second_total}: same, {first_total}.")]
    third, third_total = running_pass(numbers)
    assert third_total == total
    return out + [Segment(f"\n{first_total} and {second_total}: differ. Third: ")] + third + \
        [Segment(f"\n{total} twice: {total}.")]


def reasoning_trace(numbers: list[int], effort: int) -> str:
    """The gold reasoning (no slips) at `effort`."""
    return "".join(s.text for s in training_segments(numbers, effort))


def answer_text(numbers: list[int]) -> str:
    return f"Answer: {sum(numbers)}"


def conversation_segments(numbers: list[int], effort: int, rng: random.Random | None = None,
                          error_rate: float = 0.0) -> list[Segment]:
    """One complete training example (BOS ... EOS, the official V4.1 thinking-mode encoding) as segments whose
    concatenation is `encode_messages` of the conversation with the reasoning written out."""
    from . import segments_around

    return segments_around(numbers, training_segments(numbers, effort, rng, error_rate), effort, answer_text(numbers))


def random_numbers(rng: random.Random) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(MIN_NUMBERS, MAX_NUMBERS))]


def generate_items(per_length: int = HELDOUT_PER_LENGTH, seed: int = HELDOUT_SEED,
                   exclude: set[tuple[int, ...]] | None = None) -> list[dict]:
    """`per_length` distinct lists of every length 2..10 (a length-2 list has only 100 choices), interleaved so
    that any prefix of the file mixes the lengths."""
    from . import TASK_NAME, messages

    rng = random.Random(seed)
    seen = set(exclude or ())
    by_length: dict[int, list[list[int]]] = {}
    for length in range(MIN_NUMBERS, MAX_NUMBERS + 1):
        rows = by_length.setdefault(length, [])
        while len(rows) < per_length:
            numbers = [rng.randint(0, 9) for _ in range(length)]
            if tuple(numbers) not in seen:
                seen.add(tuple(numbers))
                rows.append(numbers)
    items = []
    for i in range(per_length):
        for length in range(MIN_NUMBERS, MAX_NUMBERS + 1):
            numbers = by_length[length][i]
            items.append({"id": f"{TASK_NAME}-v2-{len(items):04d}", "messages": messages(numbers), "numbers": numbers,
                          "answer": sum(numbers), "difficulty": DIFFICULTY[length], "version": 2})
    return items


def write_heldout(path: Path = HELDOUT_V2) -> list[dict]:
    """heldout_v2.jsonl: no list of it is a v1 held-out list either."""
    from . import HELDOUT_FILE, load_items

    items = generate_items(exclude={tuple(it["numbers"]) for it in load_items(HELDOUT_FILE)})
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return items
