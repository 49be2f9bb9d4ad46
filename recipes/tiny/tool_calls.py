"""The tool-call family of dsv41-tiny: conversations in which the assistant calls a tool and answers from
its result, written with the V4.1 encoder exactly as `dsv41 serve` and `dsv41 generate --tools` render them.

Why a family of its own: the bundled model otherwise never writes DSML, so the server's tool path could only
be shown with calls the client wrote. A 24M-parameter model can learn a narrow skill: three tools, each asked
for in a few phrasings, with the arguments copied from the user's words and the answer copied from the tool's
result. The tool list in the system part varies (the needed tool with up to two others, in any order), so the
model has to pick the tool the request names.

Designed to be easy to copy (the first two trials learnt the DSML frame, not what fills it):
- every argument value is in the request *token for token* as the call writes it: a string argument follows
  `">` in DSML, so it is tokenized without a leading space, and the request quotes it (`Reverse "river".`,
  the word after the quote is space-less too); the `add` list is shown as the call renders it, on a line of
  its own (`Add with the tool:` then `[7, 3, 9]`; JSON, as model/encoding.py writes non-string parameters),
  which also keeps it apart from the reasoning task's plain prompt "Add: 7 3 9 2 5" (that prompt without
  tools stays the reasoning task's);
- every phrasing of a tool holds the tool's keyword (Add, Weather, Reverse), and the thinking line (thinking
  mode) names the tool from it: `Weather asked: get_weather.`;
- the argument values cannot be memorized (stages 20-22, with 20 cities and 20 words, wrote one constant value
  per tool): cities and words are half from lists of about 100, half invented (`pseudo_word`), the lists hold
  2-8 numbers of 1-9 or 1-99, so nearly every value a conversation asks for is new and only copying pays;
- `conversation_segments` marks the tokens the assistant writes (both turns, their end tokens included), the
  only ones trained on (build_data writes the mask OUT/tools.mask.u8.xz); the system part with the tool
  section, the user's request and the tool's result are context.

One conversation (thinking mode; in chat mode the think blocks are empty):

    <system: effort line, the tool section>  User: Add with the tool: <line break> [7, 3, 9, 2, 5]
    Assistant: <think>Add asked: add.</think> <DSML call add numbers=[7, 3, 9, 2, 5]> EOS
    User: <tool_result>26</tool_result>
    Assistant: <think>The tool returned 26.</think>26 EOS

The results are computed (the sum, the reversed text) or drawn from a small table (the weather), never
needed from the model: it only copies them.
"""

from __future__ import annotations

import json
import random

from dsv41.evals.tasks.tiny_reasoning.v2 import Segment  # text + whether its tokens are trained on
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

# The argument values come from a space far too large to memorize (stages 20-22 drew from 20 cities and 20 words and
# learnt one constant value per tool instead of copying): half from the named lists below, half invented
# (`pseudo_word`: syllables from ONSETS x VOWELS x CODAS, 1,274 distinct syllables, so about 1.6M two-syllable
# and 2.1G three-syllable spellings, nearly every one unseen by training; 1-6 tokens in 2,000 draws), so only
# copying the request's value pays.
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Seoul", "Delhi",
          "Sydney", "Toronto", "Nairobi", "Lisbon", "Vienna", "Dublin", "Prague", "Hanoi", "Quito",
          "Athens", "Bangkok", "Beijing", "Boston", "Brussels", "Budapest", "Chicago", "Dakar", "Denver", "Dhaka",
          "Doha", "Geneva", "Havana", "Helsinki", "Istanbul", "Jakarta", "Kabul", "Kyoto", "Lagos", "Manila",
          "Miami", "Milan", "Montreal", "Moscow", "Mumbai", "Munich", "Naples", "Osaka", "Ottawa", "Perth",
          "Riga", "Santiago", "Seattle", "Shanghai", "Sofia", "Stockholm", "Taipei", "Tehran", "Tunis", "Warsaw",
          "Zurich", "Accra", "Amman", "Baku", "Bogota", "Caracas", "Casablanca", "Damascus", "Florence", "Glasgow",
          "Hamburg", "Houston", "Kiev", "Lyon", "Malaga", "Marseille", "Melbourne", "Minsk", "Nice", "Porto",
          "Reykjavik", "Seville", "Tallinn", "Valencia", "Venice", "Vilnius", "Zagreb", "Kigali", "Lusaka", "Perugia"]
SKIES = ["Sunny", "Cloudy", "Rain", "Snow", "Fog", "Windy", "Clear"]
WORDS = ["hello", "world", "tiny", "model", "python", "river", "stone", "garden", "window", "orange", "silver",
         "planet", "music", "paper", "forest", "rocket", "candle", "bridge", "yellow", "summer",
         "apple", "basket", "bottle", "butter", "castle", "cloud", "copper", "dragon", "engine", "feather",
         "flower", "glass", "guitar", "hammer", "island", "jacket", "kettle", "ladder", "lemon", "letter",
         "marble", "mirror", "monkey", "needle", "ocean", "pencil", "pepper", "pillow", "pocket", "puzzle",
         "rabbit", "ribbon", "saddle", "shadow", "spider", "spring", "sugar", "table", "tiger", "tomato",
         "tunnel", "velvet", "violin", "wagon", "winter", "wizard", "anchor", "barrel", "blanket", "button",
         "cactus", "carpet", "cherry", "circle", "coffee", "cotton", "desert", "doctor", "falcon", "finger",
         "garlic", "ginger", "harbor", "helmet", "honey", "insect", "jungle", "lantern", "meadow", "napkin",
         "orchid", "parrot", "pebble", "pirate", "quartz", "raven", "salmon", "timber", "turtle", "valley"]
ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "ch",
          "dr", "gr", "pl", "sh", "st", "tr"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou"]
