"""Forward passes the trainer needs: log-probs of target tokens, logits at chosen positions only (the LM head run on
the gathered hidden states), and shared-prompt-prefix forwards (each distinct prefix run once, its KV cache expanded
to the rows that share it). All return float32 and equal the plain full forward's values."""
from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import Tensor

from models.losses import aggregate
from models.portable.action_trie import mask_logits


def next_token_logits(model, batch: dict[str, Tensor]) -> Tensor:
    """Logits [B, L, V] in float32 on the model's device; `model` is a HF model or the DeepSpeed engine around one."""
    device = model.device
    return model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
    ).logits.float()


def gather_logprobs(logits: Tensor, target_ids: Tensor, allowed_ids: Tensor | None = None) -> Tensor:
    """log softmax(logits)[target] without materializing the [B, L, V] log-softmax; with ``allowed_ids``
    [B, L, K] (constrained decoding) the softmax is over the allowed ids only where a position is constrained."""
    if allowed_ids is not None:
        logits = mask_logits(logits, allowed_ids)
    picked = logits.gather(-1, target_ids.to(logits.device).unsqueeze(-1)).squeeze(-1)  # [B, L]
    return picked - torch.logsumexp(logits, dim=-1)                         # [B, L]


def token_logprobs(model, batch: dict[str, Tensor]) -> Tensor:
    """[B, L] log-prob of target_ids[b, t] (the token at t + 1) under `model`; meaningful where response_mask is 1.
    Under the batch's constraint (``allowed_ids``) when it has one."""
    return gather_logprobs(next_token_logits(model, batch), batch["target_ids"], batch.get("allowed_ids"))


LOGIT_FREE_AUX = ("seal",)  # aux losses that read hidden states only, never logits
SCALED_LOGIT_CONFIG_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # head output post-processed


def splits_lm_head(module: torch.nn.Module) -> bool:
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


def logits_at(engine, part: dict[str, Tensor], positions: Tensor, *, want_hidden: bool
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
    if not splits_lm_head(engine.module):
        outputs = engine(**inputs, output_hidden_states=want_hidden)
        return outputs.logits.float()[where], outputs.hidden_states[-1] if want_hidden else None
    no_logits = torch.empty(0, dtype=torch.long, device=device)
    outputs = engine(**inputs, output_hidden_states=True, logits_to_keep=no_logits)
    hidden = outputs.hidden_states[-1]                                      # [b, l, H] after the final norm
    logits = engine.module.get_output_embeddings()(hidden[where]).float()   # [N, V]
    return logits, hidden if want_hidden else None


class SharedPrefixPlan(NamedTuple):
    """How a micro-batch splits into shared prompt prefixes and per-row tails (see `shared_prefix_plan`)."""

    cache_kwarg: str            # the forward's KV-cache keyword: "cache" (transformers 5.x) or "past_key_values"
    prefix_ids: Tensor          # [G, P] distinct prefixes (prompt minus its last token), right-padded
    prefix_mask: Tensor         # [G, P]
    row_prefix: Tensor          # [b] which prefix each row continues
    tail_ids: Tensor            # [b, R] last prompt token + response tokens but the last, right-padded
    tail_mask: Tensor           # [b, P + R] attention over the expanded prefix cache and the tail
    tail_positions: Tensor      # [b, R] position ids, continuing after each row's own prefix
    tail_valid: Tensor          # [b, R] true where the tail token's hidden state predicts a response token


def shared_prefix_plan(engine, part: dict[str, Tensor]) -> SharedPrefixPlan | None:
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
    if checkpointing or not splits_lm_head(module):
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
    return SharedPrefixPlan(
        cache_kwarg=cache_kwarg,
        prefix_ids=prefix_ids.to(device),
        prefix_mask=prefix_mask.to(device),
        row_prefix=torch.tensor(row_prefix, dtype=torch.long, device=device),
        tail_ids=tail_ids.to(device),
        tail_mask=torch.cat([prefix_part, tail_valid], dim=1).long().to(device),
        tail_positions=(first[:, None] + tail_steps).to(device),
        tail_valid=tail_valid.to(device),
    )


def shared_prefix_logits(engine, part: dict[str, Tensor], plan: SharedPrefixPlan) -> Tensor:
    """float32 logits [N, V] at the micro-batch's response positions (row-major), as `logits_at` returns them.

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


def scatter_positions(values: Tensor, positions: Tensor) -> Tensor:
    """[b, l] (or [b, l, V]) tensor holding `values` [N] ([N, V]) at the true positions of `positions`, 0 elsewhere."""
    where = positions.to(values.device).bool()                              # [b, l]
    out = values.new_zeros(*where.shape, *values.shape[1:])                 # [b, l(, V)]
    return out.masked_scatter(where.view(*where.shape, *([1] * (values.dim() - 1))), values)


def entropy_at(logits: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """`losses.entropy_from_logits` for logits [N, V] already picked at the N true positions of mask [b, l]."""
    logp = torch.log_softmax(logits.float(), dim=-1)                        # [N, V]
    probs = logp.exp()                                                      # [N, V]
    safe_logp = torch.where(probs > 0, logp, torch.zeros_like(logp))        # [N, V] 0 * log 0 = 0
    token_entropy = -(probs * safe_logp).sum(dim=-1)                        # [N]
    return aggregate(scatter_positions(token_entropy, mask), mask.to(logits.device).bool(), aggregation)
