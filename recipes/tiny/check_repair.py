"""Does the effort-100 check correct? The "checked" trace style's check (evals/tasks/tiny_reasoning,
`checked_segments`) adds each number of the pass to its own sum and closes with that sum, so it can change the
answer. This measures, greedy on the held-out tiny-reasoning items at effort 100, whether a checkpoint's check does:

    python -m dsv41.recipes.tiny.check_repair --model DIR [--limit 300] [--form terse|inline|carried|compared|tagged]
        [--cases own,slipped,clean] [--json F]

--form inline measures the "checked-inline" style (stage 39), --form carried and compared the "checked-carried" and
"checked-compared" ones (stages 41-46, the same with the numbers still to add after each step, and the sum before
copied beside each check), --form tagged the "checked-tagged" one (each number still to add after the letter of its
place: "left c9 d2 e5"): each step of the pass undone where it is written,
"+9=18 (18-9=9 not 10) +9=19 (19-9=10 ok)". There the pass is the value first written at each step, the slip is
injected at its step (the forced text ends with the slipped sum) and the clean control ends at the same step with the
right sum.

- own: the model writes the whole trace. Per item: is the pass's last sum right, did the check mark a step
  ("not N"), is the answer right. "repaired" = a wrong pass and a right answer ("marked_repaired": with a check
  that disagreed), "broken" = a right pass and a wrong answer.
- slipped: the prompt is followed by a pass with one injected slip (a sum written off by -10, -1, +1 or +10 and
  carried on, as in training, drawn by `random_check_slip` with a fixed seed), then "\\nCheck: "; the model writes
  the rest. "repaired" = the answer is the true sum, not the pass's.
- clean: the same with the right pass, the control: how often the check keeps a right pass right.

Every generation goes through the engine (`evaluate.greedy_generate`, continuous batching).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import sys
from collections import Counter
from pathlib import Path

import torch
from dsv41.evals.tasks import tiny_reasoning as task
from dsv41.recipes.tiny import evaluate as E

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 213  # the task's evaluation budget (evaluate.reasoning_sweep)
SLIP_SEED = 4343
CASES = ("own", "slipped", "clean")
FORMS = ("terse",) + task.INLINE_FORMS
ORIGINS = ("list", "read", "sum", "extra", "short", None)  # pass_origin's answers, in the summary's order


def forced_pass(numbers: list[int], slip: tuple[int, int] | None, form: str = "terse", step: int | None = None) -> str:
    """What the 'slipped' and 'clean' cases put after the prompt. terse: 'Sum: <the pass, slipped or not>\\nCheck: '.
    inline forms: the trace up to the sum of the slip's step, slipped (slip given) or right (slip None, `step` given)."""
    if form in task.INLINE_FORMS:
        if slip is None:
            right = task.checked_segments(numbers, (step, 1), form)
            return right[0].text + str(sum(numbers[:step + 1]))
        segments = task.checked_segments(numbers, slip, form)
        return segments[0].text + segments[1].text
    segments = task.checked_segments(numbers, slip)
    return "".join(s.text for s in segments).split("\nCheck: ")[0] + "\nCheck: "


_INLINE_STEP = re.compile(r"(\d+)=(\d+) \((\d+)-(\d+)=(-?\d+) (?:vs \d+ )?(ok|not(?: \d+)?)\)")


def inline_pass(reasoning: str) -> tuple[list[int], bool]:
    """The value first written at each step of an inline-checked trace, and whether any check disagreed."""
    first, redo, marked = [], False, False
    for m in _INLINE_STEP.finditer(reasoning):
        if not redo:
            first.append(int(m.group(2)))
        redo = m.group(6) != "ok"
        marked |= redo
    return first, marked


_PASS_PART = re.compile(r"(?P<first>\d+)\+(?P<second>\d+)=(?P<first_sum>\d+) \("
                        r"|\+(?P<add>\d+)=(?P<sum>\d+) \("
                        r"|(?P<verdict>ok|not)(?: \d+)?\)"
                        r"|left(?P<left>(?: [a-z]?\d+)+)")


def pass_origin(reasoning: str, numbers: list[int]) -> str | None:
    """Where an inline-checked pass first leaves the true running sums, in the order the text is written (None: it
    never does). At the first step whose first-written sum is wrong (redone steps are the check's, not the pass's):
    "list" = the carried list the step reads its number from was already wrong and the step took its first number;
    "read" = the number added is not the one the list (or, at the first step, the prompt) gave; "sum" = the number
    is right and the addition is not; "extra" = the pass adds more numbers than there are ("list" when a carried
    list held them); "short" = it stops before the last one. Stage 44's wrong passes were mostly "list" (`left 0 9 3 0 9` for `0 9 0 3 3`)."""
    added, left, redo = 0, None, False  # added: index of the last number added
    for m in _PASS_PART.finditer(reasoning.split("\n")[0]):
        if m["first"] is not None:
            a, b, total = int(m["first"]), int(m["second"]), int(m["first_sum"])
            if [a, b] != numbers[:2]:
                return "read"
            if total != a + b:
                return "sum"
            added = 1
        elif m["add"] is not None:
            if redo:  # the check's redone step
                continue
            added += 1
            if added >= len(numbers):
                return "list" if left else "extra"
            n, total = int(m["add"]), int(m["sum"])
            if n != numbers[added]:
                return "list" if left and left != numbers[added:] and n == left[0] else "read"
            if total != sum(numbers[:added + 1]):
                return "sum"
        elif m["verdict"] is not None:
            redo = m["verdict"] == "not"
        else:
            left = [int(x.lstrip(string.ascii_lowercase)) for x in m["left"].split()]  # tagged: "c9"
    return None if added == len(numbers) - 1 else "short"


