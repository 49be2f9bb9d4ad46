"""The tool-call family of dsv41-tiny (recipes/tiny/tool_calls.py): what it teaches is what the server reads.

Each training conversation must be, token for token, the server's prompt for the first turn followed by the
completion the model is to write, then the server's prompt for the second turn (after the tool result) followed
by the answer; the first completion must parse into the call it was built from, with the request's arguments.
Every argument's tokens in the call are a run of the request's tokens, and the family's loss mask trains exactly
the tokens the assistant writes.
"""

import json
import random

import pytest

from dsv41.model import encoding
from dsv41.model.completion import parse_completion
from dsv41.recipes.tiny import tool_calls


@pytest.mark.parametrize("seed", range(40))
def test_conversation_is_the_servers_prompt_and_completion(seed):
    rng = random.Random(seed)
    messages, tools, mode, effort = tool_calls.conversation(rng)
    text = encoding.encode_messages(encoding.attach_tools(messages, tools), mode, effort)
    assert text == tool_calls.conversation_text(random.Random(seed))

    first_prompt = encoding.encode_messages(encoding.attach_tools(messages[:1], tools), mode, effort)
    assert text.startswith(first_prompt)
    first = text[len(first_prompt):]
    parsed = parse_completion(first[:first.index(encoding.EOS) + len(encoding.EOS)], mode)
    assert not parsed.errors and parsed.content == ""
    (call,) = parsed.tool_calls
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    assert name in [t["function"]["name"] for t in tools]
    assert {"name": name, "args": args} == {"name": messages[1]["tool_calls"][0]["function"]["name"],
                                            "args": json.loads(messages[1]["tool_calls"][0]["function"]["arguments"])}
    words, result = messages[0]["content"], messages[2]["content"]
    if name == "add":
        assert json.dumps(args["numbers"]) in words and result == str(sum(args["numbers"]))
    elif name == "reverse_text":
        assert args["text"] in words and result == args["text"][::-1]
    else:
        assert args["city"] in words

    second_prompt = encoding.encode_messages(encoding.attach_tools(messages[:3], tools), mode, effort)
    assert text.startswith(second_prompt)
    answer = parse_completion(text[len(second_prompt):], mode)
    assert not answer.errors and not answer.tool_calls and result in answer.content


def test_the_family_varies_tools_modes_and_lists():
    rng = random.Random(0)
    seen = [tool_calls.conversation(rng) for _ in range(300)]
    assert {m[1]["tool_calls"][0]["function"]["name"] for m, *_ in seen} == set(tool_calls.TOOLS)
    assert {mode for _, _, mode, _ in seen} == {"thinking", "chat"}
    assert {len(tools) for _, tools, _, _ in seen} == {1, 2, 3}


def _gold_completions(seed: int):
    messages, tools, mode, effort = tool_calls.conversation(random.Random(seed))
    text = encoding.encode_messages(encoding.attach_tools(messages, tools), mode, effort)
    p1 = encoding.encode_messages(encoding.attach_tools(messages[:1], tools), mode, effort)
    p2 = encoding.encode_messages(encoding.attach_tools(messages[:3], tools), mode, effort)
    first = text[len(p1):]
    return messages, mode, first[:first.index(encoding.EOS) + len(encoding.EOS)], text[len(p2):]


@pytest.mark.parametrize("seed", range(6))
def test_tool_eval_judges_the_reference_right_and_a_template_copy_wrong(seed):
    from dsv41.recipes.tiny import tool_eval

    messages, mode, first, second = _gold_completions(seed)
    verdict = tool_eval.judge(messages, mode, first, second)
    assert verdict["call_ok"] and verdict["answer_ok"]
    name = messages[1]["tool_calls"][0]["function"]["name"]
    copied = first.split("<｜DSML｜ parameter")[0] + (
        '<｜DSML｜ parameter name="x" string="true">$PARAMETER_VALUE</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
        '</｜DSML｜ calls>' + encoding.EOS)
    assert f'invoke name="{name}"' in copied
    assert not tool_eval.judge(messages, mode, copied, second)["call_ok"]
    wrong_answer = second.replace(messages[2]["content"], "nothing")
    assert not tool_eval.judge(messages, mode, first, wrong_answer)["answer_ok"]


def test_tool_eval_rates_and_intervals():
    from dsv41.recipes.tiny import tool_eval

    rows = [{"tool": "add", "mode": "chat", "call_ok": i < 3, "answer_ok": i < 1} for i in range(4)]
    report = tool_eval.summarize(rows)
    assert report["call"]["correct"] == 3 and report["call"]["rate"] == 0.75
    assert report["by"]["tool=add"]["answer"]["correct"] == 1
    lo, hi = report["call"]["ci95"]
    assert lo < 0.75 < hi and 0 < lo and hi < 1
    assert tool_eval.wilson(0, 60)[0] == 0.0 and 0.05 < tool_eval.wilson(0, 60)[1] < 0.07


@pytest.fixture(scope="module")
def tok():
    from dsv41.model.tokenizer import load_tokenizer

    return load_tokenizer()


