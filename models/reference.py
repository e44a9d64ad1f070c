"""Frozen weights around the trained policy: the KL reference policy, and LoRA adapters (whose base is that reference).

`ReferencePolicy(model)` scores batches under the policy as it was when the reference was made: a frozen deep copy
for a full-weight policy, or, for a LoRA policy (`apply_lora`), the very same model with its adapters switched off,
which costs no memory. Build it before `make_ds_engine` (under ZeRO-3 the engine partitions the weights).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.forward import token_logprobs

if TYPE_CHECKING:  # peft is imported where adapters are made (the import takes seconds)
    from peft import PeftModel


def apply_lora(
    model: torch.nn.Module,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
) -> PeftModel:
    """Wraps a HF causal LM in LoRA adapters of rank `r` (scale alpha / r); only the adapters have requires_grad.

    target_modules: module names to adapt; None = every linear layer except the output head (peft "all-linear").
    The B matrices start at zero, so the wrapped model computes exactly what `model` did. `make_ds_engine` then
    trains the adapters only, and `trainer.full_weights` yields a merged plain HF model for saving.
    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
    """
    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                        target_modules=target_modules if target_modules is not None else "all-linear")
    return get_peft_model(model, config)


class ReferencePolicy:
    """The policy frozen at construction time, for the KL term of the RL objective (rl_update(reference=...)).

    A plain model is deep-copied (eval mode, requires_grad off, optionally moved to `device`); a peft model is
    shared and scored inside `disable_adapter()`, i.e. as its base model.
    """

    def __init__(self, policy: torch.nn.Module, *, device: torch.device | str | None = None):
        from peft import PeftModel

        self.shares_policy = isinstance(policy, PeftModel)
        if self.shares_policy:
            self.model = policy
        else:
            if any(hasattr(p, "ds_id") for p in policy.parameters()):
                raise ValueError("the policy's parameters are already partitioned by DeepSpeed ZeRO-3: build the "
                                 "ReferencePolicy from the model before make_ds_engine")
            self.model = copy.deepcopy(policy).eval()
            self.model.requires_grad_(False)
            if device is not None:
                self.model.to(device)

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, L] log-probs of batch["target_ids"] (see trainer.collate) under the reference, on the batch's device."""
        if not self.shares_policy:
            return token_logprobs(self.model, batch).to(batch["target_ids"].device)
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                return token_logprobs(self.model, batch).to(batch["target_ids"].device)
        finally:
            self.model.train(was_training)