CODAS = ["", "", "", "", "", "", "n", "r", "l", "s", "m", "k"]


def pseudo_word(rng: random.Random, syllables: int) -> str:
    """An invented, pronounceable lowercase word of `syllables` syllables."""
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))


def city_name(rng: random.Random) -> str:
    """A city for get_weather: half from CITIES, half an invented capitalized name of 2-3 syllables."""
    return rng.choice(CITIES) if rng.random() < 0.5 else pseudo_word(rng, rng.randint(2, 3)).capitalize()


def text_word(rng: random.Random) -> str:
    """A word for reverse_text: half from WORDS, half an invented one of 1-3 syllables."""
    return rng.choice(WORDS) if rng.random() < 0.5 else pseudo_word(rng, rng.randint(1, 3))


def number_list(rng: random.Random) -> list[int]:
    """2-8 numbers for add: single digits (1-9) in half the lists, 1-99 in the other half."""
    top = 9 if rng.random() < 0.5 else 99
    return [rng.randint(1, top) for _ in range(rng.randint(2, 8))]


# {arg}: the argument exactly as the DSML parameter holds it (a string as is, the list as JSON). A quote before a
# string argument (` "` is a token of its own) and a line break before the list (`: [` would make ` [` one token,
# the call has `[` after `">`), the list at the request's end, keep the argument's tokens the call's.
ASKS = {
    "add": ["Add with the tool:\n{arg}", "Add these numbers with the tool:\n{arg}",
            "Add the list with the tool:\n{arg}"],
    "get_weather": ["Weather in \"{arg}\"?", "What is the weather in \"{arg}\"?",
                    "How is the weather in \"{arg}\" today?"],
    "reverse_text": ["Reverse \"{arg}\".", "Reverse the text \"{arg}\".", "Please reverse \"{arg}\" for me."],
}
KEYWORD = {"add": "Add", "get_weather": "Weather", "reverse_text": "Reverse"}  # in every phrasing of the tool
ARGUMENT = {"add": "numbers", "get_weather": "city", "reverse_text": "text"}


def rendered_argument(value) -> str:
    """An argument as the DSML parameter holds it (model/encoding.py: strings as is, the rest as JSON)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def request(tool: str, rng: random.Random) -> tuple[str, dict, str]:
    """(the user's words, the call's arguments, the tool's result) for one request to ``tool``."""
    ask = rng.choice(ASKS[tool])
    if tool == "add":
        numbers = number_list(rng)
        args, result = {"numbers": numbers}, str(sum(numbers))
    elif tool == "get_weather":
        city = city_name(rng)
        args, result = {"city": city}, f"{rng.choice(SKIES)}, {rng.randint(-5, 35)} C"
    else:
        text = " ".join(text_word(rng) for _ in range(rng.randint(1, 2)))
        args, result = {"text": text}, text[::-1]
    return ask.format(arg=rendered_argument(args[ARGUMENT[tool]])), args, result


def thinking(tool: str) -> str:
    """The first turn's reasoning: the request's keyword names the tool."""
    return f"{KEYWORD[tool]} asked: {tool}."


def answer(tool: str, args: dict, result: str) -> str:
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
         **({"reasoning_content": thinking(tool)} if think else {})},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": answer(tool, args, result),
         **({"reasoning_content": f"The tool returned {result}."} if think else {})},
    ]
    return messages, [TOOLS[t] for t in listed], mode, effort


def render(messages: list[dict], tools: list[dict], mode: str, effort: int) -> str:
    return encoding.encode_messages(encoding.attach_tools(messages, tools), mode, effort)


def segments(messages: list[dict], tools: list[dict], mode: str, effort: int) -> list[Segment]:
    """The rendered conversation split at the assistant's parts: each assistant turn is what follows the server's
    prompt for it (the history rendered up to the generation header: `<｜Assistant｜>` and `<think>` or
    `</think>`), up to and including its end-of-sentence token; these are trained, the rest is context.
    The segments' texts concatenate to `render(messages, tools, mode, effort)` exactly."""
    text = render(messages, tools, mode, effort)
    first_prompt = render(messages[:1], tools, mode, effort)
    second_prompt = render(messages[:3], tools, mode, effort)
    if not (text.startswith(first_prompt) and text.startswith(second_prompt) and text.endswith(encoding.EOS)):
        raise ValueError("the server's prompts are not prefixes of the conversation")
    first_end = text.index(encoding.EOS, len(first_prompt)) + len(encoding.EOS)
    if first_end > len(second_prompt):
        raise ValueError("the first turn's end is past the second prompt")
    return [Segment(first_prompt, False), Segment(text[len(first_prompt):first_end]),
            Segment(text[first_end:len(second_prompt)], False), Segment(text[len(second_prompt):])]


def conversation_segments(rng: random.Random) -> list[Segment]:
    """One training conversation (BOS ... EOS) as segments, the assistant's parts marked trained."""
    return segments(*conversation(rng))


def conversation_text(rng: random.Random) -> str:
    """One training conversation as the encoder writes it (BOS ... EOS)."""
    return render(*conversation(rng))
