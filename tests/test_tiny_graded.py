"""The "graded" trace style of tiny-reasoning (issue #25): a shortcut below the terse sums, the terse sums below
the two checked passes of "undo"."""

import re

from dsv41.evals.tasks import tiny_reasoning as task


def test_tiers_are_a_guess_a_shortcut_a_pass_and_two_checked_passes():
    numbers = [7, 3, 9, 2, 5]
    trace = {e: task.reasoning_trace(numbers, e, "graded") for e in (1, 19, 20, 44, 45, 69, 70, 89, 90, 100)}
    assert trace[1] == trace[19] == ""
    assert trace[20] == trace[44] == "Pairs 10 11 5, total 26"
    assert trace[45] == trace[69] == task.reasoning_trace(numbers, 25, "undo") == "7+3=10, +9=19, +2=21, +5=26"
    for effort in (70, 89, 90, 100):  # "undo"'s top tiers
        assert trace[effort] == task.reasoning_trace(numbers, effort, "undo")
    assert trace[100].splitlines()[-1] == "Back to 7, so the sum is 26."
    # each tier starts with its own token, which the effort value decides (--think-start-weight)
    from dsv41.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    assert len({tok.encode(trace[e])[0] for e in (20, 45, 70, 90)}) == 4


def test_the_shortcut_is_the_pair_sums_and_the_total():
    for numbers in ([7, 3, 9, 2], [1, 2, 3, 4, 5, 6, 7], [9] * 8, [0, 0, 0, 0]):
        trace = task.reasoning_trace(numbers, 30, "graded")
        pairs, total = re.fullmatch(r"Pairs ([\d ]+), total (\d+)", trace).groups()
        assert [int(p) for p in pairs.split()] == [sum(numbers[i:i + 2]) for i in range(0, len(numbers), 2)]
        assert int(total) == sum(numbers)


def test_build_data_writes_the_graded_family(tmp_path):
    import numpy as np

    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.recipes.tiny import build_data as B

    tok = load_tokenizer()
    held = task.load_items()
    info = B.build_reasoning(tmp_path, tok, held, 100, "graded")
    assert info["trace_style"] == "graded" and info["train_documents"] == 100
    assert B.reasoning_family("graded") == "reasoning_graded"
    ids = B.load_tokens(tmp_path / "reasoning_graded.u32.xz")
    assert ids.size == info["train_tokens"]
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    cuts = np.flatnonzero(ids == bos).tolist() + [ids.size]
    held_lists = {tuple(it["numbers"]) for it in held}
    forms = set()
    for a, b in zip(cuts, cuts[1:]):
        text = tok.decode(ids[a:b].tolist())
        numbers = [int(n) for n in re.search(r"Add: ([\d ]+)", text).group(1).split()]
        effort = int(re.search(r"Reasoning Effort: (\d+)", text).group(1)) if "Reasoning Effort" in text else None
        assert tuple(numbers) not in held_lists
        reasoning = text.split("<think>")[-1].split("</think>")[0]
        if effort is not None:
            assert reasoning == task.reasoning_trace(numbers, effort, "graded")
        forms.add(reasoning.split(" ")[0].split(":")[0][:5])
        assert text.endswith(f"</think>Answer: {sum(numbers)}<｜end▁of▁sentence｜>")
    assert {"Pairs", "First", "Sum"} <= forms


def test_trace_forms_name_the_graded_tiers():
    from dsv41.recipes.tiny.trace_forms import trace_form

    forms = [trace_form(task.reasoning_trace([7, 3, 9, 2, 5], e, "graded")) for e in task.SWEEP_EFFORTS]
    assert forms == ["none", "pairs", "terse", "undo", "check"]
