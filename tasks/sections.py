"""The sections of params.yaml: one frozen dataclass per concern, composed of the config dataclasses the library
code itself takes (``train.loss`` is ``models.losses.LossConfig``, ``train.advantage`` is
``models.advantages.AdvantageConfig``, ...). Every field is documented once, under it, in its class: beside the code
it configures, or for models/ in the torch-free models/config.py, so that loading params.yaml imports no torch. The
defaults here are the embedded default pipeline, and ``params.yaml`` spells all of them out (a test keeps the two
equal). Loading and checking is tasks/config.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import envs  # noqa: F401  (importing the package registers every env)
from agents.config import HarnessConfig
from datapool.filters import FilterConfig
from datapool.quality import GateConfig
from envs.base import ENVS
from models.checks import ConfigValueError, check_choice, check_config
from models.config import (PACKAGED_MODELS, AdapterConfig, AdvantageConfig, AuxConfig, EngineConfig,
                           InternalizeConfig, LossConfig, OptimizerConfig, TinyModelConfig, UpdateConfig)
from models.engine import SamplingParams
from skills.embeddings import EMBEDDERS
from skills.lifecycle import PruneConfig
from skills.llm_miner import LLMMinerConfig
from skills.miners import MinerConfig
from skills.retrieval import RetrievalConfig
from skills.validation import ValidationConfig
from skills.versions import VersionConfig

FROZENLAKE_DEFAULTS: dict[str, Any] = {"size": 4, "p_frozen": 0.8, "max_steps": 12, "is_slippery": False,
                                       "invalid_penalty": 0.1}


@dataclass(frozen=True)
class PipelineConfig:
    """params.yaml ``pipeline``: rounds, the global seed and the MLflow names."""

    rounds: int = 5
    """Number of rollout -> validate -> mine -> train rounds (unrolled in dvc.yaml: `arlflow dvc-yaml` rewrites it)."""
    seed: int = 0
    """Global seed: scenario splits, model init, sampling and data order derive from it."""
    experiment: str = "arlflow"
    """MLflow experiment name."""
    registered_model: str = "arlflow-policy"
    """MLflow registered model name for the round policies."""
    max_staleness: int = 0
    """Asynchronous rounds: rollout of round r samples with round max(0, r - 1 - k)'s policy (0 = the warm start)
    while train_r starts from round r - 1's, so with k >= 1 rollout_{r+1} runs alongside train_r under `arlflow
    pipeline` (the dvc.yaml DAG says so; `dvc repro` runs the same stages one by one). 0 = synchronous rounds."""

    def __post_init__(self) -> None:
        check_config(self, rounds="positive", seed="non_negative", max_staleness="non_negative")
        for name in ("experiment", "registered_model"):
            if not getattr(self, name).strip():
                raise ConfigValueError(name, getattr(self, name), "a non-empty name")


@dataclass(frozen=True)
class EnvConfig:
    """params.yaml ``env``: which envs the scenarios come from, and their constructor kwargs."""

    name: str = field(default="frozenlake", metadata={"registry": ENVS})
    """Registered env name (see envs.ENVS) of every scenario, when ``mix`` is empty."""
    mix: dict[str, int] = field(default_factory=dict)
    """A mix of envs: env name -> number of train scenarios (each env also gets bootstrap.heldout_scenarios held-out
    ones). Non-empty overrides ``name`` and bootstrap.train_scenarios."""
    kwargs: dict[str, dict[str, Any]] = field(default_factory=lambda: {"frozenlake": dict(FROZENLAKE_DEFAULTS)})
    """Env name -> constructor kwargs, checked against the env's signature; envs not listed use their own defaults.
    The default holds the embedded default's FrozenLake settings (a section that sets ``kwargs`` replaces it)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The envs of the scenario sets, in a fixed order."""
        return tuple(sorted(self.mix)) if self.mix else (self.name,)


@dataclass(frozen=True)
class BootstrapConfig:
    """params.yaml ``bootstrap``: the base policy and tokenizer, and the scenario sets."""

    model: str = ""
    """The base policy: a Hugging Face model folder, a packaged pretrained model converted offline
    (smollm2-135m-instruct: models/gguf.py), or empty for the tiny local model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """The tiny local model (when ``model`` is empty)."""
    vocab_size: int = 384
    """BPE vocabulary of the locally trained tokenizer (at least 257: the 256 bytes and <|endoftext|>)."""
    tokenizer_corpus_episodes: int = 400
    """Expert and random episodes whose prompts and actions train the BPE tokenizer."""
    train_scenarios: int = 512
    """Train scenarios per env (when env.mix is empty)."""
    heldout_scenarios: int = 200
    """Held-out scenarios per env, none equal in content to a train scenario."""

    def __post_init__(self) -> None:
        check_config(self, tokenizer_corpus_episodes="positive", train_scenarios="positive",
                     heldout_scenarios="positive")
        if self.vocab_size < 257:
            raise ConfigValueError("vocab_size", self.vocab_size, ">= 257 (the 256 byte symbols and <|endoftext|>)")


@dataclass(frozen=True)
class WarmstartConfig:
    """params.yaml ``warmstart``: SFT on the envs' expert demonstrations (and the round-0 skill bank)."""

    enabled: bool = True
    """False skips SFT (the warm-start policy is then the base policy)."""
    demo_scenarios: int = 512
    """Train scenarios whose expert trajectories are the SFT data."""
    skill_demos: float = 0.5
    """Skill-aware warm start: mine a bank (mine.method) from the expert demonstrations (artifacts/skills/round_0;
    its skills are candidates the first rollout validates, with skills.validate); this fraction of the scenarios is
    demonstrated a second time showing its skills, calling a shown macro wherever it is what the expert does next
    (every scenario keeps its plain demonstration). 0 = off."""
    update: UpdateConfig = UpdateConfig(epochs=10, micro_batch_size=64)
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-3)
    lora: AdapterConfig = AdapterConfig()
    """LoRA adapters for the warm-start SFT (merged into the saved policy); r 0 = full fine-tuning."""

    def __post_init__(self) -> None:
        check_config(self, demo_scenarios="positive", skill_demos="probability")


@dataclass(frozen=True)
class RolloutConfig:
    """params.yaml ``rollout``: how each round's groups are sampled and stored."""

    scenarios_per_round: int = 256
    """Train scenarios sampled (without replacement, per round) for this round's groups."""
    group_size: int = 8
    """G: rollouts per scenario (at least 2: group-normalized advantages need a group)."""
    sampling: SamplingParams = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0)
    max_generation_batches: int = 1
    """Dynamic sampling (DAPO): up to this many generation batches per round; batches after the first draw fresh
    scenarios for the shortfall of groups with a learning signal. 1 = no re-sampling."""
    use_skills: bool = True
    """Put the skills retrieved from the previous round's bank in the prompt's skill slot."""
    pool_url: str = ""
    """SQLAlchemy URL of the data pool; empty = sqlite under data/pool.db (WAL), or inside `dvc exp run` the
    experiment's data/pools/NAME@BASELINE.db (tasks.layout.stage_pool_url). A URL set here is used by the baseline
    and every experiment alike."""

    def __post_init__(self) -> None:
        check_config(self, scenarios_per_round="positive", max_generation_batches="positive")
        if self.group_size < 2:
            raise ConfigValueError("group_size", self.group_size, ">= 2 (group-normalized advantages need a group)")
        if self.pool_url and "://" not in self.pool_url:
            raise ConfigValueError("pool_url", self.pool_url, "'' or a SQLAlchemy URL (sqlite:///path, "
                                   "postgresql+psycopg://user@host/db)")


TRAIN_LAYOUTS: tuple[str, ...] = ("step_rows", "concatenated")


@dataclass(frozen=True)
class TrainConfig:
    """params.yaml ``train``: the RL update of each round (advantages, loss, optimizer, filters, ...)."""

    layout: str = "step_rows"
    """step_rows (one row per step, anchors for step-level credit) or concatenated (one sequence per trajectory)."""
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig(clip_high=0.28)
    update: UpdateConfig = UpdateConfig(epochs=2, micro_batch_size=128, checkpoint_every=20)
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4)
    filters: FilterConfig = FilterConfig(overlong_max_tokens=64, overlong_buffer_tokens=16)
    aux: AuxConfig = AuxConfig()
    internalize: InternalizeConfig = InternalizeConfig(coef=0.0)
    """SIRI internalization (coef > 0): after the policy-gradient passes, one weighted-SFT pass on the prompts WITHOUT
    the skill of beneficial skill-guided steps of validated skills. 0 = off."""
    lora: AdapterConfig = AdapterConfig()
    staleness_limit: int = -1
    """Steps sampled more than this many rounds before the policy being trained (their ``staleness``) are dropped
    before training (pipeline.max_staleness > 0); -1 = keep every step. The loss corrects the rest (loss.off_policy)."""

    def __post_init__(self) -> None:
        check_choice(self, "layout", TRAIN_LAYOUTS)
        if self.staleness_limit < -1:
            raise ConfigValueError("staleness_limit", self.staleness_limit, "-1 (keep every step) or a count >= 0")
        if self.internalize.coef > 0 and self.optimizer.lr_schedule == "cosine" and self.optimizer.min_lr_ratio == 0:
            # internalization's pass follows the policy-gradient steps the schedule decays over, at its last rate
            raise ConfigValueError("optimizer.min_lr_ratio", 0.0, "> 0 with lr_schedule cosine and internalize.coef "
                                   "> 0 (internalization runs after the decay, at min_lr_ratio x lr: 0 trains nothing)")


@dataclass(frozen=True)
class EvaluateConfig:
    """params.yaml ``evaluate``: held-out evaluation of every policy."""

    sampling: SamplingParams = SamplingParams(max_new_tokens=4, temperature=0.0)
    """How held-out episodes are sampled (temperature 0 = greedy)."""


@dataclass(frozen=True)
class SkillsConfig:
    """The skill lifecycle (skills/, docs/algorithms.md section 9): which candidates enter the bank, how skills are
    shown, versioned and pruned."""
    validate: bool = True
    """Mined candidates go through paired validation in the next rollout (base vs base + candidate halves of a
    group, same scenario) and enter the bank only if they help; False adds them to the bank directly."""
    paired: bool = True
    """Groups without a candidate split into skill-free and skill-guided halves: live skills' utility (for pruning),
    skill_used for the skillc/d2skill estimators, and data for internalization."""
    macros: bool = True
    """Skills with a macro are callable as one action ("skill 1", then the slot arguments)."""
    skip_arm: bool = False
    """SelSkill: "skip" (no skill in the prompt) competes with a skill's versions."""
    embedder: str = "tfidf"
    """Retrieval embeddings: tfidf (fitted on the bank) or minilm (offline all-MiniLM-L6-v2; falls back to TF-IDF
    with a warning when the package is absent)."""
    max_candidates: int = 3
    """New candidates added per round (the miner's best first)."""
    retrieval: RetrievalConfig = RetrievalConfig(k=1, floor=0.0, mode="per_episode")
    """The skill slot of rollout and evaluation prompts (k = 0: no slot)."""
    validation: ValidationConfig = ValidationConfig()
    versions: VersionConfig = VersionConfig()
    prune: PruneConfig = PruneConfig()
    llm: LLMMinerConfig = LLMMinerConfig()

    def __post_init__(self) -> None:
        check_config(self, max_candidates="non_negative")
        check_choice(self, "embedder", EMBEDDERS)


@dataclass(frozen=True)
class TransferConfig:
    """params.yaml ``transfer``: the final skill bank with frozen models of another architecture."""

    model: TinyModelConfig = TinyModelConfig(arch="llama")
    """The second tiny model (another architecture), warm-started like the policy with the base tokenizer."""
    pretrained: tuple[str, ...] = ("smollm2-135m-instruct",)
    """Real pretrained models (models/gguf.py PACKAGED_MODELS), evaluated frozen, zero-shot, through their own chat
    template and tokenizer, with and without the final bank: what of the bank carries over to a model that never
    trained here. Empty: none."""
    pretrained_scenarios: int = 24
    """Held-out scenarios each pretrained model plays (the first ones; 0 = all): a 135M model on 2 CPU cores costs
    ~2 s per episode."""

    def __post_init__(self) -> None:
        check_config(self, pretrained_scenarios="non_negative")
        unknown = [name for name in self.pretrained if name not in PACKAGED_MODELS]
        if unknown:
            raise ConfigValueError("pretrained", list(self.pretrained),
                                   f"packaged model names ({sorted(PACKAGED_MODELS)}); unknown: {unknown}")


@dataclass(frozen=True)
class Params:
    pipeline: PipelineConfig = PipelineConfig()
    env: EnvConfig = EnvConfig()
    harness: HarnessConfig = HarnessConfig()
    engine: EngineConfig = EngineConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    rollout: RolloutConfig = RolloutConfig()
    validate: GateConfig = GateConfig()
    mine: MinerConfig = MinerConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    skills: SkillsConfig = SkillsConfig()
    transfer: TransferConfig = TransferConfig()


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Params))
