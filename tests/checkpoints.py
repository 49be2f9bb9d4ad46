"""Small complete checkpoints for end-to-end tests: the tiny V4.1 model (every layer mode, Engram,
DSpark) with random weights, in the official layout, with its own byte-level tokenizer (256 byte
tokens plus the V4.1 control tokens) so the vocabulary, and with it the model, stays under 1M
parameters."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dsv41.model import encoding

CONTROL_TOKENS = [
    encoding.BOS, encoding.EOS, "<｜▁pad▁｜>", encoding.USER, encoding.ASSISTANT, encoding.SYSTEM,
    encoding.LATEST_REMINDER, encoding.THINK_START, encoding.THINK_END, encoding.DSML,
    encoding.IMAGE_PLACEHOLDER, "<tool_result>", "</tool_result>",
]


def small_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CONTROL_TOKENS)
    # fill the vocabulary up to the model's 512 ids, so every id the model can emit decodes
    tok.add_tokens([f"<unused{i}>" for i in range(512 - tok.get_vocab_size(with_added_tokens=True))])
    return tok


def make_small_checkpoint(dst: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint (vocab_size 512, the tokenizer's size)."""
    from dsv41.model.config import preset
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.fixtures import write_official_fixture
    from dsv41.model.tokenizer import Tokenizer as DsTokenizer

    dst = Path(dst)
    tok = small_tokenizer()
    wrapped = DsTokenizer(tok, source="small", bos_token=encoding.BOS, eos_token=encoding.EOS)
    _, n_compressed = build_compressed_token_map(wrapped, cache_dir=False)
    pad = tok.token_to_id("<｜▁pad▁｜>")
    args = preset("tiny").replace(engram_compressed_vocab_size=n_compressed, engram_pad_id=pad, pad_token_id=pad,
                                  bos_token_id=tok.token_to_id(encoding.BOS), eos_token_id=tok.token_to_id(encoding.EOS),
                                  dspark_noise_token_id=pad)
    write_official_fixture(dst, args, seed=seed, n_shards=3, tokenizer=False)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": encoding.BOS, "eos_token": encoding.EOS, "add_bos_token": False, "add_eos_token": False}))
    return dst
