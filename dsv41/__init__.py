"""dsv41: run, convert and evaluate DeepSeek-V4.1-Flash.

The one import root of the installed package. Its subpackages are the repository's top-level folders,
installed under this name so that no generic top-level name (`model`, `evals`, `recipes`, `serve`) is taken:

    dsv41.model     model/    the architecture, KV cache, engine, checkpoint I/O, kernels
    dsv41.evals     evals/    lm-eval adapter, bits per byte, effort sweeps, agent scaffolds, reports
    dsv41.recipes   recipes/  benchmark suites, scaffold definitions, the bundled model's training recipe
    dsv41.serve     serve/    `dsv41 serve`: the OpenAI-compatible endpoint on the engine (extra .[serve])

The command line is `dsv41_cli` (`dsv41 ...`, `python -m dsv41_cli ...`). setup.py maps the folders for
an install (docs/architecture.md, "Install"). In a source checkout that is not installed (a GPU machine
running the benchmarks from a copy of the tree), the folders beside this one are found through __path__.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "model" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 - the package's own __path__
