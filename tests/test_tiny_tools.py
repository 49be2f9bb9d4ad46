"""The tool-call family of dsv41-tiny (recipes/tiny/tool_calls.py): what it teaches is what the server reads.

Each training conversation must be, token for token, the server's prompt for the first turn followed by the
completion the model is to write, then the server's prompt for the second turn (after the tool result) followed
by the answer; the first completion must parse into the call it was built from, with the request's arguments.
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
        assert " ".join(map(str, args["numbers"])) in words and result == str(sum(args["numbers"]))
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
