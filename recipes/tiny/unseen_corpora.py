"""Text of the model's families from a source its training never saw: another project's Python code and prose.

    python -m dsv41.recipes.tiny.unseen_corpora [--out runs/unseen-corpora] [--sources ~/.cache/dsv41/unseen-sources]
    dsv41 bpb runs/unseen-corpora/click-code.jsonl runs/unseen-corpora/click-docs.jsonl

Fetches the sdist of `click` 8.1.7 (BSD-3-Clause) with `pip download --no-deps --no-binary=:all:` (once) and writes
two JSONL files of {"name", "text"} documents:

    click-code.jsonl   src/click/*.py: another project's Python source tree (training's code is CPython's stdlib)
    click-docs.jsonl   docs/*.rst: English technical prose in reStructuredText by other authors (training's prose
                       is the Python 3.11 documentation)

Neither is in any training stream (build_data's sources are the CPython stdlib, python3.11-doc and the KJV).
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

from dsv41.recipes.tiny.build_data import fetch_sdist

SDIST = "click==8.1.7"


def fetch(sources: Path) -> Path:
    sources.mkdir(parents=True, exist_ok=True)
    archive = fetch_sdist(sources, SDIST, "click-8.1.7.tar.gz")
    root = sources / "click-8.1.7"
    if not root.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(sources, filter="data")
    return root


def write(root: Path, out: Path) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, files in (("click-code", sorted((root / "src" / "click").glob("*.py"))),
                        ("click-docs", sorted((root / "docs").glob("*.rst")))):
        rows = [{"name": str(p.relative_to(root)), "text": p.read_text(encoding="utf-8")} for p in files]
        rows = [r for r in rows if r["text"].strip()]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                          encoding="utf-8")
        sizes[name] = sum(len(r["text"].encode()) for r in rows)
    return sizes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/unseen-corpora"))
    ap.add_argument("--sources", type=Path, default=Path.home() / ".cache" / "dsv41" / "unseen-sources")
    a = ap.parse_args(argv)
    sizes = write(fetch(a.sources), a.out)
    print(json.dumps(sizes))
    return sizes


if __name__ == "__main__":
    main()
