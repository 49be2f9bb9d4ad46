"""CompletionStream: the incremental completion parser (model/completion.py).

Every stream is checked against parse_completion of the whole text: the reasoning, content and
argument deltas concatenate to exactly its fields, calls carry its ids and names, the finish event
carries its result. Inputs are fed token by token through the bundled tokenizer, whole and cut at
every token (a completion stopped by length), plus a seeded fuzz over pieces of text, markup and
special tokens tokenized piece by piece (so token boundaries fall everywhere).
"""

from __future__ import annotations

import json
import random

import pytest

from dsv41.model.completion import CompletionStream, StreamEvent, _Scrubber, _scrub_special_tokens, parse_completion, ParsedCompletion
from dsv41.model.encoding import BOS, DSML, EOS, THINK_END, THINK_START
from dsv41.model.tokenizer import load_tokenizer

TOK = load_tokenizer()
MARKUP = ("<｜", DSML, THINK_END, THINK_START, "\ufffd")


def ids_of(*pieces: str) -> list[int]:
    """Token ids of the pieces, each tokenized on its own (token boundaries at the piece boundaries)."""
    return [i for piece in pieces for i in TOK.encode(piece, allow_special=True)]


def run(ids, mode, finish_reason="stop"):
    stream = CompletionStream(TOK, mode)
    fed: list[list[StreamEvent]] = [stream.feed(i) for i in ids]
    closing = stream.close(finish_reason)
    return stream, [e for batch in fed for e in batch], closing


def check(ids, mode, finish_reason="stop"):
    """Streams ``ids``; asserts exactness against parse_completion; returns (events before close, at close)."""
    text = TOK.decode(ids, skip_special=False)
    expected = parse_completion(text, mode, finished=finish_reason == "stop")
    stream, early, closing = run(ids, mode, finish_reason)
    events = early + closing
    assert text.startswith(stream.text) and (stream.text == text or text.endswith("\ufffd"))
    assert [e.kind for e in events].count("finish") == 1 and events[-1].kind == "finish"
    assert events[-1].finish_reason == finish_reason and events[-1].parsed == expected
    for kind in ("reasoning", "content"):
        texts = [e.text for e in events if e.kind == kind]
        assert all(texts), kind  # no empty deltas
        assert "".join(texts) == getattr(expected, kind), (kind, text, texts)
    calls: dict[int, dict] = {}
    for event in events:
        if event.kind != "tool_call":
            continue
        if event.index not in calls:
            assert event.index == len(calls) and event.id is not None and event.name is not None
            calls[event.index] = {"id": event.id, "name": event.name, "arguments": ""}
        calls[event.index]["arguments"] += event.arguments
    assert list(calls.values()) == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in expected.tool_calls
    ], text
    # markup never leaks: an event holds markup only where the parse's own result does
    for event in events:
        for marker in MARKUP:
            if marker in event.text:
                assert marker in getattr(expected, event.kind), (marker, event, text)
    return early, closing


def call_text(name, params, space=" "):
    lines = [f'<{DSML}{space}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
             f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}{space}parameter>' for k, v in params.items()]
    body = "\n".join(lines) if lines else ""
    return f'<{DSML}{space}invoke name="{name}">\n{body}\n</{DSML}{space}invoke>'


def block(*calls, space=" "):
    name = " calls" if space else "tool_calls"
    return f"<{DSML}{name}>\n" + "\n".join(call_text(n, p, space) for n, p in calls) + f"\n</{DSML}{name}>"


WEATHER = ("get_weather", {"city": "Paris 巴黎 🙂", "days": 3})
SEARCH = ("search", {"query": "a <b> & \"c\"\nline 2", "filters": {"lang": ["en", None], "on": True}, "k": -2.5})
NOW = ("now", {})

