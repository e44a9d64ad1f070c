"""Helpers the stage functions share: scenario files, metrics files, policy engines, skill slots, evaluation."""
from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agents.rollout import run_episodes, summarize
from datapool.records import TrajectoryRecord
from envs.base import Scenario
from models.build import load_policy
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine
from skills.bank import Skill, load_bank
from skills.retrieval import render_skills, select_skills
from tasks.config import EnvConfig, Params
from tasks.layout import Layout, require


def write_json(path: Path, data: Any) -> Path:
    """Write JSON atomically (tmp file + rename): a crash never leaves a half-written metrics file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)
    return path


def read_json(path: Path, produced_by: str) -> Any:
    return json.loads(require(path, produced_by).read_text())


def write_scenarios(path: Path, scenarios: list[Scenario]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(s.to_json() + "\n" for s in scenarios))
    os.replace(tmp, path)
    return path


def read_scenarios(layout: Layout, split: str) -> list[Scenario]:
    path = require(layout.scenarios(split), "bootstrap")
    scenarios = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            scenarios.append(Scenario.from_json(line))
        except (ValueError, KeyError) as err:
            raise ValueError(f"{path}:{number}: malformed scenario ({err}); rerun `dvc repro bootstrap`") from err
    return scenarios


def env_kwargs(cfg: EnvConfig) -> dict[str, Any]:
    return {"size": cfg.size, "p_frozen": cfg.p_frozen, "max_steps": cfg.max_steps, "is_slippery": cfg.is_slippery,
            "invalid_penalty": cfg.invalid_penalty}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_engine(path: Path, policy_version: str, produced_by: str) -> TransformersEngine:
    model, tokenizer = load_policy(require(path, produced_by))
    return TransformersEngine(model, tokenizer, policy_version=policy_version)


def skill_slot(skills: list[Skill], k: int) -> Callable[[Scenario], tuple[str, list[str]]] | None:
    """Per-scenario skill retrieval for the prompt's skill slot (None when the bank is empty)."""
    if not skills or k <= 0:
        return None

    def skills_for(scenario: Scenario) -> tuple[str, list[str]]:
        chosen = select_skills(skills, f"{scenario.env} {scenario.split}", k=k)
        return render_skills(chosen), [s.name for s in chosen]

    return skills_for


def load_skills(bank_dir: Path | None) -> list[Skill]:
    if bank_dir is None or not bank_dir.exists():
        return []
    return load_bank(bank_dir)


def evaluate_policy(engine: TransformersEngine, scenarios: list[Scenario], params: Params, *,
                    skills: list[Skill] | None = None, label: str = "") -> tuple[dict[str, float], list[TrajectoryRecord]]:
    """One episode per held-out scenario (greedy by default); returns the summary and the trajectories."""
    sampling = SamplingParams(max_new_tokens=params.rollout.max_new_tokens, temperature=params.evaluate.temperature,
                              seed=params.pipeline.seed)
    trajectories = run_episodes(engine, engine.tokenizer, scenarios, group_size=1, sampling=sampling,
                                round_index=0, history_turns=params.rollout.history_turns,
                                skills_for=skill_slot(skills or [], params.evaluate.skills_k),
                                env_kwargs=env_kwargs(params.env), step_timeout_s=params.rollout.step_timeout_s,
                                progress=bool(label), seed=params.pipeline.seed)
    return summarize(trajectories), trajectories
