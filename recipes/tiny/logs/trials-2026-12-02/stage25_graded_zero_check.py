"""The trace generator of stage 25 (2026-12-02, not kept; recipes/tiny/README.md "The graded traces").

It was `evals/tasks/tiny_reasoning/graded.py` when stage 25's data was built (`build_data --reasoning-only graded`
wrote `reasoning_graded.u32.xz` and `reasoning_graded.mask.u8.xz` from `conversation_segments`, efforts uniform in
1..100, error rate 0.3, the lists and efforts of `build_reasoning`'s seeded stream). Efforts 1-89 are the graded
traces as shipped; effort 90-100 differs:

    Sum: 7+3=10, +9=19, +2=21, +5=26
    Check: 26-5=21, -2=19, -9=10, -3=7, -7=0
    Left 0, so 26.                     (after an injected slip of the Sum pass: "Left 1, so 27-1=26.")

Kept here as the record of what trained; it imports the v2 task's helpers as they are in the tree.
"""

from __future__ import annotations

import random

from dsv41.evals.tasks.tiny_reasoning.v2 import Segment, pairs_shortcut, running_pass

SLIP_DELTAS = (-10, -1, 1, 10)


def effort_tier(effort: int) -> int:
    from dsv41.evals.tasks.tiny_reasoning import effort_tier as tier

    return tier(effort)


def _terse(numbers: list[int]) -> str:
    return "".join(s.text for s in running_pass(numbers)[0])


def undo_to_zero(numbers: list[int], total: int) -> tuple[str, int]:
    parts, left = [], total
    for i, n in enumerate(reversed(numbers)):
        parts.append(f"{left}-{n}={left - n}" if i == 0 else f"-{n}={left - n}")
        left -= n
    return ", ".join(parts), left


def _undo_to_first(numbers: list[int]) -> str:
    text, _ = undo_to_zero(numbers[1:], sum(numbers))
    return text


def closing_line(written: int, left: int) -> str:
    if left == 0:
        return f"Left 0, so {written}."
    sign = "-" if left > 0 else "+"
    return f"Left {left}, so {written}{sign}{abs(left)}={written - left}."


def random_slip(numbers: list[int], rng: random.Random) -> tuple[str, int, int]:
    for _ in range(100):
        step, delta = rng.randint(1, len(numbers) - 1), rng.choice(SLIP_DELTAS)
        try:
            running_pass(numbers, ("slip", step, delta))
        except ValueError:
            continue
        return "slip", step, delta
    return "slip", len(numbers) - 1, 1


def training_segments(numbers: list[int], effort: int, rng: random.Random | None = None,
                      error_rate: float = 0.0, slip: tuple[int, int] | None = None) -> list[Segment]:
    tier = effort_tier(effort)
    if tier == 0:
        return []
    if tier == 1:
        return [Segment(pairs_shortcut(numbers))]
    if tier == 2:
        return running_pass(numbers)[0]
    if tier == 3:
        total = sum(numbers)
        return [Segment(f"First: {_terse(numbers)}\nUndo: {_undo_to_first(numbers)}\nSo {total}.")]
    if slip is None and rng is not None and rng.random() < error_rate:
        slip = random_slip(numbers, rng)[1:]
    first, written = running_pass(numbers, ("slip", *slip) if slip else None)
    check, left = undo_to_zero(numbers, written)
    return [Segment("Sum: ")] + first + [Segment(f"\nCheck: {check}\n{closing_line(written, left)}")]


def conversation_segments(numbers: list[int], effort: int, rng: random.Random | None = None,
                          error_rate: float = 0.0) -> list[Segment]:
    from dsv41.evals.tasks.tiny_reasoning import answer_text, messages
    from dsv41.model.encoding import encode_messages

    reasoning = training_segments(numbers, effort, rng, error_rate)
    marker = "\x00REASONING\x00"
    text = encode_messages(messages(numbers) + [{"role": "assistant", "reasoning_content": marker,
                                                  "content": answer_text(numbers)}], mode="thinking", effort=effort)
    before, after = text.split(marker)
    return [Segment(before)] + reasoning + [Segment(after)]
