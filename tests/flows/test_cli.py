"""The CLI and the stage table: dvc.yaml in sync with params.yaml, bad stage requests rejected before any work."""
import subprocess
import sys
from pathlib import Path

import pytest

from flows.dvc_sync import render_dvc_yaml
from flows.stages import check_stage, stage_sequence
from tasks.config import load_params, parse_params
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]


def test_committed_dvc_yaml_matches_params():
    params = load_params(REPO / "params.yaml")
    assert (REPO / "dvc.yaml").read_text() == render_dvc_yaml(params, Layout(REPO)), "run `arlflow dvc-yaml`"


def test_rounds_are_unrolled_in_order():
    names = [f"{s}_{r}" if r else s for s, r in stage_sequence(2)]
    assert names == ["bootstrap", "curate", "warmstart", "rollout_1", "validate_1", "mine_1", "train_1", "rollout_2",
                     "validate_2", "mine_2", "train_2", "evaluate", "transfer"]


@pytest.mark.parametrize("stage, round_index, message", [
    ("trian", None, "unknown stage"),
    ("train", None, "needs --round"),
    ("train", 9, "pipeline.rounds"),
    ("evaluate", 1, "takes no --round"),
])
def test_bad_stage_requests(stage, round_index, message):
    with pytest.raises(ValueError, match=message):
        check_stage(stage, round_index, parse_params({"pipeline": {"rounds": 3}}))


def test_cli_stage_without_round_exits_2():
    result = subprocess.run([sys.executable, "-m", "flows.cli_main", "stage", "rollout", "--root", str(REPO)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "needs --round" in result.stderr
    # issue 15: the first line comes before the imports and Prefect's server start-up (25-35 s were silent)
    assert result.stderr.splitlines()[0].startswith("arlflow stage rollout: loading; Prefect's temporary server")


def test_cli_dvc_yaml_check_detects_drift(tmp_path):
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text().replace("rounds: 5", "rounds: 2"))
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    check = subprocess.run([sys.executable, "-m", "flows.cli_main", "dvc-yaml", "--check", "--root", str(tmp_path)],
                           capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 1 and "out of date" in check.stderr
    subprocess.run([sys.executable, "-m", "flows.cli_main", "dvc-yaml", "--root", str(tmp_path)], check=True,
                   capture_output=True, cwd=REPO)
    assert "rollout_2" in (tmp_path / "dvc.yaml").read_text() and "rollout_3" not in (tmp_path / "dvc.yaml").read_text()


def test_the_cli_imports_no_heavy_package_until_a_command_needs_it():
    """Issue 15: `arlflow --help` took 11.8 s (torch, DeepSpeed, transformers, great-expectations and every env were
    imported by flows/cli.py at load, with DeepSpeed's accelerator line); the commands now import what they run."""
    heavy = ["torch", "deepspeed", "transformers", "great_expectations", "prefect", "mlflow", "envs",
             "sqlalchemy", "pyarrow", "pandas"]  # the last three: the pool commands' (0.9 s), loaded when they run
    probe = f"import sys, flows.cli; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_check_params_imports_no_torch_dvc_prefect_or_mlflow():
    """Issue 15: `check-params` took 9-10 s; it reads params.yaml and checks dvc.yaml against it and the stages'
    imports, which needs the stages' names and modules (flows/stage_order.py), not the modules themselves."""
    heavy = ["torch", "transformers", "deepspeed", "great_expectations", "prefect", "mlflow", "dvc.repo"]
    probe = ("import sys\nfrom typer.testing import CliRunner\nfrom flows.cli import app\n"
             f"done = CliRunner().invoke(app, ['check-params', '--root', {str(REPO)!r}])\n"
             "assert done.exit_code == 0 and 'pipeline:' in done.output, done.output\n"
             f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_stage_order_names_the_modules_the_stage_table_runs():
    from flows.stage_order import STAGES, stage_module
    from flows.stages import STAGE_FUNCTIONS

    assert tuple(STAGE_FUNCTIONS) == STAGES
    assert {stage: fn.__module__ for stage, fn in STAGE_FUNCTIONS.items()} == {s: stage_module(s) for s in STAGES}
