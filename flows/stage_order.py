"""The stages' names and order, and the module each runs from: what dvc.yaml generation and `check-params` need,
without importing the stage modules (and torch) that flows/stages.py binds to the names."""
from __future__ import annotations

STAGES = ("bootstrap", "curate", "warmstart", "rollout", "validate", "mine", "train", "evaluate", "transfer")
ROUND_STAGES = ("rollout", "validate", "mine", "train")


def stage_module(stage: str) -> str:
    """The module whose ``run`` is the stage (flows/stages.py's STAGE_FUNCTIONS holds those functions)."""
    return f"tasks.{stage}"


def dvc_stage_name(stage: str, round_index: int | None) -> str:
    return stage if round_index is None else f"{stage}_{round_index}"


def stage_sequence(rounds: int) -> list[tuple[str, int | None]]:
    """(stage, round) in pipeline order, rounds unrolled."""
    sequence: list[tuple[str, int | None]] = [("bootstrap", None), ("curate", None), ("warmstart", None)]
    sequence += [(stage, r) for r in range(1, rounds + 1) for stage in ROUND_STAGES]
    return sequence + [("evaluate", None), ("transfer", None)]


def check_stage(stage: str, round_index: int | None, rounds: int) -> None:
    """ValueError unless ``stage`` exists and ``round_index`` fits it (round stages need 1 <= N <= ``rounds``)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {list(STAGES)}")
    if stage in ROUND_STAGES:
        if round_index is None or not 1 <= round_index <= rounds:
            raise ValueError(f"stage {stage!r} needs --round N with 1 <= N <= pipeline.rounds ({rounds})")
    elif round_index is not None:
        raise ValueError(f"stage {stage!r} takes no --round")
