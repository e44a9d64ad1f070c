"""train: filters and shaping, advantages (registry), policy loss (registry), DeepSpeed update, new policy version."""
from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pandas as pd
import torch

from datapool.filters import apply_filters
from datapool.parquet import read_steps
from models.advantages import ADVANTAGES, StepBatch, add_process_advantages
from models.batching import TrainRow
from models.build import load_policy, save_policy
from models.checkpoint import rank_and_world
from models.ds_engine import full_weights, make_ds_engine
from models.internalize import GuidedStep, internalization_pairs
from models.layouts import concatenated
from models.reference import ReferencePolicy
from models.sft import sft_update
from models.skill_advantages import SKILL_ADVANTAGES, SkillStepBatch
from models.trainer import rl_update
from tasks.common import seed_everything, write_json
from tasks.config import Params
from tasks.sections import TrainConfig
from tasks.layout import Layout, require
from tasks.outputs import staged_outputs
from tasks.skill_trials import candidate_results, episode_table, paired_utilities, read_trials, skill_used
from tasks.tracking import log_metrics, register_policy

log = logging.getLogger("arlflow.train")


def step_batch(frame: pd.DataFrame) -> StepBatch:
    """The advantage estimators' batch record for a step table (one row per step, rows in table order)."""
    traj_codes = {t: i for i, t in enumerate(dict.fromkeys(frame["trajectory_id"]))}
    group_codes = {g: i for i, g in enumerate(dict.fromkeys(frame["group_id"]))}
    lengths = [len(ids) for ids in frame["response_ids"]]
    width = max(lengths, default=0)
    mask = torch.zeros(len(frame), width)                                              # [R, L]
    for row, length in enumerate(lengths):
        mask[row, :length] = 1.0
    return StepBatch(
        rewards=torch.tensor(frame["reward"].to_numpy(), dtype=torch.float64),          # [R]
        traj_index=torch.tensor([traj_codes[t] for t in frame["trajectory_id"]]),       # [R]
        group_index=torch.tensor([group_codes[g] for g in frame["group_id"]]),          # [R]
        step_index=torch.tensor(frame["step_index"].to_numpy(), dtype=torch.long),     # [R]
        anchors=tuple(str(a) for a in frame["anchor"]),
        won=torch.tensor(frame["won"].to_numpy(dtype=bool)),                            # [R]
        action_valid=torch.tensor(frame["action_valid"].to_numpy(dtype=bool)),          # [R]
        response_mask=mask,
    )


def training_rows(frame: pd.DataFrame, cfg: TrainConfig, tokenizer, trials: pd.DataFrame | None = None
                  ) -> tuple[list, dict[str, float], Any]:
    """Rows with advantages from the configured estimator (always computed per step, so step-level credit works in
    both layouts): step rows carry per-token advantages; concatenated rows (one per trajectory, token ids exactly as
    sampled) carry one advantage per turn. The skill estimators (skillc, d2skill) read each row's ``skill_used``
    flag from the rollout's skill trials (the skill-guided half of a tested group). Also returns the estimator's
    result (internalization weighs its tokens by the step advantages)."""
    batch = step_batch(frame)
    advantage = cfg.advantage
    if advantage.name in SKILL_ADVANTAGES:
        flags = skill_used(frame, trials if trials is not None else pd.DataFrame())
        batch = SkillStepBatch(batch, torch.tensor(flags, dtype=torch.bool))
    result = ADVANTAGES[advantage.name](batch, advantage)
    if advantage.process_weight > 0:
        process = torch.tensor(frame["process_reward"].to_numpy(dtype=float), dtype=torch.float64)  # [R]
        result = add_process_advantages(result, batch if isinstance(batch, StepBatch) else batch.batch, process,
                                        advantage.process_weight, advantage.eps)
    if cfg.layout == "step_rows":
        rows = [TrainRow(list(r.prompt_ids), list(r.response_ids), list(r.logprobs),
                         result.token_advantages[i, :len(r.response_ids)].tolist(),
                         _choices(getattr(r, "action_choices", None)), int(getattr(r, "staleness", 0)))
                for i, r in enumerate(frame.itertuples(index=False))]
        return rows, result.metrics, result
    if "action_choices" in frame and any(len(c) for c in frame["action_choices"]):
        raise ValueError("train.layout concatenated cannot score constrained steps (harness.action_space "
                         "admissible) under their masks yet: use train.layout step_rows")
    frame = frame.assign(_advantage=result.row_advantages.tolist())
    rows = []
    for _, steps in frame.sort_values(["trajectory_id", "step_index"]).groupby("trajectory_id", sort=False):
        spec = concatenated(list(steps.itertuples(index=False)), tokenizer)
        stale = int(steps["staleness"].max()) if "staleness" in steps else 0
        rows.append(spec._replace(step_advantages=tuple(steps["_advantage"]), success=bool(steps["won"].iloc[0]),
                                  staleness=stale))
    return rows, result.metrics, result


