"""`tiny-reasoning`: effort-conditioned addition of short lists of single-digit numbers.

The synthetic reasoning task the bundled `dsv41-tiny` model is trained on (recipes/tiny/), built so
that the reasoning-effort dial of the V4.1 chat format has a visible, learnable effect:

    user:      "Add: 7 3 9 2 5"
    assistant: <think>{trace(effort)}</think>Answer: 26<EOS>

The trace grows with the effort tier, and each tier adds a more careful way of working:

    effort  1-19   (none)                         answer at once: a guess for a tiny model
    effort 20-44   7+3=10, +9=19, +2=21, +5=26     terse running sums
    effort 45-69   7+3=10 / 10+9=19 / ...          every step written out as a full equation, one per line
    effort 70-89   a restatement of the list and its length, then numbered full steps
    effort 90-100  the 70-89 trace plus a verification pass that adds the list in reverse order

so mean reasoning tokens rise strictly across efforts 1, 25, 50, 75, 100, and the more explicit
traces make each step a single table look-up (a+b with b < 10), which is what makes them more often
right. That is the "reverse-check" style. Four more styles (`TRACE_STYLES`, `reasoning_trace(...,
style=)`) keep the efforts 1-69 traces and change only the two top tiers (a sixth, "graded", below, changes
them all). Each is built so that the
steps the 64-token attention window of the bundled model must get right read only text inside that
window:

    carry      Step 1: 7+3=10, left 9 2 5 / ... / Step 4: 21+5=26, left none
               (90-100: each step also checked by undoing it: "..., check 10-3=7, left 9 2 5")
               every step reads only the line above: the next number is the first one left
    twice      7+3=10, +9=19, +2=21, +5=26 / Again: <the same sums>
               (90-100: "Check:" for "Again:", then "Both give 26.")
               the terse running sums of effort 20-44, the form the model gets right most often, twice
    labelled   "twice" with the tier named by the first reasoning token ("First:" at 70-89, "Sum:" at
               90-100), which the effort value decides from inside the window; later choices read
               that label
    undo       First: 7+3=10, +9=19, +2=21, +5=26 / Undo: 26-5=21, -2=19, -9=10, -3=7 / So 26.
               (90-100: "Sum:" ... "Check:" ... "Back to 7, so the sum is 26.")
               the labels of "labelled"; the check undoes the first pass from its end, so it reads only
               the pass just written, and starts from the sum it closes with

A sixth style, "graded" (issue #25), keeps "undo"'s top tiers and changes the two below them, so that each
tier is a different quality of work:

    effort 20-44   Pairs 10 11 5, total 26         a shortcut: the pair sums, then the total at once
    effort 45-69   7+3=10, +9=19, +2=21, +5=26     the terse running sums (the other styles' effort 20-44)

With "undo" the bundled model was best at effort 25, where it wrote the terse sums, the form it computes best,
and worse at effort 50, which wrote every step as a full equation: more effort gave less. Here the shortcut
is cheap on purpose (it names a total of two-digit numbers in one step, as effort 1 names it of one-digit
numbers), the middle tier computes and the top tiers compute and check. The check does not change the
answer: a first design whose check could (stage 25, recipes/tiny/README.md "The graded traces") was learnt
as a form, not as a check.

A seventh style, "checked" (issue #25), keeps "graded"'s tiers and gives effort 90-100 a check that can change
the answer (`checked_segments`): the pass's numbers added again to the check's own sums, every step where the
pass wrote another value marked ("+9=19 not 18"), the close taken from the check. Its training data
(`build_data --reasoning-only checked`) holds passes with an injected slip, masked from the loss, that the check
catches and repairs. Stages 37-38 trained it (recipes/tiny/README.md "Stages 37-38"); neither was kept.
An eighth, "checked-inline" (`inline_checked_segments`), checks each step of the pass where it is written, by
undoing it ("+9=19 (19-9=10 ok)"; a slipped sum gets "not 10" and the step done again); stages 39-40 trained it
(recipes/tiny/README.md "Stages 39-40"); neither was kept. "checked-carried" writes the numbers still to add after
each checked step ("... (10-3=7 ok) left 9 2 5, +9=19 ..."), "checked-compared" also copies the sum before beside
each check ("(19-9=10 vs 10 ok)"); stages 41-46 trained them (recipes/tiny/README.md "Stages 41-43", "Stages
44-46"): the check corrects, the effort curve falls at 100 (the carried lists are copied wrongly), and none was
kept. "checked-tagged" writes each carried number after the letter of its place ("left c9 d2 e5"), for the copy.

The bundled model is trained on "undo" since stage 13 ("graded" since stage 26). Which style was trained when, what each did to
accuracy and why the next one followed is recorded in recipes/tiny/README.md ("The reasoning task",
"Measurements", "Trials that were not kept").

In training data the effort is uniform in 1..100 and appears, as the number it is, in the
effort line of the system part (`dsv41.model.encoding.encode_messages(..., mode="thinking", effort=e)`).

The held-out set (`heldout.jsonl`, 300 items) is effort-free: each item is the prompt messages and
the gold answer; the effort is chosen at evaluation time. Training data never contains a held-out
list (`recipes/tiny/build_data.py` excludes them).

Scoring: the last integer in the content after `</think>` must equal the gold sum.

Versions. v1 is everything above (`heldout.jsonl`, 300 items of 4-8 numbers), the task the bundled model
is trained and measured on. v2 (`v2.py`, `heldout_v2.jsonl`: 360 items, 40 of each length 2..10; not yet
trained, recipes/tiny/README.md "v2 plan") keeps the item schema, the prompt and the scorer, and adds a
"difficulty" field; its traces are v2.py's. `load_items()` reads the version named by the environment
variable DSV41_TINY_REASONING_VERSION, else DEFAULT_VERSION (1 until a v2-trained checkpoint ships), so
`dsv41 eval tiny-reasoning` and `dsv41 effort-sweep tiny-reasoning` run either set unchanged:

    DSV41_TINY_REASONING_VERSION=2 dsv41 effort-sweep tiny-reasoning --limit 360
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

TASK_NAME = "tiny-reasoning"
HELDOUT_FILE = Path(__file__).resolve().parent / "heldout.jsonl"
HELDOUT_FILES = {1: HELDOUT_FILE, 2: Path(__file__).resolve().parent / "heldout_v2.jsonl"}
DEFAULT_VERSION = 1  # the bundled checkpoint's; 2 once a v2-trained checkpoint ships
VERSION_ENV = "DSV41_TINY_REASONING_VERSION"
MIN_NUMBERS, MAX_NUMBERS = 4, 8
EFFORT_TIERS = (20, 45, 70, 90)  # lower bounds of tiers 1..4; tier 0 is effort 1-19
SWEEP_EFFORTS = (1, 25, 50, 75, 100)
THINK_END = "</think>"
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Segment:
    """A piece of a training conversation; train=False: context only (an injected slip), no loss on its tokens."""
    text: str
    train: bool = True


def effort_tier(effort: int) -> int:
    """0 (answer at once) .. 4 (restate, step, verify)."""
    if not 1 <= int(effort) <= 100:
        raise ValueError(f"effort must be in 1..100, got {effort}")
    return sum(int(effort) >= bound for bound in EFFORT_TIERS)


def question(numbers: list[int]) -> str:
    return "Add: " + " ".join(str(n) for n in numbers)


def _running_steps(numbers: list[int]) -> list[tuple[int, int, int]]:
    """(running sum so far, next number, new running sum) for every addition, left to right."""
    steps, total = [], numbers[0]
    for n in numbers[1:]:
        steps.append((total, n, total + n))
        total += n
    return steps


TRACE_STYLES = ("reverse-check", "carry", "twice", "labelled", "undo", "graded", "checked", "checked-inline",
                "checked-carried", "checked-compared", "checked-tagged")


def reasoning_trace(numbers: list[int], effort: int, style: str = "reverse-check") -> str:
    """The gold reasoning (the text between <think> and </think>) for `numbers` at `effort`, in one
    of the TRACE_STYLES (they differ at efforts 70-100 only, but for "graded", which differs at 20-69)."""
    if style not in TRACE_STYLES:
        raise ValueError(f"trace style must be one of {TRACE_STYLES}, got {style!r}")
    tier = effort_tier(effort)
    steps = _running_steps(numbers)
    if tier == 0:
        return ""
    graded = style == "graded" or style in CHECK_FORM_OF_STYLE
    if graded and tier == 1:  # a shortcut below the terse sums (the v2 task's too)
        return pairs_shortcut(numbers)
    if tier == 1 or (graded and tier == 2):
        return _terse_sums(steps)
    if tier == 2:
        return "\n".join(f"{a}+{n}={s}" for a, n, s in steps)
    if style in ("twice", "labelled"):  # "labelled" also names the tier with the first reasoning token
        terse = _terse_sums(steps)
        first, second = ("Sum: ", "Check") if tier == 4 else ("First: ", "Again")
        first = first if style == "labelled" else ""
        closing = [f"Both give {sum(numbers)}."] if tier == 4 else []
        return "\n".join([first + terse, f"{second}: {terse}"] + closing)
    if style in CHECK_FORM_OF_STYLE and tier == 4:  # a check that can change the answer (checked_segments)
        return "".join(s.text for s in checked_segments(numbers, None, CHECK_FORM_OF_STYLE[style]))
    if style == "undo" or graded:  # the tier named first; then the sums undone from the end, no look back at the list
        first, second = ("Sum", "Check") if tier == 4 else ("First", "Undo")
        total = sum(numbers)
        closing = f"Back to {numbers[0]}, so the sum is {total}." if tier == 4 else f"So {total}."
        return "\n".join([f"{first}: {_terse_sums(steps)}", f"{second}: {_undo_sums(steps)}", closing])
    if style == "carry":
        return "\n".join(_carry_step(i, a, n, s, numbers[i + 1:], check=tier == 4)
                         for i, (a, n, s) in enumerate(steps, 1))
    lines = [f"Numbers: {', '.join(str(n) for n in numbers)} ({len(numbers)} numbers)."]
    lines += [f"Step {i}: {a}+{n}={s}" for i, (a, n, s) in enumerate(steps, 1)]
    if tier == 4:
        backward = _running_steps(numbers[::-1])
        lines.append("Check in reverse:")
        lines += [f"{a}+{n}={s}" for a, n, s in backward]
        lines.append(f"Both give {sum(numbers)}.")
    return "\n".join(lines)


def pairs_shortcut(numbers: list[int]) -> str:
    """'Pairs 10 11 5, total 26': the pair sums, then the total named at once (the graded style's effort 20-44
    and v2's tier 1)."""
    values = [sum(numbers[i:i + 2]) for i in range(0, len(numbers), 2)]
    return "Pairs " + " ".join(str(v) for v in values) + f", total {sum(numbers)}"


def _terse_sums(steps: list[tuple[int, int, int]]) -> str:
    """7+3=10, +9=19, +2=21, +5=26"""
    first, n, total = steps[0]
    return ", ".join([f"{first}+{n}={total}"] + [f"+{n}={total}" for _, n, total in steps[1:]])


def _undo_sums(steps: list[tuple[int, int, int]]) -> str:
    """26-5=21, -2=19, -9=10, -3=7: the terse sums undone from the end, back to the first number"""
    (before, n, last), *rest = steps[::-1]
    return ", ".join([f"{last}-{n}={before}"] + [f"-{n}={a}" for a, n, _ in rest])


CHECK_SLIP_DELTAS = (-10, -1, 1, 10)  # a sum written off by one in either digit: the slips a check must catch
CHECK_FORMS = ("terse", "equations", "inline", "carried", "compared", "tagged")
INLINE_FORMS = ("inline", "carried", "compared", "tagged")  # checked where each step is written: inline_checked_segments
# each checked style's top-tier check
CHECK_FORM_OF_STYLE = {"checked": "terse", "checked-inline": "inline", "checked-carried": "carried",
                       "checked-compared": "compared", "checked-tagged": "tagged"}


def checked_segments(numbers: list[int], slip: tuple[int, int] | None = None, form: str = "terse") -> list:
    """The "checked" style's effort 90-100 reasoning as v2 segments (text, trained or not):

        Sum: 7+3=10, +9=19, +2=21, +5=26
        Check: 7+3=10, +9=19, +2=21, +5=26
        So the sum is 26.

    `slip` = (step k >= 1, delta): the pass writes its k-th sum off by `delta` and carries on from what it wrote
    (those tokens are context, not targets); the check adds each of the pass's numbers to its own sum, marks every
    step where the pass wrote another value, and closes with its own sum, so it changes the answer:

        Sum: 7+3=10, +9=18, +2=20, +5=25
        Check: 7+3=10, +9=19 not 18, +2=21 not 20, +5=26 not 25
        So the sum is 26.

    The check is written in the pass's own form, the terse running sums the model computes best: each step reads
    its number from the same step of the pass, about one pass length back (inside the 64-token window at every
    list length), and adds it to the sum just written. form="equations" is stage 37's check (not kept,
    recipes/tiny/README.md "Stages 37-38"), every step a full equation ("10+9=19 not 18"), closed by "So 26."."""
    if form not in CHECK_FORMS:
        raise ValueError(f"check form must be one of {CHECK_FORMS}, got {form!r}")
    if form in INLINE_FORMS:
        return inline_checked_segments(numbers, slip, carry=form != "inline", compare=form in ("compared", "tagged"),
                                       tags=form == "tagged")
    if isinstance(slip, dict):  # one slip a pass here: {step: delta} of one entry is (step, delta)
        if len(slip) > 1:
            raise ValueError(f"the {form} check takes one slip a pass, got {len(slip)}")
        slip = next(iter(slip.items()), None)
    written, total = [], numbers[0]
    for k, n in enumerate(numbers[1:], 1):
        total += n + (slip[1] if slip and k == slip[0] else 0)
        if total < 0:
            raise ValueError("a slip below zero is not one the model makes")
        written.append(total)
    texts = [f"{numbers[0]}+{numbers[1]}={written[0]}"] + [f"+{n}={w}" for n, w in zip(numbers[2:], written[1:])]
    k = slip[0] if slip else len(texts) + 1
    first = [Segment("Sum: " + ", ".join(texts[:k - 1]))]
    if k <= len(texts):  # from the slip on, the pass is context only
        first.append(Segment((", " if k > 1 else "") + ", ".join(texts[k - 1:]), train=False))
    check, right = [], numbers[0]
    for i, (n, w) in enumerate(zip(numbers[1:], written)):
        step = f"{right}+{n}={right + n}" if i == 0 or form == "equations" else f"+{n}={right + n}"
        check.append(step + (f" not {w}" if w != right + n else ""))
        right += n
    closing = f"So {right}." if form == "equations" else f"So the sum is {right}."
    return first + [Segment(f"\nCheck: {', '.join(check)}\n{closing}")]


def inline_checked_segments(numbers: list[int], slip=None, carry: bool = False, compare: bool = False,
                            tags: bool = False) -> list:
    """The "checked" style's effort 90-100 reasoning with every step checked where it is written (form="inline",
    stage 39): each new sum is undone by the number just added, and the result must be the sum before it:

        Sum: 7+3=10 (10-3=7 ok), +9=19 (19-9=10 ok), +2=21 (21-2=19 ok), +5=26 (26-5=21 ok)
        So the sum is 26.

    `slip` = (step k >= 1, delta), or {step: delta, ...} for several: the pass writes its k-th sum off by `delta`.
    Only that value is context (not a target); its check finds another number than the sum before it, says so, and
    the step is done again, so the pass goes on from the right sum and the answer changes:

        Sum: 7+3=10 (10-3=7 ok), +9=18 (18-9=9 not 10) +9=19 (19-9=10 ok), +2=21 (21-2=19 ok), ...

    Unlike the terse and equations forms, whose check looks up each number one pass length back (stages 37-38 read
    them out of order), every number a check reads is among the last dozen tokens: the sum before, the number, the
    sum just written. A check that wrongly disagrees still ends right: the redone step is the same addition.

    carry=True (form="carried", the "checked-carried" style, stage 41): after each checked step but the last, the
    numbers still to add, so that the next step reads its number from the line just written, not from the prompt,
    which the interleaved checks push out of the 64-token window (stage 40 read the list out of order):

        Sum: 7+3=10 (10-3=7 ok) left 9 2 5, +9=18 (18-9=9 not 10) +9=19 (19-9=10 ok) left 2 5, ...

    compare=True (form="compared", the "checked-compared" style, stage 42): every check also copies the sum before
    next to what the undoing gave, so that "ok" or "not" compares the two numbers just written (stage 41's checks
    undid the steps right, "19-5=14", but said "ok" after a 13 about a dozen tokens back):

        Sum: 7+3=10 (10-3=7 vs 7 ok) left 9 2 5, +9=18 (18-9=9 vs 10 not) +9=19 (19-9=10 vs 10 ok) left 2 5, ...

    tags=True (form="tagged", the "checked-tagged" style, stage 47): each carried number after the letter of its
    place in the list (a = the first), one token each ("Ġc", "9"), so a list costs the tokens of an untagged one.
    Stages 44-46 went wrong mostly in copying the carried list (`left 0 9 3 0 9` for `0 9 0 3 3`): untagged, every
    number follows the same space token, and where a digit repeats the copy cannot tell which one it is at. Tagged,
    every earlier occurrence of a letter in the trace is followed by the same number, and the letters come in order:

        Sum: 7+3=10 (10-3=7 vs 7 ok) left c9 d2 e5, +9=19 (19-9=10 vs 10 ok) left d2 e5, ..."""
    steps = _running_steps(numbers)
    slips = dict([slip] if isinstance(slip, tuple) else (slip or {}))
    for k in slips:
        if not 1 <= k <= len(steps):
            raise ValueError(f"slip step must be in 1..{len(steps)}, got {k}")
    segments, text = [], "Sum: "
    for i, (before, n, total) in enumerate(steps, 1):
        head = f"{before}+{n}=" if i == 1 else f"+{n}="
        if i > 1:
            text += ", "
        if i in slips:
            wrong = total + slips[i]
            if wrong < 0 or wrong - n < 0:
                raise ValueError("a slip below zero is not one the model makes")
            segments += [Segment(text + head), Segment(str(wrong), train=False)]
            verdict = f"vs {before} not" if compare else f"not {before}"
            text = f" ({wrong}-{n}={wrong - n} {verdict}) "
        text += f"{head}{total} ({total}-{n}={before}{f' vs {before}' if compare else ''} ok)"
        if carry and i < len(steps):
            text += " left " + " ".join(f"{chr(ord('a') + j) if tags else ''}{x}"
                                        for j, x in enumerate(numbers[i + 1:], i + 1))
    return segments + [Segment(f"{text}\nSo the sum is {sum(numbers)}.")]


def random_check_slip(numbers: list[int], rng: random.Random, form: str = "terse") -> tuple[int, int]:
    """A (step, delta) slip of the pass that keeps every written sum (and, inline, every check) at zero or above."""
    return next(iter(random_check_slips(numbers, rng, form).items()))


def random_check_slips(numbers: list[int], rng: random.Random, form: str = "terse",
                       step_rate: float | None = None) -> dict[int, int]:
    """{step: delta}, every written sum and check at zero or above: one step (step_rate None), or each step slipped
    with probability `step_rate`, at least one (the inline forms' training data since stage 41: a check then
    disagrees at a large share of the check steps, so that "ok" after every step is not its majority answer)."""
    for _ in range(100):
        if step_rate is None:
            steps = [rng.randint(1, len(numbers) - 1)]
        else:
            steps = [k for k in range(1, len(numbers)) if rng.random() < step_rate] or [
                rng.randint(1, len(numbers) - 1)]
        slips = {k: rng.choice(CHECK_SLIP_DELTAS) for k in steps}
        try:
            checked_segments(numbers, slips, form)
        except ValueError:
            continue
        return slips
    return {len(numbers) - 1: 1}


def checked_conversation_segments(numbers: list[int], effort: int, slip: tuple[int, int] | None = None,
                                  form: str = "terse") -> list:
    """One "checked"-style training conversation as segments; the slip (effort 90-100 only) is untrained."""
    if effort_tier(effort) == 4:
        reasoning = checked_segments(numbers, slip, form)
    else:
        reasoning = [Segment(reasoning_trace(numbers, effort, "checked"))]
    return segments_around(numbers, reasoning, effort, answer_text(numbers))


def segments_around(numbers: list[int], reasoning: list[Segment], effort: int, answer: str) -> list[Segment]:
    """One complete training example (BOS ... EOS, the official V4.1 thinking-mode encoding) as segments whose
    concatenation is `encode_messages` of the conversation with `reasoning` written out and `answer` as content."""
    from dsv41.model.encoding import encode_messages

    marker = "\x00REASONING\x00"
    text = encode_messages(messages(numbers) + [{"role": "assistant", "reasoning_content": marker,
                                                  "content": answer}], mode="thinking", effort=effort)
    before, after = text.split(marker)
    return [Segment(before)] + reasoning + [Segment(after)]


def _carry_step(i: int, a: int, n: int, s: int, left: list[int], check: bool) -> str:
    checked = f", check {s}-{n}={a}" if check else ""
    return f"Step {i}: {a}+{n}={s}{checked}, left {' '.join(str(x) for x in left) or 'none'}"


def answer_text(numbers: list[int]) -> str:
    return f"Answer: {sum(numbers)}"


def messages(numbers: list[int]) -> list[dict]:
    """The effort-free prompt messages of one item."""
    return [{"role": "user", "content": question(numbers)}]


def training_conversation(numbers: list[int], effort: int, style: str = "reverse-check") -> str:
    """One complete training example in the official V4.1 thinking-mode encoding (BOS ... EOS)."""
    from dsv41.model.encoding import encode_messages

    convo = messages(numbers) + [{"role": "assistant", "reasoning_content": reasoning_trace(numbers, effort, style),
                                  "content": answer_text(numbers)}]
    return encode_messages(convo, mode="thinking", effort=effort)


def prompt_text(item: dict, effort: int) -> str:
    """The generation prompt (ends with `<｜Assistant｜><think>`) for a held-out item at `effort`."""
    from dsv41.model.encoding import encode_messages

    return encode_messages(item["messages"], mode="thinking", effort=effort)


def random_numbers(rng: random.Random) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(MIN_NUMBERS, MAX_NUMBERS))]


