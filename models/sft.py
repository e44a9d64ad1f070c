"""Supervised fine-tuning of the policy on (prompt, response) pairs (warm start, SIRI internalization)."""
from __future__ import annotations

import math
import random
import time
from typing import Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from models.batching import (TrainRow, UpdateConfig, aggregation_units, all_reduce_sum, collate, loss_weight,
                             rank_micro_batches, select_rows, train_mini_batch)
from models.checkpoint import rank_and_world
from models.forward import next_token_logits
from models.internalize import check_token_weights, weighted_sft_loss
from models.losses import sft_loss


def sft_update(
    engine,
    pairs: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    update: UpdateConfig,
    seed: int = 0,
    progress: bool = True,
    desc: str = "sft",
    weights: list[float | list[float]] | None = None,
    on_update: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Supervised fine-tuning on (prompt_ids, response_ids) pairs; only response tokens are trained.

    Steps as in rl_update: one optimizer step per mini-batch (default engine.train_batch_size() pairs), token-mean
    cross-entropy over the mini-batch. `weights` (one entry per pair: a number for all its response tokens, or one
    per response token; finite, >= 0) turn it into -sum_t w_t log pi(a_t) / (response tokens in the mini-batch),
    the same normalization, so weights of 1 train exactly as None; SIRI internalization uses this
    (models/internalize.py). Returns loss_first / loss_last (first and last micro-batch of this rank),
    loss_first_epoch / loss_last_epoch (epoch means), updates (optimizer steps), tokens_per_s and weighted_tokens
    (response tokens with a weight > 0, over all pairs).
    on_update(step, metrics): as in rl_update, after every optimizer step: the mini-batch loss (over all ranks),
    grad_norm, lr and tokens_per_s. progress: a tqdm bar `desc` on rank 0.
    """
    if not pairs:
        raise ValueError("sft_update got no pairs")
    epochs, micro_batch_size, token_budget = update.epochs, update.micro_batch_size, update.token_budget or None
    token_weights = check_token_weights(weights, pairs) if weights is not None else [1.0] * len(pairs)
    started = time.perf_counter()
    # the weights ride in the rows' advantage slot: collate spreads them over the response tokens, 0 elsewhere
    batch = collate([TrainRow(p, r, None, w) for (p, r), w in zip(pairs, token_weights)], pad_id)
    weighted_tokens = float(((batch["advantages"] > 0) & batch["response_mask"].bool()).sum())
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    mini_size = update.mini_batch(engine)
    rng = random.Random(seed)
    engine.module.train()
    losses_per_epoch: list[list[float]] = []
    updates, tokens = 0, 0

    def loss_of(part: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        logits = next_token_logits(engine, part)
        if weights is None:
            value = sft_loss(logits, part["target_ids"], part["response_mask"])
        else:
            value = weighted_sft_loss(logits, part["target_ids"], part["response_mask"], part["advantages"])
        return value, {"loss": float(value.detach())}

    with tqdm(total=epochs * math.ceil(len(pairs) / mini_size), desc=desc, unit="step",
              disable=not progress or rank_and_world()[0] != 0) as bar:
        for _ in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            epoch_losses = []
            for start in range(0, len(order), mini_size):
                step_started, step_tokens = time.perf_counter(), tokens
                mini = order[start : start + mini_size]
                units = aggregation_units(batch["response_mask"][mini], "token-mean")
                plan = rank_micro_batches(mini, lengths, max_rows=micro_batch_size, token_budget=token_budget)
                micro = []
                for index, real in plan:
                    part = select_rows(batch, index, engine.device)
                    micro.append((part, loss_weight(part, units, "token-mean", 1) if real else 0.0))
                    tokens += int(part["attention_mask"].sum()) if real else 0
                lr = float(engine.get_lr()[0])
                grad_norm, metrics = train_mini_batch(engine, micro, loss_of)
                epoch_losses.extend(m["loss"] for m, (_, real) in zip(metrics, plan) if real)
                updates += 1
                # the mini-batch loss: micro-batch losses weighted as in the backward (fillers weigh 0)
                weighted = torch.tensor([sum(w * m["loss"] for (_, w), m in zip(micro, metrics))], dtype=torch.float64)
                step_loss = float(all_reduce_sum(weighted, engine.device)) / rank_and_world()[1]
                if on_update is not None:
                    on_update(int(engine.global_steps), {
                        "loss": step_loss, "grad_norm": grad_norm, "lr": lr,
                        "tokens_per_s": (tokens - step_tokens) / max(time.perf_counter() - step_started, 1e-9)})
                bar.update(1)
                bar.set_postfix(loss=f"{step_loss:.3f}")
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
