"""scaffold-bench: the same model and tasks under several agent scaffolds, every command in a jail.

Modules: ``sandbox`` (the bubblewrap jail), ``actions`` (action formats: read and write),
``scaffold`` (scaffold files in recipes/scaffolds/), ``tasks`` (Harbor-like task directories and
BFCL-style function-calling items), ``backends`` (oracle, OpenAI-compatible endpoint, local engine),
``loop`` (the one agent loop), ``bench`` (running the matrix and reporting). See docs/scaffold-bench.md.
"""

from dsv41.evals.scaffolds.actions import Action, FormatError, ToolCall, read_action, write_action
from dsv41.evals.scaffolds.backends import (Backend, BackendError, BackendFatal, EndpointBackend, OracleBackend,
                                      local_backend_available)
from dsv41.evals.scaffolds.bench import markdown_table, plot_report, run_bench, write_report
from dsv41.evals.scaffolds.loop import EpisodeResult, run_agent_episode, run_function_calling_item
from dsv41.evals.scaffolds.sandbox import CommandResult, Sandbox, SandboxLimits, SandboxUnavailable
from dsv41.evals.scaffolds.scaffold import Scaffold, builtin_scaffold_names, load_scaffold
from dsv41.evals.scaffolds.tasks import AgentTask, FunctionCallingItem, TaskError, bundled_tasks_dir, check_calls, load_tasks

__all__ = [
    "Action", "AgentTask", "Backend", "BackendError", "BackendFatal", "CommandResult", "EndpointBackend",
    "EpisodeResult", "FormatError", "FunctionCallingItem", "OracleBackend", "Sandbox", "SandboxLimits",
    "SandboxUnavailable", "Scaffold", "TaskError", "ToolCall", "builtin_scaffold_names", "bundled_tasks_dir",
    "check_calls", "load_scaffold", "load_tasks", "local_backend_available", "markdown_table", "plot_report",
    "read_action", "run_agent_episode", "run_bench", "run_function_calling_item", "write_action", "write_report",
]
