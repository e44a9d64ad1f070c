"""DataPool's step-at-a-time API (what the gateway writes through), on SQLite and PostgreSQL: open, append with
idempotency keys, rewards, finishing, reading back, concurrent writers (threads and processes), migration 3 -> 4."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from datapool.records import StepRecord
from datapool.store import SCHEMA_VERSION, DataPool

REPO = Path(__file__).resolve().parents[2]


def make_step(tid: str, group: str = "g0", *, reward: float = 0.0, response=(7, 8, 9), retokenized: bool = False,
              step_index: int = 99) -> StepRecord:
    """A gateway-like step; ``step_index`` is deliberately wrong: append_step assigns the real one."""
    return StepRecord(trajectory_id=tid, group_id=group, step_index=step_index, prompt_ids=[1, 2, 3],
                      response_ids=list(response), logprobs=[-0.5] * len(response), prompt_text="<p>",
                      observation="", action="", response_text="hi", reward=reward, anchor="",
                      policy_version="v1", retokenized=retokenized)


def test_open_append_reward_finish_round_trip(pool: DataPool) -> None:
    assert pool.open_trajectory("t1", group_id="g0", policy_version="v1", metadata={"client": "sdk"}) is True
    assert pool.open_trajectory("t1", group_id="other", policy_version="v9") is False  # no change
    opened = pool.get_trajectory("t1")
    assert (opened.status, opened.num_steps, opened.episode_return, opened.group_id) == ("open", 0, 0.0, "g0")
    assert opened.env == "gateway" and opened.metadata == {"client": "sdk"} and opened.steps == []

    first = make_step("t1", reward=0.5)
    assert pool.append_step(first) == (0, None)
    assert first.step_index == 0  # assigned on the record too
    assert pool.append_step(make_step("t1", reward=0.25, response=(4,), retokenized=True)) == (1, None)
    traj = pool.get_trajectory("t1")
    assert traj.num_steps == 2 and traj.response_tokens == 4 and traj.episode_return == 0.75
    assert [s.step_index for s in traj.steps] == [0, 1] and traj.steps[1].retokenized is True
    assert traj.steps[0].response_ids == [7, 8, 9] and traj.steps[0].logprobs == [-0.5] * 3

    pool.set_reward("t1", 2.0)  # the last step
    pool.set_reward("t1", -1.0, step_index=0)
    traj = pool.get_trajectory("t1")
    assert [s.reward for s in traj.steps] == [-1.0, 2.0] and traj.episode_return == 1.0

    pool.finish_trajectory("t1", status="truncated", won=True)
    done = pool.get_trajectory("t1")
    assert done.status == "truncated" and done.won is True and done.wall_time_s >= 0.0
    with pytest.raises(ValueError, match="'status'"):  # steps go only to open trajectories
        pool.append_step(make_step("t1"))
    assert pool.counts() == {"trajectories": 1, "steps": 2}

    frame = pool.steps_frame()
    assert frame["retokenized"].tolist() == [False, True] and frame["excluded"].tolist() == [False, False]


def test_idempotency_key_returns_the_stored_response_and_writes_nothing(pool: DataPool) -> None:
    pool.open_trajectory("t1", group_id="g0", policy_version="v1")
    response = {"id": "chatcmpl-1", "choices": [{"text": "hi", "token_ids": [7, 8, 9]}]}
    assert pool.append_step(make_step("t1", reward=1.0), idempotency_key="k1", response=response) == (0, None)
    assert pool.lookup_request("k1") == response and pool.lookup_request("nope") is None
    # the client retries: same key, nothing new is written, the first answer comes back
    assert pool.append_step(make_step("t1", reward=1.0), idempotency_key="k1",
                            response={"id": "chatcmpl-2"}) == (0, response)
    assert pool.append_step(make_step("t1"), idempotency_key="k2") == (1, None)
    assert pool.lookup_request("k2") is None  # stored without a response
    traj = pool.get_trajectory("t1")
    assert traj.num_steps == 2 and traj.episode_return == 1.0 and pool.counts()["steps"] == 2


def test_bad_input_names_the_field_and_writes_nothing(pool: DataPool) -> None:
    pool.open_trajectory("t1", group_id="g0", policy_version="v1")
    with pytest.raises(KeyError, match="unknown trajectory 'ghost'"):
        pool.append_step(make_step("ghost"))
    for step, field in [(make_step("t1", group="g9"), "'group_id'"),
                        (make_step("t1", reward=float("nan")), "'reward'")]:
        with pytest.raises(ValueError, match=field):
            pool.append_step(step)
    bad_logprobs = make_step("t1")
    bad_logprobs.logprobs = [-0.5]
    with pytest.raises(ValueError, match="'logprobs'"):
        pool.append_step(bad_logprobs)
    with pytest.raises(ValueError, match="'response'"):
        pool.append_step(make_step("t1"), idempotency_key="k", response={"x": object()})
    with pytest.raises(ValueError, match="'idempotency_key'"):
        pool.append_step(make_step("t1"), idempotency_key="")
    with pytest.raises(ValueError, match="'group_id'"):
        pool.open_trajectory("t2", group_id="", policy_version="v1")
    with pytest.raises(ValueError, match="'metadata'"):
        pool.open_trajectory("t2", group_id="g", policy_version="v1", metadata={"x": {1, 2}})
    with pytest.raises(ValueError, match="'step_index'"):  # no steps yet
        pool.set_reward("t1", 1.0)
    with pytest.raises(KeyError, match="unknown trajectory 'ghost'"):
        pool.set_reward("ghost", 1.0)
    with pytest.raises(ValueError, match="'reward'"):
        pool.set_reward("t1", float("nan"))
    with pytest.raises(ValueError, match="'status'"):
        pool.finish_trajectory("t1", status="open")
    with pytest.raises(KeyError, match="unknown trajectory 'ghost'"):
        pool.finish_trajectory("ghost")
    with pytest.raises(KeyError, match="unknown trajectory 'ghost'"):
        pool.get_trajectory("ghost")
    assert pool.counts() == {"trajectories": 1, "steps": 0} and pool.lookup_request("k") is None
    pool.append_step(make_step("t1"))
    with pytest.raises(KeyError, match="unknown step 5"):
        pool.set_reward("t1", 1.0, step_index=5)


def test_many_threads_appending_to_one_trajectory_get_distinct_indices(pool_url: str) -> None:
    """8 threads x 15 appends, half through one shared pool and half through their own: every step stored once,
    indices 0..119 without gaps, and the trajectory's sums match its steps."""
    shared = DataPool(pool_url)
    shared.open_trajectory("t", group_id="g", policy_version="v1")
    errors: list[BaseException] = []
    results: list[int] = []
    lock = threading.Lock()

    def worker(slot: int) -> None:
        pool = shared if slot % 2 else DataPool(pool_url)
        try:
            for k in range(15):
                index, stored = pool.append_step(make_step("t", "g", reward=1.0), idempotency_key=f"{slot}-{k}",
                                                 response={"slot": slot, "k": k})
                assert stored is None
                with lock:
                    results.append(index)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            if pool is not shared:
                pool.close()

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results) == list(range(120))
    traj = shared.get_trajectory("t")
    assert [s.step_index for s in traj.steps] == list(range(120))
    assert traj.num_steps == 120 and traj.episode_return == 120.0 and traj.response_tokens == 360
    assert shared.lookup_request("3-14") == {"slot": 3, "k": 14}
    shared.close()


