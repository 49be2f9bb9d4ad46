"""recipes/tiny/ship_gate.py: the bars of the bundled model's must-shows, judged on the committed records of the
shipped stage 36 and of stage 46 (not shipped). Nothing is run: the gate's commands are the recorded ones."""

import json
import shutil
from pathlib import Path

import pytest
from dsv41.recipes.tiny import ship_gate as G

LOGS = Path(__file__).resolve().parents[1] / "recipes" / "tiny" / "logs"  # committed records
S36 = LOGS / "trials-2026-12-03"
S46 = LOGS / "trials-2026-12-04"


def _results(sweep: Path, repair: Path) -> dict:
    return {"sweep": json.loads(sweep.read_text()), "check_repair": json.loads(repair.read_text()),
            "vision_independent": json.loads((S36 / "vision_independent_s36_n240.json").read_text()),
            "vision_v1": json.loads((S36 / "vision_accuracy_s36_n200.json").read_text()),
            "evaluate": json.loads((S36 / "eval_s36_cpu.json").read_text()),
            "unseen_bpb": json.loads((S36 / "unseen_bpb_s36.json").read_text())}


def _by_name(rows):
    return {r["measurement"]: r for r in rows}


def test_the_shipped_stage_meets_every_bar_but_a_check_that_corrects():
    rows = _by_name(G.judge(_results(S36 / "stage36_effort_sweep.json", S36 / "check_repair_s36.json")))
    failed = sorted(name for name, r in rows.items() if r["ok"] is False)
    assert failed == ["the check corrects (own traces)"]  # #25's open item: 0 turned right, 2 broken
    assert rows["effort curve non-decreasing"]["ok"]  # two steps down, each inside the lower point's interval
    assert rows["held-out bpb, literature"]["value"] == "1.881"
    assert rows["unseen bpb, click-code"]["ok"] is None  # reported, no bar
    assert len([r for r in rows.values() if r["issue"] in ("#25", "#11") and "pictures" in r["measurement"]]) == 8


def test_stage_46_fails_on_its_curve_and_passes_on_its_check():
    rows = _by_name(G.judge(_results(S46 / "stage46_effort_sweep.json", S46 / "check_repair_s46.json")))
    assert rows["effort curve non-decreasing"]["ok"] is False  # 93.7 -> 71.0% at effort 100
    assert rows["effort 100 above effort 25"]["ok"]
    assert rows["the check corrects (own traces)"] == {
        "issue": "#25", "measurement": "the check corrects (own traces)", "value": "34 turned right / 2 broken",
        "bar": "more turned right than broken", "ok": True}


def test_a_missing_measurement_fails_its_bar():
    rows = G.judge({})
    assert rows and all(r["ok"] is False for r in rows)


def test_judge_only_writes_the_verdict_and_exits_1_when_a_bar_fails(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "gate"
    parts = G.commands(model.resolve(), out.resolve(), "compared", None)
    sources = {"sweep": S36 / "stage36_effort_sweep.json", "check_repair": S36 / "check_repair_s36.json",
               "vision_independent": S36 / "vision_independent_s36_n240.json",
               "vision_v1": S36 / "vision_accuracy_s36_n200.json", "evaluate": S36 / "eval_s36_cpu.json",
               "unseen_bpb": S36 / "unseen_bpb_s36.json"}
    for name, part in parts.items():
        part.path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sources[name], part.path)
    assert G.main(["--model", str(model), "--out", str(out), "--judge-only"]) == 1
    verdict = json.loads((out / "gate.json").read_text())
    assert verdict["ship"] is False and len(verdict["rows"]) >= 15


@pytest.mark.parametrize("argv", [["--form", "sideways"], ["--model", "/nonexistent"]])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv):
    base = {"--model": str(tmp_path), "--out": str(tmp_path / "gate")}
    (tmp_path / "config.json").write_text("{}")
    args = dict(base, **dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as exit_info:
        G.main([x for kv in args.items() for x in kv] + ["--judge-only"])
    assert exit_info.value.code == 2
