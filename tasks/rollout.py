"""rollout: G rollouts per train scenario with the current policy; every step into the data pool; Parquet export."""
from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import replace
from typing import Any

from agents.rollout import run_episodes, summarize
from datapool.parquet import export_steps
from datapool.quality import STEPLESS, stepless_groups
from datapool.records import TrajectoryRecord
from datapool.store import DataPool
from skills.lifecycle import RoundBank, load_round_bank
from tasks.common import play_options, read_scenarios, seed_everything, skill_program, write_json
from tasks.skill_trials import trial_frame, write_trials
from tasks.config import Params, params_to_dict
from tasks.engines import open_engine
from tasks.layout import Layout, behaviour_round, policy_name, require, stage_pool_url
from tasks.outputs import staged_outputs


def policy_version(round_index: int, max_staleness: int = 0) -> str:
    """The name of the policy rollout of round r samples with (pipeline.max_staleness k): round max(0, r-1-k)'s."""
    return policy_name(behaviour_round(round_index, max_staleness))


def policy_producer(round_index: int, max_staleness: int = 0) -> str:
    """The stage that writes that policy: warmstart, or train_<round>."""
    source = behaviour_round(round_index, max_staleness)
    return "warmstart" if source == 0 else f"train_{source}"


def mark_staleness(trajectories: list[TrajectoryRecord], staleness: int) -> list[TrajectoryRecord]:
    """Every step records how many rounds its sampling policy lags the one train_r starts from."""
    if staleness == 0:
        return trajectories
    return [replace(traj, steps=[replace(step, staleness=staleness) for step in traj.steps]) for traj in trajectories]


def tag_attempt(trajectories: list[TrajectoryRecord], attempt: str) -> list[TrajectoryRecord]:
    """Make trajectory ids unique per stage attempt, so a rerun (other params, same policy) never collides."""
    tagged = []
    for traj in trajectories:
        new_id = f"{attempt}/{traj.trajectory_id}"
        steps = [replace(step, trajectory_id=new_id) for step in traj.steps]
        tagged.append(replace(traj, trajectory_id=new_id, steps=steps,
                              metadata={**traj.metadata, "attempt": attempt}))
    return tagged


def attempt_id(params: Params, layout: Layout, round_index: int) -> str:
    """Content hash of what determines this rollout (policy weights, skill bank, params, round): a rerun with the same
    inputs reproduces the same trajectory ids, which the pool stores once (idempotent); anything else gets new ids."""
    digest = hashlib.sha256()
    for folder in (layout.rollout_policy(round_index, params.pipeline.max_staleness), layout.skills(round_index - 1)):
        for path in sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    digest.update(json.dumps([params_to_dict(params)[s] for s in ("pipeline", "env", "harness", "rollout", "skills")],
                             sort_keys=True).encode())
    digest.update(str(round_index).encode())
    return digest.hexdigest()[:10]


def count_informative_groups(trajectories: list[TrajectoryRecord]) -> int:
    """Groups whose returns are not all equal (a group-normalized advantage is non-zero for some member)."""
    returns: dict[str, set[float]] = {}
    for traj in trajectories:
        returns.setdefault(traj.group_id, set()).add(traj.episode_return)
    return sum(len(values) > 1 for values in returns.values())


class PoolError(RuntimeError):
    """The data pool cannot be opened, is corrupt, or is not writable: nothing was generated."""


