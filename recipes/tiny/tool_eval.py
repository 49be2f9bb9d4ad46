"""How well a checkpoint uses tools: conversations of the tool-call family (recipes/tiny/tool_calls.py) drawn
with a seed training never used, both turns generated greedily through the engine.

    python -m dsv41.recipes.tiny.tool_eval --model runs/tiny-v2/s18 --n 120 [--json OUT]

For each conversation: the first turn's completion must parse (model/completion.py, the server's parser) into
exactly one call of the right tool with the request's arguments; then, with the *reference* call and the tool's
result in the history (as a client would send them), the second turn's answer must contain the result. Reports
both rates with 95% Wilson intervals, by tool and mode. `--teacher-forced K` also reads K conversations whole
(one forward each) and counts the tokens of the first turn's completion the model predicts as its argmax: where a
checkpoint fails, whether it fails on the frame or on what the frame must be filled with.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

EVAL_SEED = 777_001  # training draws with build_data's seed 20263


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def evaluate(model, tok, n: int, seed: int = EVAL_SEED, batch: int = 32) -> dict:
    """Both turns of n conversations generated greedily by `model` (with its tokenizer `tok`), judged."""
    from dsv41.model import encoding
    from dsv41.model.engine import GenerationConfig, Generator, Request
    from dsv41.recipes.tiny import tool_calls

    gen = Generator(model, tok)
    rng = random.Random(seed)
    convos = [tool_calls.conversation(rng) for _ in range(n)]
    config = GenerationConfig(max_new_tokens=96)

    def run(prompts: list[str], what: str) -> list[str]:
        t0 = time.time()
        done = [0]

        def tick(i, _):
            done[0] += 1
            if done[0] % 10 == 0 or done[0] == len(prompts):
                el = time.time() - t0
                eta = el / done[0] * (len(prompts) - done[0])
                print(f"tool_eval {what}: {done[0]}/{len(prompts)} ETA {eta:.0f} s", file=sys.stderr, flush=True)

        results = gen.generate_many([Request(tok.encode(p), config) for p in prompts], max_batch_size=batch,
                                    on_done=tick)
        return [tok.decode(r.output_ids) for r in results]

    firsts = run([encoding.encode_messages(encoding.attach_tools(m[:1], t), mode, e) for m, t, mode, e in convos],
                 "first turn")
    seconds = run([encoding.encode_messages(encoding.attach_tools(m[:3], t), mode, e) for m, t, mode, e in convos],
                  "second turn")
    rows = [judge(messages, mode, first, second) | {"effort": effort, "listed": len(tools)}
            for (messages, tools, mode, effort), first, second in zip(convos, firsts, seconds)]
    return summarize(rows) | {"n": n, "seed": seed, "rows": rows}


def teacher_forced(model, tok, k: int, seed: int = EVAL_SEED) -> dict:
    """Greedy next-token hits over the first turn's completion (what follows the first generation header, up
    to and including its end-of-sentence token) of k conversations, and which tokens were missed."""
    import torch

    from dsv41.model import encoding
    from dsv41.recipes.tiny import tool_calls

    rng = random.Random(seed + 1)
    hits = total = 0
    missed: dict[str, int] = defaultdict(int)
    for _ in range(k):
        messages, tools, mode, effort = tool_calls.conversation(rng)
        prompt = encoding.encode_messages(encoding.attach_tools(messages[:1], tools), mode, effort)
        whole = encoding.encode_messages(encoding.attach_tools(messages, tools), mode, effort)
        p_ids = tok.encode(prompt)
        ids = tok.encode(whole)
        if ids[:len(p_ids)] != p_ids:
            raise RuntimeError("the prompt's tokens are not a prefix of the conversation's")
        first = whole[len(prompt):]
        n = len(tok.encode(first[:first.index(encoding.EOS) + len(encoding.EOS)]))
        with torch.inference_mode():
            pred = model(torch.tensor([ids[:-1]]), all_logits=True)[0].argmax(-1).tolist()
        for j in range(len(p_ids), len(p_ids) + n):
            total += 1
            if pred[j - 1] == ids[j]:
                hits += 1
            else:
                missed[tok.decode([ids[j]]).strip() or repr(tok.decode([ids[j]]))] += 1
    return {"conversations": k, "tokens": total, "argmax_hits": hits, "rate": round(hits / max(1, total), 4),
            "missed_most": dict(sorted(missed.items(), key=lambda kv: -kv[1])[:15])}


def judge(messages: list[dict], mode: str, first: str, second: str) -> dict:
    """One conversation's verdict: the first completion must parse into exactly the reference call (name and
    arguments as JSON values), the second must answer with text containing the tool's result and call nothing."""
    from dsv41.model.completion import parse_completion

    want = messages[1]["tool_calls"][0]["function"]
    parsed = parse_completion(first, mode)
    calls = [(c["function"]["name"], _json(c["function"]["arguments"])) for c in parsed.tool_calls]
    answer = parse_completion(second, mode)
    return {"tool": want["name"], "mode": mode,
            "call_ok": calls == [(want["name"], json.loads(want["arguments"]))],
            "answer_ok": not answer.tool_calls and messages[2]["content"] in answer.content,
            "first": first, "second": second}


def _json(text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def summarize(rows: list[dict]) -> dict:
    def rate(sel: list[dict], key: str) -> dict:
        k = sum(r[key] for r in sel)
        lo, hi = wilson(k, len(sel))
        return {"n": len(sel), "correct": k, "rate": round(k / max(1, len(sel)), 4), "ci95": [round(lo, 4), round(hi, 4)]}

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[f"tool={r['tool']}"].append(r)
        groups[f"mode={r['mode']}"].append(r)
    return {"call": rate(rows, "call_ok"), "answer": rate(rows, "answer_ok"),
            "by": {g: {"call": rate(sel, "call_ok"), "answer": rate(sel, "answer_ok")} for g, sel in sorted(groups.items())}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--n", type=int, default=120, help="conversations generated (0: only --teacher-forced)")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--json", type=Path, default=None, help="write the report (with every completion) here")
    ap.add_argument("--teacher-forced", type=int, default=0, metavar="K",
                    help="also the argmax hits over K conversations' first completions, read whole")
    a = ap.parse_args(argv)
    if a.n < 0 or a.teacher_forced < 0 or a.n == a.teacher_forced == 0:
        ap.error("--n (generated conversations) and --teacher-forced take counts >= 0, not both 0")
    if a.model is None:
        from dsv41.model.assets import bundled_model_dir
        a.model = str(bundled_model_dir())
    from dsv41.model.checkpoint.load import load_model

    model, _, tok = load_model(a.model)
    report = {"model": str(a.model)} | (evaluate(model, tok, a.n, a.seed) if a.n else {"n": 0, "seed": a.seed})
    if a.teacher_forced:
        report["teacher_forced"] = teacher_forced(model, tok, a.teacher_forced, a.seed)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(a.json)
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    return report


if __name__ == "__main__":
    main()
