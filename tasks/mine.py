"""mine: the round's skill bank, mined from successful trajectories (frequent action sub-sequences, or MDL macros)."""
from __future__ import annotations

from typing import Any

from datapool.parquet import read_steps
from skills.bank import write_bank
from skills.mdl import mine_mdl_skills
from skills.mining import mine_frequent_subsequences
from tasks.common import write_json
from tasks.config import Params
from tasks.layout import Layout, require


def successful_action_sequences(frame) -> list[tuple[str, list[str]]]:
    """(trajectory id, actions in step order) of every won trajectory; invalid steps stay as "" (they break runs)."""
    won = frame[frame["won"].astype(bool)].sort_values(["trajectory_id", "step_index"])
    return [(str(tid), [str(a) for a in group["action"].tolist()]) for tid, group in won.groupby("trajectory_id")]


def run(params: Params, layout: Layout, round_index: int) -> dict[str, Any]:
    cfg = params.mine
    frame, _ = read_steps(require(layout.steps(round_index), f"rollout_{round_index}"))
    sequences = successful_action_sequences(frame)
    if cfg.method == "mdl":
        skills = mine_mdl_skills(sequences, max_length=cfg.max_length, min_count=cfg.min_count, max_skills=cfg.top_k)
    else:
        skills = mine_frequent_subsequences(sequences, min_length=cfg.min_length, max_length=cfg.max_length,
                                            min_support=cfg.min_support, top_k=cfg.top_k)
    bank = layout.skills(round_index)
    names = ", ".join(s.name for s in skills) or "none"
    write_bank(bank, skills, f"round {round_index}: mined ({cfg.method}) {len(skills)} skill(s) from {len(sequences)} "
                             f"successful trajectories: {names}")
    metrics = {"round": round_index, "successful_trajectories": len(sequences), "skills": len(skills),
               "top_support": max((s.stats.get("support", 0.0) for s in skills), default=0.0)}
    write_json(layout.round_metrics(round_index, "mine"), metrics)
    return metrics
