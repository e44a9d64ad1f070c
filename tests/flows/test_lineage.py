"""Code lineage (flows/lineage.py): the import closure on small fake trees, dvc.yaml's code deps equal to it, and
DVC itself marking exactly the stages whose closure holds an edited file (the check the lineage exists for)."""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from dvc.dependency import param as dvc_param
from dvc.repo import Repo

from flows import lineage
from flows.dvc_sync import _in_project, render_dvc_yaml
from flows.lineage import (DATA_READERS, SOURCE_ROOT, LineageError, code_deps, data_files, import_closure,
                           project_packages)
from flows.stages import STAGE_FUNCTIONS, dvc_stage_name, stage_sequence
from tasks.config import load_params
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]
DATA_PREFIXES = ("data/", "artifacts/", "metrics/")
"""Where the stages' data deps live (Layout); every other dep in dvc.yaml is code."""


def make_tree(root: Path, files: dict[str, str], packages: tuple[str, ...] = ("pkg", "other")) -> Path:
    include = ", ".join(f'"{p}*"' for p in packages)
    (root / "pyproject.toml").write_text(f"[tool.setuptools.packages.find]\ninclude = [{include}]\n")
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


# --- the closure on fake trees ---------------------------------------------------------------------------------


def test_lazy_import_inside_a_function_counts(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "def f():\n    import pkg.lazy\n",
                         "pkg/lazy.py": "", "pkg/unused.py": ""})
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/lazy.py", "pkg/main.py"]


def test_from_package_import_submodule_pulls_its_file_but_a_name_does_not(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "VALUE = 1\n", "pkg/main.py": "from pkg import sub, VALUE\n",
                         "pkg/sub.py": "", "pkg/VALUE_not_a_module.py": ""})
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/main.py", "pkg/sub.py"]


def test_a_module_nobody_imports_is_absent(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "import pkg.used\n", "pkg/used.py": "",
                         "pkg/unused.py": "import pkg.used\n"})
    assert "pkg/unused.py" not in import_closure("pkg.main", tmp_path)


def test_every_package_init_on_the_way_is_included_with_its_imports(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/a/__init__.py": "from pkg.a import registered\n",
                         "pkg/a/registered.py": "", "pkg/a/b/__init__.py": "", "pkg/a/b/leaf.py": "",
                         "pkg/main.py": "from pkg.a.b.leaf import thing\n"})
    assert import_closure("pkg.main", tmp_path) == [
        "pkg/__init__.py", "pkg/a/__init__.py", "pkg/a/b/__init__.py", "pkg/a/b/leaf.py", "pkg/a/registered.py",
        "pkg/main.py"]


def test_import_cycles_terminate(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "from pkg import a\n"})
    assert import_closure("pkg.a", tmp_path) == ["pkg/__init__.py", "pkg/a.py", "pkg/b.py"]


def test_relative_imports_resolve_against_the_importing_package(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "from . import near\n",
                         "pkg/sub/near.py": "from ..far import x\n", "pkg/far.py": "", "pkg/main.py": "import pkg.sub\n"})
    assert import_closure("pkg.main", tmp_path) == [
        "pkg/__init__.py", "pkg/far.py", "pkg/main.py", "pkg/sub/__init__.py", "pkg/sub/near.py"]


def test_other_packages_count_and_outside_ones_and_type_checking_imports_do_not(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "other/__init__.py": "", "other/util.py": "",
                         "outside/__init__.py": "", "pkg/typed.py": "",
                         "pkg/main.py": ("import os\nimport outside\nfrom typing import TYPE_CHECKING\n"
                                         "from other.util import helper\n"
                                         "if TYPE_CHECKING:\n    import pkg.typed\n")})
    assert import_closure("pkg.main", tmp_path) == ["other/__init__.py", "other/util.py", "pkg/__init__.py",
                                                    "pkg/main.py"]


def test_a_missing_project_module_is_a_clear_error(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "import pkg.gone\n"})
    with pytest.raises(LineageError, match=r"pkg/main.py imports pkg.gone.*fix the import"):
        import_closure("pkg.main", tmp_path)


def test_an_edited_import_is_seen_by_the_next_closure(tmp_path):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "", "pkg/new.py": ""})
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/main.py"]
    (tmp_path / "pkg/main.py").write_text("import pkg.new  # now imported\n")
    assert "pkg/new.py" in import_closure("pkg.main", tmp_path)


def _new_process(monkeypatch) -> None:
    """Forget the per-process state, as a new `arlflow` command starts without it."""
    monkeypatch.setattr(lineage, "_PARSED", {})
    monkeypatch.setattr(lineage, "_FRESH", {})


