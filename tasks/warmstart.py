"""warmstart: supervised fine-tuning on the envs' expert trajectories, only action tokens trained.

With warmstart.skill_demos > 0 the warm start is skill-aware: the configured miner (mine.method) mines a bank from
the expert trajectories (``artifacts/skills/round_0``, the lifecycle's first bank: candidates the first rollout
validates, or live skills without skills.validate), and that fraction of the demonstrations shows its skills in the
prompt and calls a shown macro wherever it is what the expert does next. The policy thereby learns the calling
convention; whether a skill then helps is for validation to measure."""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from agents.demos import expert_demonstrations
from envs.base import Scenario
from envs.scenarios import expert_steps
from skills.bank import Skill
from skills.lifecycle import BankChange, RoundBank, save_round_bank
from models.build import load_policy, save_policy
from models.checkpoint import rank_and_world
from models.ds_engine import full_weights, make_ds_engine
from models.sft import sft_update
from tasks.common import (env_kwargs, episode_options, read_scenarios, seed_everything, skill_slot, skills_per_step,
                          write_json)
from skills.miners import mine_skills
from tasks.skill_trials import with_stats
from tasks.config import Params
from tasks.layout import Layout, require
from tasks.outputs import staged_outputs
from tasks.tracking import log_metrics

log = logging.getLogger("arlflow.warmstart")


def bootstrap_bank(scenarios: list[Scenario], params: Params, layout: Layout, bank_dir: Path) -> list[Skill]:
    """Mine the first bank from the expert trajectories of ``scenarios`` and save it to ``bank_dir`` (round 0's)."""
    kwargs = env_kwargs(params, layout)
    sequences = [(s.scenario_id, [step.action for step in expert_steps(s, **kwargs.get(s.env, {}))])
                 for s in scenarios]
    skills = [with_stats(s, round=0, source="expert") for s in mine_skills(sequences, params.mine)]
    skills = skills[: max(params.skills.max_candidates, 1)]
    as_candidates = params.skills.validate
    changes = [BankChange("added", s, {"as": "candidate" if as_candidates else "live", "source": "expert"})
               for s in skills]
    bank = RoundBank(live=[] if as_candidates else skills, candidates=skills if as_candidates else [])
    save_round_bank(bank_dir, bank, changes, header=f"round 0: mined ({params.mine.method}) {len(skills)} "
                                                            f"from {len(sequences)} expert demonstrations")
    return skills


def sft_policy(model, tokenizer, scenarios: list[Scenario], params: Params, save_to: Path,
               layout: Layout | None = None, skills: list[Skill] | None = None) -> dict[str, Any]:
    """SFT `model` on expert demos of `scenarios` through a DeepSpeed engine, save it to `save_to`; metrics.
    With ``skills``, a warmstart.skill_demos fraction of the scenarios is demonstrated a second time, showing them
    and calling their macros."""
    cfg = params.warmstart
    chosen = set(random.Random(params.pipeline.seed).sample(range(len(scenarios)),
                                                            round(cfg.skill_demos * len(scenarios)))) if skills else set()
    guided = [s for i, s in enumerate(scenarios) if i in chosen]
    log.info("warmstart: rendering the expert demonstrations of %d scenarios (%d also skill-guided) ...",
             len(scenarios), len(guided))
    # every scenario keeps its plain demonstration (held-out play is plain); the chosen ones add a skill-guided one
    pairs = expert_demonstrations(tokenizer, scenarios, **episode_options(params, layout),
                                  tool_format=params.harness.tool_format)
    if guided:
        pairs += expert_demonstrations(tokenizer, guided, **episode_options(params, layout),
                                       tool_format=params.harness.tool_format,
                                       skills_for=skill_slot(list(skills), params),
                                       skills_per_step=skills_per_step(params),
                                       call_macros=params.skills.macros)
    if cfg.lora.r > 0:
        model = cfg.lora.apply(model)
    engine = make_ds_engine(model, cfg.optimizer, micro_batch_size=cfg.update.micro_batch_size,
                            total_steps=cfg.update.optimizer_steps(len(pairs), rank_and_world()[1]))
    log.info("warmstart: SFT on %d demonstrations, epochs: %d", len(pairs), cfg.update.epochs)
    on_update = (lambda step, m: log_metrics(m, step=step, prefix="sft.")) if rank_and_world()[0] == 0 else None
    metrics = sft_update(engine, pairs, pad_id=tokenizer.pad_token_id, update=cfg.update, seed=params.pipeline.seed,
                         desc="warmstart", on_update=on_update)
    log.info("warmstart: loss %.4f -> %.4f (first -> last micro-batch; last epoch's mean %.4f) over %d updates, "
             "%.0f tokens/s (per-step curve: MLflow sft.loss)", metrics["loss_first"], metrics["loss_last"],
             metrics["loss_last_epoch"], metrics["updates"], metrics["tokens_per_s"])
    metrics["demos"] = len(pairs)
    metrics["skill_guided_scenarios"] = len(guided)
    with full_weights(engine) as trained:  # gathers ZeRO-3 partitions; a no-op for stages 0-2
        save_policy(trained, tokenizer, save_to)
    return metrics


def run(params: Params, layout: Layout) -> dict[str, Any]:
    """The warm-start policy, round 0's skill bank and warmstart.json, replaced together once all succeeded."""
    seed_everything(params.pipeline.seed)
    base = require(layout.policy("base"), "bootstrap")
    scenarios = read_scenarios(layout, "train")[: params.warmstart.demo_scenarios]
    target, bank_dir, metrics_path = layout.policy("warmstart"), layout.skills(0), layout.metrics_dir / "warmstart.json"
    model, tokenizer = load_policy(base)
    metrics: dict[str, Any] = {"enabled": params.warmstart.enabled}
    with staged_outputs(layout.root, "warmstart", [target, bank_dir, metrics_path]) as out:
        # round 0's bank always exists (the first rollout and mine stages read it): empty unless mined below
        save_round_bank(out.path(bank_dir), RoundBank(), [], header="round 0: no bootstrap skills (warm start off "
                                                                    "or warmstart.skill_demos = 0)")
        if params.warmstart.enabled:
            skills = (bootstrap_bank(scenarios, params, layout, out.path(bank_dir))
                      if params.warmstart.skill_demos > 0 else [])
            metrics["bootstrap_skills"] = [s.name for s in skills]
            metrics.update(sft_policy(model, tokenizer, scenarios, params, out.path(target), layout, skills))
        else:
            log.info("warmstart off (warmstart.enabled false): the base policy is the warm start")
            save_policy(model, tokenizer, out.path(target))
        write_json(out.path(metrics_path), metrics)
    return metrics
