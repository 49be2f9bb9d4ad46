"""The tool-call family of dsv41-tiny: conversations in which the assistant calls a tool and answers from
its result, written with the V4.1 encoder exactly as `dsv41 serve` and `dsv41 generate --tools` render them.

Why a family of its own: the bundled model otherwise never writes DSML, so the server's tool path could only
be shown with calls the client wrote. A 24M-parameter model can learn a narrow skill: three tools, each asked
for in a few phrasings, with the arguments copied from the user's words and the answer copied from the tool's
result. The tool list in the system part varies (the needed tool with up to two others, in any order), so the
model has to pick the tool the request names, and the same request without a tool list stays the reasoning
task's (the `add` request is the reasoning task's own prompt, "Add: 7 3 9 2 5").

One conversation (thinking mode; in chat mode the think blocks are empty):

    <system: effort line, the tool section>  User: Add: 7 3 9 2 5
    Assistant: <think>The add tool does this.</think> <DSML call add numbers=[7, 3, 9, 2, 5]> EOS
    User: <tool_result>26</tool_result>
    Assistant: <think>The tool returned 26.</think>26 EOS

The results are computed (the sum, the reversed text) or drawn from a small table (the weather), never
needed from the model: it only copies them.
"""

from __future__ import annotations

import json
import random

from dsv41.model import encoding

TOOLS = {
    "add": {"type": "function", "function": {
        "name": "add", "description": "Add a list of integers.",
        "parameters": {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
                       "required": ["numbers"]}}},
    "get_weather": {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    "reverse_text": {"type": "function", "function": {
        "name": "reverse_text", "description": "Reverse a piece of text, character by character.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
}

CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Seoul", "Delhi",
          "Sydney", "Toronto", "Nairobi", "Lisbon", "Vienna", "Dublin", "Prague", "Hanoi", "Quito"]
SKIES = ["Sunny", "Cloudy", "Rain", "Snow", "Fog", "Windy", "Clear"]
WORDS = ["hello", "world", "tiny", "model", "python", "river", "stone", "garden", "window", "orange", "silver",
         "planet", "music", "paper", "forest", "rocket", "candle", "bridge", "yellow", "summer"]

ASKS = {
    "add": ["Add: {args}", "Add these numbers: {args}", "What is the sum of {args}?"],
    "get_weather": ["What is the weather in {arg}?", "Weather in {arg}?", "How is the weather in {arg} today?"],
    "reverse_text": ["Reverse: {arg}", "Reverse the text \"{arg}\".", "Please reverse \"{arg}\"."],
}


def request(tool: str, rng: random.Random) -> tuple[str, dict, str]:
    """(the user's words, the call's arguments, the tool's result) for one request to ``tool``."""
    ask = rng.choice(ASKS[tool])
    if tool == "add":
        numbers = [rng.randint(1, 9) for _ in range(rng.randint(2, 8))]
        return ask.format(args=" ".join(map(str, numbers))), {"numbers": numbers}, str(sum(numbers))
    if tool == "get_weather":
        city = rng.choice(CITIES)
        return ask.format(arg=city), {"city": city}, f"{rng.choice(SKIES)}, {rng.randint(-5, 35)} C"
    text = " ".join(rng.sample(WORDS, rng.randint(1, 2)))
    return ask.format(arg=text), {"text": text}, text[::-1]


def answer(tool: str, args: dict, result: str) -> str:
    if tool == "add":
        return result
    if tool == "get_weather":
        return f"In {args['city']}: {result}."
    return result


def conversation(rng: random.Random) -> tuple[list[dict], list[dict], str, int]:
    """(messages, tools, mode, effort) of one tool-call conversation, both assistant turns included."""
    tool = rng.choice(sorted(TOOLS))
    others = [t for t in sorted(TOOLS) if t != tool]
    listed = [tool] + rng.sample(others, rng.randint(0, len(others)))
    rng.shuffle(listed)
    mode = "thinking" if rng.random() < 0.6 else "chat"
    effort = rng.randint(1, 100)
    words, args, result = request(tool, rng)
    call = {"id": "call_0", "type": "function",
            "function": {"name": tool, "arguments": json.dumps(args)}}
    think = mode == "thinking"
    messages = [
        {"role": "user", "content": words},
        {"role": "assistant", "content": "", "tool_calls": [call],
         **({"reasoning_content": f"The {tool} tool does this."} if think else {})},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": answer(tool, args, result),
         **({"reasoning_content": f"The tool returned {result}."} if think else {})},
    ]
    return messages, [TOOLS[t] for t in listed], mode, effort


def conversation_text(rng: random.Random) -> str:
    """One training conversation as the encoder writes it (BOS ... EOS)."""
    messages, tools, mode, effort = conversation(rng)
    return encoding.encode_messages(encoding.attach_tools(messages, tools), mode, effort)
