"""The train stage refuses names it cannot honour before doing any work."""
import pytest

from tasks.config import parse_params
from tasks.train import check_names


@pytest.mark.parametrize("name", ["skillc", "d2skill"])
def test_skill_credit_estimators_are_accepted_now_that_rollouts_split_skill_halves(name):
    check_names(parse_params({"train": {"advantage": name}}).train)  # tests/tasks/test_skill_lifecycle.py uses them


def test_unknown_estimator_lists_the_valid_ones():
    with pytest.raises(KeyError, match="gigpo"):
        check_names(parse_params({"train": {"advantage": "ppo2"}}).train)
