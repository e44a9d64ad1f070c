"""Layering rule (DESIGN.md): envs/ and models/ are pure; they import no orchestration, tracking or data tooling,
and nothing from the layers above them. Checked on the source with ast, so lazy imports inside functions count."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE_PACKAGES = ("envs", "models")
FORBIDDEN = {"prefect", "mlflow", "dvc", "great_expectations", "flows", "tasks", "agents", "skills", "datapool"}


def imported_top_level_modules(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_checker_sees_lazy_and_from_imports():
    src = "import os\nfrom prefect.flows import flow\ndef f():\n    import mlflow.tracking as t\n"
    assert imported_top_level_modules(src) == {"os", "prefect", "mlflow"}


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_forbidden_module(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    offenders = {str(f.relative_to(ROOT)): sorted(imported_top_level_modules(f.read_text()) & FORBIDDEN)
                 for f in files}
    offenders = {path: mods for path, mods in offenders.items() if mods}
    assert not offenders, f"{package}/ must stay pure (DESIGN.md layering); move these imports up a layer: {offenders}"