def test_a_second_process_reads_the_imports_from_the_cache_and_parses_only_an_edited_file(tmp_path, monkeypatch):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "import pkg.a\n", "pkg/a.py": "", "pkg/b.py": ""})
    first = import_closure("pkg.main", tmp_path)
    assert (tmp_path / lineage.IMPORTS_CACHE).is_file()
    _new_process(monkeypatch)
    parsed: list[str] = []
    real_parse = lineage.ast.parse
    monkeypatch.setattr(lineage.ast, "parse", lambda source, filename: parsed.append(filename) or
                        real_parse(source, filename=filename))
    assert import_closure("pkg.main", tmp_path) == first and parsed == []
    (tmp_path / "pkg/a.py").write_text("import pkg.b\n")  # same mtime resolution or not: the content decides
    _new_process(monkeypatch)
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/a.py", "pkg/b.py", "pkg/main.py"]
    assert [Path(f).name for f in parsed] == ["a.py", "b.py"]
    stored = json.loads((tmp_path / lineage.IMPORTS_CACHE).read_text())
    assert sorted(k.rpartition(":")[0] for k in stored) == ["pkg/__init__.py", "pkg/a.py", "pkg/b.py", "pkg/main.py"]


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2]", '{"pkg/main.py:x": 5}', ""])
def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path, monkeypatch, garbage):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "import pkg.a\n", "pkg/a.py": ""})
    (tmp_path / lineage.IMPORTS_CACHE).parent.mkdir(parents=True)
    (tmp_path / lineage.IMPORTS_CACHE).write_text(garbage)
    _new_process(monkeypatch)
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/a.py", "pkg/main.py"]
    assert len(json.loads((tmp_path / lineage.IMPORTS_CACHE).read_text())) == 3


def test_a_cache_entry_under_another_file_content_is_never_used(tmp_path, monkeypatch):
    """A poisoned entry (right path, wrong hash) must not change the closure."""
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "", "pkg/a.py": ""})
    (tmp_path / lineage.IMPORTS_CACHE).parent.mkdir(parents=True)
    (tmp_path / lineage.IMPORTS_CACHE).write_text(json.dumps({"pkg/main.py:0000": [["pkg.a", True]]}))
    _new_process(monkeypatch)
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/main.py"]


def test_an_unwritable_cache_folder_only_costs_the_parse(tmp_path, monkeypatch):
    make_tree(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "import pkg.a\n", "pkg/a.py": ""})
    (tmp_path / ".arlflow").write_text("a file where the cache folder would go")
    _new_process(monkeypatch)
    assert import_closure("pkg.main", tmp_path) == ["pkg/__init__.py", "pkg/a.py", "pkg/main.py"]


def test_data_files_follow_their_reader_and_a_missing_one_is_an_error(tmp_path):
    make_tree(tmp_path, {"skills/__init__.py": "", "skills/llm_miner.py": "", "skills/prompts/a.md": "",
                         "skills/prompts/b.md": "", "skills/prompts/notes.txt": ""}, packages=("skills",))
    assert data_files(["skills/__init__.py"], tmp_path) == []
    assert data_files(["skills/llm_miner.py"], tmp_path) == ["skills/prompts/a.md", "skills/prompts/b.md"]
    with pytest.raises(LineageError, match="reads infra/deepspeed/\\*.json"):
        data_files(["models/ds_engine.py"], tmp_path)


# --- the project's own stages ----------------------------------------------------------------------------------


def test_packages_come_from_pyproject():
    assert project_packages() == ("agents", "datapool", "envs", "flows", "models", "skills", "tasks")


