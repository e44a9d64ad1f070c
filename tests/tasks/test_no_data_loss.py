"""No stage destroys what it does not replace: a stage that fails (bad value, exception, corrupt input, kill -9)
leaves every earlier output byte-identical, and outputs that belong together are replaced together."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from typer.testing import CliRunner

from flows.cli import app
from flows.stages import run_stage_functions
from tasks import mine, rollout, train, validate, warmstart
from tasks.config import params_to_dict, parse_params
from tasks.layout import Layout, MissingInputError
from tasks.outputs import JOURNAL_DIR, recover, staged_outputs

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "pipeline": {"rounds": 1, "seed": 5},
    "bootstrap": {"train_scenarios": 16, "heldout_scenarios": 4, "tokenizer_corpus_episodes": 16,
                  "tiny": {"hidden_size": 32, "intermediate_size": 64}},
    "warmstart": {"demo_scenarios": 16, "update": {"epochs": 1, "micro_batch_size": 32}},
    "rollout": {"scenarios_per_round": 4, "group_size": 4},
    "validate": {"drop_zero_variance": False},
    "train": {"update": {"micro_batch_size": 64, "epochs": 1}},
}


def digest(path: Path) -> str:
    """Names and bytes of every file under ``path`` (or of the file itself)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def snapshot(layout: Layout) -> dict[str, str]:
    paths = [layout.policy("round_1"), layout.round_metrics(1, "train"), layout.steps(1), layout.skill_trials(1),
             layout.round_metrics(1, "rollout"), layout.validated(1), layout.skills(1), layout.skills(0),
             layout.policy("warmstart"), layout.round_metrics(1, "mine")]
    return {str(p.relative_to(layout.root)): digest(p) for p in paths}


