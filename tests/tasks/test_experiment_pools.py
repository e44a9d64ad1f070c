"""Experiments keep their data apart: inside `dvc exp run` (workspace, --temp, queued) a stage's data pool is the
experiment's own data/pools/NAME@BASELINE.db of the workspace, a copy of the workspace's pool made by its first
writer; the workspace's data/pool.db (the baseline's view: `arlflow pool`, the gateway's UI) never changes."""
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from datapool.store import DataPool
from tasks import curate
from tasks.config import parse_params
from tasks.layout import Layout, copy_sqlite, experiment_of, stage_pool_url, workspace_root
from tests.datapool.records_helpers import full_trajectory

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
REV = "0123456789abcdef0123456789abcdef01234567"


def experiment_env(name: str, repo: Path | None = None) -> dict[str, str]:
    """The variables `dvc exp run` sets for a stage (dvc/repo/experiments/queue/base.py, _stash_exp)."""
    return {"DVC_EXP_NAME": name, "DVC_EXP_BASELINE_REV": REV, **({"DVC_ROOT": str(repo)} if repo else {})}


def ids(url: str) -> set[str]:
    with DataPool(url) as pool:
        return set(pool.trajectories_frame()["trajectory_id"])


def seed_pool(url: str, *tids: str) -> None:
    with DataPool(url) as pool:
        pool.add_trajectories([full_trajectory(t) for t in tids])


# ------------------------------------------------------------------------------------------ which pool resolves


def test_outside_an_experiment_the_workspace_pool_is_used(tmp_path):
    layout = Layout(tmp_path)
    assert experiment_of({}) is None and experiment_of({"DVC_ROOT": str(tmp_path)}) is None  # plain `dvc repro`
    assert stage_pool_url(layout, "", {"DVC_ROOT": str(tmp_path)}) == layout.pool_url
    assert stage_pool_url(layout, "postgresql+psycopg://u@db/pool", {}) == "postgresql+psycopg://u@db/pool"


def test_an_experiment_writes_its_own_copy_of_the_workspace_pool(tmp_path):
    layout = Layout(tmp_path)
    seed_pool(layout.pool_url, "base/a", "base/b")
    with DataPool(layout.pool_url) as pool:
        pool.curate("base/a", excluded=True, label="bad")
    env = experiment_env("lr-test")
    assert experiment_of(env) == "lr-test@0123456"

    # a reader before any write: the workspace's pool as it is, nothing copied
    assert stage_pool_url(layout, "", env, writes=False) == layout.pool_url
    assert not layout.experiment_pools_dir.exists()

    url = stage_pool_url(layout, "", env)
    assert url == f"sqlite:///{tmp_path / 'data' / 'pools' / 'lr-test@0123456.db'}"
    assert ids(url) == {"base/a", "base/b"}  # inherits the baseline's data and curation
    with DataPool(url) as pool:
        assert pool.curation_of("base/a")["trajectory"]["label"] == "bad"
        pool.add_trajectories([full_trajectory("exp/a")])
    assert ids(layout.pool_url) == {"base/a", "base/b"}  # the baseline's view is unchanged
    seed_pool(layout.pool_url, "base/c")  # later baseline data does not reach the existing experiment pool
    assert stage_pool_url(layout, "", env) == url and ids(url) == {"base/a", "base/b", "exp/a"}
    assert stage_pool_url(layout, "", env, writes=False) == url  # readers follow once it exists
    assert not list(layout.experiment_pools_dir.glob(".*"))  # no partial copy left behind


def test_a_temp_or_queued_experiment_writes_into_the_workspace_not_its_copy(tmp_path):
    workspace = tmp_path / "repo"
    copy = workspace / ".dvc" / "tmp" / "exps" / "standalone" / "tmpab12"
    for repo in (workspace, copy):  # the copy is a clone: it has its own .dvc folder
        (repo / ".dvc").mkdir(parents=True, exist_ok=True)
    seed_pool(Layout(workspace).pool_url, "base/a")
    env = experiment_env("queued", repo=workspace)
    assert workspace_root(copy, env) == workspace
    url = stage_pool_url(Layout(copy), "", env)
    assert url == f"sqlite:///{Layout(workspace).experiment_pool('queued@0123456')}"
    assert ids(url) == {"base/a"} and not (copy / "data").exists()
    # a project in a subfolder of the repository maps to the same subfolder of the workspace
    assert workspace_root(copy / "project", env) == workspace / "project"


