"""Code lineage of the DVC stages: the exact project files a stage's code can run or read.

Rule: a stage's code deps are the static import closure of its module (``tasks/<stage>.py``), found with ``ast``:
``import a.b`` and ``from a import b`` anywhere in a file (inside functions too, since lazy imports still run),
``from pkg import sub`` pulling ``pkg/sub.py`` when ``sub`` is a module, relative imports, and the ``__init__.py`` of
every package on the way (importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``, and their imports).
Only the project's packages count (``[tool.setuptools.packages.find] include`` in pyproject.toml); third-party and
stdlib imports are skipped, and imports under ``if TYPE_CHECKING:`` are skipped (they never run). On top of the
modules come the non-Python files a module in the closure reads at run time (DATA_READERS). Paths are individual
files relative to the project root, sorted, so editing a file outside a stage's closure marks that stage fresh.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import tempfile
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]
"""The tree this code runs from (an editable install, a checkout): the default root the lineage is read in."""

DATA_READERS: dict[str, tuple[str, ...]] = {
    # Module -> globs of the non-Python files it reads at run time. Found by grepping the packages for `__file__`
    # and `importlib.resources` (tests/flows/test_lineage.py repeats that grep, so a new reader fails a test until
    # it is listed here); covers pyproject.toml's package-data and the DeepSpeed configs outside the packages.
    "envs/search_qa.py": ("envs/data/*.jsonl",),
    "skills/llm_miner.py": ("skills/prompts/*.md",),
    "datapool/gateway/ui.py": ("datapool/gateway/static/*",),
    "models/ds_engine.py": ("infra/deepspeed/*.json",),
    "models/vllm_server.py": ("models/portable/*.py",),   # the servers load the action-trie logits processor
}


class LineageError(RuntimeError):
    """The import closure cannot be computed: a missing module, an unparsable file or no package list."""


IMPORTS_CACHE = Path(".arlflow") / "cache" / "imports.json"
"""Under the code root: each file's imports by path and content hash, so `check-params` and every stage's dvc.yaml
check parse only the files that changed since the last run (parsing all of them is most of a second on 2 cores).
Missing, unreadable or unwritable (a read-only install) means parsing again; a stale entry can never match."""

_PARSED: dict[Path, dict[str, tuple[tuple[str, bool], ...]]] = {}
"""code root -> {"<relative path>:<sha1 of its bytes>": its imports}: loaded from IMPORTS_CACHE once per process."""
_FRESH: dict[Path, dict[str, str]] = {}
"""code root -> {relative path: key} of the files parsed (not found in the cache) by this process."""


def project_packages(root: Path = SOURCE_ROOT) -> tuple[str, ...]:
    """Top-level package names from pyproject.toml's `[tool.setuptools.packages.find] include` ("flows*" -> flows)."""
    path = root / "pyproject.toml"
    try:
        include = tomllib.loads(path.read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
        raise LineageError(f"cannot read the package list from {path} ([tool.setuptools.packages.find] include): "
                           f"{err!r}") from err
    return tuple(sorted({pattern.rstrip("*").split(".")[0] for pattern in include if pattern.rstrip("*")}))


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    """Dotted name of a source file and whether it is a package (`__init__.py`)."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in and below nodes, at any depth (function bodies too), except the bodies of
    `if TYPE_CHECKING:` (their `else:` still runs)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node))


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None, path: Path) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    package = module if is_package else module.rpartition(".")[0]
    parts = package.split(".") if package else []
    if level > len(parts):
        raise LineageError(f"{path}: relative import beyond the top-level package (level {level} in {module})")
    base = ".".join(parts[: len(parts) - (level - 1)])
    return f"{base}.{name}" if name else base


def file_imports(root: Path, path: Path) -> tuple[tuple[str, bool], ...]:
    """Absolute module names a file imports, each with `required`: False for `from x import y`'s `x.y` candidates,
    which are modules only when such a file exists (else y is a name defined in x)."""
    source = path.read_bytes()
    parsed = _parsed(root)
    key = f"{path.relative_to(root)}:{hashlib.sha1(source).hexdigest()}"
    if key in parsed:
        return parsed[key]
    _FRESH.setdefault(root, {})[key.rpartition(":")[0]] = key
    module, is_package = _module_name(root, path)
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as err:
        raise LineageError(f"cannot parse {path} to find its imports: {err}") from err
    found: list[tuple[str, bool]] = []
    for node in _import_nodes(tree.body):
        if isinstance(node, ast.Import):
            found += [(alias.name, True) for alias in node.names]
            continue
        base = _resolve_relative(module, is_package, node.level, node.module, path) if node.level else node.module
        found.append((base, True))
        found += [(f"{base}.{alias.name}", False) for alias in node.names if alias.name != "*"]
    parsed[key] = tuple(found)
    return parsed[key]


def _parsed(root: Path) -> dict[str, tuple[tuple[str, bool], ...]]:
    if root not in _PARSED:
        try:
            stored = json.loads((root / IMPORTS_CACHE).read_text())
            _PARSED[root] = {key: tuple((name, bool(required)) for name, required in imports)
                             for key, imports in stored.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            _PARSED[root] = {}
    return _PARSED[root]


def _save_parsed(root: Path) -> None:
    """Write the cache when this process parsed a file: its new entry replaces the file's older ones."""
    fresh = _FRESH.pop(root, {})
    if not fresh:
        return
    parsed = _parsed(root)
    kept = {key: parsed[key] for key in sorted(parsed) if fresh.get(key.rpartition(":")[0], key) == key}
    path = root / IMPORTS_CACHE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            json.dump(kept, out)
        os.replace(out.name, path)
    except OSError:
        return


def _module_file(root: Path, name: str) -> Path | None:
    """The file a dotted name imports from root: a package's `__init__.py` wins over a same-named module, as in
    Python's path finder; None when neither exists."""
    base = root.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_name(base.name + ".py")):
        if candidate.is_file():
            return candidate
    return None


