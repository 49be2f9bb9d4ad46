"""Scaffolds as data: one YAML (or JSON) file per scaffold in ``recipes/scaffolds/``.

A scaffold is everything about the harness that is not the model or the task (spec/toolkit-anchors.md
§5, after mini-swe-agent's benchmark configs): the system prompt, how the task is put to the model,
the tool schema, how actions are written and read back, how command output is returned, and what the
model is told when its reply cannot be read. The agent loop (:mod:`dsv41.evals.scaffolds.loop`) is the same
for all of them.

Keys of a scaffold file::

    name, family, description
    action_format          dsml | json | xml | backticks   (see evals/scaffolds/actions.py)
    action_options         format options, e.g. {fence_tag: bash, call_fence_tag: python}
    native_tools           true: the tools go to the backend as native tools (the chat encoding renders
                           them, the model answers in DSML); false: they are described in the prompt
    one_action_per_turn    true: a reply with several actions is a format error (mini-swe-agent)
    system_template        {{ tools_json }} {{ submit_sentinel }} {{ workspace }}
    instance_template      {{ instruction }}
    function_calling_template   system prompt of single-turn function-calling items: {{ functions_json }}
    observation_role       tool | user
    observation_template   {{ returncode }} {{ output }} {{ output_json }} {{ note }}
    format_error_template  {{ error }}
    submit_sentinel        the first output line that ends an episode (default COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT)
    max_observation_chars  longer output is cut in the middle
    tools                  the OpenAI tool list (the bash tool)

Templates use ``{{ name }}`` placeholders and nothing else, so JSON braces in prompts need no escaping.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dsv41.evals.scaffolds.actions import FORMATS

DEFAULT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
BUILTIN_ORDER = ("dsml", "openai-tools", "xml", "backticks")

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_TEMPLATE_VARIABLES = {
    "system_template": {"tools_json", "submit_sentinel", "workspace"},
    "instance_template": {"instruction"},
    "function_calling_template": {"functions_json"},
    "observation_template": {"returncode", "output", "output_json", "note"},
    "format_error_template": {"error", "submit_sentinel"},
}


def render_template(template: str, **values) -> str:
    """Replace each ``{{ name }}`` with ``values[name]`` (KeyError for a missing value)."""
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def scaffolds_dir() -> Path:
    from dsv41 import recipes
    return Path(recipes.__file__).resolve().parent / "scaffolds"


@dataclass(frozen=True)
class Scaffold:
    name: str
    family: str
    description: str
    action_format: str
    native_tools: bool
    one_action_per_turn: bool
    system_template: str
    instance_template: str
    function_calling_template: str
    observation_role: str
    observation_template: str
    format_error_template: str
    tools: list
    submit_sentinel: str = DEFAULT_SENTINEL
    max_observation_chars: int = 10_000
    action_options: dict = field(default_factory=dict)
    path: str | None = None

    # -------------------------------------------------------------- prompts
    def system_prompt(self) -> str:
        tools_json = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
        return render_template(self.system_template, tools_json=tools_json, submit_sentinel=self.submit_sentinel,
                               workspace="/workspace")

    def instance_prompt(self, instruction: str) -> str:
        return render_template(self.instance_template, instruction=instruction.strip())

    def function_calling_prompt(self, tools: list[dict]) -> str:
        functions_json = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        return render_template(self.function_calling_template, functions_json=functions_json)

    def observation(self, returncode, output: str, note: str | None) -> str:
        output = truncate_middle(output, self.max_observation_chars)
        return render_template(self.observation_template, returncode="null" if returncode is None else returncode,
                               output=output, output_json=json.dumps(output, ensure_ascii=False),
                               note=f"<note>{note}</note>\n" if note else "")

    def format_error(self, error: str) -> str:
        return render_template(self.format_error_template, error=error, submit_sentinel=self.submit_sentinel)

    def summary(self) -> dict:
        return {"name": self.name, "family": self.family, "action_format": self.action_format,
                "native_tools": self.native_tools, "path": self.path}


def truncate_middle(text: str, limit: int) -> str:
    """At most ``limit`` characters: the head and the tail, with a line saying how much was left out."""
    if len(text) <= limit:
        return text
    half = limit // 2
    elided = len(text) - 2 * half
    return f"{text[:half]}\n[... {elided:,} characters elided ...]\n{text[-half:]}"


_REQUIRED = ("name", "action_format", "system_template", "instance_template", "function_calling_template",
             "observation_template", "format_error_template", "tools")


def load_scaffold(name_or_path: str | Path) -> Scaffold:
    """A built-in scaffold by name (``dsml``, ``openai-tools``, ``xml``, ``backticks``) or a scaffold file.
    Raises ValueError on an unknown name or an invalid file."""
    path = Path(name_or_path)
    if not path.suffix:
        candidates = [scaffolds_dir() / f"{name_or_path}{ext}" for ext in (".yaml", ".yml", ".json")]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise ValueError(f"unknown scaffold {str(name_or_path)!r} (built in: {', '.join(builtin_scaffold_names())})")
        path = found[0]
    if not path.is_file():
        raise ValueError(f"scaffold file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ValueError(f"scaffold file {path}: cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"scaffold file {path}: expected a mapping at the top level")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"scaffold file {path}: missing keys {', '.join(missing)}")
    if data["action_format"] not in FORMATS:
        raise ValueError(f"scaffold file {path}: action_format must be one of {', '.join(FORMATS)}")
    role = data.get("observation_role", "user")
    if role not in ("tool", "user"):
        raise ValueError(f"scaffold file {path}: observation_role must be tool or user")
    native = bool(data.get("native_tools", False))
    if role == "tool" and not native:
        raise ValueError(f"scaffold file {path}: observation_role tool needs native_tools")
    for key, allowed in _TEMPLATE_VARIABLES.items():
        used = set(_PLACEHOLDER.findall(str(data[key])))
        if used - allowed:
            raise ValueError(f"scaffold file {path}: {key} uses unknown placeholders {sorted(used - allowed)}")
    tools = data["tools"]
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools):
        raise ValueError(f"scaffold file {path}: tools must be an OpenAI tool list")
    if "bash" not in [t["function"].get("name") for t in tools]:
        raise ValueError(f"scaffold file {path}: the tool list needs the bash tool")
    return Scaffold(
        name=str(data["name"]),
        family=str(data.get("family", data["name"])),
        description=" ".join(str(data.get("description", "")).split()),
        action_format=data["action_format"],
        native_tools=native,
        one_action_per_turn=bool(data.get("one_action_per_turn", False)),
        system_template=str(data["system_template"]),
        instance_template=str(data["instance_template"]),
        function_calling_template=str(data["function_calling_template"]),
        observation_role=role,
        observation_template=str(data["observation_template"]),
        format_error_template=str(data["format_error_template"]),
        tools=tools,
        submit_sentinel=str(data.get("submit_sentinel", DEFAULT_SENTINEL)),
        max_observation_chars=int(data.get("max_observation_chars", 10_000)),
        action_options=dict(data.get("action_options") or {}),
        path=str(path),
    )


def builtin_scaffold_names() -> list[str]:
    names = sorted(p.stem for p in scaffolds_dir().glob("*") if p.suffix in (".yaml", ".yml", ".json"))
    return sorted(names, key=lambda n: (BUILTIN_ORDER.index(n) if n in BUILTIN_ORDER else len(BUILTIN_ORDER), n))
