"""train.staleness_limit: the steps a train stage keeps by the staleness their rollout recorded (issue 17)."""
import pandas as pd
import pytest

from tasks.config import ParamsError, parse_params
from tasks.train import drop_stale


def frame(staleness: list[int]) -> pd.DataFrame:
    return pd.DataFrame({"step_index": range(len(staleness)), "staleness": staleness})


def test_minus_one_keeps_every_step_and_counts_them_by_staleness():
    kept, metrics = drop_stale(frame([0, 1, 1, 2]), -1)
    assert kept["step_index"].tolist() == [0, 1, 2, 3]
    assert metrics == {"steps_staleness_0": 1, "steps_staleness_1": 2, "steps_staleness_2": 1}


@pytest.mark.parametrize("limit, kept_steps, dropped", [(0, [0, 4], 3), (1, [0, 1, 2, 4], 1), (2, [0, 1, 2, 3, 4], 0)])
def test_a_limit_drops_the_steps_sampled_more_rounds_before(limit, kept_steps, dropped):
    kept, metrics = drop_stale(frame([0, 1, 1, 2, 0]), limit)
    assert kept["step_index"].tolist() == kept_steps and kept.index.tolist() == list(range(len(kept_steps)))
    assert metrics["stale_steps_dropped"] == dropped and metrics["steps_staleness_1"] == 2


def test_steps_written_before_the_staleness_column_count_as_on_policy():
    kept, metrics = drop_stale(pd.DataFrame({"step_index": [0, 1]}), 0)
    assert len(kept) == 2 and metrics == {"steps_staleness_0": 2, "stale_steps_dropped": 0}


def test_a_limit_below_minus_one_is_refused_with_what_is_valid():
    with pytest.raises(ParamsError, match="staleness_limit.*-1 \\(keep every step\\)"):
        parse_params({"train": {"staleness_limit": -2}})
