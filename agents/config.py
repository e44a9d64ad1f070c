"""The agent harness's config (params.yaml ``harness``): how prompts are built from an episode's history and how
env steps are run. Every stage that plays episodes (warm-start demos, rollout, evaluation, transfer) uses it, so
prompts look the same everywhere."""
from __future__ import annotations

from dataclasses import dataclass, field

from agents.context import CONTEXT_MANAGERS
from agents.templates import TOOL_FORMATS
from models.checks import ConfigValueError, check_choice, check_config

ACTION_SPACES = ("free", "admissible")


@dataclass(frozen=True)
class HarnessConfig:
    """params.yaml ``harness``: prompt building and env stepping, shared by every stage that plays episodes."""

    context: str = field(default="window", metadata={"registry": CONTEXT_MANAGERS})
    """Context manager (agents/context.py): full, window (last history_turns turns) or fold (HIPIF subgoal folding)."""
    history_turns: int = 0
    """Earlier (state, action) turns kept in the prompt (window context manager); 0 = current state only."""
    process_alpha: float = 0.1
    """fold: process reward +-alpha on a step that closes a subgoal, by the env's subgoal progress."""
    tool_format: str = "text"
    """How warm-start demos write tool envs' actions: text (the env's grammar, search[q]) or openai (JSON tool
    calls). The rollout parser accepts both."""
    step_timeout_s: float = 10.0
    """Seconds an env step may take before its episode fails (recorded with the reason)."""
    action_space: str = "free"
    """free: the policy writes any text and the env judges it; admissible: constrained decoding, sampling restricted
    to the token sequences of the state's admissible actions (slot-free macros of live skills included) by a prefix
    tree over the vocabulary, in every engine (local; vLLM through arlflow's logits processor), with the trainer
    scoring under the same mask (models/portable/action_trie.py). States without admissible actions decode freely."""
    max_turns: int = 0
    """Decisions an episode may take: one action or one macro call each (a macro's actions still count against
    the env's own step limit, e.g. FrozenLake's max_steps). An episode still live then ends truncated. 0: no budget
    beyond the env's. The non-learning baselines play under the same budget, with primitive actions only."""
    chat_template: bool = False
    """Wrap every prompt in the tokenizer's own chat template (one user turn, generation prompt added): for
    pretrained chat models (bootstrap.model); the embedded tiny tokenizer has none."""

    def __post_init__(self) -> None:
        check_config(self, history_turns="non_negative", process_alpha="non_negative", step_timeout_s="positive",
                     max_turns="non_negative")
        check_choice(self, "tool_format", TOOL_FORMATS)
        check_choice(self, "action_space", ACTION_SPACES)
        if self.action_space == "admissible" and self.context == "fold":
            raise ConfigValueError("action_space", self.action_space, "free with context fold (fold responses carry "
                                   "subgoal tags around the action, which the admissible actions do not)")
