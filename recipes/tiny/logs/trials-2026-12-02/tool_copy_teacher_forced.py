"""Teacher-forced argmax hits on the tokens that must be copied: the call's argument value (first turn) and the
tool result in the answer (second turn), over K conversations of the tool_eval seed + 2."""
import json, random, sys
sys.path.insert(0, "/work/main")
import torch
torch.set_num_threads(1)
from dsv41.model.checkpoint.load import load_model
from dsv41.model import encoding
from dsv41.recipes.tiny import tool_calls, tool_eval
model, _, tok = load_model(sys.argv[1]); K = int(sys.argv[2])
rng = random.Random(tool_eval.EVAL_SEED + 2)
b = tok.backend
hits = {"value": [0, 0], "value_first_token": [0, 0], "result_in_answer": [0, 0], "result_first_token": [0, 0]}
for _ in range(K):
    messages, tools, mode, effort = tool_calls.conversation(rng)
    text = tool_calls.render(messages, tools, mode, effort)
    enc = b.encode(text, add_special_tokens=False)
    ids = enc.ids
    with torch.inference_mode():
        pred = model(torch.tensor([ids[:-1]]), all_logits=True)[0].argmax(-1).tolist()
    fn = messages[1]["tool_calls"][0]["function"]; name = fn["name"]
    value = tool_calls.rendered_argument(json.loads(fn["arguments"])[tool_calls.ARGUMENT[name]])
    head = f'string="{"true" if name != "add" else "false"}">'
    at = text.index(head) + len(head)
    p2 = tool_calls.render(messages[:3], tools, mode, effort)
    result = messages[2]["content"]
    rat = text.index(result, len(p2))  # first occurrence of the result in the second turn
    for key, lo, hi in (("value", at, at + len(value)), ("result_in_answer", rat, rat + len(result))):
        idx = [i for i, (a, c) in enumerate(enc.offsets) if a >= lo and c <= hi and c > a]
        for n, i in enumerate(idx):
            ok = pred[i - 1] == ids[i]
            hits[key][0] += ok; hits[key][1] += 1
            if n == 0:
                k2 = "value_first_token" if key == "value" else "result_first_token"
                hits[k2][0] += ok; hits[k2][1] += 1
print(json.dumps({"model": sys.argv[1], "conversations": K,
                  **{k: {"hits": h, "tokens": n, "rate": round(h / max(1, n), 4)} for k, (h, n) in hits.items()}}))
