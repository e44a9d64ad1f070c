"""kill -9 of every stage of a one-round pipeline at a seeded random point, then a rerun: the rerun's outputs equal
those of an uninterrupted run on the same inputs, and the killed run left nothing a later stage would read as
valid. Every stage runs as its own process, ``arlflow stage NAME [--round N]`` (conftest.StageProcesses).

Outputs compared: the stage's DVC outs, metrics and plots (flows/dvc_sync.stage_spec) file by file, plus the data
pool's rows after rollout. Fields left out of the comparison, because they measure the run and not its result:
``wall_time_s``, ``sampled_tokens_per_s``, ``tokens_per_s`` (JSON metrics) and the pool's ``wall_time_s`` /
``created_at``; the Data Docs of validate (its pages and paths carry the validation's run time: only the files'
names, with the run-time folder dropped, are compared, and the report's ``data_docs`` link is left out); and ``registered_version`` in train.json: the MLflow registry numbers every registration, and a
train killed after registering its policy makes the rerun's version the next number (the registered weights are
the same). Everything else must be byte-identical (JSON compared as parsed values).
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import yaml

from datapool.store import DataPool
from flows.dvc_sync import stage_spec
from flows.stages import dvc_stage_name, stage_sequence
from tasks.config import load_params, params_to_dict, parse_params
from tasks.layout import Layout
from tasks.outputs import JOURNAL_DIR, recover

TINY = {
    "pipeline": {"rounds": 1, "seed": 3},
    "bootstrap": {"train_scenarios": 12, "heldout_scenarios": 4, "tokenizer_corpus_episodes": 12,
                  "tiny": {"hidden_size": 32, "intermediate_size": 64}},
    "warmstart": {"demo_scenarios": 12, "update": {"epochs": 1, "micro_batch_size": 32}},
    "rollout": {"scenarios_per_round": 4, "group_size": 4},
    "validate": {"drop_zero_variance": False},
    "mine": {"min_support": 0.1},
    "train": {"update": {"micro_batch_size": 64, "epochs": 1}},
    "transfer": {"model": {"hidden_size": 32, "intermediate_size": 64}, "pretrained": []},
}
SEQUENCE = stage_sequence(TINY["pipeline"]["rounds"])
KILL_SEED = 14
VOLATILE = {"wall_time_s", "sampled_tokens_per_s", "tokens_per_s", "registered_version", "data_docs"}
POOL_VOLATILE = ["wall_time_s", "created_at"]


def kill_fraction(label: str) -> float:
    """Where in its measured run time the stage is killed (seeded per stage: the same in every run)."""
    return round(random.Random(f"{KILL_SEED}:{label}").uniform(0.05, 0.8), 2)


CASES = [pytest.param(stage, r, kill_fraction(dvc_stage_name(stage, r)),
                      id=f"{dvc_stage_name(stage, r)}-at-{kill_fraction(dvc_stage_name(stage, r)):.0%}")
         for stage, r in SEQUENCE]


def write_project(root: Path, raw: dict) -> Layout:
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params_to_dict(parse_params(raw)), sort_keys=False))
    return Layout(root)


def stage_outputs(layout: Layout, stage: str, round_index: int | None) -> list[str]:
    """The paths DVC tracks for the stage (outs, metrics, plots), relative to the project root."""
    spec = stage_spec(stage, round_index, load_params(layout.root / "params.yaml"), layout)
    plots = [next(iter(p)) if isinstance(p, dict) else p for p in spec.get("plots", [])]
    return spec.get("outs", []) + spec.get("metrics", []) + plots


def _without_volatile(value):
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def file_content(path: Path) -> str:
    if path.suffix == ".json":
        return json.dumps(_without_volatile(json.loads(path.read_text())), sort_keys=True)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def contents(root: Path, rel: str) -> dict[str, str] | None:
    """Every file of an output (a file or a folder) -> its compared content; None when the output is absent."""
    path = root / rel
    if not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if path.name == "data_docs":  # validations/<suite>/<run name>/<run time>/<batch>.html: the run time varies
        return {"pages": sorted(f"validations/.../{f.name}" if "validations" in f.relative_to(path).parts
                                else str(f.relative_to(path)) for f in files)}
    return {str(f.relative_to(root)): file_content(f) for f in files}


def pool_rows(layout: Layout) -> dict[str, set[str]]:
    """The pool's trajectory and step rows (volatile columns dropped), one JSON string each."""
    if not (layout.root / "data" / "pool.db").exists():
        return {"trajectories": set(), "steps": set()}
    with DataPool(layout.pool_url) as pool:
        frames = {"trajectories": pool.trajectories_frame(), "steps": pool.steps_frame()}
    return {name: {json.dumps(row, sort_keys=True, default=str)
                   for row in frame.drop(columns=POOL_VOLATILE, errors="ignore").to_dict("records")}
            for name, frame in frames.items()}