def test_an_explicit_pool_url_is_kept_and_a_warning_says_it_is_shared(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="arlflow.layout"):
        url = stage_pool_url(Layout(tmp_path), "sqlite:////srv/shared.db", experiment_env("x"))
    assert url == "sqlite:////srv/shared.db"
    assert "x@0123456 uses that pool, shared with the baseline" in caplog.text


def test_a_temp_or_queued_experiment_logs_into_the_workspace_mlflow_store(tmp_path, monkeypatch):
    """The copy DVC runs a --temp or queued experiment in is deleted afterwards, and its MLflow runs with it."""
    from tasks.tracking import configure

    workspace = tmp_path / "repo"
    copy = workspace / ".dvc" / "tmp" / "exps" / "standalone" / "tmpab12"
    (workspace / ".dvc").mkdir(parents=True)
    (copy / ".dvc").mkdir(parents=True)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, value in experiment_env("lr-test", workspace).items():
        monkeypatch.setenv(name, value)
    assert configure(Layout(copy), "exp") == Layout(workspace).mlflow_uri
    assert Layout(workspace).mlflow_db.exists() and not Layout(copy).mlflow_db.exists()


def test_a_failed_copy_leaves_no_experiment_pool(tmp_path):
    source, target = tmp_path / "pool.db", tmp_path / "pools" / "e@1.db"
    source.write_bytes(b"this is not a database" * 100)
    with pytest.raises(OSError, match="cannot copy the data pool .*pool.db to .*e@1.db"):
        copy_sqlite(source, target)
    assert list(target.parent.iterdir()) == []


def test_find_experiment_pool_by_name_or_name_at_baseline(tmp_path):
    layout = Layout(tmp_path)
    for name in ("hot@1111111", "hot@2222222", "cold@1111111"):
        seed_pool(f"sqlite:///{layout.experiment_pool(name)}")
    assert layout.find_experiment_pool("cold") == layout.experiment_pool("cold@1111111")
    assert layout.find_experiment_pool("hot@2222222") == layout.experiment_pool("hot@2222222")
    with pytest.raises(ValueError, match="several experiment pools match 'hot'.*hot@1111111, hot@2222222"):
        layout.find_experiment_pool("hot")
    with pytest.raises(ValueError, match="no experiment pool named 'warm'"):
        layout.find_experiment_pool("warm")


def test_curation_made_in_an_experiment_stays_out_of_the_baseline_snapshot(tmp_path, monkeypatch):
    layout, params = Layout(tmp_path), parse_params({"pipeline": {"rounds": 3}})
    seed_pool(layout.pool_url, "base/a")  # round 3 (full_trajectory)
    monkeypatch.setenv("DVC_EXP_NAME", "curated")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", REV)
    with DataPool(stage_pool_url(layout)) as pool:  # as a gateway on the experiment's pool would
        pool.curate("base/a", excluded=True)
    assert curate.run(params, layout)["round_3"]["excluded_trajectories"] == 1
    monkeypatch.delenv("DVC_EXP_NAME")
    assert curate.run(params, layout)["round_3"]["excluded_trajectories"] == 0


# ------------------------------------------------------------------------------------------ real `dvc exp run`

STAGE = """\
import json, sys
from pathlib import Path
sys.path[:0] = [{repo!r}]
import yaml
from datapool.store import DataPool
from tasks.layout import Layout, stage_pool_url
from tests.datapool.records_helpers import full_trajectory

seed = yaml.safe_load(Path("params.yaml").read_text())["seed"]
ids = [f"seed{{seed}}/t{{i}}" for i in range(2)]  # deterministic, like the rollout stage's attempt ids
with DataPool(stage_pool_url(Layout(Path.cwd()))) as pool:
    pool.add_trajectories([full_trajectory(t) for t in ids])
Path("out.json").write_text(json.dumps(ids))
"""


