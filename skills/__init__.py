"""The skill bank (SKILL.md files), mining of candidate skills, and retrieval for the prompt's skill slot."""
from skills.bank import Skill, SkillFormatError, load_bank, read_skill, validate_skill_name, write_bank, write_skill
from skills.mining import mine_frequent_subsequences
from skills.retrieval import render_skills, select_skills

__all__ = [
    "Skill", "SkillFormatError", "load_bank", "mine_frequent_subsequences", "read_skill", "render_skills",
    "select_skills", "validate_skill_name", "write_bank", "write_skill",
]
