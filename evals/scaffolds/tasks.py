"""Bench tasks: agent tasks in a Harbor-like directory layout, and single-turn function-calling items
checked by matching the calls (BFCL-style).

Agent task layout (one directory per task; Harbor's layout without Docker)::

    <task>/instruction.md        what the agent is asked to do
    <task>/task.toml             [metadata] category, difficulty, tags; [agent] timeout_sec, max_steps;
                                 [verifier] timeout_sec                               (all optional)
    <task>/environment/          files copied into the episode's workspace; an optional
                                 environment/setup.sh runs first, in the jail, in the workspace
    <task>/solution/solve.sh     the reference solution (what the oracle replays). Lines starting with
                                 "# step" split it into steps, each replayed as one action
    <task>/tests/test.sh         the verifier: runs in the jail after the agent stops, with the tests at
                                 /tests (read-only, never visible to the agent) and the working directory
                                 /workspace; exit status 0 means pass

Function-calling items: JSON lines in ``*.jsonl`` files (in the tasks directory itself or its
``function-calling/`` subdirectory), one item per line::

    {"id": "...", "category": "simple|multiple|parallel|parallel_multiple|irrelevance",
     "question": "...", "functions": [<OpenAI function: name, description, parameters>],
     "ground_truth": [{"function_name": {"param": [acceptable values...]}}, ...]}

As in BFCL's possible-answer files, each parameter lists its acceptable values; ``""`` in the list means
the parameter may be left out. ``ground_truth: []`` means no function should be called (irrelevance).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_MARKER = re.compile(r"^\s*#\s*step\b", re.IGNORECASE)
CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")


class TaskError(ValueError):
    """A task directory or item file that does not follow the layout."""


def bundled_tasks_dir() -> Path:
    from dsv41 import recipes
    return Path(recipes.__file__).resolve().parent / "bench-tasks"


@dataclass
class AgentTask:
    id: str
    path: Path
    instruction: str
    tests: Path
    environment: Path | None = None
    solution: Path | None = None
    category: str = ""
    difficulty: str = ""
    tags: list = field(default_factory=list)
    agent_timeout: float = 600.0
    verifier_timeout: float = 60.0
    max_steps: int | None = None

    kind = "agent"

    @property
    def setup(self) -> Path | None:
        if self.environment is None:
            return None
        script = self.environment / "setup.sh"
        return script if script.is_file() else None

    def solution_steps(self) -> list[str]:
        """The reference solution as a list of commands: one per "# step" section (the whole script
        when it has none). The shebang, blank lines and the markers themselves are left out."""
        if self.solution is None:
            raise TaskError(f"task {self.id} has no solution/solve.sh")
        steps: list[list[str]] = [[]]
        for line in self.solution.read_text(encoding="utf-8").splitlines():
            if line.startswith("#!"):
                continue
            if STEP_MARKER.match(line):
                steps.append([])
                continue
            steps[-1].append(line)
        commands = ["\n".join(lines).strip("\n") for lines in steps]
        return [c for c in commands if c.strip()]


@dataclass
class FunctionCallingItem:
    id: str
    category: str
    question: str
    functions: list
    ground_truth: list
    source: str = ""

    kind = "function_calling"

    @property
    def tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]


def _load_agent_task(path: Path) -> AgentTask:
    instruction = path / "instruction.md"
    tests = path / "tests"
    if not instruction.is_file():
        raise TaskError(f"task {path}: no instruction.md")
    if not (tests / "test.sh").is_file():
        raise TaskError(f"task {path}: no tests/test.sh")
    meta: dict = {}
    toml_path = path / "task.toml"
    if toml_path.is_file():
        try:
            meta = tomllib.loads(toml_path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise TaskError(f"task {path}: task.toml: {e}") from None
    metadata, agent, verifier = meta.get("metadata", {}), meta.get("agent", {}), meta.get("verifier", {})
    environment = path / "environment"
    solution = path / "solution" / "solve.sh"
    try:
        return AgentTask(
            id=path.name,
            path=path,
            instruction=instruction.read_text(encoding="utf-8"),
            tests=tests,
            environment=environment if environment.is_dir() else None,
            solution=solution if solution.is_file() else None,
            category=str(metadata.get("category", "")),
            difficulty=str(metadata.get("difficulty", "")),
            tags=list(metadata.get("tags", [])),
            agent_timeout=float(agent.get("timeout_sec", 600.0)),
            verifier_timeout=float(verifier.get("timeout_sec", 60.0)),
            max_steps=int(agent["max_steps"]) if "max_steps" in agent else None,
        )
    except (TypeError, ValueError) as e:
        raise TaskError(f"task {path}: task.toml has a bad value: {e}") from None


def _load_items(path: Path) -> list[FunctionCallingItem]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise TaskError(f"{where}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise TaskError(f"{where}: expected a JSON object")
        for key in ("id", "question", "functions", "ground_truth"):
            if key not in row:
                raise TaskError(f"{where}: missing {key!r}")
        functions, truth = row["functions"], row["ground_truth"]
        if not isinstance(functions, list) or not all(isinstance(f, dict) and "name" in f for f in functions):
            raise TaskError(f"{where}: functions must be a list of function schemas with a name")
        if not isinstance(truth, list) or not all(isinstance(c, dict) and len(c) == 1 for c in truth):
            raise TaskError(f"{where}: ground_truth must be a list of {{name: {{param: [values]}}}}")
        for call in truth:
            (name, params), = call.items()
            if not isinstance(params, dict) or not all(isinstance(v, list) and v for v in params.values()):
                raise TaskError(f"{where}: ground truth of {name!r} must map each parameter to a list of values")
        category = row.get("category", "simple" if truth else "irrelevance")
        items.append(FunctionCallingItem(str(row["id"]), category, str(row["question"]), functions, truth, where))
    return items


def load_tasks(directory: str | Path | None = None) -> tuple[list[AgentTask], list[FunctionCallingItem]]:
    """Agent tasks and function-calling items under ``directory`` (default: the bundled set).
    A directory that is itself a task gives that one task. Raises TaskError on a bad layout."""
    root = Path(directory) if directory is not None else bundled_tasks_dir()
    if not root.is_dir():
        raise TaskError(f"tasks directory {root} does not exist")
    if (root / "instruction.md").is_file():
        return [_load_agent_task(root)], []
    tasks = [_load_agent_task(p) for p in sorted(root.iterdir()) if p.is_dir() and (p / "instruction.md").is_file()]
    item_files = sorted(root.glob("*.jsonl")) + sorted((root / "function-calling").glob("*.jsonl"))
    items = [item for f in item_files for item in _load_items(f)]
    seen: set[str] = set()
    for entry in [*tasks, *items]:
        if entry.id in seen:
            raise TaskError(f"two tasks or items are called {entry.id!r}")
        seen.add(entry.id)
    if not tasks and not items:
        raise TaskError(f"{root} holds no task directories (with instruction.md) and no *.jsonl items")
    return tasks, items


# ---------------------------------------------------------------------------------------------
# Checking function calls (BFCL-style AST matching)
# ---------------------------------------------------------------------------------------------

_STRING_NOISE = re.compile(r"[\s,./\-_*^]")


def _normalize_string(text: str) -> str:
    """BFCL's string comparison: case-insensitive, ignoring spaces and , . / - _ * ^."""
    return _STRING_NOISE.sub("", text).casefold()


