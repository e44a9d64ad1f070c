"""The skill bank (SKILL.md files), mining of candidate skills (frequent sub-sequences, MDL), retrieval for the
prompt's skill slot, pre-storage validation and version selection."""
from skills.bank import Skill, SkillFormatError, load_bank, read_skill, validate_skill_name, write_bank, write_skill
from skills.lifecycle import BankChange, apply_changes, load_rejected, prune_skills
from skills.mdl import instantiate_macro, match_macro, mine_mdl_skills
from skills.mining import mine_frequent_subsequences
from skills.retrieval import RetrievalConfig, SkillRetriever, render_skills, select_skills

__all__ = [
    "BankChange", "apply_changes", "load_rejected", "prune_skills", "RetrievalConfig", "Skill", "SkillFormatError", "SkillRetriever", "instantiate_macro", "load_bank", "match_macro",
    "mine_frequent_subsequences", "mine_mdl_skills", "read_skill", "render_skills", "select_skills",
    "validate_skill_name", "write_bank", "write_skill",
]
