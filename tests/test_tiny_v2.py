"""dsv41-tiny v2 (recipes/tiny/README.md, "v2 plan"): the tiny-reasoning v2 traces and their repaired slips, the
held-out v2 items, the loss mask of the v2 training stream and the window sampler that applies it."""

from __future__ import annotations

import collections
import random
import re

import numpy as np
import pytest
import torch

from dsv41.evals.tasks import tiny_reasoning as task
from dsv41.evals.tasks.tiny_reasoning import v2

SUM = re.compile(r"(\d+)\+(\d+)=(\d+)|\+(\d+)=(\d+)")


def pass_values(line: str) -> tuple[list[int], int]:
    """The numbers one running-sum line adds and the result it reaches; every step's arithmetic is checked
    against the sum written before it (a slip is a wrong step)."""
    added, total = [], None
    for a, b, s, n, s2 in SUM.findall(line):
        if a:
            added, total = [int(a), int(b)], int(s)
        else:
            added.append(int(n))
            total = int(s2)
    return added, total


def parse_trace(trace: str) -> dict:
    """Lines of a v2 trace -> {label: (numbers added, result)}, the copied list, the comparison and the closing
    value (the last integer of the last line)."""
    out = {}
    for line in trace.splitlines():
        head, _, body = line.partition(": ")
        if head in ("Sum", "Again"):
            out[head] = pass_values(body)
        elif head in ("List", "Copy"):
            out[head] = [int(n) for n in body.split()]
        elif ": differ. Third: " in line:
            a, b = map(int, re.match(r"(\d+) and (\d+): differ", line).groups())
            out["differ"] = (a, b)
            out["Third"] = pass_values(line.split("Third: ")[1])
    closing = re.findall(r"(\d+)\.$", trace.splitlines()[-1]) if trace else []
    out["closing"] = int(closing[-1]) if closing else None
    return out


def test_gold_traces_compute_the_sum_and_grow_with_effort():
    from dsv41.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    rng = random.Random(0)
    for length in range(v2.MIN_NUMBERS, v2.MAX_NUMBERS + 1):
        for _ in range(5):
            numbers = [rng.randint(0, 9) for _ in range(length)]
            traces = [v2.reasoning_trace(numbers, e) for e in task.SWEEP_EFFORTS]
            lengths = [len(tok.encode(t)) for t in traces]
            assert lengths[0] == 0 and all(a < b for a, b in zip(lengths, lengths[1:])), (numbers, lengths)
            total = sum(numbers)
            assert traces[1] == f"Pairs {' '.join(str(sum(numbers[i:i + 2])) for i in range(0, length, 2))}, total {total}"
            assert parse_trace(traces[2])["Sum"] == (numbers, total)
            three = parse_trace(traces[3])
            assert three["List"] == numbers and three["Sum"] == (numbers, total)
            four = parse_trace(traces[4])
            assert four["Copy"] == numbers and four["Sum"] == four["Again"] == (numbers, total)
            assert four["closing"] == total and "differ" not in four and traces[4].endswith(f"\n{total} and {total}: same, {total}.")
            # the higher tiers' passes are the effort-50 pass, written after the copy
            assert traces[2] in traces[3] and traces[2] in traces[4]
    # each tier named by the first reasoning token
    firsts = {v2.effort_tier(e): tok.encode(v2.reasoning_trace([3, 4, 5], e))[:1] for e in (25, 50, 75, 100)}
    assert len({tuple(f) for f in firsts.values()}) == 4


def test_injected_slips_are_caught_and_repaired():
    """Every slip kind at every step of either pass: the slipped pass reaches a wrong result, the comparison
    sees two different results, the third pass reaches the true sum, and the closing line (hence the answer)
    is right. The slip's text is the only untrained text."""
    rng = random.Random(1)
    seen_kinds = collections.Counter()
    for length in (3, 5, 8, 10):
        numbers = [rng.randint(1, 9) for _ in range(length)]
        total = sum(numbers)
        for which in (0, 1):
            for kind in v2.ERROR_KINDS:
                for step in range(1, length):
                    for delta in (-10, 1):
                        if kind == "skip" and step == length - 1:
                            with pytest.raises(ValueError):  # nothing after it to mask
                                v2.running_pass(numbers, (kind, step, delta))
                            continue
                        try:
                            _, got = v2.running_pass(numbers, (kind, step, delta))
                        except ValueError:  # a sum below zero
                            assert kind == "slip" and delta < 0
                            continue
                        if got == total:
                            continue  # (repeating an equal number changes nothing: random_error re-draws these)
                        segs = v2.training_segments(numbers, 100, error={
                            "pass": which, "kind": kind, "step": step, "delta": delta})
                        trace = "".join(s.text for s in segs)
                        parsed = parse_trace(trace)
                        slipped, clean = parsed[("Sum", "Again")[which]], parsed[("Sum", "Again")[1 - which]]
                        assert slipped[1] == got != total and clean == (numbers, total)
                        assert parsed["differ"] == ((got, total) if which == 0 else (total, got))
                        assert parsed["Third"] == (numbers, total)
                        assert trace.endswith(f"\n{total} twice: {total}.") and parsed["closing"] == total
                        untrained = [s.text for s in segs if not s.train]
                        assert len(untrained) == 1 and str(got) in untrained[0]
                        seen_kinds[kind] += 1
    assert all(seen_kinds[k] > 10 for k in v2.ERROR_KINDS)
    # the tier below has no check, so no slips either
    assert all(s.train for s in v2.training_segments([4, 5, 6], 80, random.Random(0), error_rate=1.0))


