"""Report suites (recipes/suites/*.toml) and the files `dsv41 eval` writes.

A suite is one of the tech report's tables as data: sections of rows, each row a benchmark with its
metric and shot count, the lm-eval task that measures it (or the external harness it needs), which
result key holds the number, and the report's published numbers as reference columns. Running a
suite evaluates every runnable row and lays the numbers out in the table's shape, this run beside
the references. A number that is not there is shown as such, with the reason, never dropped:

    n/g          the reference number is not given in the report text this project holds
    not run [k]  the row could not run here (footnote k says why: no offline data, code execution
                 not confirmed, an external harness, ...)
    pending      the run was interrupted before this row (a partial report; rerun to resume)
"""

from __future__ import annotations

import html
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SUITES_DIR = Path(__file__).resolve().parent.parent / "recipes" / "suites"
NOT_GIVEN = "n/g"


class SuiteError(ValueError):
    """An unknown suite name or a malformed suite file (bad input)."""


@dataclass
class SuiteRow:
    section: str
    benchmark: str
    metric: str  # as the report names it: EM, Pass@1, F1, Acc., Rating, ...
    shots: int | None
    task: str | None  # our alias or an lm-eval task; None: needs an external harness
    result: str | None  # lm-eval result key, "metric,filter"
    scale: float = 100.0  # lm-eval's fraction -> the report's percent
    mode: str | None = None  # overrides the suite's mode for this row
    reference: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class Suite:
    name: str
    title: str
    columns: list[str]  # reference columns, left to right
    rows: list[SuiteRow]
    default_mode: str | None = None  # None: raw text (base model); "thinking"/"chat": chat encoding
    offline: bool = False  # every row's data ships with the packages
    source: str = ""
    notes: list[str] = field(default_factory=list)


def suite_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml":
        return p
    return SUITES_DIR / f"{name}.toml"


def load_suite(name: str) -> Suite:
    path = suite_path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SUITES_DIR.glob("*.toml")))
        raise SuiteError(f"unknown suite {name!r} (known: {known})")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: not valid TOML ({e})") from None
    try:
        columns = list(doc.get("columns", []))
        rows = []
        for r in doc["rows"]:
            ref = {k: float(v) for k, v in r.get("reference", {}).items()}
            unknown = set(ref) - set(columns)
            if unknown:
                raise SuiteError(f"{path}: row {r['benchmark']!r} has a reference for unknown column {sorted(unknown)[0]!r}")
            rows.append(SuiteRow(section=r["section"], benchmark=r["benchmark"], metric=r["metric"],
                                 shots=r.get("shots"), task=r.get("task") or None, result=r.get("result") or None,
                                 scale=float(r.get("scale", 100.0)), mode=r.get("mode"), reference=ref,
                                 note=r.get("note", "")))
        mode = doc.get("mode", "base")
        return Suite(name=doc.get("name", path.stem), title=doc["title"], columns=columns, rows=rows,
                     default_mode=None if mode == "base" else mode, offline=bool(doc.get("offline", False)),
                     source=doc.get("source", ""), notes=list(doc.get("notes", [])))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SuiteError):
            raise
        raise SuiteError(f"{path}: malformed suite ({type(e).__name__}: {e})") from None


# ============================================================================ running a suite
def lookup(results: dict, task: str, key: str) -> tuple[float | None, float | None]:
    """(value, stderr) of result `key` ("metric,filter") for a task or group in lm-eval's results.
    A tag (a name for several tasks without an aggregate, e.g. mgsm_cot_native) gets the unweighted
    mean of its tasks' values and no stderr."""
    metric, _, filt = key.partition(",")
    for section in ("groups", "results"):
        row = (results.get(section) or {}).get(task)
        if row and key in row:
            se = row.get(f"{metric}_stderr,{filt}") if filt else row.get(f"{metric}_stderr")
            return float(row[key]), (float(se) if isinstance(se, (int, float)) else None)
    values = [float(r[key]) for r in (results.get("results") or {}).values() if isinstance(r.get(key), (int, float))]
    return (sum(values) / len(values), None) if values else (None, None)


def row_mode(row: SuiteRow, suite: Suite, override: str | None) -> str | None:
    """The mode a row runs in: its own, else --mode, else the suite's; "base" means raw text (None)."""
    mode = row.mode or override or suite.default_mode
    return None if mode in (None, "base") else mode


