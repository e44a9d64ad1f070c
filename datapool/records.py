"""Step and trajectory records: what the rollout loop and the gateway produce and the data pool stores, and the
checks a record must pass before it is stored.

Token ids are the ids the engine sampled; they are never re-tokenized from text (a step whose upstream could only
return text is re-tokenized and flagged ``retokenized``; the quality gate rejects it by default).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TRAJECTORY_STATUSES = ("complete", "truncated", "failed", "open")
""""open": a gateway trajectory still receiving steps; the other three are final."""
FINAL_STATUSES = ("complete", "truncated", "failed")

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass
class StepRecord:
    trajectory_id: str
    group_id: str            # one group = the G rollouts of one scenario under one policy version
    step_index: int
    prompt_ids: list[int]     # exactly the ids fed to the engine
    response_ids: list[int]   # exactly the ids the engine sampled (eos included when produced)
    logprobs: list[float]     # rollout log-prob of each response id, len == len(response_ids)
    prompt_text: str
    observation: str          # env observation this step acted on
    action: str               # parsed action ("" when invalid)
    response_text: str        # decoded response
    reward: float
    anchor: str               # canonical env state (str of the env's hashable anchor)
    policy_version: str
    action_valid: bool = True
    truncated: bool = False   # the response hit max_new_tokens without eos
    skill_ids: list[str] = field(default_factory=list)
    context_manager: str = "full"
    tool_calls: int = 0       # tool calls the agent made in this step's action
    tool_successes: int = 0   # of those, how many the tool reported as successful (<= tool_calls)
    process_reward: float = 0.0  # fold context: +-alpha on a step that closed a subgoal (docs/algorithms.md section 10)
    retokenized: bool = False  # the ids were re-derived from text: the upstream could not return sampled ids


@dataclass
class TrajectoryRecord:
    trajectory_id: str
    group_id: str
    scenario: str             # Scenario.to_json()
    env: str
    split: str
    round: int
    policy_version: str
    status: str               # one of TRAJECTORY_STATUSES ("open" while a gateway trajectory receives steps)
    episode_return: float
    won: bool
    num_steps: int
    response_tokens: int      # total sampled tokens over the episode
    wall_time_s: float = 0.0
    error: str | None = None  # why an episode failed (env raised, timed out)
    metadata: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- validation

def _fail(traj_id: str, where: str, message: str) -> ValueError:
    return ValueError(f"invalid trajectory {traj_id!r}: {where} {message}; nothing was written")


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_ids(tid: str, where: str, ids: Any) -> None:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise _fail(tid, where, f"must be a flat list of ints, got dtype {arr.dtype} with shape {arr.shape}")
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise _fail(tid, where, "holds an id outside the int32 range")


def validate_step(tid: str, group_id: str, step: StepRecord, *, check_index: bool = True) -> None:
    """Raise ValueError naming the trajectory, step and field if ``step`` cannot be stored in trajectory ``tid`` of
    group ``group_id``. ``check_index=False`` skips step_index (the pool assigns it on append)."""
    where = f"step {step.step_index!r} field"
    if step.trajectory_id != tid:
        raise _fail(tid, f"{where} 'trajectory_id'", f"is {step.trajectory_id!r}, not its trajectory's id")
    if step.group_id != group_id:
        raise _fail(tid, f"{where} 'group_id'", f"is {step.group_id!r}, its trajectory's is {group_id!r}")
    if check_index and (not is_int(step.step_index) or step.step_index < 0):
        raise _fail(tid, f"{where} 'step_index'", "must be an int >= 0")
    _check_ids(tid, f"{where} 'prompt_ids'", step.prompt_ids)
    _check_ids(tid, f"{where} 'response_ids'", step.response_ids)
    logprobs = np.asarray(step.logprobs)
    if logprobs.ndim != 1 or (logprobs.size and logprobs.dtype.kind not in "iuf"):
        raise _fail(tid, f"{where} 'logprobs'", "must be a flat list of floats")
    if len(logprobs) != len(step.response_ids):
        raise _fail(tid, f"{where} 'logprobs'",
                    f"has {len(logprobs)} values for {len(step.response_ids)} response_ids (must be equal)")
    if not is_real(step.process_reward) or not math.isfinite(step.process_reward):
        raise _fail(tid, f"{where} 'process_reward'", f"must be a finite real number; got {step.process_reward!r}")
    if not is_real(step.reward) or math.isnan(step.reward):
        # SQL backends cannot round-trip NaN faithfully (SQLite stores it as NULL)
        raise _fail(tid, f"{where} 'reward'", f"must be a real number, not NaN; got {step.reward!r}")
    for name in ("prompt_text", "observation", "action", "response_text", "anchor", "policy_version",
                 "context_manager"):
        if not isinstance(getattr(step, name), str):
            raise _fail(tid, f"{where} {name!r}", f"must be a str, got {type(getattr(step, name)).__name__}")
    for name in ("action_valid", "truncated", "retokenized"):
        if not isinstance(getattr(step, name), (bool, np.bool_)):
            raise _fail(tid, f"{where} {name!r}", "must be a bool")
    for name in ("tool_calls", "tool_successes"):
        if not is_int(getattr(step, name)) or not 0 <= getattr(step, name) <= _INT32_MAX:
            raise _fail(tid, f"{where} {name!r}", f"must be an int >= 0, got {getattr(step, name)!r}")
    if step.tool_successes > step.tool_calls:
        raise _fail(tid, f"{where} 'tool_successes'",
                    f"is {step.tool_successes}, more than the step's {step.tool_calls} tool_calls")
    if not isinstance(step.skill_ids, (list, tuple)) or not all(isinstance(s, str) for s in step.skill_ids):
        raise _fail(tid, f"{where} 'skill_ids'", "must be a list of str")


def check_metadata(tid: str, metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise _fail(tid, "field 'metadata'", "must be a dict")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _fail(tid, "field 'metadata'", f"is not JSON-serializable ({exc})") from None


def validate_trajectory(traj: TrajectoryRecord) -> None:
    """Raise ValueError naming the trajectory and field if ``traj`` (or one of its steps) cannot be stored."""
    tid = traj.trajectory_id
    if not isinstance(tid, str) or not tid:
        raise ValueError(f"invalid trajectory {tid!r}: field 'trajectory_id' must be a non-empty str")
    for name in ("group_id", "env", "split", "policy_version"):
        if not isinstance(getattr(traj, name), str) or not getattr(traj, name):
            raise _fail(tid, f"field {name!r}", "must be a non-empty str")
    if not isinstance(traj.scenario, str):
        raise _fail(tid, "field 'scenario'", "must be a str (Scenario.to_json())")
    if traj.status not in TRAJECTORY_STATUSES:
        raise _fail(tid, "field 'status'", f"is {traj.status!r}; valid statuses: {', '.join(TRAJECTORY_STATUSES)}")
    for name in ("round", "num_steps", "response_tokens"):
        if not is_int(getattr(traj, name)) or getattr(traj, name) < 0:
            raise _fail(tid, f"field {name!r}", f"must be an int >= 0, got {getattr(traj, name)!r}")
    for name in ("episode_return", "wall_time_s"):
        if not is_real(getattr(traj, name)) or math.isnan(getattr(traj, name)):
            raise _fail(tid, f"field {name!r}", f"must be a real number, not NaN; got {getattr(traj, name)!r}")
    if not isinstance(traj.won, (bool, np.bool_)):
        raise _fail(tid, "field 'won'", "must be a bool")
    if traj.error is not None and not isinstance(traj.error, str):
        raise _fail(tid, "field 'error'", "must be a str or None")
    check_metadata(tid, traj.metadata)
    seen: set[int] = set()
    for step in traj.steps:
        validate_step(tid, traj.group_id, step)
        if step.step_index in seen:
            raise _fail(tid, f"step {step.step_index} field 'step_index'", "appears twice")
        seen.add(step.step_index)
