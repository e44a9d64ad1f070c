"""params.yaml: one section per stage, each mapped to a frozen dataclass; one strict loader.

The loader rejects unknown sections and keys and wrong types with an error that names the section, the key and the
valid keys, before any stage writes anything.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import envs  # noqa: F401  (importing the package registers every env)
from agents.context import CONTEXT_MANAGERS
from agents.templates import TOOL_FORMATS
from envs.base import ENVS


class ParamsError(ValueError):
    """params.yaml is malformed: the message says which section/key and what is valid."""


MINE_METHODS: tuple[str, ...] = ("frequent", "mdl")
FROZENLAKE_DEFAULTS: dict[str, Any] = {"size": 4, "p_frozen": 0.8, "max_steps": 12, "is_slippery": False,
                                       "invalid_penalty": 0.1}


@dataclass(frozen=True)
class EnvConfig:
    name: str = "frozenlake"
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
class PipelineConfig:
    rounds: int = 3
    """Number of rollout -> validate -> mine -> train rounds (unrolled in dvc.yaml: `arlflow dvc-yaml` rewrites it)."""
    seed: int = 0
    """Global seed: scenario splits, model init, sampling and data order derive from it."""
    experiment: str = "arlflow"
    """MLflow experiment name."""
    registered_model: str = "arlflow-policy"
    """MLflow registered model name for the round policies."""


@dataclass(frozen=True)
class BootstrapConfig:
    model: str = ""
    """Path to a Hugging Face model folder to use as the base policy; empty builds the tiny local model."""
    arch: str = "qwen2"
    """Architecture of the tiny model: qwen2 or llama."""
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    tokenizer_corpus_episodes: int = 400
    """Expert and random episodes whose prompts and actions train the BPE tokenizer."""
    train_scenarios: int = 512
    heldout_scenarios: int = 200


@dataclass(frozen=True)
class WarmstartConfig:
    enabled: bool = True
    """False skips SFT (the warm-start policy is then the base policy)."""
    demo_scenarios: int = 512
    """Train scenarios whose expert trajectories are the SFT data."""
    skill_demos: float = 0.5
    """Skill-aware warm start: mine a bank (mine.method) from the expert demonstrations (artifacts/skills/round_0;
    its skills are candidates the first rollout validates, with skills.validate); this fraction of the scenarios is
    demonstrated a second time showing its skills, calling a shown macro wherever it is what the expert does next
    (every scenario keeps its plain demonstration). 0 = off."""
    epochs: int = 2
    lr: float = 0.001
    micro_batch_size: int = 64


@dataclass(frozen=True)
class RolloutConfig:
    scenarios_per_round: int = 64
    """Train scenarios sampled (without replacement, per round) for this round's groups."""
    group_size: int = 8
    """G: rollouts per scenario."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4
    context: str = "window"
    """Context manager (agents/context.py): full, window (last history_turns turns) or fold (HIPIF subgoal folding)."""
    history_turns: int = 0
    """Earlier (state, action) turns kept in the prompt (window context manager); 0 = current state only."""
    process_alpha: float = 0.1
    """fold: process reward +-alpha on a step that closes a subgoal, by the env's subgoal progress."""
    tool_format: str = "text"
    """How warm-start demos write tool envs' actions: text (the env's grammar, search[q]) or openai (JSON tool
    calls). The rollout parser accepts both."""
    max_generation_batches: int = 1
    """Dynamic sampling (DAPO): up to this many generation batches per round; batches after the first draw fresh
    scenarios for the shortfall of groups with a learning signal. 1 = no re-sampling."""
    use_skills: bool = True
    """Put the skill retrieved from the previous round's bank in the prompt's skill slot."""
    step_timeout_s: float = 10.0
    pool_url: str = ""
    """SQLAlchemy URL of the data pool; empty = sqlite under data/pool.db (WAL)."""


@dataclass(frozen=True)
class ValidateConfig:
    max_prompt_tokens: int = 256
    max_response_tokens: int = 8
    reward_min: float = -1.0
    reward_max: float = 1.0
    drop_zero_variance: bool = True
    """Drop groups whose returns are all equal (no GRPO signal); counted in metrics."""


@dataclass(frozen=True)
class MineConfig:
    method: str = "frequent"
    """frequent: action sub-sequences by support (min_length..max_length, min_support, top_k); mdl: slot-abstracted
    macros chosen by minimum description length (skills/mdl.py; max_length, min_count, top_k)."""
    min_length: int = 2
    max_length: int = 4
    min_support: float = 0.2
    top_k: int = 5
    min_count: int = 2
    """mdl: a macro must occur at least this many times."""