def partial_trajectories(layout: Layout) -> list[str]:
    """Trajectories in the pool with fewer (or more) stored steps than their ``num_steps``."""
    if not (layout.root / "data" / "pool.db").exists():
        return []
    with DataPool(layout.pool_url) as pool:
        trajectories, steps = pool.trajectories_frame(), pool.steps_frame()
    stored = steps.groupby("trajectory_id").size()
    return sorted(t for t, n in zip(trajectories["trajectory_id"], trajectories["num_steps"])
                  if int(stored.get(t, 0)) != int(n))


def leftovers(root: Path) -> list[str]:
    """Temporaries and backups of the commit protocol, and commit journals (tasks/outputs.py)."""
    found = [p for p in root.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]
    found += list((root / JOURNAL_DIR).glob("*.json")) if (root / JOURNAL_DIR).is_dir() else []
    return sorted(str(p.relative_to(root)) for p in found)


@pytest.fixture(scope="module")
def reference(stages, tmp_path_factory) -> dict:
    """The uninterrupted pipeline: every stage's outputs and measured run time (fork to exit)."""
    layout = write_project(tmp_path_factory.mktemp("uninterrupted"), TINY)
    outputs, times = {}, {}
    for stage, r in SEQUENCE:
        label = dvc_stage_name(stage, r)
        done = stages.run(layout.root, stage, r)
        assert done.exit == 0, f"uninterrupted {label} failed (exit {done.exit}): {done.log.read_text()[-3000:]}"
        times[label] = done.wall_s
        outputs[label] = {rel: contents(layout.root, rel) for rel in stage_outputs(layout, stage, r)}
        assert all(v is not None for v in outputs[label].values()), (label, outputs[label])
    for stage, r in SEQUENCE:  # no stage rewrote an earlier stage's outputs
        label = dvc_stage_name(stage, r)
        assert {rel: contents(layout.root, rel) for rel in outputs[label]} == outputs[label], label
    return {"layout": layout, "outputs": outputs, "times": times, "pool": pool_rows(layout)}


@pytest.fixture(scope="module")
def killed_project(tmp_path_factory) -> dict:
    """The project every stage is killed in, then rerun (``done``: the stages that passed, in order)."""
    return {"layout": write_project(tmp_path_factory.mktemp("killed"), TINY), "failed": None, "done": []}


