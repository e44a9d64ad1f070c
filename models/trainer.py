"""DeepSpeed updates of a HF causal-LM policy: PPO-style RL updates on (prompt, response, advantage) rows, and SFT.

One process on the CPU accelerator by default (gloo, fp32); the same code runs ZeRO 1-3 over several processes under
the `deepspeed` launcher (RANK/WORLD_SIZE/... from the launcher) and in bf16 on GPUs.

Batch layout (see `collate`): position t of every [B, L] tensor describes the token at t + 1, the one that the
logits at t predict. So `response_mask[b, t] = 1` exactly when input_ids[b, t + 1] is a response token.

Steps: every rank gets the same rows. Each epoch shuffles them (seeded) and cuts them into global mini-batches of
`mini_batch_size` rows; rank r trains on rows r, r + W, ... of each (W ranks). A rank's share is sorted longest first
and packed into micro-batches of at most `micro_batch_size` rows and `token_budget` padded tokens. Every micro-batch
is one forward/backward; the loss of a micro-batch is weighted by its share of the mini-batch's aggregation units
(valid tokens, or sequences), so gradients accumulate to the gradient of the whole mini-batch's loss however it was
split, and there is exactly one optimizer step per mini-batch.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from models.aux_losses import AUX_LOSSES, AuxConfig, AuxInputs
from models.checkpoint import load_checkpoint, rank_and_world, save_checkpoint
from models.ds_engine import (  # noqa: F401 - re-exported: callers import the engine setup from the trainer
    DEEPSPEED_CONFIG_DIR, LR_SCHEDULES, PRECISIONS, LrSchedule, build_ds_config, ensure_single_process_env,
    full_weights, load_ds_config, make_ds_engine, resolve_precision,
)
from models.internalize import check_token_weights, weighted_sft_loss
from models.layouts import RowSpec, collate_rows
from models.losses import AGGREGATIONS, LOSSES, aggregate, masked_token_mean, policy_objective, sft_loss

AGGREGATED_METRICS = ("loss", "pg_loss", "kl_loss", "entropy")  # policy_objective terms reduced by `aggregation`


class TrainRow(NamedTuple):
    """One training sequence: the policy saw prompt_ids and produced response_ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float] | None   # rollout log-probs of response_ids (one per token), None if unknown
    advantage: float | list[float]     # one value for every response token, or one per response token


class ReferenceScorer(Protocol):
    """What rl_update needs of a reference policy (models.reference.ReferencePolicy is one)."""

    def ref_logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, L] log-probs of batch["target_ids"] under the reference policy."""


def collate(rows: list[TrainRow], pad_id: int) -> dict[str, Tensor]:
    """Right-pads rows into next-token-aligned [B, L] tensors (L = longest prompt + response).

    input_ids, attention_mask: the sequences. target_ids[b, t] = input_ids[b, t + 1] (pad at the end).
    response_mask[b, t] = 1 iff target_ids[b, t] is a response token. old_logprobs / advantages: the row's rollout
    log-prob / advantage at those positions (a scalar advantage is broadcast), 0 elsewhere. has_old_logprobs [B]:
    whether the row carried log-probs.
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
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "target_ids": target_ids,
        "response_mask": response_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "has_old_logprobs": has_old_logprobs,
    }


def _next_token_logits(model, batch: dict[str, Tensor]) -> Tensor:
    """Logits [B, L, V] in float32 on the model's device; `model` is a HF model or the DeepSpeed engine around one."""
    device = model.device
    return model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
    ).logits.float()


def _gather_logprobs(logits: Tensor, target_ids: Tensor) -> Tensor:
    """log softmax(logits)[target] without materializing the [B, L, V] log-softmax."""
    picked = logits.gather(-1, target_ids.to(logits.device).unsqueeze(-1)).squeeze(-1)  # [B, L]
    return picked - torch.logsumexp(logits, dim=-1)                         # [B, L]


def token_logprobs(model, batch: dict[str, Tensor]) -> Tensor:
    """[B, L] log-prob of target_ids[b, t] (the token at t + 1) under `model`; meaningful where response_mask is 1."""
    return _gather_logprobs(_next_token_logits(model, batch), batch["target_ids"])


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


