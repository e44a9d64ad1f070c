"""rollout: G rollouts per scenario into the pool and Parquet; dynamic sampling re-draws scenarios for degenerate
groups up to rollout.max_generation_batches."""
import json
from pathlib import Path

from datapool.parquet import read_steps
from datapool.store import DataPool
from tasks import bootstrap, rollout, warmstart
from tasks.config import parse_params
from tasks.layout import Layout

SMALL = {"bootstrap": {"train_scenarios": 40, "heldout_scenarios": 4, "tokenizer_corpus_episodes": 20,
                       "tiny": {"hidden_size": 32, "intermediate_size": 64}},
         "warmstart": {"enabled": False},
         "rollout": {"scenarios_per_round": 4, "group_size": 3, "use_skills": False}}


def informative_groups(frame) -> int:
    spread = frame.drop_duplicates("trajectory_id").groupby("group_id")["episode_return"].agg(lambda r: r.max() - r.min())
    return int((spread > 0).sum())


def test_rollout_resamples_degenerate_groups_up_to_the_limit(tmp_path: Path):
    layout = Layout(tmp_path)
    base = parse_params(SMALL)
    bootstrap.run(base, layout)
    warmstart.run(base, layout)  # disabled: the untrained policy mostly answers gibberish

    single = rollout.run(base, layout, 1)
    assert single["generation_batches"] == 1 and single["episodes"] == 4 * 3

    assert single["informative_groups"] < 4  # the untrained policy leaves most groups without signal

    params = parse_params({**SMALL, "rollout": {**SMALL["rollout"], "max_generation_batches": 3}})
    metrics = rollout.run(params, layout, 1)
    frame, _ = read_steps(layout.steps(1))
    batches = metrics["generation_batches"]
    assert 1 < batches <= 3
    assert metrics["batch_full"] or batches == 3  # stopped because the batch was full or at the limit
    assert metrics["informative_groups"] == informative_groups(frame)
    assert metrics["batch_full"] == (informative_groups(frame) >= 4)
    assert frame["group_id"].nunique() > 4  # fresh scenarios were drawn for the shortfall
    assert frame["trajectory_id"].nunique() == metrics["episodes"] == 3 * frame["group_id"].nunique()
    with DataPool(layout.pool_url) as pool:  # both attempts are kept in the pool, nothing overwritten
        assert pool.counts()["trajectories"] == 12 + metrics["episodes"]
    assert json.loads(layout.round_metrics(1, "rollout").read_text())["generation_batches"] == batches


def test_rerun_with_the_same_inputs_reproduces_ids_and_writes_no_duplicates(tmp_path: Path):
    layout = Layout(tmp_path)
    params = parse_params(SMALL)
    bootstrap.run(params, layout)
    warmstart.run(params, layout)
    rollout.run(params, layout, 1)
    first, _ = read_steps(layout.steps(1))
    rollout.run(params, layout, 1)
    second, _ = read_steps(layout.steps(1))
    assert first["trajectory_id"].tolist() == second["trajectory_id"].tolist()
    assert first["response_ids"].map(list).tolist() == second["response_ids"].map(list).tolist()
    with DataPool(layout.pool_url) as pool:
        assert pool.counts()["trajectories"] == 12  # the pool stored the rerun's identical trajectories once