def _choices(value) -> list[list[int]] | None:
    """A step's constrained-decoding choices as lists, or None (free decoding; frames without the column)."""
    return [list(c) for c in value] if value is not None and len(value) else None


def drop_stale(frame: pd.DataFrame, limit: int) -> tuple[pd.DataFrame, dict[str, float]]:
    """train.staleness_limit: keep the steps sampled at most ``limit`` rounds stale (-1 keeps all); the counts go to
    train.json (`stale_steps_dropped`, and the steps per staleness before the filter)."""
    staleness = frame["staleness"] if "staleness" in frame else pd.Series(0, index=frame.index)
    metrics = {f"steps_staleness_{int(k)}": int(n) for k, n in staleness.value_counts().sort_index().items()}
    if limit < 0:
        return frame, metrics
    keep = staleness <= limit
    return frame[keep].reset_index(drop=True), {**metrics, "stale_steps_dropped": int((~keep).sum())}


def guided_steps(frame: pd.DataFrame, trials: pd.DataFrame, row_advantages: torch.Tensor, *, tau: float = 0.0,
                 t_min: float = 1.0) -> list[GuidedStep]:
    """SIRI's data: the steps of skill-guided (augmented) halves of VALIDATED skills, with the prompt each would
    have had without the skill (the step's own ``plain_prompt_ids`` / ``macro_*_ids``) and its advantage. u is the candidate's pooled u(c) when validation promotes it
    (u > tau, Welch t > t_min; a rejected candidate guides nothing), and for a paired group of live skills the mean
    paired utility of the skills the episode saw. A macro step contributes each of its sub-steps (plain prompt ->
    the primitive action), with the macro step's advantage."""
    if trials.empty or len(frame) == 0:
        return []
    episodes = episode_table(trials)
    validated = {name: r.u for name, r in candidate_results(episodes, tau=tau, t_min=t_min).items() if r.promote}
    paired = {name: u for name, (u, _) in paired_utilities(episodes).items()}
    by_step = {(t, int(i)): row for t, i, row in zip(trials["trajectory_id"], trials["step_index"],
                                                     trials.itertuples(index=False))}
    steps = []
    for position, row in enumerate(frame.itertuples(index=False)):
        trial = by_step.get((row.trajectory_id, int(row.step_index)))
        if trial is None or trial.arm != "aug" or len(row.plain_prompt_ids) == 0:
            continue
        if trial.test == "candidate":
            u = validated.get(trial.candidate)
        else:
            known = [paired[name] for name in trial.skill_ids if name in paired]
            u = sum(known) / len(known) if known else None
        advantage = float(row_advantages[position])
        if len(row.macro_prompt_ids):
            steps += [GuidedStep(list(p), list(a), advantage, u)
                      for p, a in zip(row.macro_prompt_ids, row.macro_action_ids)]
        elif len(row.response_ids):
            steps.append(GuidedStep(list(row.plain_prompt_ids), list(row.response_ids), advantage, u))
    return steps


def internalize(engine, frame: pd.DataFrame, trials: pd.DataFrame, row_advantages: torch.Tensor, params: Params,
                tokenizer, seed: int, round_index: int) -> dict[str, float]:
    """SIRI: L_int = -mean w_t log pi(a_t | prompt without the skill) over the selected skill-guided tokens
    (models/internalize.py), one pass with the same optimizer after the policy-gradient passes."""
    cfg = params.train
    gate = params.skills.validation
    steps = guided_steps(frame, trials, row_advantages, tau=gate.tau, t_min=gate.t_min)
    pairs, weights, metrics = internalization_pairs(steps, cfg.internalize)
    out = {f"internalize.{k}": float(v) for k, v in metrics.items()}
    if pairs:
        log.info("train round %d: internalizing %d skill-guided steps (SIRI)", round_index, len(pairs))
        result = sft_update(engine, pairs, weights=weights, pad_id=tokenizer.pad_token_id,
                            update=replace(cfg.update, epochs=1), seed=seed, desc=f"internalize r{round_index}",
                            on_update=log_steps("internalize."))
        out.update({f"internalize.{k}": float(v) for k, v in result.items()})
    return out