def runnable(suite: Suite) -> list[int]:
    """Indices of the rows that have a task to run."""
    return [i for i, r in enumerate(suite.rows) if r.task is not None]


def run_suite(suite: Suite, evaluate_row: Callable[[SuiteRow], dict], explain: Callable[[Exception], str],
              log: Callable[[str], None] = lambda m: None, mode_override: str | None = None,
              done: dict[int, dict] | None = None, on_row: Callable[[int, dict, dict], None] | None = None) -> dict:
    """Evaluate every runnable row; a row that fails is marked with the reason, the rest go on.
    evaluate_row(row) runs the row's task (in `row_mode(row, suite, mode_override)`) and returns
    lm-eval's results. done: {row index: entry} of rows an earlier run finished (status ok), taken as
    they are. on_row(index, entry, report so far) after each row (the rows not reached yet are
    "pending"), so that a caller can keep the finished rows and a partial report on disk."""
    from dsv41.evals.tasks import resolve

    done = done or {}
    rows: list[dict] = []

    def report(upto: int) -> dict:
        pending = [dict(_entry(suite, r), status="pending", reason=None) for r in suite.rows[upto:]]
        return {"suite": suite.name, "title": suite.title, "columns": suite.columns, "source": suite.source,
                "notes": suite.notes, "rows": rows + pending}

    for k, row in enumerate(suite.rows):
        if k in done and done[k].get("status") == "ok":
            rows.append(done[k])
            if on_row:
                on_row(k, done[k], report(k + 1))
            continue
        entry = _entry(suite, row)
        if row.task is not None:
            log(f"{suite.name}: {row.benchmark} ({row.task})")
        _run_row(suite, row, entry, evaluate_row, explain, mode_override, resolve)
        rows.append(entry)
        if on_row:
            on_row(k, entry, report(k + 1))
    return report(len(suite.rows))


def _entry(suite: Suite, row: SuiteRow) -> dict:
    return {"section": row.section, "benchmark": row.benchmark, "metric": row.metric, "shots": row.shots,
            "task": row.task, "result_key": row.result, "reference": {c: row.reference.get(c) for c in suite.columns},
            "this_run": None, "stderr": None, "n": None, "status": "ok", "reason": None, "note": row.note}


def _run_row(suite, row, entry, evaluate_row, explain, mode_override, resolve) -> None:
    if row.task is None:
        entry["status"], entry["reason"] = "external", row.note or "needs an external harness"
    else:
        try:
            results = evaluate_row(row)
            task = resolve(row.task, row_mode(row, suite, mode_override))
            value, se = lookup(results, task, row.result)
            if value is None:
                raise KeyError(f"no result {row.result!r} for {task}")
            entry["this_run"] = value * row.scale
            entry["stderr"] = None if se is None else se * row.scale
            entry["n"] = sum(int(v.get("effective", v.get("original", 0)) or 0)
                             for v in (results.get("n-samples") or {}).values())
            entry["task"] = task
        except Exception as e:  # noqa: BLE001 - recorded in the report, never dropped
            if os.environ.get("DSV41_DEBUG"):
                raise
            entry["status"], entry["reason"] = "not run", explain(e)


# ============================================================================ rendering
def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return NOT_GIVEN
    return f"{v:.{digits}f}"


def _table(report: dict) -> tuple[list[str], list[list[str] | str], list[str]]:
    """Header, body (a str is a section heading), footnotes: shared by markdown and HTML."""
    header = ["Benchmark (Metric)", "# Shots"] + report["columns"] + ["This run"]
    body: list[list[str] | str] = []
    notes: list[str] = []
    section = None
    for r in report["rows"]:
        if r["section"] != section:
            section = r["section"]
            body.append(section)
        shots = "-" if r["shots"] is None else str(r["shots"])
        refs = [_fmt(r["reference"].get(c), 0 if r["metric"].lower() == "rating" else 1) for c in report["columns"]]
        if r["status"] == "ok":
            ours = _fmt(r["this_run"])
            if r["stderr"] is not None:
                ours += f" ± {r['stderr']:.1f}"
        elif r["status"] == "pending":
            ours = "pending"
        else:
            notes.append(r["reason"])
            ours = f"{'external' if r['status'] == 'external' else 'not run'} [{len(notes)}]"
        body.append([f"{r['benchmark']} ({r['metric']})", shots] + refs + [ours])
    return header, body, notes