def _encode(tok, text):
    return tok.backend.encode(text, add_special_tokens=False)


def _span_ids(enc, lo, hi):
    """The ids of the tokens inside characters [lo, hi), which must start at lo and end at hi exactly."""
    inside = [(i, a, b) for i, (a, b) in enumerate(enc.offsets) if a >= lo and b <= hi and b > a]
    assert inside and inside[0][1] == lo and inside[-1][2] == hi, "the span is not whole tokens"
    assert [i for i, *_ in inside] == list(range(inside[0][0], inside[-1][0] + 1))
    return [enc.ids[i] for i, *_ in inside]


def _contains_run(seq, run):
    return any(seq[i:i + len(run)] == run for i in range(len(seq) - len(run) + 1))


def _check_arguments_in_request(tok, messages, tools, mode, effort):
    text = tool_calls.render(messages, tools, mode, effort)
    enc = _encode(tok, text)
    words = messages[0]["content"]
    user_at = text.index(encoding.USER + words) + len(encoding.USER)
    request_ids = _span_ids(enc, user_at, user_at + len(words))
    fn = messages[1]["tool_calls"][0]["function"]
    for key, value in json.loads(fn["arguments"]).items():
        shown = tool_calls.rendered_argument(value)
        head = f'parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        at = text.index(head, user_at) + len(head)
        assert text[at:at + len(shown)] == shown
        arg_ids = _span_ids(enc, at, at + len(shown))
        assert _contains_run(request_ids, arg_ids), (words, shown)


@pytest.mark.parametrize("seed", range(60))
def test_every_argument_is_a_token_run_of_the_request(tok, seed):
    _check_arguments_in_request(tok, *tool_calls.conversation(random.Random(seed)))


def _check_value(tok, tool, value):
    key = tool_calls.ARGUMENT[tool]
    for ask in tool_calls.ASKS[tool]:
        messages = [{"role": "user", "content": ask.format(arg=tool_calls.rendered_argument(value))},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
                     "function": {"name": tool, "arguments": json.dumps({key: value})}}]}]
        _check_arguments_in_request(tok, messages, [tool_calls.TOOLS[tool]], "chat", 50)


def test_every_city_word_and_phrasing_keeps_the_arguments_tokens(tok):
    """All listed values and phrasings, and 300 invented values and lists of each tool, not only those a seed
    draws (a string argument follows `">` in DSML)."""
    rng = random.Random(11)
    invented_cities = [tool_calls.pseudo_word(rng, rng.randint(1, 3)).capitalize() for _ in range(300)]
    texts = [" ".join(tool_calls.text_word(rng) for _ in range(rng.randint(1, 2))) for _ in range(300)]
    for tool, values in [("get_weather", tool_calls.CITIES + invented_cities),
                         ("reverse_text", tool_calls.WORDS + texts +
                          [f"{a} {b}" for a, b in zip(tool_calls.WORDS, tool_calls.WORDS[1:] + tool_calls.WORDS[:1])]),
                         ("add", [tool_calls.number_list(rng) for _ in range(300)])]:
        for value in values:
            _check_value(tok, tool, value)


