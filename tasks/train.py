"""train: advantages (registry) over the validated groups, policy loss (registry), DeepSpeed update, new policy."""
from __future__ import annotations

import shutil
from typing import Any

import torch

from datapool.parquet import read_steps
from models.advantages import ADVANTAGES
from models.build import load_policy, save_policy
from models.losses import LOSSES
from models.trainer import TrainRow, full_weights, make_ds_engine, rl_update
from tasks.common import seed_everything, write_json
from tasks.config import Params
from tasks.layout import Layout, require
from tasks.tracking import log_metrics, register_policy


def trajectory_advantages(frame, estimator: str) -> dict[str, float]:
    """Per-trajectory advantage from episode returns, normalized within scenario groups."""
    per_traj = frame.groupby("trajectory_id").agg(group_id=("group_id", "first"),
                                                  score=("episode_return", "first")).reset_index()
    group_codes = {g: i for i, g in enumerate(sorted(per_traj["group_id"].unique()))}
    scores = torch.tensor(per_traj["score"].to_numpy(), dtype=torch.float32)  # [N]
    groups = torch.tensor([group_codes[g] for g in per_traj["group_id"]], dtype=torch.long)  # [N]
    advantages = ADVANTAGES[estimator](scores, groups)  # [N]
    return dict(zip(per_traj["trajectory_id"], advantages.tolist()))


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    cfg = params.train
    LOSSES[cfg.loss]  # unknown names fail before any work, listing the valid ones
    seed = params.pipeline.seed * 1000 + round_index
    seed_everything(seed)
    frame, metadata = read_steps(require(layout.validated(round_index), f"validate_{round_index}"))
    model, tokenizer = load_policy(require(layout.round_policy(round_index),
                                           "warmstart" if round_index == 1 else f"train_{round_index - 1}"))
    target = layout.policy(f"round_{round_index}")
    metrics: dict[str, Any] = {"round": round_index, "rows": len(frame)}
    if target.exists():
        shutil.rmtree(target)
    if len(frame) == 0:
        metrics["skipped_no_signal"] = 1
        save_policy(model, tokenizer, target)
    else:
        advantages = trajectory_advantages(frame, cfg.advantage)
        rows = [TrainRow(list(r.prompt_ids), list(r.response_ids), list(r.logprobs), advantages[r.trajectory_id])
                for r in frame.itertuples()]
        engine = make_ds_engine(model, lr=cfg.lr, zero_stage=cfg.zero_stage, micro_batch_size=cfg.micro_batch_size)
        metrics.update(rl_update(engine, rows, pad_id=tokenizer.pad_token_id, micro_batch_size=cfg.micro_batch_size,
                                 epochs=cfg.epochs, clip_low=cfg.clip_low, clip_high=cfg.clip_high, loss=cfg.loss,
                                 seed=seed))
        with full_weights(engine) as trained:  # gathers ZeRO-3 partitions; a no-op for stages 0-2
            save_policy(trained, tokenizer, target)
    model, tokenizer = load_policy(target)
    log_metrics(metrics)
    version = register_policy(model, tokenizer, params.pipeline.registered_model,
                              tags={"round": str(round_index), "policy_path": str(target)})
    if version is not None:
        metrics["registered_version"] = int(version)
    write_json(layout.round_metrics(round_index, "train"), metrics)
    return metrics
