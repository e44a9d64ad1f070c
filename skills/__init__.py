"""The skill bank (SKILL.md files), mining of candidate skills (frequent sub-sequences, MDL, an LLM miner), retrieval
for the prompt's skill slot, pre-storage validation, version selection and the bank's lifecycle."""
from skills.bank import Skill, SkillFormatError, load_bank, read_skill, validate_skill_name, write_bank, write_skill
from skills.lifecycle import (BankChange, RoundBank, apply_changes, load_rejected, load_round_bank, prune_skills,
                              save_round_bank)
from skills.llm_miner import TrajectoryText, mine_llm_skills, revise_skill
from skills.llm_writers import ChatEndpointWriter, EngineWriter
from skills.mdl import bind_macro_arguments, instantiate_macro, match_macro, mine_mdl_skills
from skills.mining import mine_frequent_subsequences
from skills.retrieval import RetrievalConfig, SkillRetriever, render_skills, select_skills

__all__ = [
    "BankChange", "ChatEndpointWriter", "EngineWriter", "RetrievalConfig", "RoundBank", "Skill", "SkillFormatError",
    "SkillRetriever", "TrajectoryText", "apply_changes", "bind_macro_arguments", "instantiate_macro", "load_bank",
    "load_rejected", "load_round_bank", "match_macro", "mine_frequent_subsequences", "mine_llm_skills",
    "mine_mdl_skills", "prune_skills", "read_skill", "render_skills", "revise_skill", "save_round_bank",
    "select_skills", "validate_skill_name", "write_bank", "write_skill",
]