def log_steps(prefix: str) -> Callable[[int, dict[str, float]], None] | None:
    """An `on_update` callback logging every optimizer step's metrics to MLflow as `<prefix><name>` at that step
    (the per-step curves; a no-op without an active run), on rank 0 only."""
    if rank_and_world()[0] != 0:
        return None
    return lambda step, metrics: log_metrics(metrics, step=step, prefix=prefix)


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    """Filters, advantages, the DeepSpeed update; the new policy and train.json replace the old ones together, only
    once everything succeeded (a failed or killed run leaves them as they were; a killed update resumes from its
    checkpoints)."""
    cfg = params.train
    seed = params.pipeline.seed * 1000 + round_index
    seed_everything(seed)
    frame, _ = read_steps(require(layout.validated(round_index), f"validate_{round_index}"))
    trials = read_trials(layout.skill_trials(round_index))
    source = require(layout.round_policy(round_index), "warmstart" if round_index == 1 else f"train_{round_index - 1}")
    model, tokenizer = load_policy(source)
    target, metrics_path = layout.policy(f"round_{round_index}"), layout.round_metrics(round_index, "train")
    checkpoints = layout.train_checkpoints(round_index)
    with staged_outputs(layout.root, f"train_{round_index}", [target, metrics_path]) as out:
        frame, stale_metrics = drop_stale(frame, cfg.staleness_limit)
        frame, metrics = apply_filters(frame, cfg.filters)
        metrics = {"round": round_index, "rows": len(frame), **stale_metrics, **metrics}
        if len(frame) == 0:
            log.info("train round %d: no steps left after the filters: the policy is kept as it was", round_index)
            metrics["skipped_no_signal"] = 1
            save_policy(model, tokenizer, out.path(target))
        else:
            rows, advantage_metrics, advantage_result = training_rows(frame, cfg, tokenizer, trials)
            metrics.update(advantage_metrics)
            wants_reference = cfg.loss.kl_beta > 0
            reference = ReferencePolicy(model) if wants_reference and cfg.lora.r == 0 else None
            if cfg.lora.r > 0:
                model = cfg.lora.apply(model)
                reference = ReferencePolicy(model) if wants_reference else None
            updates = cfg.update.optimizer_steps(len(rows), rank_and_world()[1])   # what a cosine decays over
            engine = make_ds_engine(model, cfg.optimizer, micro_batch_size=cfg.update.micro_batch_size,
                                    total_steps=updates)
            log.info("train round %d: %d steps -> %d rows (%s); epochs %d x %d mini-batches of <= %d rows = %d "
                     "optimizer updates", round_index, len(frame), len(rows), cfg.layout, cfg.update.epochs,
                     updates // cfg.update.epochs, cfg.update.mini_batch(engine), updates)
            result = rl_update(engine, rows, pad_id=tokenizer.pad_token_id, loss=cfg.loss, update=cfg.update,
                               seed=seed, aux=cfg.aux, reference=reference, on_update=log_steps("rl."),
                               checkpoint_dir=checkpoints, desc=f"train r{round_index}")
            log.info("train round %d: %d updates, loss %.4f, grad norm %.3f, %.0f tokens/s (means over updates; "
                     "per-step curves: MLflow rl.*)", round_index, result["updates"], result["loss"],
                     result["grad_norm"], result["tokens_per_s"])
            metrics.update(result)
            if cfg.internalize.coef > 0:
                metrics.update(internalize(engine, frame, trials, advantage_result.row_advantages, params,
                                           tokenizer, seed, round_index))
            with full_weights(engine) as trained:  # gathers ZeRO-3 partitions, merges LoRA adapters
                save_policy(trained, tokenizer, out.path(target))
        saved, saved_tokenizer = load_policy(out.path(target))
        log_metrics(metrics)
        version = register_policy(saved, saved_tokenizer, params.pipeline.registered_model,
                                  tags={"round": str(round_index), "policy_path": target.relative_to(layout.root).as_posix()})
        if version is not None:
            metrics["registered_version"] = int(version)
        write_json(out.path(metrics_path), metrics)
    shutil.rmtree(checkpoints, ignore_errors=True)  # the round's policy is in place: its resume state is done
    return metrics