def test_random_slips_change_the_result_and_happen_at_the_asked_rate():
    rng = random.Random(2)
    slipped = 0
    for _ in range(600):
        numbers = v2.random_numbers(rng)
        segs = v2.training_segments(numbers, 95, rng, error_rate=0.3)
        trace = "".join(s.text for s in segs)
        if any(not s.train for s in segs):
            slipped += 1
            assert "differ" in trace
        assert parse_trace(trace)["closing"] == sum(numbers)
    assert 140 <= slipped <= 220  # 0.3 of 600 = 180


def test_heldout_v2_items_difficulty_and_versions(monkeypatch):
    items = task.load_items(version=2)
    assert len(items) == 360 and items == v2.generate_items(
        exclude={tuple(it["numbers"]) for it in task.load_items(version=1)})
    counts = collections.Counter(len(it["numbers"]) for it in items)
    assert counts == {n: 40 for n in range(2, 11)}
    assert collections.Counter(it["difficulty"] for it in items) == {"short": 80, "medium": 120, "long": 160}
    assert collections.Counter(len(it["numbers"]) for it in items[:90]) == {n: 10 for n in range(2, 11)}
    assert all(it["answer"] == sum(it["numbers"]) and it["messages"][0]["content"] == task.question(it["numbers"])
               for it in items)
    assert len({tuple(it["numbers"]) for it in items}) == 360
    assert not {tuple(it["numbers"]) for it in items} & {tuple(it["numbers"]) for it in task.load_items(version=1)}
    # the default stays v1 (the bundled model's) until a v2 checkpoint ships; the variable picks v2
    monkeypatch.delenv(task.VERSION_ENV, raising=False)
    assert len(task.load_items()) == 300 and task.task_version() == task.DEFAULT_VERSION == 1
    monkeypatch.setenv(task.VERSION_ENV, "2")
    assert task.load_items(limit=5) == items[:5]
    monkeypatch.setenv(task.VERSION_ENV, "3")
    with pytest.raises(ValueError):
        task.load_items()


def test_v2_conversation_is_the_v41_encoding_and_the_gold_answer_scores():
    from dsv41.model.encoding import encode_messages

    numbers = [4, 8, 1]
    segs = v2.conversation_segments(numbers, 95)
    text = "".join(s.text for s in segs)
    assert text == encode_messages(task.messages(numbers) + [{"role": "assistant", "reasoning_content":
                                   v2.reasoning_trace(numbers, 95), "content": "Answer: 13"}], mode="thinking", effort=95)
    completion = text.split("<think>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    assert task.score(completion, {"answer": 13})


def test_training_stream_mask_covers_exactly_the_slip_tokens():
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny.build_data import conversation_mask

    tok = load_tokenizer()
    numbers = [7, 3, 9, 2, 5]
    segs = [v2.Segment("".join(s.text for s in v2.conversation_segments(numbers, 95)[:1]))] + \
        v2.training_segments(numbers, 95, error={"pass": 0, "kind": "slip", "step": 2, "delta": 10}) + \
        [v2.Segment("</think>Answer: 26<｜end▁of▁sentence｜>")]
    text = "".join(s.text for s in segs)
    enc = tok.backend.encode_batch([text], add_special_tokens=False)[0]
    ids, mask = conversation_mask(segs, enc)
    assert ids.tolist() == enc.ids and mask.dtype == np.uint8
    untrained = tok.decode(ids[mask == 0].tolist())
    assert untrained == ", +9=29, +2=31, +5=36" and mask.sum() == len(ids) - (mask == 0).sum() > 0


def test_window_sampler_applies_a_family_mask_and_leaves_others_whole():
    from dsv41.recipes.tiny.train import WindowSampler

    streams = {"a": torch.arange(100), "b": torch.arange(1000, 1100)}
    masks = {"b": (torch.arange(100) % 3 != 0).float()}
    sampler = WindowSampler(streams, {"a": 0.5, "b": 0.5}, seed=0, masks=masks)
    rows = sampler.sample(64, 9)
    for row, m in zip(rows, sampler.last_mask):
        if row[0] >= 1000:
            assert torch.equal(m, ((row - 1000) % 3 != 0).float())
        else:
            assert torch.equal(m, torch.ones(9))
    plain = WindowSampler(streams, {"a": 0.5, "b": 0.5}, seed=0)
    assert torch.equal(plain.sample(64, 9), rows) and plain.last_mask is None  # the same rows: stages stay reproducible
    with pytest.raises(ValueError):
        WindowSampler(streams, {"b": 1.0}, masks={"b": torch.ones(5)})
