"""Step and trajectory records: what the rollout loop and the gateway produce and the data pool stores, and the
checks a record must pass before it is stored.

Each field is declared here once, with its kind, the schema version that added it, its default and a one-line doc
(``datapool.schema.column``). The pool's tables, the row encoders and migrations (``datapool.tables``), the
Parquet schema and the defaults of older files (``datapool.parquet``) and the checks below are derived from these
declarations: a field added here is stored, exported, read back and validated everywhere.

Token ids are the ids the engine sampled; they are never re-tokenized from text (a step whose upstream could only
return text is re-tokenized and flagged ``retokenized``; the quality gate rejects it by default). A gateway step
whose prompt does not extend the previous step's prompt + response is flagged ``prefix_break`` (counted by the gate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from datapool.schema import FieldSpec, checker, column, field_specs, is_int, is_real, problem, spec

__all__ = ["FINAL_STATUSES", "ROW_EXTRA_FIELDS", "ROW_TRAJECTORY_FIELDS", "STEP_FIELDS", "STEP_ROW_FIELDS",
           "StepRecord", "TRAJECTORY_FIELDS", "TRAJECTORY_STATUSES", "TrajectoryRecord", "check_metadata", "is_int",
           "is_real", "validate_step", "validate_trajectory"]

TRAJECTORY_STATUSES = ("complete", "truncated", "failed", "open")
""""open": a gateway trajectory still receiving steps; the other three are final."""
FINAL_STATUSES = ("complete", "truncated", "failed")


@dataclass
class StepRecord:
    """One agent step: exactly what the engine was fed and sampled, what the env made of it, and its flags."""

    trajectory_id: str = column("str", "the trajectory the step belongs to")
    group_id: str = column("str", "one group = the G rollouts of one scenario under one policy version")
    step_index: int = column("int", "position in the trajectory, from 0")
    prompt_ids: list[int] = column("ids", "exactly the ids fed to the engine")
    response_ids: list[int] = column("ids", "exactly the ids the engine sampled (eos included when produced)")
    logprobs: list[float] = column("logprobs", "rollout log-prob of each response id, len == len(response_ids)")
    prompt_text: str = column("text", "the rendered prompt")
    observation: str = column("text", "env observation this step acted on")
    action: str = column("text", 'parsed action ("" when invalid)')
    response_text: str = column("text", "decoded response")
    reward: float = column("float", "env reward of the step (+-inf allowed)")
    anchor: str = column("text", "canonical env state (str of the env's hashable anchor)")
    policy_version: str = column("str", "the policy version that sampled the response")
    action_valid: bool = column("bool", "the env accepted the action", default=True)
    truncated: bool = column("bool", "the response hit max_new_tokens without eos", default=False)
    skill_ids: list[str] = column("strs", "skills shown in the prompt's skill slot", default=[])
    context_manager: str = column("str", "the context manager that built the prompt", default="full")
    tool_calls: int = column("int", "tool calls the agent made in this step's action", since=2, default=0)
    tool_successes: int = column("int", "of those, how many the tool reported as successful (<= tool_calls)",
                                 since=2, default=0)
    process_reward: float = column("float", "fold context: +-alpha on a step that closed a subgoal "
                                   "(docs/algorithms.md section 10)", since=3, default=0.0, finite=True)
    retokenized: bool = column("bool", "the ids were re-derived from text: the upstream could not return sampled ids",
                               since=4, default=False)
    plain_prompt_ids: list[int] = column("ids", "the prompt this step would have had without the skill slot (SIRI "
                                         "distills onto it; empty when no skill was shown)", since=5, default=[])
    macro_prompt_ids: list[list[int]] = column("id_lists", "a macro call's sub-steps: each one's plain prompt ids "
                                               "(empty when the step called no macro)", since=5, default=[])
    macro_action_ids: list[list[int]] = column("id_lists", "a macro call's sub-steps: each one's primitive action "
                                               "ids, eos included (one per macro_prompt_ids)", since=5, default=[])
    action_choices: list[list[int]] = column("id_lists", "constrained decoding (harness.action_space admissible): the "
                                             "token sequences the response was restricted to, one per admissible "
                                             "action (eos included), the trainer's mask; empty = free decoding",
                                             since=6, default=[])
    prefix_break: bool = column("bool", "a gateway step that does not extend its predecessor: its prompt_ids do not "
                                "start with the previous step's prompt_ids + response_ids (a re-sent, edited or "
                                "re-rendered turn). The rollout loop re-renders by design and never sets it; the "
                                "concatenated layout re-renders between such turns", since=7, default=False)
    staleness: int = column("int", "rounds between the policy that sampled the response (policy_version) and the one "
                            "the round's train stage starts from: min(pipeline.max_staleness, round - 1); 0 = "
                            "on-policy (synchronous rounds, the gateway)", since=8, default=0)


@dataclass
class TrajectoryRecord:
    """One episode: its scenario, outcome and steps."""

    trajectory_id: str = column("str", "unique id of the episode", nonempty=True)
    group_id: str = column("str", "the episode's group (G rollouts of one scenario, one policy)", nonempty=True,
                           index=True)
    scenario: str = column("str", "Scenario.to_json()")
    env: str = column("str", "env name", nonempty=True, index=True, on_step_rows=True)
    split: str = column("str", "scenario split (train, heldout, ...)", nonempty=True, on_step_rows=True)
    round: int = column("int", "pipeline round", index=True, on_step_rows=True)
    policy_version: str = column("str", "the policy version that played it", nonempty=True)
    status: str = column("str", 'one of TRAJECTORY_STATUSES ("open" while a gateway trajectory receives steps)',
                         on_step_rows=True)
    episode_return: float = column("float", "sum of the step rewards (after shaping, on exported rows)",
                                   on_step_rows=True)
    won: bool = column("bool", "the env reported success", on_step_rows=True)
    num_steps: int = column("int", "steps taken")
    response_tokens: int = column("int", "total sampled tokens over the episode")
    wall_time_s: float = column("float", "seconds the episode took", default=0.0)
    error: str | None = column("text", "why an episode failed (env raised, timed out)", default=None, nullable=True)
    metadata: dict[str, Any] = column("json", "free-form, JSON-serializable", default={})
    steps: list[StepRecord] = field(default_factory=list)


STEP_FIELDS: tuple[FieldSpec, ...] = field_specs(StepRecord)
"""Every StepRecord field, in order: the pool's step columns and the first columns of an exported step row."""
TRAJECTORY_FIELDS: tuple[FieldSpec, ...] = field_specs(TrajectoryRecord, relations=("steps",))
"""Every TrajectoryRecord field but ``steps``, in order: the pool's trajectory columns."""
ROW_TRAJECTORY_FIELDS: tuple[FieldSpec, ...] = tuple(f for f in TRAJECTORY_FIELDS if f.on_step_rows)
"""The trajectory fields joined onto every step row (group_id is a step field already)."""
ROW_EXTRA_FIELDS: tuple[FieldSpec, ...] = (
    spec("excluded", "bool", "curation excluded the step or its trajectory (DataPool.curate)", since=4,
         default=False),
    spec("shaping", "float", "total reward adjustment datapool.filters made to the step's trajectory: "
         "episode_return - shaping is the env's return (the pool's own frames have none: 0.0)", since=2,
         default=0.0),
    spec("label", "str", "curation label of the step, else of its trajectory, when validate exported it ('' = "
         "none)", since=5, default=""),
)
"""Columns of an exported step row that are no record's field."""
STEP_ROW_FIELDS: tuple[FieldSpec, ...] = STEP_FIELDS + ROW_TRAJECTORY_FIELDS + ROW_EXTRA_FIELDS
"""One exported step row (steps.parquet): the step, its trajectory's row fields, excluded and shaping."""