def test_concurrent_retries_of_one_key_store_one_step(pool_url: str) -> None:
    """6 threads send the same idempotency key at once (a client retrying): one step, one answer for all."""
    pool = DataPool(pool_url)
    pool.open_trajectory("t", group_id="g", policy_version="v1")
    barrier = threading.Barrier(6)
    answers: list[tuple[int, dict | None]] = []

    def retry(slot: int) -> None:
        barrier.wait()
        answers.append(pool.append_step(make_step("t", "g"), idempotency_key="same", response={"first": slot}))

    threads = [threading.Thread(target=retry, args=(slot,)) for slot in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert pool.counts()["steps"] == 1 and len(answers) == 6
    winner = [stored for _, stored in answers if stored is None]
    assert len(winner) == 1 and {index for index, _ in answers} == {0}
    assert all(stored == pool.lookup_request("same") for _, stored in answers if stored is not None)
    pool.close()


WRITER = """
import sys
from datapool.records import StepRecord
from datapool.store import DataPool
url, slot, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with DataPool(url) as pool:
    pool.open_trajectory(f"own-{slot}", group_id="g", policy_version="v1")
    for k in range(n):
        for tid in ("shared", f"own-{slot}"):
            step = StepRecord(trajectory_id=tid, group_id="g", step_index=0, prompt_ids=[1], response_ids=[2],
                              logprobs=[-0.1], prompt_text="", observation="", action="", response_text="",
                              reward=1.0, anchor="", policy_version="v1")
            pool.append_step(step, idempotency_key=f"{tid}-{slot}-{k}")
"""


@pytest.mark.slow
def test_separate_processes_append_concurrently(pool_url: str) -> None:
    """4 processes, each appending 25 steps to a shared trajectory and 25 to its own, all at once."""
    with DataPool(pool_url) as pool:
        pool.open_trajectory("shared", group_id="g", policy_version="v1")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, pool_url, str(slot), "25"], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for slot in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    with DataPool(pool_url) as pool:
        shared = pool.get_trajectory("shared")
        assert [s.step_index for s in shared.steps] == list(range(100)) and shared.episode_return == 100.0
        for slot in range(4):
            assert pool.get_trajectory(f"own-{slot}").num_steps == 25
        assert pool.counts() == {"trajectories": 5, "steps": 200}


