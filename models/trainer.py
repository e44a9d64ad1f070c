"""DeepSpeed RL updates of a HF causal-LM policy: PPO-style updates on (prompt, response, advantage) rows.

One process on the CPU accelerator by default (gloo, fp32); the same code runs ZeRO 1-3 over several processes under
the `deepspeed` launcher (RANK/WORLD_SIZE/... from the launcher) and in bf16 on GPUs. Rows, batches and the step
loop are in models/batching.py, the forward passes in models/forward.py, SFT in models/sft.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from tqdm.auto import tqdm

from models.aux_losses import AUX_LOSSES, AuxConfig, AuxInputs
from models.batching import (TrainRow, UpdateConfig, aggregation_units, all_ranks_max, all_reduce_sum, collate,
                             loss_weight,
                             rank_micro_batches, select_rows, train_mini_batch)
from models.checkpoint import load_checkpoint, rank_and_world, save_checkpoint
from models.ds_engine import LrSchedule
from models.forward import (LOGIT_FREE_AUX, entropy_at, logits_at, scatter_positions, shared_prefix_logits,
                            shared_prefix_plan, token_logprobs)
from models.layouts import RowSpec, collate_rows
from models.losses import LossConfig, masked_token_mean, policy_objective
from models.portable.action_trie import mask_logits
from models.staleness import (IS_WEIGHT_METRICS, NO_STALE_TOKENS, add_is_weight_totals, is_weight_metrics,
                              is_weight_totals, loss_settings, staleness_metrics)

AGGREGATED_METRICS = ("loss", "pg_loss", "kl_loss", "entropy")  # policy_objective terms reduced by `aggregation`


def _is_aggregated(name: str) -> bool:
    """A metric reduced by the loss aggregation (weighted by loss share), not a token mean."""
    return name in AGGREGATED_METRICS or name.startswith("kl_ref_")


class ReferenceScorer(Protocol):
    """What rl_update needs of a reference policy (models.reference.ReferencePolicy is one)."""

    def ref_logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, L] log-probs of batch["target_ids"] under the reference policy."""