_names = [f.name for f in STEP_ROW_FIELDS]
if len(set(_names)) != len(_names):
    raise TypeError(f"the step row has duplicate column names: {sorted({n for n in _names if _names.count(n) > 1})}")

# (name, check) of what validate_step checks by kind; identity fields are checked against the trajectory first
_STEP_CHECKED = tuple((f.name, checker(f)) for f in STEP_FIELDS
                      if f.name not in ("trajectory_id", "group_id", "step_index"))
_STEP_INDEX = next(f for f in STEP_FIELDS if f.name == "step_index")
_TRAJECTORY_CHECKED = tuple((f.name, checker(f)) for f in TRAJECTORY_FIELDS if f.name != "trajectory_id")


# --------------------------------------------------------------------------------------------- validation

def _fail(traj_id: str, where: str, message: str) -> ValueError:
    return ValueError(f"invalid trajectory {traj_id!r}: {where} {message}; nothing was written")


def validate_step(tid: str, group_id: str, step: StepRecord, *, check_index: bool = True) -> None:
    """Raise ValueError naming the trajectory, step and field if ``step`` cannot be stored in trajectory ``tid`` of
    group ``group_id``. ``check_index=False`` skips step_index (the pool assigns it on append)."""
    where = f"step {step.step_index!r} field"
    if step.trajectory_id != tid:
        raise _fail(tid, f"{where} 'trajectory_id'", f"is {step.trajectory_id!r}, not its trajectory's id")
    if step.group_id != group_id:
        raise _fail(tid, f"{where} 'group_id'", f"is {step.group_id!r}, its trajectory's is {group_id!r}")
    if check_index and (found := problem(_STEP_INDEX, step.step_index)) is not None:
        raise _fail(tid, f"{where} 'step_index'", found)
    for name, check in _STEP_CHECKED:
        found = check(getattr(step, name))
        if found is not None:
            raise _fail(tid, f"{where} {name!r}", found)
    if len(step.logprobs) != len(step.response_ids):
        raise _fail(tid, f"{where} 'logprobs'",
                    f"has {len(step.logprobs)} values for {len(step.response_ids)} response_ids (must be equal)")
    if step.tool_successes > step.tool_calls:
        raise _fail(tid, f"{where} 'tool_successes'",
                    f"is {step.tool_successes}, more than the step's {step.tool_calls} tool_calls")
    if len(step.macro_action_ids) != len(step.macro_prompt_ids):
        raise _fail(tid, f"{where} 'macro_action_ids'", f"has {len(step.macro_action_ids)} sub-steps for "
                    f"{len(step.macro_prompt_ids)} macro_prompt_ids (must be equal)")
    if step.action_choices and not _on_a_choice(step.response_ids, step.action_choices):
        raise _fail(tid, f"{where} 'action_choices'", "does not contain the response: a constrained step's "
                    "response_ids must be one of its choices or a prefix of one (the trainer scores it under them)")


