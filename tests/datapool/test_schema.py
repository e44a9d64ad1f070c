"""The one step schema: records declared once, every storage form derived, and nothing lost on the way.

A record goes record -> pool -> steps_frame -> steps.parquet -> read_steps -> import_steps -> another pool and
comes back field for field (the new skill-trace fields included). The strategies are built per field *kind* from
the declarations, so a field added to StepRecord is in these round trips without touching this file, and a new kind
fails here (no strategy) until it is given one.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapool.parquet import ADDED_COLUMNS, STEPS_SCHEMA, import_steps, read_steps
from datapool.records import (ROW_TRAJECTORY_FIELDS, STEP_FIELDS, STEP_ROW_FIELDS, TRAJECTORY_FIELDS,
                              TRAJECTORY_STATUSES, StepRecord, TrajectoryRecord, validate_trajectory)
from datapool.schema import INT32_MAX, INT32_MIN, KINDS, FieldSpec, column, field_specs, spec
from datapool.store import DataPool
from datapool.tables import SQL_KINDS, STEPS, decode_id_lists, encode_id_lists
from tests.datapool.records_helpers import full_trajectory

ids = st.lists(st.integers(INT32_MIN, INT32_MAX), max_size=8)
KIND_STRATEGIES = {
    "ids": lambda f: ids,
    "logprobs": lambda f: st.lists(st.floats(-50, 0, width=32), max_size=8),
    "id_lists": lambda f: st.lists(ids, max_size=3),
    "text": lambda f: st.text(max_size=12) | st.none() if f.nullable else st.text(max_size=12),
    "str": lambda f: st.text(min_size=1 if f.nonempty else 0, max_size=8),
    "int": lambda f: st.integers(0, INT32_MAX),
    "float": lambda f: st.floats(allow_nan=False, allow_infinity=not f.finite),
    "bool": lambda f: st.booleans(),
    "strs": lambda f: st.lists(st.text(max_size=5), max_size=3),
    "json": lambda f: st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3),
}


def test_every_kind_has_a_strategy_here_and_a_type_in_each_backend() -> None:
    assert set(KIND_STRATEGIES) == set(KINDS) == set(SQL_KINDS)
    assert [f.name for f in STEPS.columns] == ["id", *(f.name for f in STEP_FIELDS)]
    assert STEPS_SCHEMA.names == [f.name for f in STEP_ROW_FIELDS]
    assert ADDED_COLUMNS == {f.name: f.default for f in STEP_ROW_FIELDS if f.since > 1}
    assert {"plain_prompt_ids", "macro_prompt_ids", "macro_action_ids"} <= set(ADDED_COLUMNS)


def test_a_field_without_a_declaration_or_a_late_field_without_a_default_is_refused() -> None:
    @dataclasses.dataclass
    class Half:
        declared: int = column("int", "fine")
        plain: int = 0

    with pytest.raises(TypeError, match=r"Half.plain has no schema"):
        field_specs(Half)
    with pytest.raises(ValueError, match="give it a default"):
        spec("late", "int", "added later", since=5)
    with pytest.raises(ValueError, match="unknown kind 'tensor'"):
        spec("x", "tensor", "no such kind")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(INT32_MIN, INT32_MAX), max_size=5), max_size=4))
def test_id_lists_encode_compactly_and_decode_exactly(lists: list[list[int]]) -> None:
    blob = encode_id_lists(lists)
    assert decode_id_lists(blob) == lists
    assert len(blob) == (0 if not lists else 4 * (1 + len(lists) + sum(map(len, lists))))


def test_a_corrupt_id_lists_blob_is_an_error_not_garbage() -> None:
    with pytest.raises(ValueError, match="corrupt"):
        decode_id_lists(encode_id_lists([[1, 2], [3]])[:-4])


@st.composite
def step_records(draw, tid: str, group: str, index: int) -> StepRecord:
    values = {f.name: draw(KIND_STRATEGIES[f.kind](f)) for f in STEP_FIELDS}
    values.update(trajectory_id=tid, group_id=group, step_index=index)
    # the cross-field rules validate_step enforces
    values["logprobs"] = draw(st.lists(st.floats(-50, 0, width=32), min_size=len(values["response_ids"]),
                                       max_size=len(values["response_ids"])))
    values["tool_successes"] = min(values["tool_successes"], values["tool_calls"])
    values["macro_action_ids"] = draw(st.lists(ids, min_size=len(values["macro_prompt_ids"]),
                                               max_size=len(values["macro_prompt_ids"])))
    if values["action_choices"]:  # a constrained step's response is on one of its choices
        values["action_choices"] = [list(values["response_ids"]) + draw(ids)] + values["action_choices"]
    return StepRecord(**values)


@st.composite
def trajectory_records(draw, tid: str) -> TrajectoryRecord:
    values = {f.name: draw(KIND_STRATEGIES[f.kind](f)) for f in TRAJECTORY_FIELDS}
    values.update(trajectory_id=tid, status=draw(st.sampled_from(TRAJECTORY_STATUSES)))
    steps = [draw(step_records(tid, values["group_id"], k)) for k in range(draw(st.integers(1, 3)))]
    for step in steps:  # an imported trajectory takes its policy version from its steps
        step.policy_version = values["policy_version"]
    return TrajectoryRecord(**values, steps=steps)


def _stored(step: StepRecord) -> dict:
    """What the pool gives back of ``step``: every field as it is, log-probs at float32 precision."""
    fields = dataclasses.asdict(step)
    fields["logprobs"] = [float(np.float32(x)) for x in step.logprobs]
    return fields


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True).flatmap(
    lambda tids: st.tuples(*(trajectory_records(t) for t in tids))), st.data())
def test_every_field_survives_pool_parquet_and_import(trajs: tuple[TrajectoryRecord, ...], data) -> None:
    for traj in trajs:
        validate_trajectory(traj)  # the strategies only make valid records
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "steps.parquet"
        with DataPool(f"{tmp}/a.db") as source:
            assert source.add_trajectories(list(trajs)) == len(trajs)
            excluded = set()
            for traj in trajs:
                for step in traj.steps:
                    if data.draw(st.booleans()):
                        source.curate(traj.trajectory_id, step_index=step.step_index, excluded=True)
                        excluded.add((traj.trajectory_id, step.step_index))
            for traj in trajs:  # record -> pool -> record
                back = source.get_trajectory(traj.trajectory_id)
                assert [_stored(s) for s in back.steps] == [_stored(s) for s in traj.steps]
                assert {f.name: getattr(back, f.name) for f in TRAJECTORY_FIELDS} == \
                    {f.name: getattr(traj, f.name) for f in TRAJECTORY_FIELDS}
            assert source.export(path) == sum(len(t.steps) for t in trajs)
        frame, _ = read_steps(path)
        assert list(frame.columns) == STEPS_SCHEMA.names
        with DataPool(f"{tmp}/b.db") as copy:
            assert import_steps(path, copy) == len(trajs)
            for traj in trajs:
                back = copy.get_trajectory(traj.trajectory_id)
                assert [_stored(s) for s in back.steps] == [_stored(s) for s in traj.steps]
                for f in ROW_TRAJECTORY_FIELDS:
                    assert getattr(back, f.name) == getattr(traj, f.name), f.name
                assert (back.group_id, back.policy_version) == (traj.group_id, traj.policy_version)
            again = copy.steps_frame()
            assert {(t, int(i)) for t, i, x in zip(again["trajectory_id"], again["step_index"], again["excluded"])
                    if x} == excluded


def test_every_field_round_trips_on_each_backend(pool: DataPool, tmp_path: Path) -> None:
    traj = full_trajectory()
    assert pool.add_trajectories([traj]) == 1
    assert pool.get_trajectory("full") == traj
    frame = pool.steps_frame()
    assert frame["macro_prompt_ids"].tolist() == [[[3], [], [5, 6]]] * 2
    assert frame["plain_prompt_ids"].tolist() == [[3, 4], [4, 4]]
    # the gateway's path: one step at a time
    pool.open_trajectory("live", group_id="g2", policy_version="v3")
    step = dataclasses.replace(traj.steps[1], trajectory_id="live", group_id="g2")
    assert pool.append_step(step) == (0, None)
    assert pool.get_trajectory("live").steps == [dataclasses.replace(step, step_index=0)]

    assert pool.export(tmp_path / "s.parquet") == 3
    with DataPool(str(tmp_path / "copy.db")) as copy:
        assert import_steps(tmp_path / "s.parquet", copy) == 2
        assert copy.get_trajectory("full").steps == traj.steps


def test_a_malformed_new_field_is_refused_naming_it(pool: DataPool) -> None:
    traj = full_trajectory("bad")
    traj.steps[1].macro_action_ids = [[1]]  # 1 action list for 3 sub-step prompts
    with pytest.raises(ValueError, match=r"'bad'.*step 1 field 'macro_action_ids'.*must be equal"):
        pool.add_trajectories([traj])
    traj = full_trajectory("bad")
    traj.steps[0].macro_prompt_ids = [[1, 2**31]]
    with pytest.raises(ValueError, match=r"field 'macro_prompt_ids' item 0 holds an id outside the int32 range"):
        pool.add_trajectories([traj])
    traj = full_trajectory("bad")
    traj.steps[0].plain_prompt_ids = [0.5]
    with pytest.raises(ValueError, match=r"field 'plain_prompt_ids' must be a flat list of ints"):
        pool.add_trajectories([traj])
    assert pool.counts() == {"trajectories": 0, "steps": 0}


def test_field_specs_document_every_field() -> None:
    for f in (*STEP_ROW_FIELDS, *TRAJECTORY_FIELDS):
        assert isinstance(f, FieldSpec) and f.doc and f.name and f.kind in KINDS
