"""A project like a clone of this repository, for tests and benchmarks that run the pipeline under real DVC."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from flows.dvc_sync import render_dvc_yaml
from tasks.config import params_to_dict, parse_params
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[1]
CODE = ["envs", "agents", "models", "tasks", "skills", "datapool", "flows"]


def make_project(root: Path, raw: dict) -> Layout:
    """root as a clone would be: the code and infra/, params.yaml from ``raw`` with every key (defaults filled in,
    as the repo's params.yaml), dvc.yaml rendered from it, git and DVC initialised.

    dvc.yaml names the code this process imports (lineage), relative to root: a copy of the finished project
    keeps its stages fresh only at the same folder depth."""
    for name in CODE:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(REPO / "infra", root / "infra")
    shutil.copy(REPO / ".gitignore", root / ".gitignore")  # git holds code, params and dvc.lock; DVC the rest
    # DVC tracks whole sections, so the file holds every key (defaults filled in), as the repo's params.yaml does
    (root / "params.yaml").write_text(yaml.safe_dump(params_to_dict(parse_params(raw)), sort_keys=False))
    layout = Layout(root)
    (root / "dvc.yaml").write_text(render_dvc_yaml(parse_params(raw), layout))
    (root / ".dvcignore").write_text("__pycache__/\n*.pyc\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q"], cwd=root, check=True)
    return layout


def stage_env(**extra: str) -> dict[str, str]:
    """The environment for `dvc repro` / `arlflow stage` subprocesses: the venv's tools on PATH, and none of this
    test process's Prefect server or torch.distributed group (it already holds MASTER_PORT)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}
    for inherited in ("PREFECT_API_URL", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(inherited, None)
    return env
