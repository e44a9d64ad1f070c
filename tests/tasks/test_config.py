"""params.yaml loader: strict keys and types, errors that name the section, key and valid keys."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.config import Params, ParamsError, load_params, parse_params

REPO = Path(__file__).resolve().parents[2]


def test_repo_params_yaml_loads_and_matches_defaults_keys():
    params = load_params(REPO / "params.yaml")
    assert set(dataclasses.asdict(params)) == set(dataclasses.asdict(Params()))


def test_every_section_is_a_frozen_dataclass():
    params = parse_params({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.train.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("raw, fragments", [
    ({"train": {"lrr": 0.1}}, ["'lrr'", "'train'", "'lr'", "valid keys"]),
    ({"trian": {}}, ["'trian'", "valid sections", "'train'"]),
    ({"train": {"lr": "fast"}}, ["train.lr", "float", "'fast'"]),
    ({"rollout": {"group_size": True}}, ["rollout.group_size", "int"]),
    ({"rollout": {"group_size": 2.5}}, ["rollout.group_size", "int"]),
    ({"env": {"kwargs": {"frozenlake": {"sise": 4}}}}, ["env.kwargs.frozenlake", "'sise'", "size"]),
    ({"env": {"kwargs": {"frozenlake": {"size": 1}}}}, ["env.kwargs.frozenlake", "size must be >= 2"]),
    ({"env": {"mix": {"nope": 3}}}, ["'nope'", "registered envs", "household"]),
    ({"env": {"mix": {"sokoban": 0}}}, ["env.mix", ">= 1"]),
    ({"env": {"mix": ["sokoban"]}}, ["env.mix", "mapping"]),
    ({"rollout": {"context": "zip"}}, ["rollout.context", "fold", "window"]),
    ({"rollout": {"tool_format": "xml"}}, ["rollout.tool_format", "openai"]),
    ({"train": [1, 2]}, ["section 'train'", "mapping"]),
    ({"rollout": {"group_size": 1}}, ["group_size", ">= 2"]),
    ({"bootstrap": {"arch": "gpt9"}}, ["bootstrap.arch", "qwen2"]),
])
def test_bad_params_are_rejected_with_named_key(raw, fragments):
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_int_is_accepted_where_float_is_expected():
    assert parse_params({"train": {"lr": 1}}).train.lr == 1.0


def test_cli_exits_nonzero_before_writing_anything(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"learning_rate": 0.1}}))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = subprocess.run([sys.executable, "-m", "flows.cli_main", "stage", "train", "--round", "1",
                             "--root", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "learning_rate" in result.stderr and "valid keys" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