def test_open_trajectory_races_create_it_once(pool_url: str) -> None:
    pool = DataPool(pool_url)
    barrier = threading.Barrier(5)
    created: list[bool] = []

    def open_it() -> None:
        barrier.wait()
        created.append(pool.open_trajectory("t", group_id="g", policy_version="v1"))

    threads = [threading.Thread(target=open_it) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(created) == [False, False, False, False, True]
    pool.close()


def test_a_version_3_pool_is_migrated_to_the_current_version(pool_url: str) -> None:
    """Take a fresh pool back to version 3 (drop what 4 and 5 added), then reopen it: the migrations restore it."""
    with DataPool(pool_url) as pool:
        pool.open_trajectory("old", group_id="g", policy_version="v0")
        pool.append_step(make_step("old", "g"))
        with pool.engine.begin() as conn:
            conn.execute(text("DROP TABLE curation"))
            conn.execute(text("DROP TABLE requests"))
            conn.execute(text("DROP INDEX ix_trajectories_created_at"))
            for column in ("retokenized", "plain_prompt_ids", "macro_prompt_ids", "macro_action_ids", "action_choices",
                           "prefix_break"):
                conn.execute(text(f"ALTER TABLE steps DROP COLUMN {column}"))
            conn.execute(text("ALTER TABLE trajectories DROP COLUMN created_at"))
            conn.execute(text("UPDATE schema_version SET version = 3"))
    assert SCHEMA_VERSION == 8
    with DataPool(pool_url) as pool:
        with pool.engine.connect() as conn:
            assert conn.execute(text("SELECT version FROM schema_version")).scalar() == 8
        old = pool.get_trajectory("old")
        assert old.steps[0].retokenized is False and old.num_steps == 1
        pool.curate("old", step_index=0, excluded=True)  # the new tables exist
        pool.append_step(make_step("old", "g", retokenized=True), idempotency_key="k")
        assert pool.steps_frame()["retokenized"].tolist() == [False, True]
        assert pool.query_trajectories()[0]["created_at"] == 0.0


def test_export_and_import_round_trip(pool: DataPool, tmp_path: Path) -> None:
    from datapool.parquet import import_steps, read_steps

    pool.open_trajectory("t1", group_id="g0", policy_version="v1", round=3)
    pool.append_step(make_step("t1", reward=0.5))
    pool.append_step(make_step("t1", reward=0.5, retokenized=True))
    pool.finish_trajectory("t1", won=True)
    pool.curate("t1", step_index=1, excluded=True, label="bad-ids")
    path = tmp_path / "steps.parquet"
    assert pool.export(path, round=3) == 2
    df, metadata = read_steps(path)
    assert metadata["retokenized_rows"] == 1 and metadata["excluded_rows"] == 1 and metadata["round"] == 3
    assert df["excluded"].tolist() == [False, True] and df["retokenized"].tolist() == [False, True]
    assert pool.export(tmp_path / "kept.parquet", include_excluded=False) == 1

    with DataPool(str(tmp_path / "copy.db")) as copy:
        assert import_steps(path, copy) == 1
        assert import_steps(path, copy) == 0  # idempotent
        back = copy.get_trajectory("t1")
        assert back.status == "complete" and back.won is True and back.episode_return == 1.0 and back.round == 3
        assert [s.response_ids for s in back.steps] == [[7, 8, 9]] * 2 and back.steps[1].retokenized
        assert copy.curation_of("t1")["steps"][1]["excluded"] is True
        frame = copy.steps_frame()
        original = pool.steps_frame()
        for column in ("prompt_ids", "response_ids", "logprobs", "reward", "retokenized", "excluded", "step_index"):
            assert frame[column].tolist() == original[column].tolist(), column
        json.dumps(copy.stats())
