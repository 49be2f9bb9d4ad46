"""The one agent loop every scaffold runs through (after mini-swe-agent's ``DefaultAgent``).

An agent episode::

    workspace <- task environment; environment/setup.sh runs in the jail
    messages  <- [system: scaffold system prompt, user: task instruction]
    repeat until submitted, out of steps or out of time:
        text, tokens <- backend.chat(messages, tools if native else None, effort)     # one step
        action <- read_action(scaffold format, text)
            unreadable -> format error: the scaffold's message goes back to the model, next step
        each call: run its command in the jail; the first output line == submit sentinel ends the episode;
                   otherwise the observation goes back (tool messages or one user message)
    verifier: tests/test.sh in the jail (tests at /tests, read-only); exit 0 = pass

The verifier runs however the episode ended (as in Harbor): a model that did the work but never
submitted still passes. A single-turn function-calling item is one step: the calls read from the reply
are matched against the ground truth.

Accounting per episode: steps (model calls), format errors (steps whose reply could not be read),
output tokens per step, commands run, how it ended.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from dsv41.evals.scaffolds.actions import Action, FormatError, read_action
from dsv41.evals.scaffolds.backends import BackendError, mode_of
from dsv41.evals.scaffolds.sandbox import TESTS, Sandbox
from dsv41.evals.scaffolds.scaffold import Scaffold
from dsv41.evals.scaffolds.tasks import AgentTask, FunctionCallingItem, check_calls
from dsv41.model.completion import parse_completion

DEFAULT_MAX_STEPS = 30
_TAIL = 2000  # characters of verifier output kept in the result


@dataclass
class StepRecord:
    output_tokens: int | None
    format_error: str | None = None
    commands: list = field(default_factory=list)  # {"command", "returncode", "killed", "seconds"}


@dataclass
class EpisodeResult:
    task: str
    kind: str  # agent | function_calling
    category: str
    scaffold: str
    effort: int | None
    passed: bool
    end_reason: str  # submitted | step_limit | time_limit | workspace_limit | backend_error | setup_error | answered
    steps: int = 0
    format_errors: int = 0
    output_tokens: int | None = 0
    step_records: list = field(default_factory=list)
    verifier: dict | None = None  # {"returncode", "killed", "output_tail"}
    detail: str = ""  # why it failed, in a line
    seconds: float = 0.0
    messages: list | None = None

    def to_json(self, with_messages: bool = False) -> dict:
        doc = asdict(self)
        if not with_messages:
            doc.pop("messages")
        return doc


def _add_tokens(total: int | None, step: int | None) -> int | None:
    return None if total is None or step is None else total + step


def _assistant_message(action_or_text, native: bool) -> dict:
    if isinstance(action_or_text, Action):
        action = action_or_text
        message = {"role": "assistant", "content": action.content, "reasoning_content": action.reasoning}
        if native and action.native_calls:
            message["tool_calls"] = action.native_calls
        return message
    return {"role": "assistant", "content": action_or_text, "reasoning_content": ""}


def _unreadable_reply_message(text: str, mode: str) -> dict:
    """The history entry of a reply whose action could not be read: its text without any tool-call markup."""
    parsed = parse_completion(text, mode)
    return {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning}


def _is_submission(output: str, sentinel: str) -> bool:
    lines = output.lstrip().splitlines()
    return bool(lines) and lines[0].strip() == sentinel


def _validate_bash_calls(action: Action, scaffold: Scaffold) -> None:
    if not action.calls:
        problems = f" ({'; '.join(action.notes)})" if action.notes else ""
        raise FormatError(f"no command was found in the reply{problems}")
    if scaffold.one_action_per_turn and len(action.calls) > 1:
        raise FormatError(f"the reply holds {len(action.calls)} commands; give exactly one per reply")
    for call in action.calls:
        if call.name != "bash":
            raise FormatError(f"there is no tool {call.name!r}; the only tool is bash")
        command = call.arguments.get("command")
        if set(call.arguments) - {"command"} or not isinstance(command, str):
            raise FormatError("bash takes exactly one argument, command, a string")
        if not command.strip():
            raise FormatError("the command is empty")


def run_agent_episode(task: AgentTask, scaffold: Scaffold, backend, sandbox: Sandbox, effort: int | None,
                      max_steps: int | None = None, *, keep_messages: bool = False) -> EpisodeResult:
    """Run one task under one scaffold; never raises for what the model or its commands do (raises
    SandboxUnavailable if the jail breaks, BackendFatal if the backend can never answer)."""
    started = time.monotonic()
    max_steps = max_steps or task.max_steps or DEFAULT_MAX_STEPS
    mode = mode_of(effort)
    result = EpisodeResult(task.id, "agent", task.category, scaffold.name, effort, False, "step_limit")
    tools = scaffold.tools
    with sandbox.episode() as episode:
        if task.environment is not None:
            episode.copy_in(task.environment)
            (episode.workspace / "setup.sh").unlink(missing_ok=True)
        if task.setup is not None:
            setup = episode.run(task.setup.read_text(encoding="utf-8"), timeout=task.verifier_timeout)
            if not setup.ok:
                result.end_reason, result.detail = "setup_error", f"setup.sh failed: {setup.output[-300:]}"
                result.seconds = time.monotonic() - started
                return result
        messages = [{"role": "system", "content": scaffold.system_prompt()},
                    {"role": "user", "content": scaffold.instance_prompt(task.instruction)}]
        if hasattr(backend, "begin"):
            backend.begin(task, scaffold)
        submitted = False
        while result.steps < max_steps:
            if time.monotonic() - started > task.agent_timeout:
                result.end_reason = "time_limit"
                break
            try:
                text, tokens = backend.chat(messages, tools if scaffold.native_tools else None, effort)
            except BackendError as e:
                result.end_reason, result.detail = "backend_error", str(e)
                break
            result.steps += 1
            record = StepRecord(tokens)
            result.step_records.append(record)
            result.output_tokens = _add_tokens(result.output_tokens, tokens)
            try:
                action = read_action(scaffold.action_format, text, mode, tools, options=scaffold.action_options)
                _validate_bash_calls(action, scaffold)
            except FormatError as e:
                record.format_error = str(e)
                result.format_errors += 1
                messages.append(_unreadable_reply_message(text, mode))
                messages.append({"role": "user", "content": scaffold.format_error(str(e))})
                continue
            messages.append(_assistant_message(action, scaffold.native_tools))
            observations = []
            for call in action.calls:
                run = episode.run(call.arguments["command"])
                record.commands.append({"command": call.arguments["command"], "returncode": run.returncode,
                                        "killed": run.killed, "seconds": round(run.wall_seconds, 3)})
                if run.killed == "workspace limit":
                    result.end_reason = "workspace_limit"
                    result.detail = "a command passed the workspace's size or file-count limit"
                    break
                if run.returncode == 0 and _is_submission(run.output, scaffold.submit_sentinel):
                    submitted = True
                    break
                observation = scaffold.observation(run.returncode, run.output, run.note())
                if scaffold.observation_role == "tool":
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
                else:
                    observations.append(observation)
            if observations:
                messages.append({"role": "user", "content": "\n".join(observations)})
            if submitted or result.end_reason == "workspace_limit":
                break
        if submitted:
            result.end_reason = "submitted"
        if result.end_reason != "workspace_limit":
            tests = episode.stage_tests(task.tests)
            verdict = episode.run(f"bash {TESTS}/test.sh", tests_dir=tests, timeout=task.verifier_timeout)
            result.verifier = {"returncode": verdict.returncode, "killed": verdict.killed,
                               "output_tail": verdict.output[-_TAIL:]}
            result.passed = verdict.ok
            if not result.passed and not result.detail:
                result.detail = f"tests failed (exit {verdict.returncode}{', ' + verdict.killed if verdict.killed else ''})"
    if keep_messages:
        result.messages = messages
    result.seconds = time.monotonic() - started
    return result


def run_function_calling_item(item: FunctionCallingItem, scaffold: Scaffold, backend, effort: int | None,
                              *, keep_messages: bool = False) -> EpisodeResult:
    """One single-turn function-calling item: one reply, its calls matched against the ground truth."""
    started = time.monotonic()
    mode = mode_of(effort)
    result = EpisodeResult(item.id, "function_calling", item.category, scaffold.name, effort, False, "answered")
    messages = [{"role": "system", "content": scaffold.function_calling_prompt(item.tools)},
                {"role": "user", "content": item.question}]
    if hasattr(backend, "begin"):
        backend.begin(item, scaffold)
    try:
        text, tokens = backend.chat(messages, item.tools if scaffold.native_tools else None, effort)
    except BackendError as e:
        result.end_reason, result.detail = "backend_error", str(e)
        result.seconds = time.monotonic() - started
        return result
    result.steps = 1
    record = StepRecord(tokens)
    result.step_records.append(record)
    result.output_tokens = tokens
    try:
        action = read_action(scaffold.action_format, text, mode, item.tools, options=scaffold.action_options)
    except FormatError as e:
        record.format_error = str(e)
        result.format_errors = 1
        result.detail = f"format error: {e}"
    else:
        result.passed, result.detail = check_calls([(c.name, c.arguments) for c in action.calls], item)
        messages.append(_assistant_message(action, scaffold.native_tools))
    if keep_messages:
        result.messages = messages + ([_unreadable_reply_message(text, mode)] if result.format_errors else [])
    result.seconds = time.monotonic() - started
    return result


__all__ = ["DEFAULT_MAX_STEPS", "EpisodeResult", "StepRecord", "run_agent_episode", "run_function_calling_item"]
