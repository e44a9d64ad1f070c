"""bootstrap: scenario files with disjoint splits, a tiny model whose tokenizer round-trips, or a given HF folder."""
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from agents.prompts import build_prompt
from envs.base import Scenario
from tasks import bootstrap
from tasks.common import evaluate_policy, load_engine
from tasks.config import parse_params
from tasks.layout import Layout

SMALL = {"bootstrap": {"train_scenarios": 12, "heldout_scenarios": 6, "tokenizer_corpus_episodes": 12,
                       "hidden_size": 32, "intermediate_size": 64},
         "rollout": {"scenarios_per_round": 4}}


def test_bootstrap_builds_scenarios_and_a_roundtripping_tiny_model(tmp_path: Path):
    layout = Layout(tmp_path)
    metrics = bootstrap.run(parse_params(SMALL), layout)
    train = [Scenario.from_json(line) for line in layout.scenarios("train").read_text().splitlines()]
    heldout = [Scenario.from_json(line) for line in layout.scenarios("heldout").read_text().splitlines()]
    assert len(train) == 12 and len(heldout) == 6
    assert not {s.seed for s in train} & {s.seed for s in heldout}
    assert metrics["parameters"] > 0 and metrics["mean_prompt_tokens"] > 10
    tokenizer = AutoTokenizer.from_pretrained(layout.policy("base"), local_files_only=True)
    text = build_prompt("Reach G without stepping on H.", "P F F F\nF H F H\nF F F H\nH F F G") + " left"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # BPE merged something: it was trained on env text


def test_bootstrap_uses_a_given_hf_model_folder(tmp_path: Path, tiny_policy_dir: Path):
    layout = Layout(tmp_path)
    bootstrap.run(parse_params({**SMALL, "bootstrap": {**SMALL["bootstrap"], "model": str(tiny_policy_dir)}}), layout)
    given, copied = load_file(str(tiny_policy_dir / "model.safetensors")), load_file(
        str(layout.policy("base") / "model.safetensors"))
    assert given.keys() == copied.keys() and all((given[k] == copied[k]).all() for k in given)


def test_bootstrap_rejects_a_folder_that_is_not_a_model(tmp_path: Path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    project = tmp_path / "project"
    with pytest.raises(FileNotFoundError, match="config.json"):
        bootstrap.run(parse_params({**SMALL, "bootstrap": {**SMALL["bootstrap"], "model": str(bad)}}), Layout(project))
    assert not project.exists()  # nothing written


@pytest.mark.slow
def test_a_mix_of_envs_gets_per_env_sets_pregenerated_games_and_per_env_evaluation(tmp_path: Path):
    layout = Layout(tmp_path)
    params = parse_params({**SMALL, "env": {"mix": {"household": 4, "textworld_cooking": 2, "search_qa": 3},
                                            "kwargs": {"household": {"rooms": 1}}},
                           "bootstrap": {**SMALL["bootstrap"], "heldout_scenarios": 2}})
    bootstrap.run(params, layout)
    train = [Scenario.from_json(line) for line in layout.scenarios("train").read_text().splitlines()]
    heldout = [Scenario.from_json(line) for line in layout.scenarios("heldout").read_text().splitlines()]
    assert sorted(s.env for s in train) == ["household"] * 4 + ["search_qa"] * 3 + ["textworld_cooking"] * 2
    assert [s.env for s in train] != sorted(s.env for s in train)  # shuffled across envs
    assert sorted(s.env for s in heldout) == ["household"] * 2 + ["search_qa"] * 2 + ["textworld_cooking"] * 2
    assert all(dict(s.options)["split"] == s.split for s in train + heldout)  # split-aware envs get their split
    games = sorted(layout.games_dir.rglob("*.z8"))
    assert len(games) == 4  # one per textworld_cooking scenario, under the DVC-tracked scenarios folder

    engine = load_engine(layout.policy("base"), "base", "bootstrap")
    summary, trajectories = evaluate_policy(engine, heldout, params, layout=layout)
    assert sorted(summary["per_env"]) == ["household", "search_qa", "textworld_cooking"]
    assert summary["per_env"]["household"]["episodes"] == 2
    assert all(t.status != "failed" for t in trajectories), [t.error for t in trajectories]