def values_match(given: Any, expected: Any) -> bool:
    """One argument against one acceptable value: strings normalized, int accepted for float, lists in
    order, objects key by key."""
    if isinstance(expected, bool) or isinstance(given, bool):
        return type(given) is type(expected) and given == expected
    if isinstance(expected, (int, float)):
        return isinstance(given, (int, float)) and float(given) == float(expected) and (
            isinstance(expected, float) or isinstance(given, int) or float(given).is_integer())
    if isinstance(expected, str):
        return isinstance(given, str) and _normalize_string(given) == _normalize_string(expected)
    if isinstance(expected, list):
        return isinstance(given, list) and len(given) == len(expected) and all(
            values_match(g, e) for g, e in zip(given, expected))
    if isinstance(expected, dict):
        return isinstance(given, dict) and set(given) == set(expected) and all(
            values_match(given[k], v) for k, v in expected.items())
    return given == expected


def _call_matches(call_name: str, arguments: dict, expected_name: str, expected: dict,
                  schema: dict | None) -> str | None:
    """None when the call matches, else why not."""
    if call_name != expected_name:
        return f"called {call_name!r}, expected {expected_name!r}"
    allowed = set(((schema or {}).get("parameters") or {}).get("properties") or {}) | set(expected)
    unexpected = set(arguments) - allowed
    if unexpected:
        return f"{call_name}: unexpected arguments {sorted(unexpected)}"
    for parameter, acceptable in expected.items():
        if parameter not in arguments:
            if "" not in acceptable:
                return f"{call_name}: missing argument {parameter!r}"
            continue
        if not any(values_match(arguments[parameter], value) for value in acceptable if value != ""):
            return f"{call_name}: {parameter}={arguments[parameter]!r} is not one of {acceptable!r}"
    for parameter in arguments:
        if parameter not in expected:  # a schema parameter the ground truth does not mention
            return f"{call_name}: argument {parameter!r} was not asked for"
    return None


def check_calls(calls: list[tuple[str, dict]], item: FunctionCallingItem) -> tuple[bool, str]:
    """Whether ``calls`` ((name, arguments) pairs) answer the item: the same number of calls as the
    ground truth, each matching a different expected call (any order)."""
    expected = [next(iter(c.items())) for c in item.ground_truth]
    if not expected:
        return (not calls), ("no call, as expected" if not calls else f"expected no call, got {len(calls)}")
    if len(calls) != len(expected):
        return False, f"expected {len(expected)} call(s), got {len(calls)}"
    schemas = {f["name"]: f for f in item.functions}

    # Try every assignment of given calls to expected calls (a handful of calls at most).
    def assign(index: int, used: frozenset) -> str | None:
        if index == len(calls):
            return None
        name, arguments = calls[index]
        first_reason = None
        for slot, (expected_name, params) in enumerate(expected):
            if slot in used:
                continue
            reason = _call_matches(name, arguments, expected_name, params, schemas.get(name))
            if reason is None:
                deeper = assign(index + 1, used | {slot})
                if deeper is None:
                    return None
                reason = deeper
            first_reason = first_reason or reason
        return first_reason or f"call {name!r} matches no expected call"

    reason = assign(0, frozenset())
    return (reason is None), (reason or "all calls match")