CASES = [
    ("chat", "Hello there, plain text with no markup at all."),
    ("chat", "Hello" + EOS),
    ("thinking", "Let me think.\n\nStep 2." + THINK_END + "The answer is 42." + EOS),
    ("thinking", "Reasoning that never closes" + EOS),
    ("thinking", "Reasoning cut by length, ending in a blank line\n\n<"),
    ("thinking", THINK_START + "leading think" + THINK_END + "answer" + EOS),
    ("thinking", "plan" + THINK_END + "Calling.\n\n" + block(WEATHER) + EOS),
    ("chat", "Several calls.\n\n" + block(WEATHER, SEARCH, NOW) + EOS),
    ("chat", "\n\n" + block(NOW) + EOS),
    ("thinking", "calls before the end of thinking\n\n" + block(SEARCH) + THINK_END + "late" + EOS),
    ("thinking", "r" + THINK_END + "V4 dialect\n\n" + block(WEATHER, NOW, space="") + EOS),
    ("chat", "malformed\n\n" + block(WEATHER).replace('string="false"', 'string="maybe"') + EOS),
    ("chat", "unclosed call\n\n" + block(WEATHER, SEARCH).replace(f"</{DSML} invoke>", "", 1) + EOS),
    ("chat", "a bad JSON value\n\n" + block(("f", {"a": 1})).replace(">1<", ">{oops<") + EOS),
    ("chat", "cut by length\n\n" + block(WEATHER, SEARCH)[:-60]),
    ("chat", "text after the block\n\n" + block(NOW) + "\n\nmore text" + EOS),
    ("chat", "stray </" + DSML + " invoke> markup and a bare " + DSML + " token\n\nthen " + BOS + " text" + EOS),
    ("thinking", "special " + BOS + " tokens <｜User｜> in" + THINK_START + " reasoning" + THINK_END + "and <｜Assistant｜> content " + THINK_END + EOS),
    ("chat", "emoji 🙂🚀👩‍👩‍👧 and CJK 中文字符 mixed with ñ and 𝔘" + EOS),
    ("thinking", "思考中…🙂" + THINK_END + "答案：日本語のテキスト" + EOS),
    ("chat", "a < b and c > d, <html> and ｜ bars, </not> tags" + EOS),
    ("chat", "text after the end" + EOS + " ignored <｜DSML｜ calls>"),
    ("chat", "nested <｜a<｜b｜>｜> special <｜a｜> tokens" + EOS),
    ("chat", "two blocks\n\n" + block(NOW) + "\n\n" + block(WEATHER) + EOS),
    ("chat", "\n\n\n\n" + block(NOW)),
]


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_exact_against_parse_completion(case, finish_reason):
    mode, text = CASES[case]
    check(TOK.encode(text, allow_special=True), mode, finish_reason)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_exact_at_every_cut(case):
    """Generation stopped after each token (finish_reason "length"), and the token-by-token split."""
    mode, text = CASES[case]
    ids = TOK.encode(text, allow_special=True)
    for cut in range(len(ids) + 1):
        check(ids[:cut], mode, "length")
    check(ids_of(*text), mode, "stop")  # one character per piece: the finest token boundaries


def test_text_streams_before_close():
    text = "The quick brown fox jumps over the lazy dog. " * 20
    early, closing = check(TOK.encode(text + EOS), "chat")
    assert "".join(e.text for e in early) == text and [e.kind for e in closing] == ["finish"]
    assert len(early) > 100  # delta by delta, not at the end
    early, _ = check(TOK.encode("thinking about it" + THINK_END + "answer" + EOS), "thinking")
    assert [(e.kind, e.text) for e in early][0][0] == "reasoning"
    assert "".join(e.text for e in early if e.kind == "reasoning") == "thinking about it"


def test_calls_are_emitted_when_their_invoke_closes():
    text = "Calling.\n\n" + block(WEATHER, SEARCH)
    ids = TOK.encode(text, allow_special=True)
    stream = CompletionStream(TOK, "chat")
    seen = []
    for n, token in enumerate(ids):
        for event in stream.feed(token):
            if event.kind == "tool_call":
                seen.append((event.index, TOK.decode(ids[: n + 1])))
    assert [i for i, _ in seen] == [0, 1]
    for index, prefix in seen:  # right after the call's closing tag
        assert prefix.rstrip("\n").endswith(f"</{DSML} invoke>") and prefix.count(f"</{DSML} invoke>") == index + 1
    closing = stream.close("stop")
    assert [e.kind for e in closing] == ["finish"] and len(closing[0].parsed.tool_calls) == 2


def test_markers_are_held_not_split():
    stream = CompletionStream(TOK, "chat")
    got = []
    for piece in ["Hi", " <", "｜DSML｜", " calls", ">\n"]:
        for token in TOK.encode(piece, allow_special=True):
            got += stream.feed(token)
    assert [e.text for e in got] == ["Hi", " "]  # " <" held; once markup, the space is content (one space, not a blank line)
    stream = CompletionStream(TOK, "thinking")
    got = [e for t in TOK.encode("a\n\n</thi", allow_special=False) for e in stream.feed(t)]
    assert "".join(e.text for e in got) == "a"
    got = [e for t in TOK.encode("nk>b", allow_special=False) for e in stream.feed(t)]
    assert [(e.kind, e.text) for e in got] == [("reasoning", "\n\n"), ("content", "b")]
    stream = CompletionStream(TOK, "chat")
    got = [e for t in TOK.encode("x <y", allow_special=True) for e in stream.feed(t)]
    assert "".join(e.text for e in got) == "x <y"  # a '<' that is not markup is released by what follows


