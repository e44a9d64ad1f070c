"""Rows, batches and optimizer steps for the trainer (models/trainer.py) and SFT (models/sft.py).

Batch layout (see `collate`): position t of every [B, L] tensor describes the token at t + 1, the one that the
logits at t predict. So `response_mask[b, t] = 1` exactly when input_ids[b, t + 1] is a response token.

Steps: every rank gets the same rows. Each epoch shuffles them (seeded) and cuts them into global mini-batches of
`mini_batch_size` rows; rank r trains on rows r, r + W, ... of each (W ranks). A rank's share is sorted longest first
and packed into micro-batches of at most `micro_batch_size` rows and `token_budget` padded tokens. Every micro-batch
is one forward/backward; the loss of a micro-batch is weighted by its share of the mini-batch's aggregation units
(valid tokens, or sequences), so gradients accumulate to the gradient of the whole mini-batch's loss however it was
split, and there is exactly one optimizer step per mini-batch (`train_mini_batch`).
"""
from __future__ import annotations

from numbers import Integral
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from models.checkpoint import rank_and_world
from models.config import UpdateConfig  # noqa: F401 - re-exported: the config of these updates
from models.portable.action_trie import allowed_positions, pad_allowed


class TrainRow(NamedTuple):
    """One training sequence: the policy saw prompt_ids and produced response_ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float] | None   # rollout log-probs of response_ids (one per token), None if unknown
    advantage: float | list[float]     # one value for every response token, or one per response token
    choices: list[list[int]] | None = None   # constrained decoding: the token sequences sampling was restricted to
    staleness: int = 0                       # rounds between the sampling policy and the one being trained (0 = on-policy)



def collate(rows: list[TrainRow], pad_id: int) -> dict[str, Tensor]:
    """Right-pads rows into next-token-aligned [B, L] tensors (L = longest prompt + response).

    input_ids, attention_mask: the sequences. target_ids[b, t] = input_ids[b, t + 1] (pad at the end).
    response_mask[b, t] = 1 iff target_ids[b, t] is a response token. old_logprobs / advantages: the row's rollout
    log-prob / advantage at those positions (a scalar advantage is broadcast), 0 elsewhere. behaviour_logprobs: a
    copy of old_logprobs that keeps the rollout (behaviour policy) log-probs once the trainer replaces old_logprobs by
    the proximal policy's (docs/algorithms.md §2.7). has_old_logprobs [B]: whether the row carried log-probs.
    staleness [B] long: the row's staleness (0 = on-policy). allowed_ids [B, L, K] (only when a row has
    ``choices``): at each response position, the ids constrained decoding allowed there (-1 padded; all -1 =
    unconstrained), which every scoring of the batch masks the logits to (models/portable/action_trie.mask_logits).
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)        # [B, L]
    attention_mask = torch.zeros((batch, width), dtype=torch.long)          # [B, L]
    response_mask = torch.zeros((batch, width), dtype=torch.float32)        # [B, L]
    old_logprobs = torch.zeros((batch, width), dtype=torch.float32)         # [B, L]
    advantages = torch.zeros((batch, width), dtype=torch.float32)           # [B, L]
    has_old_logprobs = torch.zeros(batch, dtype=torch.bool)                 # [B]
    staleness = torch.tensor([check_staleness(r.staleness, f"row {b}") for b, r in enumerate(rows)])  # [B] long
    allowed = {b: allowed_positions(row.choices, row.response_ids) for b, row in enumerate(rows) if row.choices}
    for b, row in enumerate(rows):
        n_prompt, n_response = len(row.prompt_ids), len(row.response_ids)
        if n_prompt == 0:
            raise ValueError(f"row {b} has an empty prompt: its first response token would have no context")
        total = n_prompt + n_response
        input_ids[b, :total] = torch.tensor(list(row.prompt_ids) + list(row.response_ids), dtype=torch.long)
        attention_mask[b, :total] = 1
        predicts_response = slice(n_prompt - 1, total - 1)                 # logits at t predict token t + 1
        response_mask[b, predicts_response] = 1.0
        if isinstance(row.advantage, (int, float)):
            advantages[b, predicts_response] = float(row.advantage)
        elif len(row.advantage) != n_response:
            raise ValueError(f"row {b}: {len(row.advantage)} advantages for {n_response} response tokens")
        else:
            advantages[b, predicts_response] = torch.tensor(row.advantage, dtype=torch.float32)
        if row.old_logprobs is not None:
            if len(row.old_logprobs) != n_response:
                raise ValueError(f"row {b}: {len(row.old_logprobs)} old log-probs for {n_response} response tokens")
            old_logprobs[b, predicts_response] = torch.tensor(row.old_logprobs, dtype=torch.float32)
            has_old_logprobs[b] = True
    target_ids = torch.cat([input_ids[:, 1:], torch.full((batch, 1), pad_id, dtype=torch.long)], dim=1)  # [B, L]
    extra = {}
    if allowed:
        width_k = max(len(ids) for lists in allowed.values() for ids in lists)
        allowed_ids = torch.full((batch, width, width_k), -1, dtype=torch.long)   # [B, L, K]
        for b, lists in allowed.items():
            start = len(rows[b].prompt_ids) - 1
            allowed_ids[b, start:start + len(lists)] = pad_allowed(lists, width_k)
        extra["allowed_ids"] = allowed_ids
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "target_ids": target_ids,
        "response_mask": response_mask,
        "old_logprobs": old_logprobs,
        "behaviour_logprobs": old_logprobs.clone(),
        "advantages": advantages,
        "has_old_logprobs": has_old_logprobs,
        "staleness": staleness,
        **extra,
    }