def git_env() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.update({k: "arlflow-test" for k in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME")})
    env.update({k: "test@arlflow.invalid" for k in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL")})
    for inherited in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "DVC_ROOT", "PREFECT_API_URL", "MLFLOW_TRACKING_URI",
                      "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(inherited, None)
    return env


def sh(root: Path, *args: str) -> str:
    done = subprocess.run(list(args), cwd=root, capture_output=True, text=True, env=git_env())
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def commit_baseline(root: Path) -> str:
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "baseline")
    return sh(root, "git", "rev-parse", "HEAD").strip()


@pytest.fixture()
def script_project(tmp_path) -> Path:
    """A git + DVC project whose one stage writes two trajectories (ids from params' seed) to the pool."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "write_pool.py").write_text(STAGE.format(repo=str(REPO)))
    (root / "params.yaml").write_text("seed: 1\n")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"write": {
        "cmd": f"{sys.executable} write_pool.py", "deps": ["write_pool.py"], "params": ["seed"],
        "outs": ["out.json"]}}}))
    (root / ".gitignore").write_text("/data/\n")
    sh(root, "git", "init", "-q")
    sh(root, str(BIN / "dvc"), "init", "-q")
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ui_trajectory_ids(root: Path, policy: Path, *pool_args: str) -> set[str]:
    """The trajectory ids the gateway's UI lists, serving from `root` (`arlflow gateway serve ... --allow-no-auth`)."""
    port = free_port()
    env = {**git_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.gateway_cli", "serve", "--policy", str(policy), "--port",
                             str(port), "--allow-no-auth", *pool_args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/ui/api/trajectories", timeout=2)
                if reply.status_code == 200:
                    return {row["trajectory_id"] for row in reply.json()["trajectories"]}
            except httpx.TransportError:
                time.sleep(0.2)
        raise TimeoutError("the gateway did not start")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_dvc_exp_run_never_writes_into_the_baseline_pool(script_project, tiny_policy_dir):
    root, layout = script_project, Layout(script_project)
    dvc = str(BIN / "dvc")
    sh(root, dvc, "repro")
    baseline = commit_baseline(root)[:7]
    assert ids(layout.pool_url) == {"seed1/t0", "seed1/t1"}

    sh(root, dvc, "exp", "run", "--temp", "-S", "seed=3", "-n", "tmp")  # runs in .dvc/tmp/exps/, then deleted
    sh(root, dvc, "exp", "run", "-S", "seed=2", "-n", "ws")  # in the workspace: the measured case
    assert ids(layout.pool_url) == {"seed1/t0", "seed1/t1"}  # the baseline's view is untouched
    temp_pool, ws_pool = (layout.experiment_pool(f"{n}@{baseline}") for n in ("tmp", "ws"))
    assert ids(f"sqlite:///{temp_pool}") == {"seed1/t0", "seed1/t1", "seed3/t0", "seed3/t1"}
    assert ids(f"sqlite:///{ws_pool}") == {"seed1/t0", "seed1/t1", "seed2/t0", "seed2/t1"}
    assert set(json.loads((root / "out.json").read_text())) == {"seed2/t0", "seed2/t1"}  # the ws run's outputs

    sh(root, dvc, "exp", "run", "-f", "-S", "seed=2", "-n", "ws")  # a rerun of the same experiment
    with DataPool(f"sqlite:///{ws_pool}") as pool:
        assert pool.counts()["trajectories"] == 4  # the same ids, stored once

    # the gateway's UI: the baseline's pool by default, the experiment's when asked by name
    assert ui_trajectory_ids(root, tiny_policy_dir) == {"seed1/t0", "seed1/t1"}
    assert ui_trajectory_ids(root, tiny_policy_dir, "--experiment", "ws") == ids(f"sqlite:///{ws_pool}")


def test_gateway_refuses_an_unknown_experiment_or_two_pools(tmp_path, tiny_policy_dir, monkeypatch):
    from typer.testing import CliRunner

    from flows.gateway_cli import gateway_app

    monkeypatch.chdir(tmp_path)
    seed_pool(f"sqlite:///{Layout(tmp_path).experiment_pool('hot@1111111')}")
    unknown = CliRunner().invoke(gateway_app, ["serve", "--policy", str(tiny_policy_dir), "--experiment", "cold"])
    assert unknown.exit_code == 2 and "no experiment pool named 'cold'" in unknown.output
    assert "hot@1111111" in unknown.output
    both = CliRunner().invoke(gateway_app, ["serve", "--policy", str(tiny_policy_dir), "--experiment", "hot",
                                            "--pool-url", "sqlite:///x.db"])
    assert both.exit_code == 2 and "not both" in both.output


def test_pool_commands_open_an_experiment_pool_by_name(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flows.pool_cli import pool_app

    monkeypatch.chdir(tmp_path)
    seed_pool(Layout(tmp_path).pool_url, "base/a")
    seed_pool(f"sqlite:///{Layout(tmp_path).experiment_pool('hot@1111111')}", "exp/a", "exp/b")
    shown = CliRunner().invoke(pool_app, ["stats", "--experiment", "hot"])
    assert shown.exit_code == 0 and json.loads(shown.output)["trajectories"] == 2, shown.output
    listed = CliRunner().invoke(pool_app, ["ls", "--experiment", "hot@1111111", "--json"])
    assert {row["trajectory_id"] for row in json.loads(listed.output)} == {"exp/a", "exp/b"}
    assert json.loads(CliRunner().invoke(pool_app, ["stats"]).output)["trajectories"] == 1  # the baseline's view
    both = CliRunner().invoke(pool_app, ["stats", "--experiment", "hot", "--url", "x.db"])
    assert both.exit_code == 2 and "not both" in both.output and not (tmp_path / "x.db").exists()
    unknown = CliRunner().invoke(pool_app, ["stats", "--experiment", "cold"])
    assert unknown.exit_code == 2 and "no experiment pool named 'cold'" in unknown.output


# the pipeline's own stages: the rollout of an experiment (`dvc exp run rollout_1 -S ...`) on a tiny project
SMALL = {"pipeline": {"rounds": 1, "seed": 3},
         "bootstrap": {"train_scenarios": 12, "heldout_scenarios": 4, "tokenizer_corpus_episodes": 20,
                       "tiny": {"hidden_size": 32, "intermediate_size": 64}},
         "warmstart": {"enabled": False},
         "rollout": {"scenarios_per_round": 3, "group_size": 2, "use_skills": False}}


@pytest.mark.slow
def test_the_rollout_stage_of_an_experiment_keeps_its_data_apart(tmp_path):
    from datapool.parquet import read_steps
    from tasks import bootstrap, rollout, warmstart
    from tests.projects import make_project

    layout, params = make_project(tmp_path, SMALL), parse_params(SMALL)
    for run in (bootstrap.run, warmstart.run, lambda p, lay: rollout.run(p, lay, 1)):  # the baseline, in-process
        run(params, layout)
    dvc = str(BIN / "dvc")
    sh(tmp_path, dvc, "commit", "-f", "-q", "bootstrap", "warmstart", "rollout_1")  # as `dvc repro` records them
    baseline_ids = ids(layout.pool_url)
    assert len(baseline_ids) == 3 * 2
    baseline = commit_baseline(tmp_path)[:7]

    sh(tmp_path, dvc, "exp", "run", "rollout_1", "-S", "rollout.sampling.temperature=0.7", "-n", "cool")
    assert ids(layout.pool_url) == baseline_ids
    exp_ids = ids(f"sqlite:///{layout.experiment_pool(f'cool@{baseline}')}")
    frame, _ = read_steps(layout.steps(1))  # the experiment's exported round: the DVC-versioned truth
    assert set(frame["trajectory_id"]) == exp_ids - baseline_ids and len(exp_ids) == 2 * len(baseline_ids)
    # the Parquet alone rebuilds the experiment's round in any pool
    sh(tmp_path, str(BIN / "arlflow"), "pool", "import", str(layout.steps(1)), "--url", "data/rebuilt.db")
    assert ids(f"sqlite:///{tmp_path / 'data' / 'rebuilt.db'}") == exp_ids - baseline_ids