def _files_run_by_import(root: Path, name: str, required: bool, importer: Path) -> list[Path]:
    """The module's file and the `__init__.py` of each package above it (importing a.b.c runs a and a.b first)."""
    target = _module_file(root, name)
    if target is None:
        if required:
            raise LineageError(f"{importer} imports {name}, but neither {name.replace('.', '/')}.py nor its "
                               f"__init__.py exists under {root}: fix the import or add the module")
        return []
    parts = name.split(".")
    parents = [_module_file(root, ".".join(parts[:i])) for i in range(1, len(parts))]
    return [p for p in parents if p is not None] + [target]


def import_closure(module: str, root: Path = SOURCE_ROOT, packages: tuple[str, ...] | None = None) -> list[str]:
    """Sorted paths (relative to root) of the project files that importing `module` (dotted) runs."""
    packages = project_packages(root) if packages is None else packages
    if module.split(".")[0] not in packages:
        raise LineageError(f"{module} is not in the project packages {list(packages)} (pyproject.toml)")
    if _module_file(root, module) is None:
        raise LineageError(f"no module {module} under {root} ({module.replace('.', '/')}.py is missing)")
    start = _files_run_by_import(root, module, True, root)
    seen: set[Path] = set(start)
    queue = list(start)
    while queue:
        path = queue.pop()
        for name, required in file_imports(root, path):
            if name.split(".")[0] not in packages:
                continue
            for found in _files_run_by_import(root, name, required, path):
                if found not in seen:
                    seen.add(found)
                    queue.append(found)
    _save_parsed(root)
    return sorted(str(p.relative_to(root)) for p in seen)


def data_files(modules: list[str], root: Path = SOURCE_ROOT) -> list[str]:
    """Sorted non-Python files (relative to root) that the given modules (relative paths) read at run time."""
    files: set[str] = set()
    for module in modules:
        for pattern in DATA_READERS.get(module, ()):
            matches = [p for p in root.glob(pattern) if p.is_file()]
            if not matches:
                raise LineageError(f"{module} reads {pattern}, but no file under {root} matches it: restore the "
                                   f"files or update DATA_READERS in flows/lineage.py")
            files.update(str(p.relative_to(root)) for p in matches)
    return sorted(files)


@functools.lru_cache(maxsize=None)
def code_deps(module: str, root: Path = SOURCE_ROOT) -> tuple[str, ...]:
    """A stage's code deps: the import closure of its module plus the data files the closure reads, sorted.
    Cached per process and root (rendering dvc.yaml asks once per unrolled stage); a process that edits imports
    and needs fresh answers calls `code_deps.cache_clear()`."""
    modules = import_closure(module, root)
    return tuple(sorted(modules + data_files(modules, root)))