def open_checked_pool(url: str) -> DataPool:
    """The pool at ``url``, opened (schema checked or migrated) and, for SQLite, integrity-checked: a truncated or
    corrupt file is found before any episode is generated, not after."""
    try:
        pool = DataPool(url)
    except Exception as err:  # noqa: BLE001 - any backend error means the same thing to the user
        raise PoolError(f"data pool {url} cannot be opened ({type(err).__name__}: {err}); restore it from a backup "
                        "or point rollout.pool_url at a fresh one, then rerun the stage") from err
    problem = pool.integrity_problem()
    if problem:
        pool.close()
        raise PoolError(f"data pool {url} is corrupt ({problem}); restore it from a backup or point "
                        "rollout.pool_url at a fresh one, then rerun the stage")
    return pool


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    """G rollouts per scenario of this round. Inputs (policy, scenarios, the previous bank, the pool) are checked
    before any episode runs; steps.parquet, skill_trials.parquet and rollout.json replace the old ones together."""
    cfg = params.rollout
    seed = params.pipeline.seed * 1000 + round_index
    seed_everything(seed)
    lag = params.pipeline.max_staleness
    version, producer = policy_version(round_index, lag), policy_producer(round_index, lag)
    policy = require(layout.rollout_policy(round_index, lag), producer)
    staleness = (round_index - 1) - behaviour_round(round_index, lag)
    train = read_scenarios(layout, "train")
    order = random.Random(seed).sample(train, len(train))  # this round's scenario order; batches take the next ones
    # round 0's bank is the warm start's (always written): a missing bank is an error, not a run without skills
    bank = (load_round_bank(require(layout.skills(round_index - 1),
                                    "warmstart" if round_index == 1 else f"mine_{round_index - 1}"))
            if cfg.use_skills else RoundBank())
    pool_url = stage_pool_url(layout, cfg.pool_url)  # inside `dvc exp run`: the experiment's own pool
    open_checked_pool(pool_url).close()
    program = skill_program(bank, params)
    sampling = replace(cfg.sampling, seed=seed)

    # cheap checks above, servers (engine.kind vllm) last: the handoff is verified before the first episode
    with open_engine(params, layout, policy, version, producer,
                     stage=f"rollout_{round_index}") as (engine, engine_stats):
        started = time.perf_counter()
        trajectories: list[TrajectoryRecord] = []
        informative, batches, used = 0, 0, 0
        # DAPO-style dynamic sampling: degenerate groups (all returns equal) carry no signal; draw fresh scenarios
        # for the shortfall until scenarios_per_round informative groups exist or max_generation_batches is reached.
        while batches < cfg.max_generation_batches and used < len(order):
            wanted = cfg.scenarios_per_round if batches == 0 else cfg.scenarios_per_round - informative
            if wanted <= 0:
                break
            batch = order[used: used + wanted]
            used += len(batch)
            batches += 1
            program.plan(batch, cfg.group_size, seed + 7919 * (batches - 1))
            new = run_episodes(engine, engine.tokenizer, batch, group_size=cfg.group_size,
                               sampling=replace(sampling, seed=seed + 7919 * (batches - 1)),
                               round_index=round_index, **play_options(params, layout),
                               skills_for=program.skills_for if program.active else None,
                               seed=seed + 7919 * (batches - 1))
            informative += count_informative_groups(new)
            trajectories += new
        elapsed = time.perf_counter() - started
    attempt = attempt_id(params, layout, round_index)
    trajectories = mark_staleness(tag_attempt(trajectories, attempt), staleness)
    if not trajectories:
        raise RuntimeError(f"rollout_{round_index} produced no trajectory (train scenarios: {len(order)}); earlier "
                           "outputs were left as they are")
    trials = trial_frame(trajectories, program)

    with open_checked_pool(pool_url) as pool:
        pool.add_trajectories(trajectories)
        frame = pool.steps_frame(round=round_index)
    frame = frame[frame["trajectory_id"].str.startswith(f"{attempt}/")]

    metrics = summarize(trajectories)
    tokens = sum(t.response_tokens for t in trajectories)
    metrics.update({"round": round_index, "steps": len(frame), "wall_time_s": elapsed, "generation_batches": batches,
                    "informative_groups": informative, "batch_full": informative >= cfg.scenarios_per_round,
                    "sampled_tokens_per_s": tokens / max(elapsed, 1e-9), "skills_in_prompt": program.active,
                    "engine": engine_stats, "policy_version": version, "staleness": staleness,
                    "skills_live": len(bank.live), "skills_candidates": len(bank.candidates),
                    "skill_tests": {test or "none": int(n) for test, n in
                                    trials.drop_duplicates("group_id")["test"].value_counts().items()}})
    outputs = [layout.steps(round_index), layout.skill_trials(round_index), layout.round_metrics(round_index, "rollout")]
    with staged_outputs(layout.root, f"rollout_{round_index}", outputs) as out:
        export_steps(frame, out.path(outputs[0]), metadata={
            "round": round_index, "policy_version": version, "attempt": attempt,
            STEPLESS: stepless_groups(trajectories)})  # episodes that failed at reset: present, not lost
        write_trials(trials, out.path(outputs[1]))
        write_json(out.path(outputs[2]), metrics)
    return metrics