def check_staleness(staleness: object, where: str) -> int:
    """`staleness` (rounds between the sampling policy and the one being trained) as an int >= 0; `where` names the
    row or step in the error."""
    if isinstance(staleness, bool) or not isinstance(staleness, Integral) or staleness < 0:
        raise ValueError(f"{where}: staleness must be an int >= 0 (0 = sampled by the policy being trained), "
                         f"got {staleness!r}")
    return int(staleness)



# --- micro-batches ------------------------------------------------------------------------------------------------

def pack_micro_batches(
    index: list[int], lengths: list[int], *, max_rows: int, token_budget: int | None = None
) -> list[list[int]]:
    """Rows `index` sorted longest first (ties by index), cut greedily into micro-batches of at most `max_rows` rows
    whose padded size (rows x longest length) is at most `token_budget`. A row longer than the budget alone gets a
    micro-batch of its own (a row is never split)."""
    micro: list[list[int]] = []
    current: list[int] = []
    for i in sorted(index, key=lambda i: (-lengths[i], i)):
        width = lengths[current[0]] if current else lengths[i]            # longest first: the first row sets it
        fits = len(current) < max_rows and (token_budget is None or (len(current) + 1) * width <= token_budget)
        if current and not fits:
            micro.append(current)
            current = []
        current.append(i)
    if current:
        micro.append(current)
    return micro


def rank_micro_batches(
    rows: list[int], lengths: list[int], *, max_rows: int, token_budget: int | None
) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of the global list `rows` (its shard rows[rank::world]) as (index, real).

    Padded with dummy micro-batches (real=False, trained with weight 0) up to the largest count of any rank, so
    every rank runs as many forward/backward passes: ZeRO-3 gathers and ZeRO-2 reductions are collective.
    """
    rank, world = rank_and_world()
    plans = [pack_micro_batches(rows[r::world], lengths, max_rows=max_rows, token_budget=token_budget)
             for r in range(world)]
    count = max(len(plan) for plan in plans)
    return [(m, True) for m in plans[rank]] + [([rows[0]], False)] * (count - len(plans[rank]))


def select_rows(batch: dict[str, Tensor], index: list[int], device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Rows `index` of a collated batch, trimmed to their own longest sequence, on `device`."""
    picked = {k: v[index] for k, v in batch.items()}
    width = max(int(picked["attention_mask"].sum(dim=1).max()), 1)
    return {k: (v[:, :width] if v.ndim >= 2 else v).to(device) for k, v in picked.items()}


def aggregation_units(mask: Tensor, aggregation: str) -> float:
    """How many terms `losses.aggregate` averages over: valid tokens (token-mean) or sequences with one (seq-*)."""
    if aggregation == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=-1) > 0).sum())


def loss_weight(part: dict[str, Tensor], units: float, aggregation: str, norm_width: int) -> float:
    """Factor that turns the micro-batch loss (aggregated over its own units) into its share of the global
    mini-batch loss (aggregated over all `units`). DeepSpeed averages gradients over ranks, hence the world size.
    seq-mean-token-sum-norm divides by the micro-batch width; it is rescaled to the constant `norm_width`."""
    share = aggregation_units(part["response_mask"], aggregation) / max(units, 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        share *= part["response_mask"].shape[-1] / norm_width
    return share * rank_and_world()[1]


def all_reduce_sum(tensor: Tensor, device: torch.device) -> Tensor:
    """Sum over ranks (moved to the engine's device for NCCL and back); a no-op on one rank."""
    if rank_and_world()[1] == 1:
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    return moved.to(tensor.device)


def all_ranks_max(value: float, device: torch.device) -> float:
    """The largest `value` of all ranks; `value` itself on one rank."""
    top = torch.tensor([value], dtype=torch.float64)                       # [1]
    if rank_and_world()[1] > 1:
        top = top.to(device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return float(top.cpu())


def params_grad_norm(module: torch.nn.Module) -> float:
    squares = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def train_mini_batch(
    engine, micro: list[tuple[dict[str, Tensor], float]], loss_of: Callable[[dict[str, Tensor]], tuple[Tensor, dict]]
) -> tuple[float, list[dict[str, float]]]:
    """Backward of every weighted micro-batch loss, then one optimizer step: the trainer sets the accumulation
    boundary itself, DeepSpeed's gradient_accumulation_steps does not count. Returns the pre-clip global grad norm
    and each micro-batch's metrics."""
    metrics, fallback_norm = [], None
    for i, (part, weight) in enumerate(micro):
        last = i == len(micro) - 1
        engine.set_gradient_accumulation_boundary(last)
        loss, part_metrics = loss_of(part)
        engine.backward(loss * weight, scale_wrt_gas=False)
        metrics.append(part_metrics)
        if last and engine.zero_optimization_stage() == 0:  # ZeRO-0 + client optimizer records no norm
            fallback_norm = params_grad_norm(engine.module)
        engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float(fallback_norm or 0.0), metrics
