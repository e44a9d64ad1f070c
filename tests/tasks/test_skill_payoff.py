"""The skill lifecycle paying off end to end with a learned policy (issue 13): configs/frozenlake-decision-budget.yaml
(4x4 FrozenLake, 5 decisions for maps that need 6 moves), shrunk. Mined from the expert, the macros are validated on
paired rollouts of the skill-aware warm start, promoted on their measured utility, and the final bank wins held-out
maps that the same policy without it, and every primitive-only baseline, cannot."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.stage_order import STAGES
from flows.stages import run_stage_functions
from skills.lifecycle import load_round_bank
from tasks.config import load_params, params_to_dict, parse_params
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_under_a_decision_budget_validation_promotes_macros_and_the_bank_wins_held_out_maps(tmp_path):
    raw = params_to_dict(load_params(REPO / "configs" / "frozenlake-decision-budget.yaml"))
    assert raw["harness"]["max_turns"] == 5
    raw["pipeline"]["rounds"] = 1
    raw["bootstrap"].update(train_scenarios=192, heldout_scenarios=60, tokenizer_corpus_episodes=200)
    raw["warmstart"]["demo_scenarios"] = 192
    raw["rollout"]["scenarios_per_round"] = 96
    layout = Layout(tmp_path)
    run_stage_functions(parse_params(raw), layout, include=tuple(s for s in STAGES if s != "transfer"))

    bank = load_round_bank(layout.skills(1))
    assert bank.live, "paired validation promoted no macro"
    report = json.loads(layout.metrics_dir.joinpath("evaluate.json").read_text())
    skills, heldout, baselines = report["skills"], report["heldout"], report["baselines"]
    promotions = [line for line in skills["changelog"] if line.startswith("promoted")]
    assert promotions
    for line in promotions:
        stats = json.loads(line[line.index("{"):])
        assert stats["u"] > 0.1 and stats["welch_t"] > 3, line     # the gate itself asks u > 0, t >= 1
    assert heldout["final"]["success_rate"] == 0.0                   # 5 primitive decisions never reach G
    assert heldout["final_with_skills"]["success_rate"] > 0.2
    assert heldout["final_with_skills"]["macro_calls_per_episode"] > 0
    assert baselines["heldout_equal_to_a_train_scenario"] == 0
    assert baselines["random"]["mean"] == baselines["train_lookup"]["mean"] == 0.0