def leftovers(layout: Layout) -> list[str]:
    return sorted(str(p.relative_to(layout.root)) for p in layout.root.rglob(".*")
                  if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def finished_round(tmp_path_factory) -> Path:
    """bootstrap -> warmstart -> rollout_1 -> validate_1 -> mine_1 -> train_1 of a tiny config, run once."""
    root = tmp_path_factory.mktemp("finished")
    (root / "params.yaml").write_text(yaml.safe_dump(params_to_dict(parse_params(TINY)), sort_keys=False))
    run_stage_functions(parse_params(TINY), Layout(root),
                        include=("bootstrap", "warmstart", "rollout", "validate", "mine", "train"))
    return root


@pytest.fixture
def project(finished_round, tmp_path) -> Layout:
    copy = tmp_path / "project"
    shutil.copytree(finished_round, copy)
    return Layout(copy)


def test_a_train_stage_that_crashes_leaves_the_round_policy_and_metrics_as_they_were(project, monkeypatch):
    before = snapshot(project)

    def crash(*args, **kwargs):
        raise RuntimeError("DeepSpeed fell over")

    monkeypatch.setattr(train, "rl_update", crash)
    with pytest.raises(RuntimeError, match="fell over"):
        train.run(parse_params(TINY), project, 1)
    assert snapshot(project) == before and leftovers(project) == []


def test_rollout_outputs_are_replaced_together_or_not_at_all(project, monkeypatch):
    """The failure hits after steps.parquet and skill_trials.parquet were written (to their temporaries)."""
    before = snapshot(project)
    real = rollout.write_json

    def fail_on_metrics(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(rollout, "write_json", fail_on_metrics)
    with pytest.raises(OSError, match="disk full"):
        rollout.run(parse_params(TINY), project, 1)
    assert snapshot(project) == before and leftovers(project) == []
    monkeypatch.setattr(rollout, "write_json", real)
    rollout.run(parse_params({**TINY, "rollout": {**TINY["rollout"], "scenarios_per_round": 3}}), project, 1)
    after = snapshot(project)
    changed = {k for k in before if before[k] != after[k]}
    assert {"data/rounds/round_1/steps.parquet", "data/rounds/round_1/skill_trials.parquet",
            "metrics/rounds/round_1/rollout.json"} <= changed


def test_a_truncated_pool_fails_the_rollout_before_any_episode(project, monkeypatch):
    before = snapshot(project)
    pool = project.root / "data" / "pool.db"
    pool.write_bytes(pool.read_bytes()[: pool.stat().st_size // 2])
    calls = []
    monkeypatch.setattr(rollout, "run_episodes", lambda *a, **k: calls.append(1) or [])
    with pytest.raises(rollout.PoolError, match="restore it from a backup"):
        rollout.run(parse_params(TINY), project, 1)
    assert calls == [] and snapshot(project) == before


def test_a_missing_previous_bank_is_an_error_not_a_run_without_skills(project):
    shutil.rmtree(project.skills(0))
    with pytest.raises(MissingInputError, match="warmstart"):
        rollout.run(parse_params(TINY), project, 1)
    with pytest.raises(MissingInputError, match="warmstart"):
        mine.run(parse_params(TINY), project, 1)


def test_failing_validation_and_mining_leave_their_outputs(project, monkeypatch):
    before = snapshot(project)
    monkeypatch.setattr(mine, "save_round_bank", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad skill")))
    with pytest.raises(ValueError, match="bad skill"):
        mine.run(parse_params(TINY), project, 1)
    bad = parse_params({**TINY, "validate": {**TINY["validate"], "max_prompt_tokens": 1}})
    with pytest.raises(validate.DataValidationError):
        validate.run(bad, project, 1)
    monkeypatch.setattr(warmstart, "sft_update", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("oom")))
    with pytest.raises(RuntimeError, match="oom"):
        warmstart.run(parse_params(TINY), project)
    assert snapshot(project) == before and leftovers(project) == []


@pytest.mark.parametrize("stage, args, override", [
    ("train", ["--round", "1"], {"train": {"update": {"micro_batch_size": 0}}}),
    ("rollout", ["--round", "1"], {"rollout": {"scenarios_per_round": 0}}),
])
def test_bad_values_exit_2_from_the_cli_and_touch_nothing(project, stage, args, override):
    """The two cases that used to destroy data: train_1 deleted its policy folder then crashed in DeepSpeed; rollout
    with 0 scenarios exited 0 and overwrote steps.parquet with 0 rows."""
    before = snapshot(project)
    raw = yaml.safe_load((project.root / "params.yaml").read_text())
    for section, values in override.items():
        for key, value in values.items():
            raw[section][key] = {**raw[section][key], **value} if isinstance(value, dict) else value
    (project.root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    result = CliRunner().invoke(app, ["stage", stage, *args, "--root", str(project.root)])
    assert result.exit_code == 2, result.output[-2000:]
    assert "must be > 0" in result.output and result.exception is not None and isinstance(result.exception,
                                                                                          SystemExit)
    assert snapshot(project) == before


KILLED_TRAIN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tasks import train
    from tasks.config import load_params
    from tasks.layout import Layout
    import tasks.train as module
    real = module.save_policy
    def slow_save(model, tokenizer, path):
        real(model, tokenizer, path)
        Path(sys.argv[2]).write_text("saved")
        time.sleep(60)                         # killed here: the new policy is complete, not yet swapped in
    module.save_policy = slow_save
    root = Path(sys.argv[1])
    train.run(load_params(root / "params.yaml"), Layout(root), 1)
""")


@pytest.mark.slow
def test_kill_9_inside_a_stage_leaves_outputs_byte_identical_and_the_rerun_completes(project, tmp_path):
    before = snapshot(project)
    flag = tmp_path / "saved"
    # the child picks its own free port: this test process may hold the one in its environment
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAIN, str(project.root), str(flag)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert flag.exists(), "the train stage never reached its save"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert snapshot(project) == before          # the complete new policy was never swapped in
    assert leftovers(project)                   # its temporary is there ...
    train.run(parse_params(TINY), project, 1)   # ... until the rerun sweeps it and replaces the outputs
    assert leftovers(project) == []
    assert (project.policy("round_1") / "config.json").exists()


def test_a_commit_killed_between_its_renames_is_rolled_forward(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "dir"
    a.write_text("old a")
    b.mkdir()
    (b / "f").write_text("old b")
    staged = None
    with staged_outputs(tmp_path, "s", [a, b]) as out:
        out.path(a).write_text("new a")
        out.path(b).mkdir()
        (out.path(b) / "f").write_text("new b")
        staged = out
    assert a.read_text() == "new a" and (b / "f").read_text() == "new b"
    # simulate a crash after the journal and the first rename: a is new, b still old, b's temporary complete
    with pytest.raises(KeyError):
        staged.path(tmp_path / "undeclared")
    journal = tmp_path / JOURNAL_DIR / "s.json"
    tmp_b = tmp_path / ".dir.tmp-x"
    tmp_b.mkdir()
    (tmp_b / "f").write_text("newer b")
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_text('{"entries": [{"tmp": "%s", "target": "%s", "backup": "%s"}]}'
                       % (tmp_b, b, tmp_path / ".dir.old-x"))
    assert recover(tmp_path) == ["s"]
    assert (b / "f").read_text() == "newer b" and not journal.exists() and not tmp_b.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".arlflow", "a.txt", "dir"]