def _on_a_choice(response: list[int], choices: list[list[int]]) -> bool:
    return any(list(choice[:len(response)]) == list(response) for choice in choices)


def check_metadata(tid: str, metadata: Any) -> None:
    found = problem(next(f for f in TRAJECTORY_FIELDS if f.name == "metadata"), metadata)
    if found is not None:
        raise _fail(tid, "field 'metadata'", found)


def validate_trajectory(traj: TrajectoryRecord) -> None:
    """Raise ValueError naming the trajectory and field if ``traj`` (or one of its steps) cannot be stored."""
    tid = traj.trajectory_id
    if not isinstance(tid, str) or not tid:
        raise ValueError(f"invalid trajectory {tid!r}: field 'trajectory_id' must be a non-empty str")
    for name, check in _TRAJECTORY_CHECKED:
        found = check(getattr(traj, name))
        if found is not None:
            raise _fail(tid, f"field {name!r}", found)
    if traj.status not in TRAJECTORY_STATUSES:
        raise _fail(tid, "field 'status'", f"is {traj.status!r}; valid statuses: {', '.join(TRAJECTORY_STATUSES)}")
    seen: set[int] = set()
    for step in traj.steps:
        validate_step(tid, traj.group_id, step)
        if step.step_index in seen:
            raise _fail(tid, f"step {step.step_index} field 'step_index'", "appears twice")
        seen.add(step.step_index)
