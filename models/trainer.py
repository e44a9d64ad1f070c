"""DeepSpeed updates of a HF causal-LM policy: PPO-style RL updates on (prompt, response, advantage) rows, and SFT.

One process on the CPU accelerator by default (gloo); the same code runs ZeRO 1-3 over many GPUs under the
`deepspeed` launcher, where RANK/WORLD_SIZE/... come from the launcher.

Batch layout (see `collate`): position t of every [B, L] tensor describes the token at t + 1, the one that the
logits at t predict. So `response_mask[b, t] = 1` exactly when input_ids[b, t + 1] is a response token.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import deepspeed
import torch
from torch import Tensor
from tqdm.auto import tqdm

from models.losses import LOSSES, masked_token_mean, sft_loss

DEEPSPEED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "infra" / "deepspeed"


class TrainRow(NamedTuple):
    """One training sequence: the policy saw prompt_ids and produced response_ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float] | None   # rollout log-probs of response_ids (one per token), None if unknown
    advantage: float                   # broadcast to every response token


def ensure_single_process_env() -> None:
    """Sets the torch.distributed variables of a one-process world where a launcher has not set them."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


def load_ds_config(zero_stage: int = 0, config_path: str | Path | None = None) -> dict:
    """Reads a DeepSpeed JSON config: `config_path`, or infra/deepspeed/zero{zero_stage}.json of this repository."""
    path = Path(config_path) if config_path is not None else DEEPSPEED_CONFIG_DIR / f"zero{zero_stage}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"DeepSpeed config {path} not found: pass config_path, or use zero_stage 0-3 from a source checkout "
            f"(configs live in {DEEPSPEED_CONFIG_DIR})"
        )
    return json.loads(path.read_text())


def make_ds_engine(
    model: torch.nn.Module,
    *,
    lr: float,
    zero_stage: int = 0,
    config_path: str | Path | None = None,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    micro_batch_size: int = 8,
    grad_accum: int = 1,
):
    """Wraps `model` in a DeepSpeed engine (fp32) with AdamW; `engine.module` is the model afterwards.

    The batch-size keys and gradient_clipping of the config are filled in here. A config without an "optimizer"
    section gets a client `torch.optim.AdamW` (no JIT compile); one with a section keeps it, with lr/weight_decay set.
    """
    ensure_single_process_env()
    config = load_ds_config(zero_stage, config_path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = grad_accum
    config["train_batch_size"] = micro_batch_size * grad_accum * world_size
    config["gradient_clipping"] = grad_clip
    optimizer = None
    if "optimizer" in config:
        config["optimizer"].setdefault("params", {}).update(lr=lr, weight_decay=weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


@contextlib.contextmanager
def full_weights(engine) -> Iterator[torch.nn.Module]:
    """Yields engine.module with whole parameters: under ZeRO-3 they are partitioned (empty) outside this block.

    Save or serve the trained policy inside it, e.g. `with full_weights(engine) as m: save_policy(m, tok, path)`
    (on several ranks, save from rank 0 only). A no-op for ZeRO 0-2.
    """
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield engine.module
    else:
        yield engine.module


def collate(rows: list[TrainRow], pad_id: int) -> dict[str, Tensor]:
    """Right-pads rows into next-token-aligned [B, L] tensors (L = longest prompt + response).

    input_ids, attention_mask: the sequences. target_ids[b, t] = input_ids[b, t + 1] (pad at the end).
    response_mask[b, t] = 1 iff target_ids[b, t] is a response token. old_logprobs / advantages: the row's rollout
    log-prob / advantage at those positions, 0 elsewhere. has_old_logprobs [B]: whether the row carried log-probs.
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
        advantages[b, predicts_response] = float(row.advantage)
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


def _masked_entropy(logits: Tensor, mask: Tensor) -> float:
    """Mean policy entropy over the valid positions (computed on those rows only, to spare memory)."""
    with torch.no_grad():
        picked = logits.detach()[mask.bool()]                               # [N, V]
        if picked.numel() == 0:
            return 0.0
        logp = torch.log_softmax(picked, dim=-1)                            # [N, V]
        return float(-(logp.exp() * logp).sum(dim=-1).mean())