def _micro_objective(engine, part: dict[str, Tensor], loss: LossConfig, aux: AuxConfig, *, on_policy: bool = False
                     ) -> tuple[Tensor, dict[str, float]]:
    """The one place where the RL objective of a micro-batch is computed: `losses.policy_objective` (policy loss
    + kl_beta * KL to the reference - entropy_coef * entropy), aggregated over the micro-batch, plus the weighted
    auxiliary losses (`aux_losses.AUX_LOSSES`, e.g. echo on observation tokens) from the same forward pass.

    Logits are computed at response positions only (plus observation positions for aux losses that read logits).
    on_policy: the weights have not moved since the rollout rows were scored, so this forward's own log-probs
    (detached) are the old log-probs (ratio exactly 1); part["old_logprobs"] then holds the rollout log-probs, and
    the metrics carry `_gap_sum` / `_gap_count` / `_gap_max` of |logp - rollout| for `logp_mismatch_*`.
    The old log-probs are the proximal policy's; rows with staleness > 0 and rollout log-probs are corrected towards
    their behaviour policy (part["behaviour_logprobs"]) as loss.off_policy says (docs/algorithms.md §2.7); the metrics
    carry IS_WEIGHT_METRICS over their `_is_weight_count` tokens.
    """
    mask = part["response_mask"]                                            # [b, l]
    names = aux.names
    logit_aux = [name for name in names if name not in LOGIT_FREE_AUX]
    positions = mask.bool()                                                 # [b, l]
    if logit_aux:
        positions = positions | (part["observation_mask"].bool() & part["attention_mask"].bool())
    plan = None if names else shared_prefix_plan(engine, part)
    if plan is not None:
        logits, hidden = shared_prefix_logits(engine, part, plan), None   # [N, V]
    else:
        logits, hidden = logits_at(engine, part, positions, want_hidden="seal" in names)  # [N, V], [b, l, H]
    if "allowed_ids" in part:                                               # constrained decoding: same mask
        logits = mask_logits(logits, part["allowed_ids"].to(logits.device)[positions.to(logits.device)])  # [N, V]
    picked_targets = part["target_ids"].to(logits.device)[positions.to(logits.device)]  # [N]
    token_logp = logits.gather(-1, picked_targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [N]
    logp = scatter_positions(token_logp, positions)                        # [b, l]
    response_logits = logits[mask.bool()[positions]]                        # [R, V]
    if loss.entropy_coef:
        entropy = entropy_at(response_logits, mask, loss.aggregation)
    else:
        with torch.no_grad():
            entropy = entropy_at(response_logits.detach(), mask, loss.aggregation)
    old_logp = logp.detach() if on_policy else part["old_logprobs"]         # [b, l] the proximal policy
    stale_rows = (part["staleness"] > 0) & part["has_old_logprobs"]        # [b]
    total, metrics = policy_objective(logp, old_logp, part["advantages"], mask, loss,
                                      ref_logp=part.get("ref_logprobs"), entropy=entropy,
                                      behaviour_logp=part["behaviour_logprobs"], stale_rows=stale_rows)
    metrics["_is_weight_count"] = float((mask.bool() & stale_rows.to(mask.device)[:, None]).sum())
    if on_policy:
        with torch.no_grad():
            carried = mask.bool() & part["has_old_logprobs"].to(mask.device)[:, None]  # [b, l]
            gap = torch.where(carried, (logp.detach() - part["old_logprobs"]).abs(), torch.zeros_like(logp))
            metrics.update(_gap_sum=float(gap.double().sum()), _gap_count=float(carried.sum()),
                           _gap_max=float(gap.max()) if gap.numel() else 0.0)
    if names:
        full_logits = scatter_positions(logits, positions) if logit_aux else None  # [b, l, V], 0 where unused
        inputs = AuxInputs(logits=full_logits, target_ids=part["target_ids"], observation_mask=part["observation_mask"],
                           hidden=hidden, attention_mask=part["attention_mask"], success=part["success"],
                           group_index=part["group_index"])
        for name in names:
            term, aux_metrics = AUX_LOSSES[name](inputs, aux)
            total = total + term
            metrics.update(aux_metrics)
        metrics["loss"] = float(total.detach())
    return total, metrics


def _score_rows(engine, batch: dict[str, Tensor], lengths: list[int], reference: ReferenceScorer | None, *,
                max_rows: int, token_budget: int | None, score_policy: bool = True
                ) -> tuple[Tensor | None, Tensor | None]:
    """[B, L] log-probs of every row under the current weights (the PPO "old" policy; None unless score_policy)
    and under `reference` (None without one).

    Each rank scores its shard in eval mode; the shards are summed across ranks, so every rank holds all rows.
    """
    if not score_policy and reference is None:
        return None, None
    old = torch.zeros_like(batch["old_logprobs"])                           # [B, L]
    ref = torch.zeros_like(old) if reference is not None else None         # [B, L]
    engine.module.eval()
    with torch.no_grad():
        for index, real in rank_micro_batches(list(range(len(lengths))), lengths, max_rows=max_rows,
                                               token_budget=token_budget):
            part = select_rows(batch, index, engine.device)
            width = part["input_ids"].shape[1]
            scored = token_logprobs(engine, part).cpu() if score_policy else None  # [b, l]
            scored_ref = reference.ref_logprobs(part).cpu() if reference is not None else None
            if real:
                if scored is not None:
                    old[index, :width] = scored
                if ref is not None:
                    ref[index, :width] = scored_ref
    engine.module.train()
    old = all_reduce_sum(old, engine.device) if score_policy else None
    return old, all_reduce_sum(ref, engine.device) if ref is not None else None


def _engine_settings(engine) -> dict[str, Any]:
    """The engine's training hyperparameters (optimizer groups, LR schedule, clipping, ZeRO stage, precision)."""
    scheduler = engine.lr_scheduler
    return {
        "optimizer": [{k: v for k, v in group.items() if k not in ("params", "lr")}
                      for group in engine.optimizer.param_groups],
        "base_lrs": getattr(scheduler, "base_lrs", None),
        "schedule": [vars(f) for f in getattr(scheduler, "lr_lambdas", []) if isinstance(f, LrSchedule)],
        "grad_clip": engine.gradient_clipping(),
        "zero_stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
    }


def _fingerprint(batch: dict[str, Tensor], settings: dict[str, Any]) -> str:
    """Identifies an rl_update call (rows + settings), so a checkpoint of another call is never resumed."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for name in ("input_ids", "attention_mask", "response_mask", "advantages", "old_logprobs", "allowed_ids"):
        if name in batch:
            digest.update(batch[name].numpy().tobytes())
    if bool(batch["staleness"].any()):                                      # all on-policy: the digest of before
        digest.update(batch["staleness"].numpy().tobytes())
    return digest.hexdigest()


def _fresh_state(engine, batch, lengths, rows, reference, *, fingerprint, epochs, seed, max_rows, token_budget,
                 on_policy: bool = False):
    """Trainer state at the start of an rl_update call: scored rows, every epoch's shuffled order, position 0.

    on_policy: the old log-probs come from the training forward (`_micro_objective`), so only the reference is
    scored here; old_logprobs is None and the mismatch is filled in after the update (`_on_policy_mismatch`).
    """
    old, ref = _score_rows(engine, batch, lengths, reference, max_rows=max_rows, token_budget=token_budget,
                           score_policy=not on_policy)
    mask = batch["response_mask"]                                           # [B, L]
    carried = mask * batch["has_old_logprobs"][:, None]                     # [B, L]
    mismatch = {}
    if old is not None and carried.sum() > 0:
        gap = (old - batch["old_logprobs"]).abs()                           # [B, L]
        mismatch["logp_mismatch_mean"] = float(masked_token_mean(gap, carried))
        mismatch["logp_mismatch_max"] = float(torch.where(carried.bool(), gap, torch.zeros_like(gap)).max())
    rng = random.Random(seed)
    orders = []
    for _ in range(epochs):
        order = list(range(len(rows)))
        rng.shuffle(order)
        orders.append(order)
    zero = torch.zeros_like(mask)
    return {
        "fingerprint": fingerprint, "orders": orders, "mismatch": mismatch,
        "old_logprobs": torch.where(mask.bool(), old, zero) if old is not None else None,
        "ref_logprobs": torch.where(mask.bool(), ref, zero) if ref is not None else None,
        "updates_done": 0, "epoch": 0, "mini_batch": 0,  # data position: next epoch / mini-batch to train
        "micro_batches_done": 0,                           # this rank's forward/backward passes so far
        "metric_sums": {}, "finished": False, "result": None,
        "is_weight_totals": dict(NO_STALE_TOKENS),         # `is_weight_totals` of every update so far
    }


def _mini_batch_parts(engine, batch, mini: list[int], lengths: list[int], *, aggregation: str, max_rows: int,
                      token_budget: int | None, norm_width: int):
    """This rank's micro-batches of the global mini-batch `mini` as (part, loss weight), and per micro-batch its
    (share of the mini-batch loss, share of the mini-batch's response tokens) for the metrics; 0 for fillers."""
    units = aggregation_units(batch["response_mask"][mini], aggregation)
    mini_tokens = float(batch["response_mask"][mini].sum())
    micro, shares = [], []
    for index, real in rank_micro_batches(mini, lengths, max_rows=max_rows, token_budget=token_budget):
        part = select_rows(batch, index, engine.device)
        part["has_old_logprobs"] = part["has_old_logprobs"] & real          # fillers never count in the mismatch
        weight = loss_weight(part, units, aggregation, norm_width) if real else 0.0
        micro.append((part, weight))
        token_share = float(part["response_mask"].sum()) / max(mini_tokens, 1.0) if real else 0.0
        shares.append((weight / rank_and_world()[1], token_share))
    return micro, shares


def _update_metrics(engine, mini: list[int], batch, micro_metrics, shares, advantages, lengths, lr, elapsed):
    """One optimizer step's metrics over the whole global mini-batch, summed over micro-batches and ranks.

    shares: per micro-batch (its share of the mini-batch loss, its share of the mini-batch's response tokens). The
    aggregated terms (AGGREGATED_METRICS) are weighted by the first, so they equal the mini-batch objective's terms;
    the token means of the policy loss (clip_fraction, approx_kl_k2/k3, ratio_mean, ...) by the second. The
    staleness statistics (`staleness_metrics`) are the mini-batch rows'.
    """
    keys = sorted(micro_metrics[0])
    local = torch.tensor([[share[not _is_aggregated(k)] * m[k] for k in keys]
                          for share, m in zip(shares, micro_metrics)], dtype=torch.float64).sum(dim=0)  # [K]
    reduced = all_reduce_sum(local, engine.device)                         # [K]
    metrics = dict(zip(keys, reduced.tolist()))
    picked = torch.tensor([advantages[i] for i in mini], dtype=torch.float64)  # [M]
    tokens = sum(lengths[i] for i in mini)
    metrics.update(
        lr=lr,
        advantage_mean=float(picked.mean()),
        advantage_std=float(picked.std()) if len(mini) > 1 else 0.0,
        response_length=float(batch["response_mask"][mini].sum()) / len(mini),
        tokens=float(tokens),
        tokens_per_s=tokens / max(elapsed, 1e-9),
        micro_batches=float(len(micro_metrics)),
        **staleness_metrics(batch["staleness"][mini]),
    )
    return metrics


def rl_update(
    engine,
    rows: list[TrainRow],
    *,
    pad_id: int,
    loss: LossConfig,
    update: UpdateConfig,
    seed: int = 0,
    aux: AuxConfig | None = None,
    reference: ReferenceScorer | None = None,
    on_update: Callable[[int, dict[str, float]], None] | None = None,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    desc: str = "train",
) -> dict[str, float]:
    """Policy-gradient update on `rows` with `losses.policy_objective` under `loss`; returns metrics averaged over
    updates.

    rows: the whole batch, the same list on every rank (see the module docstring for how ranks share it).
    update: epochs; rows per optimizer step over all ranks (`mini_batch_size`, default engine.train_batch_size(),
        i.e. micro_batch_size x grad_accum x world size; `aggregation` normalizes over the whole mini-batch, so the
        update does not depend on how rows are cut into micro-batches or ranks); at most `micro_batch_size` rows /
        `token_budget` padded tokens (rows x longest) per forward pass; `checkpoint_every`.
    aux: auxiliary losses (`aux.names`, e.g. echo on observation tokens; need RowSpec rows) and their weights.
    Old log-probs are recomputed under the current weights first (so ratio = 1 on the first step); when rows carry
    rollout log-probs, |recomputed - rollout| is reported as logp_mismatch_mean/max (engine/trainer drift). With one
    epoch of one mini-batch, no row is trained after an earlier update, so the recompute is skipped: the training
    forward's detached log-probs are the old ones (ratio exactly 1) and the mismatch is measured on them.
    Stale rows (TrainRow/RowSpec staleness > 0, sampled by an older policy): the old log-probs are the proximal
    policy's and loss.off_policy "decoupled" weights their tokens by min(pi_prox / pi_behaviour, loss.is_weight_cap)
    (docs/algorithms.md §2.7); rows with staleness 0 are never weighted. Rows are never dropped for staleness here.
    reference (e.g. `models.reference.ReferencePolicy`): scored once at the start; needed when loss.kl_beta > 0, and
    with kl_beta 0 the KL is only logged (kl_loss).
    on_update(step, metrics): called on every rank after every optimizer step (step = engine.global_steps) with that
    step's loss terms, clip fraction, KL estimates, entropy, grad norm, lr, advantage stats, response length, tokens/s,
    staleness stats (stale_row_fraction, staleness_mean/max, staleness_count_<k>) and importance weights
    (is_weight_mean/max, is_weight_truncated_fraction). The returned staleness stats are over all rows, the weights
    over every update's stale tokens.
    checkpoint_dir: save a complete checkpoint (`models.checkpoint`) every `update.checkpoint_every` optimizer steps
    and at the end; a call with the same rows and settings resumes from the newest complete one, skipping the
    mini-batches already done, and ends bit-identical to an uninterrupted call (same seed, same hardware). One
    directory per call.
    progress: a tqdm bar `desc` over the optimizer steps on rank 0 (loss and tokens/s of the last step, ETA).
    """
    if not rows:
        raise ValueError("rl_update got no rows")
    if loss.kl_beta and reference is None:
        raise ValueError(f"kl_beta is {loss.kl_beta} but no reference was given: pass reference=ReferencePolicy(model) "
                         f"(models.reference; build it before make_ds_engine) or set kl_beta to 0")
    started = time.perf_counter()
    aux = aux or AuxConfig()
    for name in aux.names:
        AUX_LOSSES[name]  # unknown names fail here, listing the valid ones
    concatenated = isinstance(rows[0], RowSpec)
    if aux.names and not concatenated:
        raise ValueError(f"aux losses {list(aux.names)} read observation tokens: pass RowSpec rows from "
                         "models.layouts.concatenated (train.layout: concatenated)")
    batch = collate_rows(rows, pad_id) if concatenated else collate(rows, pad_id)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    mini_size = update.mini_batch(engine)
    max_rows, token_budget = update.micro_batch_size, update.token_budget or None
    settings = dict(loss=loss_settings(loss, batch), pad_id=pad_id, micro_batch_size=max_rows,
                    mini_batch_size=mini_size, token_budget=token_budget, epochs=update.epochs, seed=seed,
                    world=rank_and_world()[1], reference=reference is not None, engine=_engine_settings(engine),
                    aux=dataclasses.asdict(aux))
    fingerprint = _fingerprint(batch, settings)

    state = load_checkpoint(engine, checkpoint_dir, fingerprint=fingerprint) if checkpoint_dir is not None else None
    if state is not None and state["finished"]:
        return state["result"]
    per_epoch = math.ceil(len(rows) / mini_size)
    on_policy = _reuses_training_logprobs(update.epochs, per_epoch)
    if state is None:
        state = _fresh_state(engine, batch, lengths, rows, reference, fingerprint=fingerprint, epochs=update.epochs,
                             seed=seed, max_rows=max_rows, token_budget=token_budget, on_policy=on_policy)
    if state["old_logprobs"] is not None:
        batch["old_logprobs"] = state["old_logprobs"]                       # else: rollout log-probs, for the gap
    if state["ref_logprobs"] is not None:
        batch["ref_logprobs"] = state["ref_logprobs"]

    engine.module.train()
    advantages = _row_advantages(rows)
    norm_width = batch["input_ids"].shape[1]
    total_updates = update.epochs * per_epoch
    tokens_this_call = 0
    with tqdm(total=total_updates, initial=state["updates_done"], desc=desc, unit="update",
              disable=not progress or rank_and_world()[0] != 0) as bar:
        for step in range(state["updates_done"], total_updates):
            step_started = time.perf_counter()
            epoch, index = divmod(step, per_epoch)
            mini = state["orders"][epoch][index * mini_size : (index + 1) * mini_size]
            micro, shares = _mini_batch_parts(engine, batch, mini, lengths, aggregation=loss.aggregation,
                                              max_rows=max_rows, token_budget=token_budget, norm_width=norm_width)
            lr = float(engine.get_lr()[0])
            grad_norm, micro_metrics = train_mini_batch(
                engine, micro, lambda p: _micro_objective(engine, p, loss, aux, on_policy=on_policy))
            gaps = [{k: m.pop(k) for k in ("_gap_sum", "_gap_count", "_gap_max") if k in m} for m in micro_metrics]
            if on_policy:
                state["mismatch"] = _on_policy_mismatch(gaps, engine.device)
            weights = [{k: m.pop(k) for k in (*IS_WEIGHT_METRICS, "_is_weight_count")} for m in micro_metrics]
            step_weights = is_weight_totals(weights, engine.device)
            state["is_weight_totals"] = add_is_weight_totals(state.get("is_weight_totals", NO_STALE_TOKENS),
                                                             step_weights)   # absent in older checkpoints
            metrics = _update_metrics(engine, mini, batch, micro_metrics, shares, advantages, lengths, lr,
                                      time.perf_counter() - step_started)
            metrics.update(is_weight_metrics(step_weights))
            metrics["grad_norm"] = grad_norm
            tokens_this_call += int(metrics["tokens"])
            for name, value in metrics.items():
                state["metric_sums"][name] = state["metric_sums"].get(name, 0.0) + value
            state.update(updates_done=step + 1, epoch=(step + 1) // per_epoch, mini_batch=(step + 1) % per_epoch,
                         micro_batches_done=state["micro_batches_done"] + len(micro))
            if on_update is not None:
                on_update(int(engine.global_steps), metrics)
            finished = step + 1 == total_updates
            if finished:
                state.update(finished=True, result=_rl_result(state, rows, batch, tokens_this_call, started))
            if checkpoint_dir is not None and (finished or (step + 1) % update.checkpoint_every == 0):
                save_checkpoint(engine, checkpoint_dir, step + 1, state)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
    return state["result"]


def _reuses_training_logprobs(epochs: int, mini_batches_per_epoch: int) -> bool:
    """Whether every row is trained in exactly one optimizer step with no earlier update (one epoch, one
    mini-batch): then the old policy is the training forward's own, and no scoring pass is needed."""
    return epochs == 1 and mini_batches_per_epoch == 1


def _on_policy_mismatch(gaps: list[dict[str, float]], device: torch.device) -> dict[str, float]:
    """logp_mismatch_mean/max over all ranks from the micro-batches' |training logp - rollout logp| sums, counts
    and maxima (see `_micro_objective`); empty when no row carried rollout log-probs."""
    local = torch.tensor([sum(g["_gap_sum"] for g in gaps), sum(g["_gap_count"] for g in gaps)],
                         dtype=torch.float64)                               # [2]
    total, count = all_reduce_sum(local, device).tolist()
    top = all_ranks_max(max((g["_gap_max"] for g in gaps), default=0.0), device)
    if count == 0:
        return {}
    return {"logp_mismatch_mean": total / count, "logp_mismatch_max": top}


def _row_advantages(rows: list[TrainRow]) -> list[float]:
    """Each row's advantage (the mean over its tokens when it has one per token), for the advantage statistics."""
    return [float(r.advantage) if isinstance(r.advantage, (int, float))
            else sum(r.advantage) / max(len(r.advantage), 1) for r in rows]


def _rl_result(state, rows, batch, tokens_this_call: int, started: float) -> dict[str, float]:
    """rl_update's return value: per-update metrics averaged over all updates of the call, the rollout log-prob
    mismatch, advantage / response-length / staleness statistics over all rows, and IS_WEIGHT_METRICS over the stale
    rows' tokens of all updates."""
    updates = max(state["updates_done"], 1)
    result = {name: total / updates for name, total in state["metric_sums"].items()}
    result.update(state["mismatch"])
    advantages = torch.tensor(_row_advantages(rows))                       # [B]
    result["advantage_mean"] = float(advantages.mean())
    result["advantage_std"] = float(advantages.std()) if len(rows) > 1 else 0.0
    result["response_length"] = float(batch["response_mask"].sum()) / len(rows)
    result.update(staleness_metrics(batch["staleness"]))
    result.update(is_weight_metrics(state["is_weight_totals"]))
    result["tokens_per_s"] = tokens_this_call / max(time.perf_counter() - started, 1e-9)
    result["updates"] = float(state["updates_done"])
    return result