def test_incomplete_utf8_is_held():
    ids = TOK.encode("🙂👩‍👩‍👧中" + EOS)
    assert any(TOK.decode([i]).endswith("\ufffd") for i in ids)
    early, _ = check(ids, "chat")
    assert all("\ufffd" not in e.text for e in early) and "".join(e.text for e in early) == "🙂👩‍👩‍👧中"


def test_scrubber_matches_batch_scrub():
    rng = random.Random(7)
    pieces = ["<", "｜", "a", "b", " ", ">", "<｜a｜>", "<｜b｜>", BOS, EOS, THINK_START, THINK_END, "<th", "ink>", "｜>", "x"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        exact = _scrub_special_tokens(text, "content", ParsedCompletion())
        scrubber, out = _Scrubber(), ""
        for n in range(len(text)):
            out += scrubber.push(text[n])
            assert exact.startswith(out), (text, out, exact)


def test_cost_is_linear_for_plain_text():
    """Each token is decoded once (plus the few ids of a pending UTF-8 sequence) and the held text stays short."""
    decoded = [0]

    class Counting:
        def decode(self, ids, skip_special=False):
            decoded[0] += len(ids)
            return TOK.decode(ids, skip_special=skip_special)

    ids = TOK.encode("word <tag> a\n\nb 中文🙂 " * 800)
    for mode in ("chat", "thinking"):
        decoded[0] = 0
        stream, longest = CompletionStream(Counting(), mode), 0
        for token in ids:
            stream.feed(token)
            longest = max(longest, len(stream._buf))
        assert longest < 40 and decoded[0] < 2 * len(ids)
        stream.close("length")


def test_feed_after_close_raises():
    stream = CompletionStream(TOK, "chat")
    stream.close("stop")
    with pytest.raises(RuntimeError):
        stream.feed(1)


# ---------------------------------------------------------------------------------------------
# Fuzz: random completions, tokenized piece by piece
# ---------------------------------------------------------------------------------------------

TEXT = list("ab <>/=\"{}\n\t中🙂｜") + ["hello", " world", "\n\n", "<｜", "</", "DSML", "｜DSML｜", "<think", "</think",
                                      "<｜User｜>", "<｜a｜>", BOS, THINK_START, THINK_END, EOS[:6], "👩‍👧", "é"]
MARKUP_PIECES = [f"<{DSML} calls>", f"</{DSML} calls>", f"<{DSML}tool_calls>", f"</{DSML}tool_calls>",
                 f'<{DSML} invoke name="f">', f"</{DSML} invoke>", f'<{DSML} parameter name="p" string="true">',
                 f'<{DSML} parameter name="q" string="false">', f"</{DSML} parameter>", f"<{DSML} bogus>", DSML, "\n"]


def random_completion(rng):
    pieces = []
    if rng.random() < 0.3:
        pieces += [rng.choice(TEXT) for _ in range(rng.randint(0, 8))] + [THINK_END]
    pieces += [rng.choice(TEXT) for _ in range(rng.randint(0, 10))]
    if rng.random() < 0.6:
        calls = [(f"f{n}", {"s": "".join(rng.choice(TEXT[:16]) for _ in range(3)), "j": rng.choice([1, [2, None], {"k": "v"}])})
                 for n in range(rng.randint(1, 3))]
        whole = "\n\n" + block(*calls, space=rng.choice([" ", " ", ""]))
        if rng.random() < 0.3:  # cut somewhere
            whole = whole[: rng.randint(0, len(whole))]
        pieces.append(whole)
    for _ in range(rng.randint(0, 3)):  # markup, text and special tokens anywhere
        position = rng.randint(0, len(pieces))
        pieces.insert(position, rng.choice(MARKUP_PIECES + TEXT))
    if rng.random() < 0.6:
        pieces.append(EOS)
    text = "".join(pieces)
    # random token boundaries: the text cut at random places, each part tokenized on its own
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    return ids_of(*parts)


def test_fuzz():
    rng = random.Random(20240521)
    for _ in range(300):
        ids = random_completion(rng)
        check(ids, rng.choice(["thinking", "chat"]), rng.choice(["stop", "length"]))