def _rank_micro_batches(
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


def _select(batch: dict[str, Tensor], index: list[int], device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Rows `index` of a collated batch, trimmed to their own longest sequence, on `device`."""
    picked = {k: v[index] for k, v in batch.items()}
    width = max(int(picked["attention_mask"].sum(dim=1).max()), 1)
    return {k: (v[:, :width] if v.ndim == 2 else v).to(device) for k, v in picked.items()}


def _aggregation_units(mask: Tensor, aggregation: str) -> float:
    """How many terms `losses.aggregate` averages over: valid tokens (token-mean) or sequences with one (seq-*)."""
    if aggregation == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=-1) > 0).sum())


def _loss_weight(part: dict[str, Tensor], units: float, aggregation: str, norm_width: int) -> float:
    """Factor that turns the micro-batch loss (aggregated over its own units) into its share of the global
    mini-batch loss (aggregated over all `units`). DeepSpeed averages gradients over ranks, hence the world size.
    seq-mean-token-sum-norm divides by the micro-batch width; it is rescaled to the constant `norm_width`."""
    share = _aggregation_units(part["response_mask"], aggregation) / max(units, 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        share *= part["response_mask"].shape[-1] / norm_width
    return share * rank_and_world()[1]


def _all_reduce_sum(tensor: Tensor, device: torch.device) -> Tensor:
    """Sum over ranks (moved to the engine's device for NCCL and back); a no-op on one rank."""
    if rank_and_world()[1] == 1:
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    return moved.to(tensor.device)


def _params_grad_norm(module: torch.nn.Module) -> float:
    squares = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def _train_mini_batch(
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
            fallback_norm = _params_grad_norm(engine.module)
        engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float(fallback_norm or 0.0), metrics


# --- RL update ----------------------------------------------------------------------------------------------------

LOGIT_FREE_AUX = ("seal",)  # aux losses that read hidden states only, never logits
SCALED_LOGIT_CONFIG_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # head output post-processed


def _splits_lm_head(module: torch.nn.Module) -> bool:
    """Whether the policy's forward accepts `logits_to_keep` and its logits are exactly lm_head(last hidden state).

    Then the trainer runs the forward with no logits at all and applies the head to the positions it needs only.
    Models that post-process the head's output (soft-capping, scaling) keep the full forward.
    """
    base = module.get_base_model() if hasattr(module, "get_base_model") else module   # peft wraps the HF model
    config = getattr(base, "config", None)
    if config is None or any(getattr(config, key, None) for key in SCALED_LOGIT_CONFIG_KEYS):
        return False
    return (base.get_output_embeddings() is not None
            and "logits_to_keep" in inspect.signature(base.forward).parameters)


def _logits_at(engine, part: dict[str, Tensor], positions: Tensor, *, want_hidden: bool
               ) -> tuple[Tensor, Tensor | None]:
    """float32 logits [N, V] at the N positions where `positions` [b, l] is true (row-major order), and the last
    hidden states [b, l, H] when `want_hidden`.

    The forward goes through the engine (DeepSpeed registers its backward prologue on the outputs, and applies
    autocast and ZeRO-3 gathers there) with `logits_to_keep` empty, so the model computes no logits; the LM head
    (`get_output_embeddings()`, the same module, so ZeRO-3 hooks and LoRA adapters apply) then runs on the gathered
    hidden states only. Equal to indexing the full [b, l, V] logits.
    """
    device = engine.device
    inputs = dict(input_ids=part["input_ids"].to(device), attention_mask=part["attention_mask"].to(device))
    where = positions.to(device).bool()                                     # [b, l]
    if not _splits_lm_head(engine.module):
        outputs = engine(**inputs, output_hidden_states=want_hidden)
        return outputs.logits.float()[where], outputs.hidden_states[-1] if want_hidden else None
    no_logits = torch.empty(0, dtype=torch.long, device=device)
    outputs = engine(**inputs, output_hidden_states=True, logits_to_keep=no_logits)
    hidden = outputs.hidden_states[-1]                                      # [b, l, H] after the final norm
    logits = engine.module.get_output_embeddings()(hidden[where]).float()   # [N, V]
    return logits, hidden if want_hidden else None


class _SharedPrefixPlan(NamedTuple):
    """How a micro-batch splits into shared prompt prefixes and per-row tails (see `_shared_prefix_plan`)."""

    cache_kwarg: str            # the forward's KV-cache keyword: "cache" (transformers 5.x) or "past_key_values"
    prefix_ids: Tensor          # [G, P] distinct prefixes (prompt minus its last token), right-padded
    prefix_mask: Tensor         # [G, P]
    row_prefix: Tensor          # [b] which prefix each row continues
    tail_ids: Tensor            # [b, R] last prompt token + response tokens but the last, right-padded
    tail_mask: Tensor           # [b, P + R] attention over the expanded prefix cache and the tail
    tail_positions: Tensor      # [b, R] position ids, continuing after each row's own prefix
    tail_valid: Tensor          # [b, R] true where the tail token's hidden state predicts a response token


def _shared_prefix_plan(engine, part: dict[str, Tensor]) -> _SharedPrefixPlan | None:
    """A plan for computing the micro-batch's logits with each distinct prompt prefix run once, or None (then the
    plain forward is used).

    Applies to TrainRow batches (`collate`: right-padded, response right after the prompt) in which at least two
    rows share the same prompt prefix (all tokens of the prompt but the last), on a plain HF decoder (no peft, no
    ZeRO-3, no gradient checkpointing, full attention only, LM head splittable). Anything unusual returns None.
    """
    if "observation_mask" in part or "input_ids" not in part:               # RowSpec layouts (aux, observations)
        return None
    module = engine.module
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    if hasattr(module, "get_base_model") or stage == 3:
        return None
    checkpointing = getattr(module, "is_activation_checkpointing", None)  # is_gradient_checkpointing before 5.x
    if checkpointing is None:
        checkpointing = getattr(module, "is_gradient_checkpointing", False)
    if checkpointing or not _splits_lm_head(module):
        return None
    config = getattr(module, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if module.training and (getattr(config, "attention_dropout", 0.0) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())):
        return None                                                         # keep one dropout draw per row
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or ()
    if getattr(text_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return None
    params = inspect.signature(module.forward).parameters
    # transformers 5.x renamed the forward kwarg `past_key_values` to `cache` (as in models.hf_engine)
    cache_kwarg = "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else None
    if cache_kwarg is None or "position_ids" not in params or "use_cache" not in params:
        return None

    mask = part["response_mask"].detach().cpu() > 0                         # [b, l]
    attention = part["attention_mask"].detach().cpu() > 0                   # [b, l]
    ids = part["input_ids"].detach().cpu()                                  # [b, l]
    rows, width = mask.shape
    if rows < 2:
        return None
    counts = mask.sum(dim=1)                                                # [b] response tokens
    if bool((counts == 0).any()):
        return None
    first = mask.int().argmax(dim=1)                                        # [b] last prompt token = prefix length
    steps = torch.arange(width)                                             # [l]
    if not torch.equal(mask, (steps >= first[:, None]) & (steps < (first + counts)[:, None])):
        return None
    if not torch.equal(attention, steps < (first + counts + 1)[:, None]) or bool((first < 1).any()):
        return None
    groups: dict[tuple[int, ...], int] = {}
    row_prefix = [groups.setdefault(tuple(ids[b, : int(first[b])].tolist()), len(groups)) for b in range(rows)]
    if len(groups) == rows:
        return None                                                         # nothing shared
    prefix_width, tail_width = int(first.max()), int(counts.max())
    prefix_ids = torch.zeros((len(groups), prefix_width), dtype=ids.dtype)  # [G, P]
    prefix_mask = torch.zeros((len(groups), prefix_width), dtype=torch.long)  # [G, P]
    for prefix, g in groups.items():
        prefix_ids[g, : len(prefix)] = torch.tensor(prefix, dtype=ids.dtype)
        prefix_mask[g, : len(prefix)] = 1
    tail_steps = torch.arange(tail_width)                                   # [R]
    tail_valid = tail_steps < counts[:, None]                               # [b, R]
    source = (first[:, None] + tail_steps).clamp(max=width - 1)             # [b, R]
    tail_ids = torch.where(tail_valid, ids.gather(1, source), ids[:, :1])   # [b, R]
    prefix_part = torch.arange(prefix_width) < first[:, None]               # [b, P]
    device = engine.device
    return _SharedPrefixPlan(
        cache_kwarg=cache_kwarg,
        prefix_ids=prefix_ids.to(device),
        prefix_mask=prefix_mask.to(device),
        row_prefix=torch.tensor(row_prefix, dtype=torch.long, device=device),
        tail_ids=tail_ids.to(device),
        tail_mask=torch.cat([prefix_part, tail_valid], dim=1).long().to(device),
        tail_positions=(first[:, None] + tail_steps).to(device),
        tail_valid=tail_valid.to(device),
    )


def _shared_prefix_logits(engine, part: dict[str, Tensor], plan: _SharedPrefixPlan) -> Tensor:
    """float32 logits [N, V] at the micro-batch's response positions (row-major), as `_logits_at` returns them.

    The G distinct prefixes run once (through the engine, with a KV cache); their keys/values are expanded to the b
    rows that share them (an indexing op, so gradients flow back into the prefix computation); then each row's tail
    (last prompt token + response tokens) runs on that cache with positions continuing after its own prefix. The LM
    head is applied to the tail's hidden states at the needed positions only.
    """
    from transformers import DynamicCache

    module = engine.module
    config = module.config
    no_logits = torch.empty(0, dtype=torch.long, device=engine.device)
    prefix_cache = DynamicCache(config=config)
    engine(input_ids=plan.prefix_ids, attention_mask=plan.prefix_mask, use_cache=True, logits_to_keep=no_logits,
           **{plan.cache_kwarg: prefix_cache})
    cache = DynamicCache(config=config)
    for layer_idx, layer in enumerate(prefix_cache.layers):
        cache.update(layer.keys.index_select(0, plan.row_prefix), layer.values.index_select(0, plan.row_prefix),
                     layer_idx)
    outputs = engine(input_ids=plan.tail_ids, attention_mask=plan.tail_mask, position_ids=plan.tail_positions,
                     use_cache=True, output_hidden_states=True, logits_to_keep=no_logits,
                     **{plan.cache_kwarg: cache})
    hidden = outputs.hidden_states[-1]                                      # [b, R, H] after the final norm
    return module.get_output_embeddings()(hidden[plan.tail_valid]).float()  # [N, V]


def _scatter_positions(values: Tensor, positions: Tensor) -> Tensor:
    """[b, l] (or [b, l, V]) tensor holding `values` [N] ([N, V]) at the true positions of `positions`, 0 elsewhere."""
    where = positions.to(values.device).bool()                              # [b, l]
    out = values.new_zeros(*where.shape, *values.shape[1:])                 # [b, l(, V)]
    return out.masked_scatter(where.view(*where.shape, *([1] * (values.dim() - 1))), values)


def _entropy_at(logits: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """`losses.entropy_from_logits` for logits [N, V] already picked at the N true positions of mask [b, l]."""
    logp = torch.log_softmax(logits.float(), dim=-1)                        # [N, V]
    probs = logp.exp()                                                      # [N, V]
    safe_logp = torch.where(probs > 0, logp, torch.zeros_like(logp))        # [N, V] 0 * log 0 = 0
    token_entropy = -(probs * safe_logp).sum(dim=-1)                        # [N]
    return aggregate(_scatter_positions(token_entropy, mask), mask.to(logits.device).bool(), aggregation)


def _micro_objective(engine, part: dict[str, Tensor], objective: dict[str, Any], aux: tuple[str, ...] = (),
                     aux_config: AuxConfig | None = None, *, on_policy: bool = False
                     ) -> tuple[Tensor, dict[str, float]]:
    """The one place where the RL objective of a micro-batch is computed: `losses.policy_objective` (policy loss
    + kl_beta * KL to the reference - entropy_coef * entropy), aggregated over the micro-batch, plus the weighted
    auxiliary losses (`aux_losses.AUX_LOSSES`, e.g. echo on observation tokens) from the same forward pass.

    Logits are computed at response positions only (plus observation positions for aux losses that read logits).
    on_policy: the weights have not moved since the rollout rows were scored, so this forward's own log-probs
    (detached) are the old log-probs (ratio exactly 1); part["old_logprobs"] then holds the rollout log-probs, and
    the metrics carry `_gap_sum` / `_gap_count` / `_gap_max` of |logp - rollout| for `logp_mismatch_*`.
    """
    mask = part["response_mask"]                                            # [b, l]
    logit_aux = [name for name in aux if name not in LOGIT_FREE_AUX]
    positions = mask.bool()                                                 # [b, l]
    if logit_aux:
        positions = positions | (part["observation_mask"].bool() & part["attention_mask"].bool())
    plan = None if aux else _shared_prefix_plan(engine, part)
    if plan is not None:
        logits, hidden = _shared_prefix_logits(engine, part, plan), None   # [N, V]
    else:
        logits, hidden = _logits_at(engine, part, positions, want_hidden="seal" in aux)  # [N, V], [b, l, H]
    picked_targets = part["target_ids"].to(logits.device)[positions.to(logits.device)]  # [N]
    token_logp = logits.gather(-1, picked_targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [N]
    logp = _scatter_positions(token_logp, positions)                        # [b, l]
    response_logits = logits[mask.bool()[positions]]                        # [R, V]
    if objective["entropy_coef"]:
        entropy = _entropy_at(response_logits, mask, objective["aggregation"])
    else:
        with torch.no_grad():
            entropy = _entropy_at(response_logits.detach(), mask, objective["aggregation"])
    old_logp = logp.detach() if on_policy else part["old_logprobs"]         # [b, l]
    total, metrics = policy_objective(logp, old_logp, part["advantages"], mask,
                                      ref_logp=part.get("ref_logprobs"), entropy=entropy, **objective)
    if on_policy:
        with torch.no_grad():
            carried = mask.bool() & part["has_old_logprobs"].to(mask.device)[:, None]  # [b, l]
            gap = torch.where(carried, (logp.detach() - part["old_logprobs"]).abs(), torch.zeros_like(logp))
            metrics.update(_gap_sum=float(gap.double().sum()), _gap_count=float(carried.sum()),
                           _gap_max=float(gap.max()) if gap.numel() else 0.0)
    if aux:
        full_logits = _scatter_positions(logits, positions) if logit_aux else None  # [b, l, V], 0 where unused
        inputs = AuxInputs(logits=full_logits, target_ids=part["target_ids"], observation_mask=part["observation_mask"],
                           hidden=hidden, attention_mask=part["attention_mask"], success=part["success"],
                           group_index=part["group_index"])
        for name in aux:
            term, aux_metrics = AUX_LOSSES[name](inputs, aux_config or AuxConfig())
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
        for index, real in _rank_micro_batches(list(range(len(lengths))), lengths, max_rows=max_rows,
                                               token_budget=token_budget):
            part = _select(batch, index, engine.device)
            width = part["input_ids"].shape[1]
            scored = token_logprobs(engine, part).cpu() if score_policy else None  # [b, l]
            scored_ref = reference.ref_logprobs(part).cpu() if reference is not None else None
            if real:
                if scored is not None:
                    old[index, :width] = scored
                if ref is not None:
                    ref[index, :width] = scored_ref
    engine.module.train()
    old = _all_reduce_sum(old, engine.device) if score_policy else None
    return old, _all_reduce_sum(ref, engine.device) if ref is not None else None


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
    for name in ("input_ids", "attention_mask", "response_mask", "advantages", "old_logprobs"):
        digest.update(batch[name].numpy().tobytes())
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
    }


def _mini_batch_parts(engine, batch, mini: list[int], lengths: list[int], *, aggregation: str, max_rows: int,
                      token_budget: int | None, norm_width: int):
    """This rank's micro-batches of the global mini-batch `mini` as (part, loss weight), and per micro-batch its
    (share of the mini-batch loss, share of the mini-batch's response tokens) for the metrics; 0 for fillers."""
    units = _aggregation_units(batch["response_mask"][mini], aggregation)
    mini_tokens = float(batch["response_mask"][mini].sum())
    micro, shares = [], []
    for index, real in _rank_micro_batches(mini, lengths, max_rows=max_rows, token_budget=token_budget):
        part = _select(batch, index, engine.device)
        part["has_old_logprobs"] = part["has_old_logprobs"] & real          # fillers never count in the mismatch
        weight = _loss_weight(part, units, aggregation, norm_width) if real else 0.0
        micro.append((part, weight))
        token_share = float(part["response_mask"].sum()) / max(mini_tokens, 1.0) if real else 0.0
        shares.append((weight / rank_and_world()[1], token_share))
    return micro, shares


def _update_metrics(engine, mini: list[int], batch, micro_metrics, shares, advantages, lengths, lr, elapsed):
    """One optimizer step's metrics over the whole global mini-batch, summed over micro-batches and ranks.

    shares: per micro-batch (its share of the mini-batch loss, its share of the mini-batch's response tokens). The
    aggregated terms (AGGREGATED_METRICS) are weighted by the first, so they equal the mini-batch objective's terms;
    the token means of the policy loss (clip_fraction, approx_kl, ratio_mean, ...) by the second.
    """
    keys = sorted(micro_metrics[0])
    local = torch.tensor([[share[k not in AGGREGATED_METRICS] * m[k] for k in keys]
                          for share, m in zip(shares, micro_metrics)], dtype=torch.float64).sum(dim=0)  # [K]
    reduced = _all_reduce_sum(local, engine.device)                         # [K]
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
    )
    return metrics


def rl_update(
    engine,
    rows: list[TrainRow],
    *,
    pad_id: int,
    micro_batch_size: int,
    epochs: int = 1,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss: str = "ppo_clip",
    aggregation: str = "token-mean",
    seed: int = 0,
    mini_batch_size: int | None = None,
    token_budget: int | None = None,
    reference: ReferenceScorer | None = None,
    kl_beta: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    on_update: Callable[[int, dict[str, float]], None] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 50,
    aux: tuple[str, ...] | list[str] = (),
    aux_config: AuxConfig | None = None,
) -> dict[str, float]:
    """Policy-gradient update on `rows` with `losses.policy_objective`; returns metrics averaged over updates.

    rows: the whole batch, the same list on every rank (see the module docstring for how ranks share it).
    mini_batch_size: rows per optimizer step, over all ranks (default engine.train_batch_size(), i.e. micro_batch_size
        x grad_accum x world size); `aggregation` normalizes over the whole mini-batch, so the update does not
        depend on how rows are cut into micro-batches or ranks.
    micro_batch_size / token_budget: at most this many rows / padded tokens (rows x longest) per forward pass.
    Old log-probs are recomputed under the current weights first (so ratio = 1 on the first step); when rows carry
    rollout log-probs, |recomputed - rollout| is reported as logp_mismatch_mean/max (engine/trainer drift). With one
    epoch of one mini-batch, no row is trained after an earlier update, so the recompute is skipped: the training
    forward's detached log-probs are the old ones (ratio exactly 1) and the mismatch is measured on them.
    reference (e.g. `models.reference.ReferencePolicy`): scored once at the start; needed when kl_beta > 0, and
    with kl_beta 0 the KL is only logged (kl_loss).
    on_update(step, metrics): called on every rank after every optimizer step (step = engine.global_steps) with that
    step's loss terms, clip fraction, approx KL, entropy, grad norm, lr, advantage stats, response length, tokens/s.
    checkpoint_dir: save a complete checkpoint (`models.checkpoint`) every `checkpoint_every` optimizer steps and at
    the end; a call with the same rows and settings resumes from the newest complete one, skipping the mini-batches
    already done, and ends bit-identical to an uninterrupted call (same seed, same hardware). One directory per call.
    """
    if not rows:
        raise ValueError("rl_update got no rows")
    for name, value in (("epochs", epochs), ("micro_batch_size", micro_batch_size), ("mini_batch_size",
                        mini_batch_size), ("token_budget", token_budget), ("checkpoint_every", checkpoint_every)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
    LOSSES[loss]  # unknown names fail here, listing the valid ones
    if kl_beta and reference is None:
        raise ValueError(f"kl_beta is {kl_beta} but no reference was given: pass reference=ReferencePolicy(model) "
                         f"(models.reference; build it before make_ds_engine) or set kl_beta to 0")
    started = time.perf_counter()
    aux = tuple(aux)
    for name in aux:
        AUX_LOSSES[name]  # unknown names fail here, listing the valid ones
    concatenated = isinstance(rows[0], RowSpec)
    if aux and not concatenated:
        raise ValueError(f"aux losses {list(aux)} read observation tokens: pass RowSpec rows from "
                         "models.layouts.concatenated (train.layout: concatenated)")
    batch = collate_rows(rows, pad_id) if concatenated else collate(rows, pad_id)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    mini_size = mini_batch_size or engine.train_batch_size()
    objective = dict(loss=loss, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, aggregation=aggregation,
                     kl_beta=kl_beta, kl_kind=kl_kind, entropy_coef=entropy_coef)
    settings = dict(objective, pad_id=pad_id, micro_batch_size=micro_batch_size, mini_batch_size=mini_size,
                    token_budget=token_budget, epochs=epochs, seed=seed, world=rank_and_world()[1],
                    reference=reference is not None, engine=_engine_settings(engine), aux=list(aux),
                    aux_config=str(aux_config))
    fingerprint = _fingerprint(batch, settings)

    state = load_checkpoint(engine, checkpoint_dir, fingerprint=fingerprint) if checkpoint_dir is not None else None
    if state is not None and state["finished"]:
        return state["result"]
    per_epoch = math.ceil(len(rows) / mini_size)
    on_policy = _reuses_training_logprobs(epochs, per_epoch)
    if state is None:
        state = _fresh_state(engine, batch, lengths, rows, reference, fingerprint=fingerprint, epochs=epochs,
                             seed=seed, max_rows=micro_batch_size, token_budget=token_budget, on_policy=on_policy)
    if state["old_logprobs"] is not None:
        batch["old_logprobs"] = state["old_logprobs"]                       # else: rollout log-probs, for the gap
    if state["ref_logprobs"] is not None:
        batch["ref_logprobs"] = state["ref_logprobs"]

    engine.module.train()
    advantages = _row_advantages(rows)
    norm_width = batch["input_ids"].shape[1]
    total_updates = epochs * per_epoch
    tokens_this_call = 0
    for update in range(state["updates_done"], total_updates):
        step_started = time.perf_counter()
        epoch, index = divmod(update, per_epoch)
        mini = state["orders"][epoch][index * mini_size : (index + 1) * mini_size]
        micro, shares = _mini_batch_parts(engine, batch, mini, lengths, aggregation=aggregation,
                                          max_rows=micro_batch_size, token_budget=token_budget, norm_width=norm_width)
        lr = float(engine.get_lr()[0])
        grad_norm, micro_metrics = _train_mini_batch(
            engine, micro, lambda p: _micro_objective(engine, p, objective, aux, aux_config, on_policy=on_policy))
        gaps = [{k: m.pop(k) for k in ("_gap_sum", "_gap_count", "_gap_max") if k in m} for m in micro_metrics]
        if on_policy:
            state["mismatch"] = _on_policy_mismatch(gaps, engine.device)
        metrics = _update_metrics(engine, mini, batch, micro_metrics, shares, advantages, lengths, lr,
                                  time.perf_counter() - step_started)
        metrics["grad_norm"] = grad_norm
        tokens_this_call += int(metrics["tokens"])
        for name, value in metrics.items():
            state["metric_sums"][name] = state["metric_sums"].get(name, 0.0) + value
        state.update(updates_done=update + 1, epoch=(update + 1) // per_epoch, mini_batch=(update + 1) % per_epoch,
                     micro_batches_done=state["micro_batches_done"] + len(micro))
        if on_update is not None:
            on_update(int(engine.global_steps), metrics)
        finished = update + 1 == total_updates
        if finished:
            state.update(finished=True, result=_rl_result(state, rows, batch, tokens_this_call, started))
        if checkpoint_dir is not None and (finished or (update + 1) % checkpoint_every == 0):
            save_checkpoint(engine, checkpoint_dir, update + 1, state)
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
    total, count = _all_reduce_sum(local, device).tolist()
    top = torch.tensor([max((g["_gap_max"] for g in gaps), default=0.0)], dtype=torch.float64)  # [1]
    if rank_and_world()[1] > 1:
        top = top.to(device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    if count == 0:
        return {}
    return {"logp_mismatch_mean": total / count, "logp_mismatch_max": float(top.cpu())}


def _row_advantages(rows: list[TrainRow]) -> list[float]:
    """Each row's advantage (the mean over its tokens when it has one per token), for the advantage statistics."""
    return [float(r.advantage) if isinstance(r.advantage, (int, float))
            else sum(r.advantage) / max(len(r.advantage), 1) for r in rows]


def _rl_result(state, rows, batch, tokens_this_call: int, started: float) -> dict[str, float]:
    """rl_update's return value: per-update metrics averaged over all updates of the call, the rollout log-prob
    mismatch, and advantage / response-length statistics over all rows."""
    updates = max(state["updates_done"], 1)
    result = {name: total / updates for name, total in state["metric_sums"].items()}
    result.update(state["mismatch"])
    advantages = torch.tensor(_row_advantages(rows))                       # [B]
    result["advantage_mean"] = float(advantages.mean())
    result["advantage_std"] = float(advantages.std()) if len(rows) > 1 else 0.0
    result["response_length"] = float(batch["response_mask"].sum()) / len(rows)
    result["tokens_per_s"] = tokens_this_call / max(time.perf_counter() - started, 1e-9)
    result["updates"] = float(state["updates_done"])
    return result


# --- SFT ----------------------------------------------------------------------------------------------------------

def sft_update(
    engine,
    pairs: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    micro_batch_size: int,
    epochs: int,
    seed: int = 0,
    progress: bool = True,
    mini_batch_size: int | None = None,
    token_budget: int | None = None,
    weights: list[float | list[float]] | None = None,
) -> dict[str, float]:
    """Supervised fine-tuning on (prompt_ids, response_ids) pairs; only response tokens are trained.

    Steps as in rl_update: one optimizer step per mini-batch (default engine.train_batch_size() pairs), token-mean
    cross-entropy over the mini-batch. `weights` (one entry per pair: a number for all its response tokens, or one
    per response token; finite, >= 0) turn it into -sum_t w_t log pi(a_t) / (response tokens in the mini-batch),
    the same normalization, so weights of 1 train exactly as None; SIRI internalization uses this
    (models/internalize.py). Returns loss_first / loss_last (first and last micro-batch of this rank),
    loss_first_epoch / loss_last_epoch (epoch means), updates (optimizer steps), tokens_per_s and weighted_tokens
    (response tokens with a weight > 0, over all pairs).
    """
    if not pairs:
        raise ValueError("sft_update got no pairs")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    token_weights = check_token_weights(weights, pairs) if weights is not None else [1.0] * len(pairs)
    started = time.perf_counter()
    # the weights ride in the rows' advantage slot: collate spreads them over the response tokens, 0 elsewhere
    batch = collate([TrainRow(p, r, None, w) for (p, r), w in zip(pairs, token_weights)], pad_id)
    weighted_tokens = float(((batch["advantages"] > 0) & batch["response_mask"].bool()).sum())
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    mini_size = mini_batch_size or engine.train_batch_size()
    rng = random.Random(seed)
    engine.module.train()
    losses_per_epoch: list[list[float]] = []
    updates, tokens = 0, 0

    def loss_of(part: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        logits = _next_token_logits(engine, part)
        if weights is None:
            value = sft_loss(logits, part["target_ids"], part["response_mask"])
        else:
            value = weighted_sft_loss(logits, part["target_ids"], part["response_mask"], part["advantages"])
        return value, {"loss": float(value.detach())}

    with tqdm(total=epochs * math.ceil(len(pairs) / mini_size), desc="sft", unit="step", disable=not progress) as bar:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            epoch_losses = []
            for start in range(0, len(order), mini_size):
                mini = order[start : start + mini_size]
                units = _aggregation_units(batch["response_mask"][mini], "token-mean")
                plan = _rank_micro_batches(mini, lengths, max_rows=micro_batch_size, token_budget=token_budget)
                micro = []
                for index, real in plan:
                    part = _select(batch, index, engine.device)
                    micro.append((part, _loss_weight(part, units, "token-mean", 1) if real else 0.0))
                    tokens += int(part["attention_mask"].sum()) if real else 0
                _, metrics = _train_mini_batch(engine, micro, loss_of)
                epoch_losses.extend(m["loss"] for m, (_, real) in zip(metrics, plan) if real)
                updates += 1
                bar.update(1)
                bar.set_postfix(loss=f"{epoch_losses[-1]:.3f}" if epoch_losses else "-")
            losses_per_epoch.append(epoch_losses)
    first, last = losses_per_epoch[0] or [math.nan], losses_per_epoch[-1] or [math.nan]  # nan: a rank with no pair
    return {
        "loss_first": first[0],
        "loss_last": last[-1],
        "loss_first_epoch": sum(first) / len(first),
        "loss_last_epoch": sum(last) / len(last),
        "updates": float(updates),
        "tokens_per_s": tokens / max(time.perf_counter() - started, 1e-9),
        "weighted_tokens": weighted_tokens,
    }
