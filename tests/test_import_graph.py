"""The import graph of the installed package (issue #20, "kernels are a leaf").

Every import statement of every module is read with `ast`, at module level and inside functions alike
(a lazy import that hides a cycle is still a cycle), relative imports resolved, and checked:

    no cycle among the modules of dsv41.model, none among those of dsv41.evals;
    dsv41.model.kernels.* imports nothing of dsv41 but its own modules, dsv41.model.formats and
    dsv41.model.config: the model calls the kernels, never the reverse.

Nothing is imported to build the graph: the files are found through the installed package's locations
(importlib.util.find_spec), so the test reads what an install ships. `test_checks_catch_planted_imports`
plants a cycle and a kernel import in a copy of model/ and checks both are reported.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
from pathlib import Path

import pytest

PACKAGES = ("dsv41.model", "dsv41.evals", "dsv41.recipes", "dsv41.serve")
KERNELS = "dsv41.model.kernels"
KERNEL_MAY_IMPORT = ("dsv41.model.formats", "dsv41.model.config")


def package_modules(package: str, directory: Path) -> dict[str, tuple[Path, bool]]:
    """{module name: (file, is a package)} for every .py file under `directory`, the folder of `package`."""
    found = {}
    for path in sorted(directory.rglob("*.py")):
        rel = path.relative_to(directory).with_suffix("")
        parts = list(rel.parts)
        if any(not p.isidentifier() for p in parts):
            continue  # a data folder's script (task directories), not an importable module
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        if any(not (directory.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts) + is_pkg)):
            continue  # below a folder that is not a package
        found[".".join([package, *parts])] = (path, is_pkg)
    return found


def installed_modules(packages=PACKAGES) -> dict[str, tuple[Path, bool]]:
    modules = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
        for location in spec.submodule_search_locations:
            modules.update(package_modules(package, Path(location)))
    return modules


def imports_of(name: str, path: Path, is_pkg: bool, known) -> set[str]:
    """The known modules that `name` (source at `path`) imports, from any import statement anywhere in it.

    `from P import X` is an import of P.X when that is a module, of P otherwise; `import a.b.c` of a.b.c;
    and each is also an import of the packages above it (a, a.b), whose __init__ runs first, unless they
    are above `name` too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if is_pkg else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in known else source)
    # importing a.b.c first runs the packages a and a.b: an import of a module is one of its packages too,
    # except of the importer's own packages (already running when it runs)
    own = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
    targets |= {t.rsplit(".", k)[0] for t in list(targets) for k in range(1, t.count(".") + 1)} - own
    return {t for t in targets if t in known and t != name}


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    return {name: imports_of(name, path, is_pkg, modules) for name, (path, is_pkg) in modules.items()}


def cycles(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Strongly connected components (more than one module) of the graph restricted to `prefix`, each as
    (a shortest cycle through its first member [a, b, ..., a], the component's members)."""
    inside = {n for n in graph if n == prefix or n.startswith(prefix + ".")}
    edges = {n: sorted(m for m in graph[n] if m in inside) for n in sorted(inside)}
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):  # Tarjan; the graphs are a few hundred modules, recursion depth is fine
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return [(_cycle_through(comp, edges), comp) for comp in sorted(comps)]


def _cycle_through(comp: list[str], edges) -> list[str]:
    """A shortest cycle from comp[0] back to itself inside the component (a readable witness)."""
    members, start = set(comp), comp[0]
    paths, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return comp


def kernel_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from dsv41.model.kernels.* of any dsv41 module outside the kernels, formats and config."""
    bad = []
    for name in sorted(graph):
        if name != KERNELS and not name.startswith(KERNELS + "."):
            continue
        for target in sorted(graph[name]):
            if target in KERNEL_MAY_IMPORT or target == KERNELS or target.startswith(KERNELS + "."):
                continue
            if target == "dsv41" or target.startswith("dsv41."):
                bad.append(f"{name} imports {target}")
    return bad


def _show(found: list[list[str]]) -> str:
    """Each cycle, and the whole strongly connected component when the cycle shown does not cover it."""
    lines = []
    for c in found:
        lines.append(" -> ".join(c[0]) + (f"   (all of: {', '.join(c[1])})" if len(c[1]) > len(c[0]) - 1 else ""))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph():
    return import_graph(installed_modules())


def test_graph_covers_the_package(graph):
    assert {"dsv41.model.transformer", "dsv41.model.kernels.gemm", "dsv41.model.kernels.reference",
            "dsv41.evals.effort"} <= set(graph)
    assert "dsv41.model.kernels.gemm" in graph["dsv41.model.layers"]  # function-level imports are read too


@pytest.mark.parametrize("prefix", ["dsv41.model", "dsv41.evals", "dsv41.serve"])
def test_no_import_cycle(graph, prefix):
    found = cycles(graph, prefix)
    assert not found, f"import cycles inside {prefix}:\n{_show(found)}"


def test_kernels_are_a_leaf(graph):
    bad = kernel_violations(graph)
    assert not bad, "model/kernels may import only itself, model/formats.py and model/config.py:\n" + "\n".join(bad)


def _copy_of(package: str, tmp_path: Path) -> Path:
    """The .py files of an installed package, copied under tmp_path (its graph reads as the install's)."""
    src = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    dst = tmp_path / package.rpartition(".")[2]
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if not n.endswith(".py")
                                                      and not (Path(d) / n).is_dir()] + ["__pycache__"])
    assert import_graph(package_modules(package, dst)) == import_graph(installed_modules([package]))
    return dst


def _plant(path: Path, statement: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {statement}  # noqa\n")


def test_checks_catch_planted_imports(tmp_path):
    """A copy of model/ with a lazy, relative kernels -> attention import planted: both checks must fire
    (whatever else they report on the copy)."""
    dst = _copy_of("dsv41.model", tmp_path)
    clean = import_graph(package_modules("dsv41.model", dst))
    _plant(dst / "kernels" / "gemm.py", "from ..attention import Attention")
    planted = import_graph(package_modules("dsv41.model", dst))
    assert set(kernel_violations(planted)) - set(kernel_violations(clean)) == {
        "dsv41.model.kernels.gemm imports dsv41.model.attention"}
    pair = {"dsv41.model.kernels.gemm", "dsv41.model.attention"}
    assert not any(pair <= set(members) for _, members in cycles(clean, "dsv41.model"))
    hit = [(cycle, members) for cycle, members in cycles(planted, "dsv41.model") if pair <= set(members)]
    assert len(hit) == 1
    cycle, members = hit[0]
    assert cycle[0] == cycle[-1] and set(cycle) <= set(members)


def test_checks_catch_a_planted_evals_cycle(tmp_path):
    """plots -> effort inside a function, in a copy of evals/ (effort imports plots to draw the sweep)."""
    dst = _copy_of("dsv41.evals", tmp_path)
    assert "dsv41.evals.plots" in import_graph(package_modules("dsv41.evals", dst))["dsv41.evals.effort"]
    _plant(dst / "plots.py", "from dsv41.evals.effort import PRESET_OF")
    found = cycles(import_graph(package_modules("dsv41.evals", dst)), "dsv41.evals")
    assert [c for c, _ in found] == [["dsv41.evals.effort", "dsv41.evals.plots", "dsv41.evals.effort"]]
