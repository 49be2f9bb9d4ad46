"""Put a dataset downloaded elsewhere (parquet, JSON or JSON Lines) into the layout `dsv41 eval --data-dir`
reads: DIR/<hub path>/[<config>/]<split>.jsonl.

    python -m dsv41.evals.tasks.prepare mmlu-pro ~/Downloads/MMLU-Pro --data-dir DATA
    python -m dsv41.evals.tasks.prepare TIGER-Lab/MMLU-Pro test-00000-of-00001.parquet validation.jsonl --data-dir DATA
    dsv41 eval mmlu-pro --data-dir DATA

DATASET is an alias of `dsv41 eval` (mmlu-pro, gsm8k, ...) or a Hub dataset id (owner/name). SRC is any
number of files or folders (a folder: every .parquet/.json/.jsonl under it, e.g. a copy of the Hub
repository). Each file's split is its name up to the first '-' (`test-00000-of-00001.parquet` -> test,
`validation.jsonl` -> validation) unless --split says; its config is --config, else the folder it lies in
when that folder is one of the dataset's configs (or, for datasets with one folder per subject, any folder
but `data`). Shards of one split are joined in name order. Parquet needs pyarrow (installed with the
`eval` extra, through datasets). Exit 0 when every split the alias needs is in place, 1 when some are still
missing (listed), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from dsv41.evals.tasks.offline import HUB_DATA, HubData, missing_in_data_dir

SUFFIXES = (".parquet", ".jsonl", ".json")


class PrepareError(ValueError):
    """Bad input: printed as one line, exit 2."""


def dataset_for(name: str) -> tuple[str, HubData | None]:
    """(Hub path, what the alias needs, or None for a plain Hub id)."""
    needs = HUB_DATA.get(name.strip().lower())
    if needs:
        if len(needs) > 1:
            raise PrepareError(f"{name} reads {len(needs)} Hub datasets ({needs[0].path}, ...): prepare each by its "
                               "Hub id (owner/name)")
        return needs[0].path, needs[0]
    if name.count("/") != 1 or not all(name.split("/")):
        known = ", ".join(sorted(HUB_DATA))
        raise PrepareError(f"unknown dataset {name!r}: give an alias ({known}) or a Hub id owner/name")
    for needs in HUB_DATA.values():
        for hd in needs:
            if hd.path.lower() == name.lower():
                return hd.path, hd
    return name, None


def read_rows(path: Path) -> list[dict]:
    """The records of one parquet, JSON (a list, or an object holding one list) or JSON Lines file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert it to "
                               "JSON Lines first") from None
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not text.lstrip().startswith(("[", "{"))):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        try:
            doc = json.loads(text)
        except ValueError:  # a .json file that holds JSON Lines
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            if isinstance(doc, dict):
                lists = [v for v in doc.values() if isinstance(v, list)]
                if len(lists) != 1:
                    raise PrepareError(f"{path}: a JSON object, but not one holding a single list of records")
                doc = lists[0]
            rows = doc
    if not all(isinstance(r, dict) for r in rows):
        raise PrepareError(f"{path}: expected records (JSON objects), found {type(rows[0]).__name__}")
    return rows


def split_of(path: Path) -> str:
    return path.stem.split("-")[0].split(".")[0]


def collect(sources: list[Path], hd: HubData | None, config: str | None, split: str | None) -> dict:
    """{(config or None, split): [files]} for every data file of the sources."""
    known = set(hd.configs) if hd else set()
    per_subject = bool(hd) and any(c.startswith("<") for c in hd.configs)
    found: dict[tuple, list[Path]] = defaultdict(list)
    skipped: set[str] = set()
    for src in sources:
        if not src.exists():
            raise PrepareError(f"{src}: no such file or folder")
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                                                    and not any(part.startswith(".") for part in p.relative_to(src).parts))
        for f in files:
            if f.suffix not in SUFFIXES:
                raise PrepareError(f"{f}: not a .parquet, .json or .jsonl file")
            cfg = config
            if cfg is None and src.is_dir() and f.parent != src:
                folder = f.parent.name
                if folder in known or (per_subject and folder not in ("data", "default")):
                    cfg = folder
                elif known and not per_subject and folder not in ("data", "default"):
                    skipped.add(folder)  # another config of the dataset, which lm-eval's task does not read
                    continue
            if cfg is None and hd is not None and len(hd.configs) == 1 and not hd.configs[0].startswith("<"):
                cfg = hd.configs[0]
            found[(cfg, split or split_of(f))].append(f)
    if skipped:
        print(f"skipped the folders of configs the task does not read: {', '.join(sorted(skipped))}", file=sys.stderr)
    if not found:
        raise PrepareError("no .parquet, .json or .jsonl files in " + ", ".join(map(str, sources)))
    return found


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)


def prepare(dataset: str, sources: list[Path], data_dir: Path, config: str | None = None,
            split: str | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """Convert; returns ([(written file, rows)], [files the alias still lacks])."""
    path, hd = dataset_for(dataset)
    written = []
    for (cfg, sp), files in sorted(collect(sources, hd, config, split).items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
        rows = [r for f in files for r in read_rows(f)]
        dst = data_dir / path / cfg / f"{sp}.jsonl" if cfg else data_dir / path / f"{sp}.jsonl"
        write_jsonl(dst, rows)
        written.append((dst, len(rows)))
    missing = missing_in_data_dir(hd, data_dir) if hd else []
    return written, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.evals.tasks.prepare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Examples:\n  python -m dsv41.evals.tasks.prepare mmlu-pro ~/Downloads/MMLU-Pro "
                                        "--data-dir DATA\n  python -m dsv41.evals.tasks.prepare openai/gsm8k test.parquet "
                                        "--config main --data-dir DATA")
    ap.add_argument("dataset", help="an alias of dsv41 eval (mmlu-pro, gsm8k, ...) or a Hub dataset id owner/name")
    ap.add_argument("sources", nargs="+", type=Path, help="files or folders of .parquet/.json/.jsonl")
    ap.add_argument("--data-dir", type=Path, required=True, help="the folder dsv41 eval --data-dir will read")
    ap.add_argument("--config", help="the config (subset) these files are (default: from the folder, or none)")
    ap.add_argument("--split", help="the split these files are (default: from each file's name)")
    a = ap.parse_args(argv)
    try:
        written, missing = prepare(a.dataset, a.sources, a.data_dir, a.config, a.split)
    except (PrepareError, OSError, ValueError) as e:
        print(f"prepare: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for dst, n in written:
        print(f"wrote {dst} ({n} rows)")
    if missing:
        print(f"still missing for {a.dataset}: {', '.join(missing)}", file=sys.stderr)
        return 1
    alias = a.dataset if a.dataset.lower() in HUB_DATA else "TASK"
    print(f"ready: dsv41 eval {alias} --data-dir {a.data_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
