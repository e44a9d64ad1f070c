"""warmstart: supervised fine-tuning on the envs' expert trajectories, only action tokens trained."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from agents.rollout import expert_demonstrations
from envs.base import Scenario
from models.build import load_policy, save_policy
from models.ds_engine import full_weights, make_ds_engine
from models.trainer import sft_update
from tasks.common import episode_options, read_scenarios, seed_everything, write_json
from tasks.config import Params
from tasks.layout import Layout, require


def sft_policy(model, tokenizer, scenarios: list[Scenario], params: Params, save_to: Path,
               layout: Layout | None = None) -> dict[str, Any]:
    """SFT `model` on expert demos of `scenarios` through a DeepSpeed engine, save it to `save_to`; metrics."""
    cfg = params.warmstart
    pairs = expert_demonstrations(tokenizer, scenarios, **episode_options(params, layout),
                                  tool_format=params.rollout.tool_format)
    engine = make_ds_engine(model, lr=cfg.lr, zero_stage=params.train.zero_stage,
                            micro_batch_size=cfg.micro_batch_size)
    metrics = sft_update(engine, pairs, pad_id=tokenizer.pad_token_id, micro_batch_size=cfg.micro_batch_size,
                         epochs=cfg.epochs, seed=params.pipeline.seed)
    metrics["demos"] = len(pairs)
    with full_weights(engine) as trained:  # gathers ZeRO-3 partitions; a no-op for stages 0-2
        save_policy(trained, tokenizer, save_to)
    return metrics


def run(params: Params, layout: Layout) -> dict[str, Any]:
    seed_everything(params.pipeline.seed)
    base = require(layout.policy("base"), "bootstrap")
    target = layout.policy("warmstart")
    if target.exists():
        shutil.rmtree(target)
    model, tokenizer = load_policy(base)
    metrics: dict[str, Any] = {"enabled": params.warmstart.enabled}
    if params.warmstart.enabled:
        scenarios = read_scenarios(layout, "train")[: params.warmstart.demo_scenarios]
        metrics.update(sft_policy(model, tokenizer, scenarios, params, target, layout))
    else:
        save_policy(model, tokenizer, target)
    write_json(layout.metrics_dir / "warmstart.json", metrics)
    return metrics