def _select(batch: dict[str, Tensor], index: list[int], device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Rows `index` of a collated batch, trimmed to their own longest sequence, on `device`."""
    picked = {k: v[index] for k, v in batch.items()}
    width = max(int(picked["attention_mask"].sum(dim=1).max()), 1)
    return {k: (v[:, :width] if v.ndim == 2 else v).to(device) for k, v in picked.items()}


def _micro_batches(n: int, micro_batch_size: int, rng: random.Random) -> list[list[int]]:
    order = list(range(n))
    rng.shuffle(order)
    return [order[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]


def _grad_norm(engine) -> float | None:
    """The pre-clip global gradient norm of the step just taken (None when not at a boundary)."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _params_grad_norm(module: torch.nn.Module) -> float:
    squares = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def _backward_and_step(engine, loss: Tensor) -> tuple[bool, float | None]:
    """One engine.backward + engine.step; returns (an optimizer step was taken, its grad norm)."""
    engine.backward(loss)
    at_boundary = engine.is_gradient_accumulation_boundary()
    # ZeRO-0 with a client optimizer does not record the norm; grads are whole on the params then.
    fallback = _params_grad_norm(engine.module) if at_boundary and engine.zero_optimization_stage() == 0 else None
    engine.step()
    if not at_boundary:
        return False, None
    norm = _grad_norm(engine)
    return True, norm if norm is not None else fallback


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
) -> dict[str, float]:
    """Policy-gradient update on `rows` with the LOSSES[loss] objective; returns averaged metrics.

    Old log-probs are recomputed under the current weights first (so ratio = 1 on the first step); when rows carry
    rollout log-probs, |recomputed - rollout| is reported as logp_mismatch_mean/max (engine/trainer drift).
    Each epoch shuffles the rows (seeded) into micro-batches; each micro-batch is one engine.backward + engine.step,
    and DeepSpeed's gradient_accumulation_steps decides when the optimizer steps. The token-mean aggregation is
    per micro-batch.
    """
    if not rows:
        raise ValueError("rl_update got no rows")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    loss_fn = LOSSES[loss]
    started = time.perf_counter()
    batch = collate(rows, pad_id)
    metrics: dict[str, float] = {}

    engine.module.eval()
    with torch.no_grad():
        old = torch.zeros_like(batch["old_logprobs"])                       # [B, L]
        for index in _micro_batches(len(rows), micro_batch_size, random.Random(0)):
            part = _select(batch, index)
            old[index, : part["input_ids"].shape[1]] = token_logprobs(engine, part).cpu()
    mask = batch["response_mask"]                                           # [B, L]
    carried = mask * batch["has_old_logprobs"][:, None]                     # [B, L]
    if carried.sum() > 0:
        gap = (old - batch["old_logprobs"]).abs()                           # [B, L]
        metrics["logp_mismatch_mean"] = float(masked_token_mean(gap, carried))
        metrics["logp_mismatch_max"] = float(torch.where(carried.bool(), gap, torch.zeros_like(gap)).max())
    batch["old_logprobs"] = torch.where(mask.bool(), old, torch.zeros_like(old))

    engine.module.train()
    rng = random.Random(seed)
    sums: dict[str, float] = {}
    micro_steps, updates, tokens, grad_norms = 0, 0, 0, []
    for _ in range(epochs):
        for index in _micro_batches(len(rows), micro_batch_size, rng):
            part = _select(batch, index, engine.device)
            logits = _next_token_logits(engine, part)                      # [b, l, V]
            logp = _gather_logprobs(logits, part["target_ids"])             # [b, l]
            loss_value, step_metrics = loss_fn(
                logp, part["old_logprobs"], part["advantages"], part["response_mask"],
                clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, aggregation=aggregation,
            )
            step_metrics["loss"] = float(loss_value.detach())
            step_metrics["entropy"] = _masked_entropy(logits, part["response_mask"])
            stepped, norm = _backward_and_step(engine, loss_value)
            updates += int(stepped)
            if norm is not None:
                grad_norms.append(norm)
            for name, value in step_metrics.items():
                sums[name] = sums.get(name, 0.0) + value
            micro_steps += 1
            tokens += int(part["attention_mask"].sum())

    metrics.update({name: total / micro_steps for name, total in sums.items()})
    advantages = torch.tensor([float(r.advantage) for r in rows])          # [B]
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["advantage_mean"] = float(advantages.mean())
    metrics["advantage_std"] = float(advantages.std()) if len(rows) > 1 else 0.0
    metrics["response_length"] = sum(len(r.response_ids) for r in rows) / len(rows)
    metrics["tokens_per_s"] = tokens / max(time.perf_counter() - started, 1e-9)
    metrics["updates"] = float(updates)
    return metrics


def sft_update(
    engine,
    pairs: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    micro_batch_size: int,
    epochs: int,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, float]:
    """Supervised fine-tuning on (prompt_ids, response_ids) pairs; only response tokens are trained.

    Returns loss_first / loss_last (first and last micro-batch), loss_first_epoch / loss_last_epoch (epoch means),
    updates (optimizer steps) and tokens_per_s.
    """
    if not pairs:
        raise ValueError("sft_update got no pairs")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    started = time.perf_counter()
    batch = collate([TrainRow(p, r, None, 0.0) for p, r in pairs], pad_id)
    rng = random.Random(seed)
    engine.module.train()
    losses_per_epoch: list[list[float]] = []
    updates, tokens = 0, 0
    n_micro = math.ceil(len(pairs) / micro_batch_size)
    with tqdm(total=epochs * n_micro, desc="sft", unit="batch", disable=not progress) as bar:
        for _ in range(epochs):
            epoch_losses = []
            for index in _micro_batches(len(pairs), micro_batch_size, rng):
                part = _select(batch, index, engine.device)
                loss_value = sft_loss(_next_token_logits(engine, part), part["target_ids"], part["response_mask"])
                stepped, _ = _backward_and_step(engine, loss_value)
                updates += int(stepped)
                tokens += int(part["attention_mask"].sum())
                epoch_losses.append(float(loss_value.detach()))
                bar.update(1)
                bar.set_postfix(loss=f"{epoch_losses[-1]:.3f}")
            losses_per_epoch.append(epoch_losses)
    return {
        "loss_first": losses_per_epoch[0][0],
        "loss_last": losses_per_epoch[-1][-1],
        "loss_first_epoch": sum(losses_per_epoch[0]) / len(losses_per_epoch[0]),
        "loss_last_epoch": sum(losses_per_epoch[-1]) / len(losses_per_epoch[-1]),
        "updates": float(updates),
        "tokens_per_s": tokens / max(time.perf_counter() - started, 1e-9),
    }