def pass_total(reasoning: str) -> int | None:
    """The last sum of the pass (the first line of the trace), or None."""
    sums = re.findall(r"=(-?\d+)", reasoning.split("\n")[0])
    return int(sums[-1]) if sums else None


def classify(reasoning: str | None, answer_ok: bool, truth: int, numbers: list[int] | None = None,
             form: str = "terse") -> dict:
    reasoning = reasoning or ""
    if form in task.INLINE_FORMS:  # the pass is right when every first-written sum is the true running sum
        first, marked = inline_pass(reasoning)
        right = [sum(numbers[:k + 1]) for k in range(1, len(numbers))]
        return {"pass_right": first == right, "checked": bool(first), "marked": marked, "answer_right": answer_ok,
                "origin": pass_origin(reasoning, numbers) if first != right else None}
    check = next((line for line in reasoning.splitlines() if line.startswith("Check:")), None)
    first = pass_total(reasoning)
    return {"pass_right": first == truth, "checked": check is not None,
            "marked": bool(check and " not " in check), "answer_right": answer_ok}


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    count = lambda f: sum(1 for r in rows if f(r))
    return {"items": n, "answer_right": count(lambda r: r["answer_right"]),
            "pass_right": count(lambda r: r["pass_right"]), "checked": count(lambda r: r["checked"]),
            "marked": count(lambda r: r["marked"]),
            "repaired": count(lambda r: not r["pass_right"] and r["answer_right"]),
            "broken": count(lambda r: r["pass_right"] and not r["answer_right"]),
            "marked_repaired": count(lambda r: not r["pass_right"] and r["marked"] and r["answer_right"]),
            "wrong_pass_marked": count(lambda r: not r["pass_right"] and r["marked"]),
            "right_pass_marked": count(lambda r: r["pass_right"] and r["marked"]),
            **({"wrong_pass_origin": _origins(rows)} if rows and "origin" in rows[0] else {})}


def _origins(rows: list[dict]) -> dict:
    """How many wrong passes first went wrong where (pass_origin), the kinds that occur."""
    origins = Counter(r["origin"] for r in rows if not r["pass_right"])
    return {o: origins[o] for o in ORIGINS if origins[o]}


def run(model, tok, items: list[dict], cases=CASES, form: str = "terse") -> dict:
    rng = random.Random(SLIP_SEED)
    slips = [task.random_check_slip(it["numbers"], rng, form) for it in items]
    report = {}
    for case in cases:
        forced = ["" if case == "own" else forced_pass(it["numbers"], slip if case == "slipped" else None, form,
                                                       slip[0]) for it, slip in zip(items, slips)]
        prompts = [tok.encode(task.prompt_text(it, 100) + f) for it, f in zip(items, forced)]
        with torch.inference_mode():
            outs = E.greedy_generate(model, prompts, MAX_NEW, stop_id=tok.eos_id)
        rows = []
        for it, f, out in zip(items, forced, outs):
            text = f + tok.decode([t for t in out if t != tok.eos_id])
            reasoning, _ = task.split_completion(text)
            rows.append(classify(reasoning, task.score(text, it), int(it["answer"]), it["numbers"], form))
        report[case] = summarize(rows)
        print(json.dumps({"case": case, **report[case]}), file=sys.stderr, flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "model" / "assets" / "dsv41-tiny")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--token-map", type=Path, default=None)
    ap.add_argument("--form", choices=FORMS, default="terse",
                    help="the check's form: terse (the 'checked' style, stage 38), inline ('checked-inline', stages "
                         "39-40), carried ('checked-carried', stage 41), compared ('checked-compared', stages 42-46) or tagged "
                         "('checked-tagged', the carried numbers after the letters of their places)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="which of own, slipped and clean to run, comma-separated")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    cases = tuple(c for c in a.cases.split(",") if c)
    if not cases or set(cases) - set(CASES):
        ap.error(f"--cases takes {', '.join(CASES)}, got {a.cases!r}")
    model, tok = E.load_bundled(a.model, "cpu", a.token_map)
    report = {"model": str(a.model), "effort": 100, "slip_seed": SLIP_SEED, "form": a.form,
              **run(model, tok, task.load_items(limit=a.limit), cases, form=a.form)}
    text = json.dumps(report, indent=2)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
