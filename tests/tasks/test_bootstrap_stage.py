"""bootstrap: scenario files with disjoint, unseen splits, a tiny model whose tokenizer round-trips, or a given HF
folder."""
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from agents.prompts import build_prompt
from envs.base import Scenario, make_scenario_env
from tasks import bootstrap
from tasks.common import env_kwargs, evaluate_policy, load_engine
from tasks.config import parse_params
from tasks.layout import Layout

SMALL = {"bootstrap": {"train_scenarios": 12, "heldout_scenarios": 6, "tokenizer_corpus_episodes": 12,
                       "tiny": {"hidden_size": 32, "intermediate_size": 64}},
         "rollout": {"scenarios_per_round": 4}, "warmstart": {"demo_scenarios": 12}}


def lake_maps(scenarios: list[Scenario], params) -> list[str]:
    """The FrozenLake map of each scenario: its first observation (the whole grid, the agent on S)."""
    kwargs = env_kwargs(params)["frozenlake"]
    return [make_scenario_env(s, **kwargs)[1] for s in scenarios]


def test_default_heldout_maps_are_unseen_in_train():
    """The default 4x4 lake: 115 of the 200 seed-drawn held-out maps are train maps; the sets bootstrap writes
    hold none of them, and 200 distinct held-out maps still."""
    params = parse_params({})
    sets = bootstrap.make_scenario_sets(params)
    train, heldout = sets[0], sets[1]
    train_maps, heldout_maps = set(lake_maps(train, params)), lake_maps(heldout, params)
    assert len(train) == 512 and len(heldout) == 200
    assert not train_maps & set(heldout_maps) and len(set(heldout_maps)) == 200
    report = sets[2]
    assert report["heldout_overlap"] == {"frozenlake": 0}
    assert report["heldout_overlap_before"] == {"frozenlake": 115}
    assert 315 <= report["heldout_candidates"]["frozenlake"] <= 4000
    assert bootstrap.make_scenario_sets(params) == sets  # deterministic


def test_too_few_unseen_scenarios_fail_with_what_to_change():
    params = parse_params({"env": {"kwargs": {"frozenlake": {"size": 2, "p_frozen": 0.5}}},
                           "bootstrap": {"heldout_scenarios": 2}})  # 3 maps exist, all of them train maps
    with pytest.raises(ValueError, match=r"^bootstrap: frozenlake: only 0 distinct unseen held-out scenarios in 40 "
                                         r"candidates, 2 needed .*set bootstrap.heldout_scenarios to at most 0, "
                                         r".*env.kwargs.frozenlake"):
        bootstrap.make_scenario_sets(params)


def test_bootstrap_builds_scenarios_and_a_roundtripping_tiny_model(tmp_path: Path):
    layout = Layout(tmp_path)
    metrics = bootstrap.run(parse_params(SMALL), layout)
    train = [Scenario.from_json(line) for line in layout.scenarios("train").read_text().splitlines()]
    heldout = [Scenario.from_json(line) for line in layout.scenarios("heldout").read_text().splitlines()]
    assert len(train) == 12 and len(heldout) == 6
    assert not {s.seed for s in train} & {s.seed for s in heldout}
    assert metrics["parameters"] > 0 and metrics["mean_prompt_tokens"] > 10
    assert metrics["heldout_overlap"] == {"frozenlake": 0}
    assert set(metrics["heldout_overlap_before"]) == set(metrics["heldout_candidates"]) == {"frozenlake"}
    assert metrics["heldout_candidates"]["frozenlake"] >= 6 + metrics["heldout_overlap_before"]["frozenlake"]
    assert not set(lake_maps(train, parse_params(SMALL))) & set(lake_maps(heldout, parse_params(SMALL)))
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
                           "bootstrap": {**SMALL["bootstrap"], "heldout_scenarios": 2},
                           "warmstart": {"demo_scenarios": 9}})
    metrics = bootstrap.run(params, layout)
    train = [Scenario.from_json(line) for line in layout.scenarios("train").read_text().splitlines()]
    heldout = [Scenario.from_json(line) for line in layout.scenarios("heldout").read_text().splitlines()]
    assert metrics["heldout_overlap"] == {"household": 0, "search_qa": 0, "textworld_cooking": 0}
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
