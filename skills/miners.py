"""The skill miners params.yaml selects (``mine.method``), one registered function each, and their config.

A miner is ``fn(sequences, cfg) -> list[Skill]`` over (trajectory id, actions) of SUCCESSFUL trajectories, best
first. Adding one is one ``@MINERS.register("name")`` function (docs/algorithms.md section 9 has the math of both).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models.checks import ConfigValueError, check_config
from models.registry import Registry
from skills.bank import Skill
from skills.mdl import mine_mdl_skills
from skills.mining import mine_frequent_subsequences

MINERS = Registry("miner")
"""name -> ``fn(sequences: list[tuple[str, list[str]]], cfg: MinerConfig) -> list[Skill]``."""


@dataclass(frozen=True)
class MinerConfig:
    """params.yaml ``mine``: which miner turns successful trajectories into candidate skills, and its knobs."""

    method: str = field(default="frequent", metadata={"registry": MINERS})
    """frequent: contiguous action sub-sequences by support (min_length..max_length, min_support, top_k); mdl:
    slot-abstracted macros chosen by minimum description length (max_length, min_count, top_k)."""
    min_length: int = 2
    """frequent: shortest sub-sequence (actions)."""
    max_length: int = 4
    """Longest sub-sequence / macro (actions)."""
    min_support: float = 0.2
    """frequent: least fraction of successful trajectories that must contain the sub-sequence, in (0, 1]."""
    top_k: int = 5
    """Most skills a miner returns."""
    min_count: int = 2
    """mdl: a macro must occur at least this many times."""

    def __post_init__(self) -> None:
        check_config(self, min_length="positive", max_length="positive", min_support="open_probability",
                     top_k="positive", min_count="positive")
        if self.min_length > self.max_length:
            raise ConfigValueError("min_length", self.min_length, f"<= max_length ({self.max_length})")


def mine_skills(sequences: list[tuple[str, list[str]]], cfg: MinerConfig) -> list[Skill]:
    """The configured miner over (trajectory id, actions) of successful trajectories."""
    return MINERS[cfg.method](sequences, cfg)


@MINERS.register("frequent")
def mine_frequent(sequences: list[tuple[str, list[str]]], cfg: MinerConfig) -> list[Skill]:
    return mine_frequent_subsequences(sequences, min_length=cfg.min_length, max_length=cfg.max_length,
                                      min_support=cfg.min_support, top_k=cfg.top_k)


@MINERS.register("mdl")
def mine_mdl(sequences: list[tuple[str, list[str]]], cfg: MinerConfig) -> list[Skill]:
    return mine_mdl_skills(sequences, max_length=cfg.max_length, min_count=cfg.min_count, max_skills=cfg.top_k)