def test_data_readers_are_every_module_that_reads_files_next_to_its_code():
    readers = {str(p.relative_to(SOURCE_ROOT)) for package in project_packages() for p in
               (SOURCE_ROOT / package).rglob("*.py") if re.search(r"__file__|resources\.files", p.read_text())}
    readers.discard("flows/lineage.py")  # reads the source tree itself, to find the lineage; no stage imports it
    assert readers == set(DATA_READERS), "list each module that reads files beside the code in DATA_READERS"
    package_data = tomllib.loads((SOURCE_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = {g for patterns in DATA_READERS.values() for g in patterns}
    assert {f"{package}/{pattern}" for package, patterns in package_data.items() for pattern in patterns} <= globs
    assert all(list(SOURCE_ROOT.glob(g)) for g in globs)


@pytest.mark.parametrize("stage", list(STAGE_FUNCTIONS))
def test_each_stage_starts_at_its_own_task_module_and_imports_no_flows(stage):
    deps = code_deps(STAGE_FUNCTIONS[stage].__module__)
    assert f"tasks/{stage}.py" in deps and "tasks/__init__.py" in deps
    assert not [d for d in deps if d.startswith("flows/")]
    assert all((SOURCE_ROOT / d).is_file() for d in deps)


def test_the_imports_the_issue_reported_missing_are_deps():
    assert {"tasks/skill_trials.py", "datapool/filters.py", "datapool/parquet.py", "tasks/common.py"} <= set(
        code_deps("tasks.train"))
    assert {"datapool/filters.py", "datapool/quality.py", "tasks/common.py"} <= set(code_deps("tasks.validate"))
    assert "infra/deepspeed/zero2.json" in code_deps("tasks.train")  # read by models/ds_engine.py, not imported


@pytest.mark.parametrize("stage", list(STAGE_FUNCTIONS))
def test_no_stage_runs_the_gateway_server(stage):
    """The data gateway is a separate server (arlflow gateway): editing it must leave every stage fresh."""
    assert not [d for d in code_deps(STAGE_FUNCTIONS[stage].__module__) if d.startswith("datapool/gateway/")]


def test_rendered_dvc_yaml_code_deps_equal_each_stage_closure():
    params = load_params(REPO / "params.yaml")
    stages = yaml.safe_load(render_dvc_yaml(params, Layout(REPO)))["stages"]
    assert len(stages) == len(stage_sequence(params.pipeline.rounds))
    for stage, round_index in stage_sequence(params.pipeline.rounds):
        deps = stages[dvc_stage_name(stage, round_index)]["deps"]
        code = [d for d in deps if not d.startswith(DATA_PREFIXES)]
        assert code == list(code_deps(f"tasks.{stage}")), (stage, round_index)
        assert deps[-len(code):] == code, "data deps first, then the code deps"


RUNTIME_IMPORTS = """
import json, sys
from pathlib import Path
root, packages, stages = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
loaded = {}
for stage in stages:
    for name in [n for n in sys.modules if n.split(".")[0] in packages]:
        del sys.modules[name]  # third-party modules stay loaded, so each stage costs only the project's imports
    __import__(f"tasks.{stage}")
    files = (getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] in packages)
    loaded[stage] = sorted(str(Path(f).resolve().relative_to(root)) for f in files if f)
print(json.dumps(loaded))
"""


@pytest.mark.slow
def test_every_module_python_loads_for_a_stage_is_in_its_closure():
    """An oracle independent of the ast walk: the project modules that `import tasks.<stage>` really loads (lazy
    imports inside functions load later, so the static closure may hold more, never less)."""
    result = subprocess.run([sys.executable, "-c", RUNTIME_IMPORTS, str(SOURCE_ROOT), ",".join(project_packages()),
                             ",".join(STAGE_FUNCTIONS)], capture_output=True, text=True, cwd=SOURCE_ROOT)
    assert result.returncode == 0, f"importing the stage modules failed:\n{result.stderr[-3000:]}"
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    for stage, files in loaded.items():
        closure = code_deps(STAGE_FUNCTIONS[stage].__module__)
        assert f"tasks/{stage}.py" in files
        missed = sorted(set(files) - set(closure))
        assert not missed, f"importing tasks.{stage} loads {missed}, which its lineage misses"


def test_a_data_root_outside_the_checkout_points_its_code_deps_back_at_it(tmp_path):
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    spec = yaml.safe_load(render_dvc_yaml(load_params(tmp_path / "params.yaml"), Layout(tmp_path)))["stages"]
    code = [d for d in spec["train_1"]["deps"] if not d.startswith(DATA_PREFIXES)]
    assert [str((tmp_path / d).resolve().relative_to(SOURCE_ROOT)) for d in code] == list(code_deps("tasks.train"))


# --- DVC sees an edit exactly in the stages that run the edited file --------------------------------------------


def _project_copy(root: Path) -> tuple[Layout, dict[str, tuple[str, ...]]]:
    """A one-round copy of the project's code and params, every stage's data placeholders, all stages committed;
    returns its layout and each DVC stage's lineage, computed on the copy."""
    for package in project_packages():
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(REPO / "infra", root / "infra")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["pipeline"]["rounds"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    layout = Layout(root)
    text = render_dvc_yaml(load_params(root / "params.yaml"), layout, code_root=root)  # lineage of the copy
    (root / "dvc.yaml").write_text(text)
    (root / ".dvcignore").write_text("__pycache__/\n*.pyc\n")
    stages = yaml.safe_load(text)["stages"]
    data = {p for spec in stages.values() for p in spec["deps"] + spec.get("outs", []) + spec.get("metrics", [])
            + [next(iter(plot)) for plot in spec.get("plots", [])] if p.startswith(DATA_PREFIXES)}
    for path in sorted(root / p for p in data if Path(p).suffix):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"placeholder {path.name}\n")
    for path in sorted(root / p for p in data if not Path(p).suffix):
        path.mkdir(parents=True, exist_ok=True)
        if not any(path.iterdir()):
            (path / "placeholder.txt").write_text("placeholder\n")
    Repo.init(str(root), no_scm=True).close()
    with _in_project(layout) as repo:
        repo.commit(None, force=True)
    stage_of = {dvc_stage_name(s, r): s for s, r in stage_sequence(1)}
    return layout, {name: code_deps(STAGE_FUNCTIONS[stage_of[name]].__module__, root) for name in stages}


ALWAYS = "always changed"
"""What DVC reports for the `curate` stage whatever changed (it re-reads the data pool, outside DVC): not lineage."""


def _without_always(status: dict) -> dict:
    kept = {name: [entry for entry in entries if entry != ALWAYS] for name, entries in status.items()}
    return {name: entries for name, entries in kept.items() if entries}


def _stage_status(repo, stages) -> dict:
    """What `repo.status()` returns (it calls each stage's status in turn), without re-reading dvc.yaml and dvc.lock
    on every call (about 60% of a `repo.status()` here), less the always-changed marker."""
    status: dict = {}
    with repo.lock:
        for stage in stages:
            status.update(stage.status())
    return _without_always(status)


def _parse_params_once(monkeypatch) -> None:
    """params.yaml never changes while the test edits code, yet DVC parses it (pure-Python YAML) once per stage
    on every status, about 40% of the rest: parse each requested key set once."""
    parsed: dict = {}
    read = dvc_param.read_param_file

    def read_once(fs, path, key_paths=None, flatten=False, **kwargs):
        key = (path, tuple(key_paths or ()), flatten, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = read(fs, path, key_paths, flatten, **kwargs)
        return copy.deepcopy(parsed[key])

    monkeypatch.setattr(dvc_param, "read_param_file", read_once)


@pytest.mark.slow
def test_editing_each_module_marks_exactly_the_stages_that_import_it(tmp_path, monkeypatch):
    """Append a comment to each project file in turn (every file of the packages, the DeepSpeed configs), ask DVC
    which stages are stale, restore the file. `dvc status` lists a stage
    only when its own deps changed (its upstream's outs are untouched here), so the stale set is exactly the stages
    whose closure holds the file, and the changed dep it names is that file."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    started = time.perf_counter()
    layout, deps = _project_copy(tmp_path)
    assert set(deps) == {"bootstrap", "curate", "warmstart", "rollout_1", "validate_1", "mine_1", "train_1",
                         "evaluate", "transfer"}
    in_closures = {d for stage_deps in deps.values() for d in stage_deps}
    project_files = {str(f.relative_to(tmp_path)) for package in project_packages() for f in
                     (tmp_path / package).rglob("*") if f.is_file()}
    outside = sorted(project_files - in_closures)
    assert {"flows/cli.py", "flows/lineage.py", "datapool/gateway/app.py"} <= set(outside)
    edited = sorted(in_closures) + outside
    with _in_project(layout) as repo:
        assert repo.status() == {"curate": [ALWAYS]}, "a freshly committed copy must be up to date"
        stages = list(repo.index.stages)
        _parse_params_once(monkeypatch)
        for rel in edited:
            path = tmp_path / rel
            original = path.read_bytes()
            path.write_bytes(original + b"\n# lineage test edit\n")
            try:
                status = _stage_status(repo, stages)
                if rel == "tasks/skill_trials.py":  # once: the shortcut answers as `repo.status()` does
                    assert _without_always(repo.status()) == status
            finally:
                path.write_bytes(original)
            expected = {name for name, stage_deps in deps.items() if rel in stage_deps}
            assert set(status) == expected, f"editing {rel}: DVC marked {sorted(status)}, lineage says {expected}"
            for name in expected:
                assert status[name] == [{"changed deps": {rel: "modified"}}], (rel, name)
        assert repo.status() == {"curate": [ALWAYS]}, "restoring every file must leave the copy up to date"
    print(f"lineage/DVC check: {len(edited)} files in {time.perf_counter() - started:.1f} s")
