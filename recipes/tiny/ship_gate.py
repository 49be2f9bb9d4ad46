"""Is a trained checkpoint fit to ship as dsv41-tiny? Runs every CPU measurement the bundled model's must-shows
name (issues #5, #11 and #25) and judges each against its bar:

    python -m dsv41.recipes.tiny.ship_gate --model runs/tiny-t47/s47 --out runs/gate47 [--form compared]

Each measurement is the command recipes/tiny/README.md records for the shipped stages, run as a subprocess that
writes one file under --out; a file already there is kept (an interrupted gate resumes where it stopped, and
--judge-only judges what is there). About 20 minutes on two cores. Then a table on stdout, OUT/gate.json, and
exit status 0 when every bar is met, 1 when one is not.

The bars:
- #25: the effort curve on the 300 held-out items non-decreasing (a step down is allowed when it is inside the
  lower point's 95% interval), effort 100 at least 10 points above effort 25, reasoning tokens strictly rising;
  a check that corrects (in its own effort-100 traces, more wrong passes marked and turned right than right ones
  broken); colour and shape at least 90% in both modes on the independently drawn pictures.
- #5: effort 100 at least 20 points above effort 1; held-out bits per byte below xz's on every family; DSpark
  above 1.5 accepted tokens per verification step.
- #11: colour and shape at least 90% in both modes on the v1 held-out pictures.
- Reported without a bar: bits per byte on the unseen corpora (#25 asks the README to say whether they are below
  xz), when `python -m dsv41.recipes.tiny.unseen_corpora` has built them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
UNSEEN = REPO / "runs" / "unseen-corpora"
VISION_BAR = 0.90


class Part(NamedTuple):
    """One measurement: its command and the file it leaves; `prints` = the command prints its JSON, which is
    written to `path`, instead of writing the file itself."""
    cmd: list[str]
    path: Path
    prints: bool = False


def commands(model: Path, out: Path, form: str, token_map: Path | None) -> dict[str, Part]:
    py = [sys.executable, "-m"]
    cli = py + ["dsv41_cli"]
    mapping = ["--token-map", str(token_map)] if token_map else []
    parts = {
        "sweep": Part(cli + ["effort-sweep", "tiny-reasoning", "--model", str(model), "--limit", "300",
                         "--output", str(out / "sweep")], out / "sweep" / "sweep.json"),
        "check_repair": Part(py + ["dsv41.recipes.tiny.check_repair", "--model", str(model), "--limit", "300",
                               "--form", form, "--json", str(out / "check_repair.json")] + mapping,
                         out / "check_repair.json"),
        "vision_independent": Part(py + ["dsv41.recipes.tiny.vision.independent_eval", "--model", str(model),
                                     "--n", "240", "--output", str(out / "vision_independent.json")],
                               out / "vision_independent.json"),
        "vision_v1": Part(py + ["dsv41.recipes.tiny.vision.accuracy", "--model", str(model), "--n", "200",
                                "--questions", "colour,shape", "--json"], out / "vision_v1.json", prints=True),
        "evaluate": Part(py + ["dsv41.recipes.tiny.evaluate", "--model", str(model), "--device", "cpu",
                           "--skip", "reasoning,samples", "--output", str(out / "evaluate.json")] + mapping,
                     out / "evaluate.json"),
    }
    corpora = [UNSEEN / "click-code.jsonl", UNSEEN / "click-docs.jsonl"]
    if all(c.is_file() for c in corpora):
        parts["unseen_bpb"] = Part(cli + ["bpb", *map(str, corpora), "--model", str(model), "--json"],
                                   out / "unseen_bpb.json", prints=True)
    return parts


def run_parts(parts: dict[str, Part]) -> None:
    """Runs the measurements whose file is missing, one after another; a file is written whole or not at all."""
    todo = [name for name, part in parts.items() if not part.path.is_file()]
    t0 = time.time()
    for i, name in enumerate(todo):
        cmd, path, prints = parts[name]
        eta = "" if i == 0 else f", about {(time.time() - t0) / i * (len(todo) - i) / 60:.0f} min left"
        print(f"[gate] {i + 1}/{len(todo)} {name}{eta}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(cmd, check=False, cwd=REPO, stdout=subprocess.PIPE if prints else None, text=True)
        if done.returncode != 0:
            raise SystemExit(f"[gate] {name} failed (exit {done.returncode}); nothing judged")
        if prints:
            tmp = path.with_suffix(".part")
            tmp.write_text(done.stdout)
            tmp.replace(path)
        if not path.is_file():
            raise SystemExit(f"[gate] {name} left no {path}")


def load(parts: dict[str, Part]) -> dict:
    return {name: json.loads(part.path.read_text()) for name, part in parts.items() if part.path.is_file()}


def _row(issue: str, name: str, value: str, bar: str, ok: bool | None) -> dict:
    return {"issue": issue, "measurement": name, "value": value, "bar": bar, "ok": ok}


def judge(results: dict) -> list[dict]:
    """One row per bar (module docstring); ok None = reported without a bar. A measurement that is missing is a
    failed bar, never a passed one."""
    rows = []
    points = sorted(results.get("sweep", {}).get("points", []), key=lambda p: p["effort"])
    if points and {1, 25, 100} <= {p["effort"] for p in points}:
        acc = {p["effort"]: p["accuracy"] for p in points}
        curve = " / ".join(f"{100 * p['accuracy']:.1f}" for p in points)
        downs = [(a, b) for a, b in itertools.pairwise(points) if b["accuracy"] < a["accuracy"]]
        outside = [(a["effort"], b["effort"]) for a, b in downs if a["accuracy"] > b["ci95"][1]]
        rows.append(_row("#25", "effort curve non-decreasing", curve + "%",
                         "a step down inside the lower point's 95% interval",
                         not outside))
        rows.append(_row("#25", "effort 100 above effort 25", f"{100 * (acc[100] - acc[25]):+.1f} points",
                         ">= +10 points", acc[100] - acc[25] >= 0.10))
        rows.append(_row("#5", "effort 100 above effort 1", f"{100 * (acc[100] - acc[1]):+.1f} points",
                         ">= +20 points", acc[100] - acc[1] >= 0.20))
        tokens = [p["mean_reasoning_tokens"] for p in points]
        rows.append(_row("#5 #25", "reasoning tokens rising", " / ".join(f"{t:.1f}" for t in tokens),
                         "strictly rising", all(a < b for a, b in itertools.pairwise(tokens))))
    else:
        rows.append(_row("#25", "effort curve at efforts 1 / 25 / ... / 100", "missing", "measured", False))
    own = results.get("check_repair", {}).get("own")
    if own:
        rows.append(_row("#25", "the check corrects (own traces)",
                         f"{own.get('marked_repaired', 0)} turned right / {own['broken']} broken",
                         "more turned right than broken", own.get("marked_repaired", 0) > own["broken"]))
    else:
        rows.append(_row("#25", "the check corrects", "missing", "measured", False))
    for key, issue, label in (("vision_independent", "#25", "independent pictures"),
                              ("vision_v1", "#11", "v1 held-out pictures")):
        accuracy = results.get(key, {}).get("accuracy", {})
        for mode in ("thinking", "chat"):
            for question in ("colour", "shape"):
                value = accuracy.get(f"{mode}/{question}")
                value = value["accuracy"] if isinstance(value, dict) else value
                rows.append(_row(issue, f"{label}, {question}, {mode}",
                                 "missing" if value is None else f"{100 * value:.1f}%", f">= {100 * VISION_BAR:.0f}%",
                                 value is not None and value >= VISION_BAR))
    evaluation = results.get("evaluate", {})
    families = evaluation.get("bpb", {})
    for family, v in families.items():
        rows.append(_row("#5", f"held-out bpb, {family}", f"{v['bpb']:.3f}",
                         f"< xz {v['baselines']['xz']:.3f}", v["bpb"] < v["baselines"]["xz"]))
    if not families:
        rows.append(_row("#5", "held-out bpb", "missing", "measured", False))
    dspark = evaluation.get("dspark", {}).get("mean_accepted_tokens_per_step")
    rows.append(_row("#5", "DSpark tokens per verification step", "missing" if dspark is None else f"{dspark:.3f}",
                     "> 1.5", dspark is not None and dspark > 1.5))
    unseen = results.get("unseen_bpb")
    if unseen:
        xz = unseen.get("baselines", {}).get("xz", {})
        for corpus in unseen["models"][0]["corpora"]:
            rows.append(_row("#25", f"unseen bpb, {corpus['name']}", f"{corpus['bpb']:.3f}",
                             f"(xz {xz[corpus['name']]:.3f}; reported)" if corpus["name"] in xz else "(reported)",
                             None))
    return rows


def table(rows: list[dict]) -> str:
    mark = {True: "pass", False: "FAIL", None: "-"}
    lines = ["| issue | measurement | value | bar | |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['issue']} | {r['measurement']} | {r['value']} | {r['bar']} | {mark[r['ok']]} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dsv41.recipes.tiny import check_repair

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--form", choices=check_repair.FORMS, default="compared",
                    help="the effort-100 check's form for check_repair")
    ap.add_argument("--token-map", type=Path, default=None,
                    help="a prebuilt Engram token map (build_data's engram_token_map.i32.xz): faster loading")
    ap.add_argument("--judge-only", action="store_true", help="judge the files already in --out, run nothing")
    a = ap.parse_args(argv)
    if not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there")
    parts = commands(a.model.resolve(), a.out.resolve(), a.form, a.token_map)
    if not a.judge_only:
        run_parts(parts)
    rows = judge(load(parts))
    a.out.mkdir(parents=True, exist_ok=True)
    verdict = all(r["ok"] is not False for r in rows)
    (a.out / "gate.json").write_text(json.dumps({"model": str(a.model), "ship": verdict, "rows": rows}, indent=2)
                                     + "\n")
    print(table(rows))
    print(f"\n{'every bar met: fit to ship' if verdict else 'not fit to ship'} ({a.out / 'gate.json'})")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