def generate_items(n: int, seed: int, exclude: set[tuple[int, ...]] | None = None) -> list[dict]:
    """n distinct items (no list repeated, none in `exclude`)."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    items = []
    while len(items) < n:
        numbers = random_numbers(rng)
        if tuple(numbers) in seen:
            continue
        seen.add(tuple(numbers))
        items.append({"id": f"{TASK_NAME}-{len(items):04d}", "messages": messages(numbers),
                      "numbers": numbers, "answer": sum(numbers)})
    return items


def task_version(version: int | None = None) -> int:
    """The held-out set's version: `version`, else $DSV41_TINY_REASONING_VERSION, else DEFAULT_VERSION."""
    import os

    chosen = int(version if version is not None else os.environ.get(VERSION_ENV) or DEFAULT_VERSION)
    if chosen not in HELDOUT_FILES:
        raise ValueError(f"tiny-reasoning has versions {sorted(HELDOUT_FILES)}, not {chosen}")
    return chosen


def load_items(path: str | Path | None = None, limit: int | None = None, version: int | None = None) -> list[dict]:
    """The held-out items of the task's version (`task_version`), or those of another JSONL file with the
    same schema."""
    lines = Path(path or HELDOUT_FILES[task_version(version)]).read_text().splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return items[:limit] if limit else items


def split_completion(completion: str) -> tuple[str | None, str]:
    """Completion text after `<think>` -> (reasoning, content). reasoning is None when `</think>`
    never came (the model used its whole budget thinking); then there is no content."""
    if THINK_END not in completion:
        return None, ""
    reasoning, content = completion.split(THINK_END, 1)
    return reasoning, content


def extract_answer(content: str) -> int | None:
    """The last integer in the answer content, or None."""
    found = _INTEGER.findall(content)
    return int(found[-1]) if found else None


def score(completion: str, item: dict) -> bool:
    """True when the last number of the content after `</think>` is the gold sum."""
    _, content = split_completion(completion)
    return extract_answer(content) == int(item["answer"])