def _values(seed: int, n: int) -> list[tuple[str, str]]:
    """(tool, argument as the call writes it) of n conversations drawn as build_data / tool_eval draw them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages, *_ = tool_calls.conversation(rng)
        fn = messages[1]["tool_calls"][0]["function"]
        value = json.loads(fn["arguments"])[tool_calls.ARGUMENT[fn["name"]]]
        out.append((fn["name"], tool_calls.rendered_argument(value)))
    return out


def test_argument_values_cannot_be_memorized():
    """Stages 20-22 (20 cities, 20 words) learnt one constant value per tool: now no value of a tool is more than
    1% of its training draws, about half are drawn once, and half the evaluation values never occur in training."""
    from collections import Counter

    from dsv41.recipes.tiny import build_data, tool_eval

    train = _values(20263, build_data.TOOL_CONVERSATIONS)  # build_tools' seed and count
    for tool in tool_calls.TOOLS:
        counts = Counter(v for t, v in train if t == tool)
        total = sum(counts.values())
        assert counts.most_common(1)[0][1] / total < 0.01, (tool, counts.most_common(3))
        assert len(counts) > 0.45 * total, (tool, len(counts), total)  # half the draws invented, nearly all distinct
    seen = {v for _, v in train}
    evaluated = _values(tool_eval.EVAL_SEED, 60)
    for tool in tool_calls.TOOLS:
        vals = [v for t, v in evaluated if t == tool]
        assert sum(v not in seen for v in vals) >= len(vals) // 3, tool
    assert sum(v not in seen for _, v in evaluated) >= 30


def test_the_thinking_line_names_the_tool_from_the_requests_keyword():
    rng = random.Random(5)
    for _ in range(100):
        messages, _, mode, _ = tool_calls.conversation(rng)
        name = messages[1]["tool_calls"][0]["function"]["name"]
        assert tool_calls.KEYWORD[name].lower() in messages[0]["content"].lower()
        if mode == "thinking":
            assert messages[1]["reasoning_content"] == f"{tool_calls.KEYWORD[name]} asked: {name}."


def test_the_add_request_is_never_the_reasoning_tasks_prompt():
    from dsv41.evals.tasks import tiny_reasoning as task

    rng = random.Random(1)
    seen = 0
    for _ in range(400):
        messages, *_ = tool_calls.conversation(rng)
        fn = messages[1]["tool_calls"][0]["function"]
        if fn["name"] != "add":
            continue
        seen += 1
        numbers = json.loads(fn["arguments"])["numbers"]
        words = messages[0]["content"]
        assert words != task.messages(numbers)[0]["content"] and not words.startswith("Add: ")
        assert "tool" in words and json.dumps(numbers) in words
    assert seen > 50
    for ask in tool_calls.ASKS["add"]:
        assert not ask.startswith("Add: ")


@pytest.mark.parametrize("seed", range(20))
def test_segments_render_the_conversation_and_the_mask_trains_the_assistants_tokens(tok, seed):
    from dsv41.recipes.tiny.build_data import conversation_mask

    messages, tools, mode, effort = tool_calls.conversation(random.Random(seed))
    segs = tool_calls.conversation_segments(random.Random(seed))
    text = "".join(s.text for s in segs)
    assert text == encoding.encode_messages(encoding.attach_tools(messages, tools), mode, effort)
    assert [s.train for s in segs] == [False, True, False, True]
    enc = _encode(tok, text)
    ids, mask = conversation_mask(segs, enc)
    assert list(ids) == enc.ids
    bounds, at = [], 0
    for s in segs:
        bounds.append(at)
        at += len(s.text)
    for a, b in enc.offsets:  # no token straddles two segments
        assert not any(a < x < b for x in bounds)
    trained = [tok.decode([int(i)]) for i, m in zip(ids, mask) if m]
    _, mode_, first, second = _gold_completions(seed)
    assert "".join(trained) == first + second
    assert trained[-1] == encoding.EOS and trained.count(encoding.EOS) == 2
    context = "".join(tok.decode([int(i)]) for i, m in zip(ids, mask) if not m)
    assert messages[0]["content"] in context and f"<tool_result>{messages[2]['content']}</tool_result>" in context
    assert "## Tools" in context and "## Tools" not in "".join(trained)
    if mode == "thinking":
        assert "".join(trained).startswith(messages[1]["reasoning_content"] + "</think>")


def test_the_family_builds_and_samples_through_the_window_sampler_with_its_mask(tmp_path, tok):
    import numpy as np
    import torch

    from dsv41.recipes.tiny import build_data
    from dsv41.recipes.tiny.train import WindowSampler, load_masks, load_streams

    info = build_data.build_tools(tmp_path, tok, n_train=40, seed=3)
    assert (tmp_path / "tools.u32.xz").exists() and (tmp_path / "tools.mask.u8.xz").exists()
    assert not list(tmp_path.glob("*.partial"))
    streams = load_streams(tmp_path, {"tools": 1.0})
    masks = load_masks(tmp_path, {"tools": 1.0})
    stream, mask = streams["tools"], masks["tools"]
    assert stream.numel() == mask.numel() == info["train_tokens"]
    assert 0.1 < info["trained_share"] < 0.5 and int(mask.sum()) == info["trained_tokens"]
    assert int((stream == tok.bos_id).sum()) == 40 and bool((mask[stream == tok.bos_id] == 0).all())
    assert int(mask[stream == tok.eos_id].sum()) == int((stream == tok.eos_id).sum()) == 80  # both turns' ends
    sampler = WindowSampler(streams, {"tools": 1.0}, seed=0, masks=masks)
    rows = sampler.sample(8, 64)
    assert rows.shape == sampler.last_mask.shape == (8, 64)
    s, m = stream.numpy(), mask.numpy()
    for row, row_mask in zip(rows.numpy(), sampler.last_mask.numpy()):
        starts = [i for i in range(len(s) - 64) if (s[i:i + 64] == row).all()]
        assert starts and any(np.array_equal(m[i:i + 64], row_mask) for i in starts)
    assert torch.equal(sampler.last_mask, sampler.last_mask.clamp(0, 1))
    # --mask-weight scales the trained targets of a masked family, leaves its context at 0, refuses a family
    # without a mask
    weighted = load_masks(tmp_path, {"tools": 1.0}, {"tools": 4.0})["tools"]
    assert torch.equal(weighted, mask * 4.0) and set(weighted.unique().tolist()) == {0.0, 4.0}
    with pytest.raises(SystemExit):
        load_masks(tmp_path, {"tools": 1.0}, {"prose": 2.0})


def test_mix_and_mask_weight_parse_or_fail_in_one_line():
    from dsv41.recipes.tiny.train import parse_mix

    assert parse_mix("prose=0.1,tools=0.25") == {"prose": 0.1, "tools": 0.25}
    with pytest.raises(SystemExit, match="name=number"):
        parse_mix("prose:0.1")
