"""Registry names are checked when params load, so a typo in train_5's estimator fails before bootstrap runs."""
import pytest

from tasks.config import ParamsError, parse_params


@pytest.mark.parametrize("name", ["skillc", "d2skill", "gigpo", "graphgpo"])
def test_every_registered_estimator_loads_by_name(name):
    assert parse_params({"train": {"advantage": name}}).train.advantage.name == name


def test_unknown_estimator_lists_the_valid_ones():
    with pytest.raises(ParamsError, match=r"train.advantage.name = 'ppo2' is not a registered advantage.*gigpo"):
        parse_params({"train": {"advantage": "ppo2"}})
