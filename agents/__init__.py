"""The agent harness: prompt building, action parsing, the batched multi-turn rollout loop."""
from agents.demos import expert_demonstrations
from agents.parser import parse_action
from agents.prompts import HISTORY_TURNS_DEFAULT, build_prompt, response_text
from agents.rollout import SkillQuery, run_episodes, summarize

__all__ = ["HISTORY_TURNS_DEFAULT", "SkillQuery", "build_prompt", "expert_demonstrations", "parse_action",
           "response_text", "run_episodes", "summarize"]