@dataclass(frozen=True)
class TrainConfig:
    advantage: str = "grpo"
    """Advantage estimator (models.advantages.ADVANTAGES): grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline,
    gigpo, graphgpo, turn_level."""
    loss: str = "ppo_clip"
    """Policy loss (models.losses.LOSSES): ppo_clip, vanilla_pg."""
    aggregation: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    filters: tuple[str, ...] = ()
    """Data filters and shaping before the advantages (datapool.filters.FILTERS), applied in this order. Empty by
    default: FrozenLake's turn limit is part of the task, so "truncated" would drop real failures."""
    aux: tuple[str, ...] = ()
    """Auxiliary losses (models.aux_losses.AUX_LOSSES): echo and seal need layout: concatenated."""
    layout: str = "step_rows"
    """step_rows (one row per step, anchors for step-level credit) or concatenated (one sequence per trajectory)."""
    lr: float = 0.0005
    epochs: int = 2
    micro_batch_size: int = 64
    """Rows per forward pass (and per optimizer step unless mini_batch_size is set)."""
    mini_batch_size: int = 0
    """Rows per optimizer step; 0 = micro_batch_size (gradient accumulation when larger)."""
    token_budget: int = 0
    """Padded tokens per forward pass (rows x longest); 0 = no budget, micro_batch_size only."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0
    """Dual-clip constant c for negative advantages (3.0 in the paper); 0 = off."""
    kl_beta: float = 0.0
    """Weight of the KL penalty to the frozen reference policy (the round's starting policy); 0 = no reference."""
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    gamma: float = 0.95
    """Step discount of gigpo / graphgpo / turn_level step returns."""
    omega: float = 1.0
    """gigpo: A = A^E + omega * A^S."""
    process_weight: float = 0.0
    """fold context (HIPIF): A = A + process_weight * A^proc, A^proc = the steps' process rewards normalized within
    their group (docs/algorithms.md section 10); 0 = off."""
    anchor_mode: str = "exact"
    """gigpo/graphgpo anchor grouping: exact or fuzzy."""
    echo_weight: float = 0.05
    seal_weight: float = 0.01
    lora_r: int = 0
    """LoRA rank via peft (0 = full fine-tuning); the saved policy has the adapters merged."""
    internalize_coef: float = 0.0
    """SIRI internalization: > 0 adds the distillation term on beneficial skill-guided action tokens, scored on the
    prompt WITHOUT the skill (weight w_t = coef * min(u * A_t, internalize_w_max)), so the policy needs no skill at
    inference. 0 = off."""
    internalize_w_max: float = 1.0
    overlong_max_tokens: int = 64
    """overlong filter: total response tokens of a trajectory at which the full penalty applies."""
    overlong_buffer_tokens: int = 16
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (infra/deepspeed/zero{N}.json)."""
    checkpoint_every: int = 20
    """Optimizer steps between resumable checkpoints (under artifacts/checkpoints/train_<round>)."""


@dataclass(frozen=True)
class EvaluateConfig:
    temperature: float = 0.0
    """0 = greedy decoding on held-out scenarios."""
    skills_k: int = 1
    """Skills put in the prompt's skill slot (rollout and evaluation); 0 = none."""
    skills_alpha: float = 0.5
    """Retrieval score alpha*cos(skill, task) + (1-alpha)*cos(skill, observation) (docs/algorithms.md section 9)."""
    skills_per_step: bool = False
    """Re-retrieve skills every turn from the current observation; False = once per episode, at reset."""
    skills_floor: float = 0.0
    """Least relevance a retrieved skill needs. 0 always fills the slot with the best k; raise it (e.g. 0.1 for
    TF-IDF, 0.3 for MiniLM) to leave the slot empty when nothing in the bank matches."""


SKILL_EMBEDDERS: tuple[str, ...] = ("tfidf", "minilm")


@dataclass(frozen=True)
class SkillsConfig:
    """The skill lifecycle (skills/, docs/algorithms.md section 9): which candidates enter the bank, how skills are shown,
    versioned and pruned. Retrieval knobs (k, alpha, per step, floor) are evaluate.skills_*."""
    validate: bool = True
    """Mined candidates go through paired validation in the next rollout (base vs base + candidate halves of a
    group, same scenario) and enter the bank only if they help; False adds them to the bank directly."""
    tau: float = 0.0
    """Promotion threshold on u(c) = mean R(aug) - mean R(base)."""
    t_min: float = 1.0
    """Welch t a candidate must exceed (when both halves have a variance)."""
    paired: bool = True
    """Groups without a candidate split into skill-free and skill-guided halves: live skills' utility (for pruning),
    skill_used for the skillc/d2skill estimators, and data for internalization."""
    macros: bool = True
    """Skills with a macro are callable as one action ("skill 1", then the slot arguments)."""
    embedder: str = "tfidf"
    """Retrieval embeddings: tfidf (fitted on the bank) or minilm (offline all-MiniLM-L6-v2; falls back to TF-IDF
    with a warning when the package is absent)."""
    ucb_c: float = 0.0
    """Retrieval's UCB exploration bonus c*sqrt(ln(1+N)/(1+n)) over skills' uses (0 = off; 0.05 in section 9)."""
    max_candidates: int = 3
    """New candidates added per round (the miner's best first)."""
    versions_gamma: float = 0.9
    """Discount of every version's Thompson evidence per group update (0.8-0.99)."""
    versions_min_uses: int = 10
    """Rollouts a version needs before it can retire."""
    skip_arm: bool = False
    """SelSkill: "skip" (no skill in the prompt) competes with a skill's versions."""
    llm_miner: str = ""
    """LLM miner and reviser: "" (off), "policy" (the round's policy writes skills), or the base URL of any
    OpenAI-compatible endpoint (e.g. the gateway, http://127.0.0.1:8000/v1)."""
    llm_model: str = ""
    """Model name sent to the endpoint."""
    llm_api_key_env: str = ""
    """Name of the environment variable holding the endpoint's API key (the key itself never goes in params)."""
    prune_min_utility: float = -0.05
    """Prune live skills whose utility estimate falls below this."""
    prune_max_idle_rounds: int = 2
    """Prune live skills not shown in a rollout for more than this many rounds."""
    max_bank_size: int = 8
    """Most live skills; the lowest-utility ones beyond it are pruned."""


@dataclass(frozen=True)
class TransferConfig:
    arch: str = "llama"
    """Architecture of the second tiny model, warm-started like the policy."""
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384


@dataclass(frozen=True)
class Params:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    mine: MineConfig = field(default_factory=MineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    skills: SkillsConfig = field(default_factory=SkillsConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Params)[f.name] for f in dataclasses.fields(Params)}


def _coerce(section: str, key: str, expected: Any, value: Any) -> Any:
    """Check one value against its annotated type (int accepted for float; bool never accepted for int)."""
    ok: bool
    if expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is bool:
        ok = isinstance(value, bool)
    elif expected is str:
        ok = isinstance(value, str)
    elif typing.get_origin(expected) is tuple:  # tuple[str, ...]: a YAML list of strings
        ok = isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value)
        value = tuple(value) if ok else value
    elif typing.get_origin(expected) is dict:  # dict[str, int] or dict[str, dict[str, Any]]: a YAML mapping
        inner = typing.get_args(expected)[1]
        check = ((lambda v: isinstance(v, int) and not isinstance(v, bool)) if inner is int
                 else (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)))
        ok = isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())
        value = {k: dict(v) if isinstance(v, dict) else v for k, v in value.items()} if ok else value
    else:
        raise TypeError(f"tasks/config.py: unsupported annotation {expected!r} for {section}.{key}")
    if not ok:
        name = ("a list of strings" if typing.get_origin(expected) is tuple
                else f"a mapping {expected}" if typing.get_origin(expected) is dict
                else getattr(expected, "__name__", str(expected)))
        raise ParamsError(f"params.yaml: {section}.{key} must be {name}, got {value!r} ({type(value).__name__})")
    return value


