"""Integration: a tiny policy's held-out success on FrozenLake rises under RL with grpo and with gigpo, through the
real stage functions (bootstrap, warmstart, rollout, validate, train on DeepSpeed); and the concatenated layout with
the echo and seal auxiliary losses trains."""
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.stages import run_stage_functions
from tasks.common import evaluate_policy, load_engine, read_scenarios
from tasks.config import parse_params
from tasks.layout import Layout

TINY = {
    "pipeline": {"rounds": 3, "seed": 1},
    "bootstrap": {"train_scenarios": 256, "heldout_scenarios": 64, "tokenizer_corpus_episodes": 100},
    "warmstart": {"demo_scenarios": 256, "update": {"epochs": 4, "micro_batch_size": 64}, "skill_demos": 0.0},  # RL only
    "rollout": {"scenarios_per_round": 64, "group_size": 8, "use_skills": False},
    "train": {"optimizer": {"lr": 0.0005}, "update": {"epochs": 2, "micro_batch_size": 128}},
}


def run_rounds(root: Path, raw: dict) -> tuple[Layout, dict]:
    params, layout = parse_params(raw), Layout(root)
    run_stage_functions(params, layout)
    return layout, params


def heldout_success(layout: Layout, params, policy: str) -> float:
    engine = load_engine(layout.policy(policy), policy, policy)
    summary, _ = evaluate_policy(engine, read_scenarios(layout, "heldout"), params)
    return summary["success_rate"]


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "gigpo"])
def test_heldout_success_rises_under_rl(tmp_path, advantage):
    raw = {**TINY, "train": {**TINY["train"], "advantage": advantage}}
    layout, params = run_rounds(tmp_path, raw)
    before = heldout_success(layout, params, "warmstart")
    after = heldout_success(layout, params, "round_3")
    assert after > before, f"{advantage}: held-out success {before:.3f} -> {after:.3f}"


@pytest.mark.slow
def test_concatenated_layout_with_echo_and_seal_trains(tmp_path):
    raw = {**TINY, "pipeline": {"rounds": 1, "seed": 1},
           "train": {**TINY["train"], "layout": "concatenated", "aux": {"names": ["echo", "seal"]},
                     "advantage": "gigpo"}}
    layout, params = run_rounds(tmp_path, raw)
    import json
    metrics = json.loads(layout.round_metrics(1, "train").read_text())
    assert metrics["echo_loss"] > 0 and "seal_loss" in metrics
    before, after = load_file(str(layout.policy("warmstart") / "model.safetensors")), load_file(
        str(layout.policy("round_1") / "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before)