def render_markdown(report: dict) -> str:
    header, body, notes = _table(report)
    lines = [f"# {report['title']}", ""]
    if report.get("source"):
        lines += [report["source"], ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + [" ---: "] * (len(header) - 1)) + "|"]
    for row in body:
        if isinstance(row, str):
            lines.append(f"| **{row}** |" + " |" * (len(header) - 1))
        else:
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"{NOT_GIVEN}: not given in the report text this project holds."]
    for k, n in enumerate(notes, 1):
        lines.append(f"[{k}] {n}")
    for n in report.get("notes", []):
        lines.append(f"- {n}")
    cfg = report.get("config")
    if cfg:
        lines += ["", "Run settings: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if v is not None)]
    return "\n".join(lines) + "\n"


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "th,td{padding:4px 10px;border-bottom:1px solid #ddd;text-align:right}th:first-child,td:first-child"
        "{text-align:left}tr.section td{font-weight:bold;background:#f3f3f3;text-align:left}"
        "td.ours{font-weight:bold}.missing{color:#999}")


def render_html(report: dict) -> str:
    header, body, notes = _table(report)
    esc = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>{esc(report['title'])}</title><style>{_CSS}</style>",
             f"<h1>{esc(report['title'])}</h1>"]
    if report.get("source"):
        parts.append(f"<p>{esc(report['source'])}</p>")
    parts.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
    for row in body:
        if isinstance(row, str):
            parts.append(f"<tr class='section'><td colspan='{len(header)}'>{esc(row)}</td></tr>")
            continue
        cells = []
        for k, cell in enumerate(row):
            cls = ["ours"] if k == len(row) - 1 else []
            if cell == NOT_GIVEN or cell.startswith(("not run", "external", "pending")):
                cls.append("missing")
            cells.append(f"<td class='{' '.join(cls)}'>{esc(cell)}</td>")
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</table>")
    parts.append(f"<p class='missing'>{NOT_GIVEN}: not given in the report text this project holds.</p><ol>")
    parts += [f"<li>{esc(n)}</li>" for n in notes]
    parts.append("</ol>")
    if report.get("notes"):
        parts.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in report["notes"]) + "</ul>")
    return "\n".join(parts) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(report: dict, out_dir: str | os.PathLike) -> list[Path]:
    out_dir = Path(out_dir)
    paths = [out_dir / "report.md", out_dir / "report.html", out_dir / "report.json"]
    write_atomic(paths[0], render_markdown(report))
    write_atomic(paths[1], render_html(report))
    write_atomic(paths[2], json.dumps(report, indent=2, default=_jsonable) + "\n")
    return paths


# ============================================================================ plain `dsv41 eval` output
def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def result_rows(results: dict) -> list[dict]:
    """Flat rows (task, filter, n-shot, metric, direction, value, stderr) of lm-eval's results."""
    rows = []
    hib = results.get("higher_is_better", {})
    for section in ("results", "groups"):
        for task, row in (results.get(section) or {}).items():
            if section == "groups" and task in (results.get("results") or {}):
                continue
            for key, value in row.items():
                if "," not in key or "_stderr" in key or isinstance(value, str):
                    continue
                metric, filt = key.split(",", 1)
                se = row.get(f"{metric}_stderr,{filt}")
                up = hib.get(task, {}).get(metric)
                rows.append({"task": task, "filter": filt, "n_shot": results.get("n-shot", {}).get(task, ""),
                             "metric": metric, "arrow": "↑" if up else ("↓" if up is False else ""),
                             "value": float(value), "stderr": float(se) if isinstance(se, (int, float)) else None})
    return rows


def write_eval_outputs(out_dir: str | os.PathLike, results: dict, summary: dict) -> list[Path]:
    """results.json (lm-eval's results without the samples, plus our summary) and one
    samples_<task>.jsonl per task, each written atomically."""
    out_dir = Path(out_dir)
    full = {k: v for k, v in results.items() if k != "samples"}
    full["dsv41"] = summary
    paths = [out_dir / "results.json"]
    write_atomic(paths[0], json.dumps(full, indent=2, default=_jsonable) + "\n")
    for task, samples in (results.get("samples") or {}).items():
        p = out_dir / f"samples_{task}.jsonl"
        write_atomic(p, "".join(json.dumps(s, default=_jsonable) + "\n" for s in samples))
        paths.append(p)
    return paths