def _build_section(section: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"params.yaml: section {section!r} must be a mapping of keys, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ParamsError(f"params.yaml: unknown key(s) {unknown} in section {section!r}; valid keys: {valid}")
    values = {key: _coerce(section, key, hints[key], value) for key, value in raw.items()}
    return cls(**values)


def parse_params(raw: Any) -> Params:
    """Build Params from a parsed YAML mapping; every problem raises ParamsError naming section and key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError("params.yaml must be a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ParamsError(f"params.yaml: unknown section(s) {unknown}; valid sections: {list(SECTIONS)}")
    params = Params(**{name: _build_section(name, cls, raw.get(name)) for name, cls in SECTIONS.items()})
    check_params(params)
    return params


def check_params(params: Params) -> None:
    """Reject combinations that cannot run, saying how to fix them."""
    if params.pipeline.rounds < 1:
        raise ParamsError("params.yaml: pipeline.rounds must be >= 1")
    if params.rollout.group_size < 2:
        raise ParamsError("params.yaml: rollout.group_size must be >= 2 (group-normalized advantages need a group)")
    if params.bootstrap.arch not in ("qwen2", "llama"):
        raise ParamsError(f"params.yaml: bootstrap.arch must be one of ['qwen2', 'llama'], got {params.bootstrap.arch!r}")
    if params.transfer.arch not in ("qwen2", "llama"):
        raise ParamsError(f"params.yaml: transfer.arch must be one of ['qwen2', 'llama'], got {params.transfer.arch!r}")
    if params.train.layout not in ("step_rows", "concatenated"):
        raise ParamsError(f"params.yaml: train.layout must be step_rows or concatenated, got {params.train.layout!r}")
    if params.train.aux and params.train.layout != "concatenated":
        raise ParamsError(f"params.yaml: train.aux {list(params.train.aux)} needs train.layout: concatenated (the "
                          "auxiliary losses read observation tokens inside whole-trajectory sequences)")
    if params.train.zero_stage not in (0, 1, 2, 3):
        raise ParamsError(f"params.yaml: train.zero_stage must be 0-3, got {params.train.zero_stage}")
    if params.skills.embedder not in SKILL_EMBEDDERS:
        raise ParamsError(f"params.yaml: skills.embedder must be one of {list(SKILL_EMBEDDERS)}, "
                          f"got {params.skills.embedder!r}")
    if not 0.8 <= params.skills.versions_gamma <= 0.99:
        raise ParamsError(f"params.yaml: skills.versions_gamma must be in [0.8, 0.99], got {params.skills.versions_gamma}")
    if params.skills.ucb_c < 0:
        raise ParamsError(f"params.yaml: skills.ucb_c must be >= 0, got {params.skills.ucb_c}")
    if params.skills.max_bank_size < 0 or params.skills.max_candidates < 0 or params.skills.prune_max_idle_rounds < 0:
        raise ParamsError("params.yaml: skills.max_bank_size, max_candidates and prune_max_idle_rounds must be >= 0")
    llm = params.skills.llm_miner
    if llm and llm != "policy" and not llm.startswith(("http://", "https://")):
        raise ParamsError(f"params.yaml: skills.llm_miner must be '', 'policy' or an http(s) base URL, got {llm!r}")
    if params.train.internalize_coef < 0 or params.train.internalize_w_max <= 0:
        raise ParamsError("params.yaml: train.internalize_coef must be >= 0 and train.internalize_w_max > 0")
    if not 0.0 <= params.warmstart.skill_demos <= 1.0:
        raise ParamsError(f"params.yaml: warmstart.skill_demos must be in [0, 1], got {params.warmstart.skill_demos}")
    if params.rollout.max_generation_batches < 1:
        raise ParamsError("params.yaml: rollout.max_generation_batches must be >= 1 (1 = no re-sampling)")
    check_env_params(params)
    train_total = sum(params.env.mix.values()) if params.env.mix else params.bootstrap.train_scenarios
    if params.rollout.scenarios_per_round > train_total:
        raise ParamsError("params.yaml: rollout.scenarios_per_round exceeds the train scenarios (bootstrap."
                          "train_scenarios, or the sum of env.mix); lower it or raise those")


def check_env_params(params: Params) -> None:
    """Env names, mix counts and kwargs against the env registry and each env's constructor signature."""
    named = set(params.env.names) | set(params.env.kwargs)
    unknown = sorted(name for name in named if name not in ENVS)
    if unknown:
        raise ParamsError(f"params.yaml: env {unknown} not registered (in env.name, env.mix or env.kwargs); "
                          f"registered envs: {sorted(ENVS)}")
    bad_counts = {name: n for name, n in params.env.mix.items() if n < 1}
    if bad_counts:
        raise ParamsError(f"params.yaml: env.mix counts must be >= 1, got {bad_counts}; drop the env instead")
    for name, kwargs in params.env.kwargs.items():
        signature = inspect.signature(ENVS[name])
        accepted = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY or
                    p.kind is p.POSITIONAL_OR_KEYWORD]
        wrong = sorted(set(kwargs) - set(accepted))
        if wrong:
            raise ParamsError(f"params.yaml: env.kwargs.{name} has unknown key(s) {wrong}; {name} accepts {accepted}")
        try:  # constructing an env is cheap (no reset): its own checks judge the values
            ENVS[name](**kwargs)
        except (TypeError, ValueError) as err:
            raise ParamsError(f"params.yaml: env.kwargs.{name} is not accepted by the env: {err}") from err
    if params.mine.method not in MINE_METHODS:
        raise ParamsError(f"params.yaml: mine.method must be one of {list(MINE_METHODS)}, got {params.mine.method!r}")
    if params.rollout.context not in CONTEXT_MANAGERS:
        raise ParamsError(f"params.yaml: rollout.context must be one of {sorted(CONTEXT_MANAGERS)}, got "
                          f"{params.rollout.context!r}")
    if params.rollout.tool_format not in TOOL_FORMATS:
        raise ParamsError(f"params.yaml: rollout.tool_format must be one of {list(TOOL_FORMATS)}, got "
                          f"{params.rollout.tool_format!r}")


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml (missing file or bad YAML -> ParamsError saying so)."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path} not found: run from the repository root or pass --params PATH")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ParamsError(f"{path} is not valid YAML: {err}") from err
    return parse_params(raw)


def params_to_dict(params: Params) -> dict[str, dict[str, Any]]:
    """Plain YAML-ready values (tuples become lists)."""
    return {section: {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
            for section, values in dataclasses.asdict(params).items()}
