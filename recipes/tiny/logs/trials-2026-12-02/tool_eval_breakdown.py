import json, random, sys
sys.path.insert(0, "/work/main")
from collections import Counter
from dsv41.recipes.tiny import tool_calls, tool_eval
from dsv41.model.completion import parse_completion
path = sys.argv[1]
r = json.load(open(path))
rng = random.Random(20263)
seen = set()
for _ in range(20000):
    m, *_ = tool_calls.conversation(rng)
    seen.add(m[1]["tool_calls"][0]["function"]["arguments"])
rng = random.Random(r["seed"])
convos = [tool_calls.conversation(rng) for _ in range(r["n"])]
c = Counter()
for (messages, tools, mode, effort), row in zip(convos, r["rows"]):
    want = messages[1]["tool_calls"][0]["function"]
    wargs = json.loads(want["arguments"])
    p = parse_completion(row["first"], mode)
    c["one_call"] += len(p.tool_calls) == 1
    c["unseen_value"] += want["arguments"] not in seen
    if len(p.tool_calls) == 1:
        f = p.tool_calls[0]["function"]
        name_ok = f["name"] == want["name"]
        c["name_ok"] += name_ok
        try:
            got = json.loads(f["arguments"])
        except Exception:
            got = {}
        key = tool_calls.ARGUMENT[want["name"]]
        c["param_ok"] += name_ok and set(got) == {key}
        c["value_ok"] += got.get(key) == wargs[key]
    if mode == "thinking":
        c["thinking_rows"] += 1
        c["thinking_line_ok"] += row["first"].startswith(tool_calls.thinking(want["name"]) + "</think>")
    c["answer_ok"] += row["answer_ok"]
print(dict(c), "of", r["n"])
