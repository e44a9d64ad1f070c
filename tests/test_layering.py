"""Layering rules (DESIGN.md, STYLE.md): flows -> tasks -> {agents, skills, datapool} -> {models, envs}.

A module may import its own package and any package of a lower layer. Packages of the same layer may import each
other only while the package-level import graph has no cycle. models/ and envs/ stay pure (no orchestration,
tracking or data tooling), and nothing below flows/ imports flows/. Checked on the source with ast, so lazy imports
inside functions and ``if TYPE_CHECKING:`` blocks count, and relative imports are resolved to their package.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS: tuple[tuple[str, ...], ...] = (("flows",), ("tasks",), ("agents", "skills", "datapool"), ("models", "envs"))
PACKAGES = tuple(package for layer in LAYERS for package in layer)
LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}
PURE_PACKAGES = ("models", "envs")
TOOLING = {"prefect", "mlflow", "dvc", "great_expectations"}


def module_name(path: Path, root: Path = ROOT) -> str:
    """``datapool/gateway/chat.py`` -> ``datapool.gateway.chat``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str = "", is_package: bool = False) -> set[str]:
    """Dotted names of every module ``source`` imports, anywhere in the file.

    Relative imports are resolved against ``module`` (the importing module's dotted name; ``is_package`` when the
    source is that package's ``__init__.py``). One that climbs above the top-level package raises ValueError.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add(node.module)
                continue
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            if node.level - 1 >= len(anchor):
                raise ValueError(f"relative import of level {node.level} in {module!r} leaves its top-level package")
            base = anchor[: len(anchor) - (node.level - 1)]
            found.add(".".join(base + ([node.module] if node.module else [])))
    return found


def top_level_imports(path: Path) -> set[str]:
    """Top-level names (``prefect``, ``datapool``, ...) that the module at ``path`` imports."""
    names = imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")
    return {name.split(".")[0] for name in names}


def sources(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    return files


def package_graph() -> dict[str, dict[str, list[str]]]:
    """{importer package: {imported package: [files that import it]}}, between our packages only."""
    graph: dict[str, dict[str, list[str]]] = {package: {} for package in PACKAGES}
    for package in PACKAGES:
        for path in sources(package):
            for target in top_level_imports(path) & set(PACKAGES) - {package}:
                graph[package].setdefault(target, []).append(str(path.relative_to(ROOT)))
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of the directed graph, or None when it is acyclic (depth-first, three colours)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# ------------------------------------------------------------------------------------------- the checker itself
def test_the_checker_sees_lazy_from_and_relative_imports():
    src = ("import os\nfrom prefect.flows import flow\nfrom . import chat\nfrom ..records import StepRecord\n"
           "from .. import filters\ndef f():\n    import mlflow.tracking as t\n")
    assert imported_modules(src, "datapool.gateway.app") == {
        "os", "prefect.flows", "datapool.gateway", "datapool.records", "datapool", "mlflow.tracking"}
    assert imported_modules("from . import base\nfrom .sub import x\n", "envs", is_package=True) == {"envs", "envs.sub"}
    with pytest.raises(ValueError, match="leaves its top-level package"):
        imported_modules("from .. import x\n", "envs.base")


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_the_layers_name_every_package():
    on_disk = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"tests", "benchmarks"}
    assert on_disk <= set(PACKAGES), f"packages {sorted(on_disk - set(PACKAGES))} are in no layer: add them to LAYERS"


# ------------------------------------------------------------------------------------------------- the rules
@pytest.mark.parametrize("package", PACKAGES)
def test_no_upward_imports(package):
    offenders = {}
    for path in sources(package):
        upward = sorted(t for t in top_level_imports(path) & set(PACKAGES) if LAYER_OF[t] < LAYER_OF[package])
        if upward:
            offenders[str(path.relative_to(ROOT))] = upward
    order = " -> ".join("{" + ", ".join(layer) + "}" for layer in LAYERS)
    assert not offenders, (f"{package}/ may import only its own package and lower layers ({order}); these import a "
                           f"higher layer, move the code they need down or the import up: {offenders}")


def test_no_import_cycle_between_packages():
    graph = package_graph()
    cycle = find_cycle({package: set(targets) for package, targets in graph.items()})
    if cycle:
        edges = [f"{a} -> {b} (in {', '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between packages " + " -> ".join(cycle) + ":\n  " + "\n  ".join(edges)
                    + "\nmove what both sides need to a lower layer")


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_tooling(package):
    offenders = {str(f.relative_to(ROOT)): sorted(top_level_imports(f) & TOOLING) for f in sources(package)}
    offenders = {path: mods for path, mods in offenders.items() if mods}
    assert not offenders, f"{package}/ must stay pure (DESIGN.md layering); move these imports up a layer: {offenders}"


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "flows"])
def test_nothing_below_flows_imports_flows(package):
    offenders = sorted(str(f.relative_to(ROOT)) for f in sources(package) if "flows" in top_level_imports(f))
    assert not offenders, f"flows/ is control flow only, nothing imports it; these do: {offenders}"