@pytest.mark.slow
@pytest.mark.parametrize("stage, round_index, fraction", CASES)
def test_kill_9_at_a_random_point_then_rerun_gives_the_uninterrupted_outputs(stages, reference, killed_project,
                                                                              stage, round_index, fraction):
    label = dvc_stage_name(stage, round_index)
    if killed_project["failed"]:
        pytest.skip(f"an earlier stage failed in the killed project ({killed_project['failed']})")
    killed_project["failed"] = label   # cleared at the end
    layout: Layout = killed_project["layout"]
    expected = reference["outputs"][label]
    delay = fraction * reference["times"][label]
    where = f"{label} SIGKILLed {delay:.2f} s after start ({fraction:.0%} of its {reference['times'][label]:.2f} s)"

    killed = stages.run(layout.root, stage, round_index, kill_after_s=delay, log_name=f"{label}.killed")
    if not killed.killed and killed.exit == 0:
        # it ran faster than the measured run (load varies): kill a second run at the same fraction of its time
        delay = fraction * killed.wall_s
        where += f"; it finished first, so its rerun was SIGKILLed {delay:.2f} s after start"
        killed = stages.run(layout.root, stage, round_index, kill_after_s=delay, log_name=f"{label}.killed")
    assert killed.killed, f"{where}: it was not killed (exit {killed.exit}): {killed.log.read_text()[-2000:]}"
    # what a later stage reads (every stage first rolls forward a commit a kill cut short: tasks/outputs.py)
    in_commit = (layout.root / JOURNAL_DIR / f"{label}.json").exists()
    recover(layout.root)
    after_kill = {rel: contents(layout.root, rel) for rel in expected}
    present = sorted(rel for rel, value in after_kill.items() if value is not None)
    assert present in ([], sorted(expected)), f"{where}: only some outputs exist after it: {present}"
    for rel in present:
        assert after_kill[rel] == expected[rel], f"{where}: {rel} exists but differs from the uninterrupted run's"
    pool_after_kill = pool_rows(layout)
    assert pool_after_kill["trajectories"] <= reference["pool"]["trajectories"], f"{where}: foreign pool rows"
    assert pool_after_kill["steps"] <= reference["pool"]["steps"], f"{where}: foreign pool steps"
    assert partial_trajectories(layout) == [], f"{where}: the pool holds trajectories with missing steps"
    stray = leftovers(layout.root)

    rerun = stages.run(layout.root, stage, round_index)
    assert rerun.exit == 0, f"{where}; the rerun failed (exit {rerun.exit}): {rerun.log.read_text()[-3000:]}"
    done = killed_project["done"]
    for checked in [*done, label]:   # this stage's outputs, and the earlier stages' left as they were
        for rel, value in reference["outputs"][checked].items():
            assert contents(layout.root, rel) == value, f"{where}; after the rerun {rel} differs from the " \
                                                        "uninterrupted run's"
    assert leftovers(layout.root) == [], f"{where}; temporaries or journals outlived the rerun"
    assert not (stage == "train" and layout.train_checkpoints(1).exists()), "train's resume state outlived it"
    pool = pool_rows(layout)
    after_rollout = SEQUENCE.index((stage, round_index)) >= SEQUENCE.index(("rollout", 1))
    wanted = reference["pool"] if after_rollout else {"trajectories": set(), "steps": set()}
    lost = {name: len(wanted[name] - pool[name]) for name in wanted}
    extra = {name: len(pool[name] - wanted[name]) for name in wanted}
    assert pool == wanted, f"{where}; pool rows lost {lost}, extra {extra}"
    done.append(label)
    killed_project["failed"] = None
    state = "inside its commit" if in_commit else "outputs after kill: " + ("all" if present else "none")
    print(f"{where}: {state}, {len(stray)} temporaries left, swept by the rerun ({rerun.wall_s:.2f} s); "
          f"{len(expected)} outputs identical; pool {len(pool['trajectories'])} trajectories / "
          f"{len(pool['steps'])} steps, lost {lost}")


@pytest.mark.slow
def test_a_stage_run_right_after_a_commit_killed_midway_reads_the_committed_outputs(stages, reference,
                                                                                    tmp_path):
    """bootstrap, rerun with a bigger base model, dies right after the first rename of its commit (the scenarios
    are in place, the old base policy is still there); the next stage run directly (``arlflow stage warmstart``,
    not via DVC, which would rerun bootstrap) must warm-start the NEW base, not the one bootstrap replaced."""
    root = tmp_path / "project"
    shutil.copytree(reference["layout"].root, root, ignore=shutil.ignore_patterns("logs"))
    layout = Layout(root)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["bootstrap"]["tiny"]["hidden_size"] = 48
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    cut = stages.run(root, "bootstrap", kill_at="commit")
    assert cut.killed, f"bootstrap was not killed in its commit (exit {cut.exit}): {cut.log.read_text()[-2000:]}"
    assert (root / JOURNAL_DIR / "bootstrap.json").exists()
    assert json.loads((layout.policy("base") / "config.json").read_text())["hidden_size"] == 32  # not swapped yet

    done = stages.run(root, "warmstart")
    assert done.exit == 0, done.log.read_text()[-3000:]
    assert leftovers(root) == []
    base = json.loads((layout.policy("base") / "config.json").read_text())["hidden_size"]
    warm = json.loads((layout.policy("warmstart") / "config.json").read_text())["hidden_size"]
    assert base == 48 and warm == 48, (f"warmstart trained a {warm}-wide model while the base it depends on is "
                                       f"{base} wide: it read its input before rolling bootstrap's commit forward")


@pytest.mark.slow
def test_a_stage_killed_while_mlflow_creates_its_store_leaves_one_the_next_stage_opens(stages, tmp_path):
    """The first stage of a project creates the MLflow store (mlflow.db): killed among MLflow's migrations, it
    used to leave a half-made store that every later stage failed to open ("table ... already exists")."""
    layout = write_project(tmp_path / "project", TINY)
    cut = stages.run(layout.root, "curate", kill_at="mlflow-store", log_name="curate.killed")
    assert cut.killed, f"curate was not killed in the store's creation (exit {cut.exit}): {cut.log.read_text()[-2000:]}"
    done = stages.run(layout.root, "curate")
    assert done.exit == 0, f"the stage after the kill cannot use the store: {done.log.read_text()[-2000:]}"
    assert leftovers(layout.root) == [] and not list(layout.root.glob(".mlflow.db.tmp-*"))
