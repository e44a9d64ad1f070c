"""Helpers the stage functions share: scenario files, metrics files, policy engines, skill slots, evaluation."""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from dataclasses import replace

import torch

from agents.rollout import SkillsFor, run_episodes, summarize
from datapool.records import TrajectoryRecord
from envs.base import Scenario
from envs.textworld_cooking import TextWorldCooking
from envs.textworld_games import generate_games
from models.build import load_policy
from models.hf_engine import TransformersEngine
from skills.bank import Skill, load_bank
from skills.lifecycle import RoundBank
from tasks.skill_trials import SkillProgram
from tasks.config import Params
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


def env_kwargs(params: Params, layout: Layout | None = None) -> dict[str, dict[str, Any]]:
    """Env name -> constructor kwargs: params' env.kwargs, plus where generated game files live (textworld_cooking
    games are a bootstrap output under the layout)."""
    kwargs = {name: dict(values) for name, values in params.env.kwargs.items()}
    if layout is not None and "textworld_cooking" in params.env.names:
        kwargs.setdefault("textworld_cooking", {}).setdefault("games_dir", str(layout.games_dir))
    return kwargs


def pregenerate_games(scenarios: list[Scenario], kwargs_by_env: dict[str, dict[str, Any]]) -> list[Path]:
    """Generate the game files of every textworld_cooking scenario up front (bootstrap), with a progress bar, so
    rollouts never pay TextWorld's compile time and the games are DVC-tracked with the scenario sets."""
    cooking = [s for s in scenarios if s.env == "textworld_cooking"]
    if not cooking:
        return []
    env = TextWorldCooking(**kwargs_by_env.get("textworld_cooking", {}))
    return generate_games(cooking, env.games_dir, env.settings)


def episode_options(params: Params, layout: Layout | None = None) -> dict[str, Any]:
    """The harness options every stage runs episodes (and expert demos) with: one place, so rollout, evaluation
    and warm start render prompts the same way."""
    return {"context": params.harness.context, "history_turns": params.harness.history_turns,
            "env_kwargs": env_kwargs(params, layout), "chat_template": params.harness.chat_template}


SAFETY_TURNS = 256
"""run_episodes' own stop for envs that never truncate, when harness.max_turns sets no budget."""


def play_options(params: Params, layout: Layout | None = None) -> dict[str, Any]:
    """episode_options plus how episodes are played (the action space, fold's process reward, the env step
    timeout, the decision budget): what rollout, evaluation and transfer pass to run_episodes."""
    harness = params.harness
    return {**episode_options(params, layout), "action_space": harness.action_space,
            "process_alpha": harness.process_alpha, "step_timeout_s": harness.step_timeout_s,
            "max_turns": harness.max_turns or SAFETY_TURNS, "skills_per_step": skills_per_step(params)}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_engine(path: Path, policy_version: str, produced_by: str) -> TransformersEngine:
    model, tokenizer = load_policy(require(path, produced_by))
    return TransformersEngine(model, tokenizer, policy_version=policy_version)


def skills_per_step(params: Params) -> bool:
    """Whether the skill slot is re-retrieved every turn (skills.retrieval.mode per_step) or once per episode."""
    return params.skills.retrieval.mode == "per_step"


def skill_program(bank: RoundBank, params: Params, *, tests: bool = True) -> SkillProgram:
    """The skill slot of a rollout or an evaluation over ``bank``: state-grounded retrieval over its live skills
    (score = alpha*cos(task) + (1-alpha)*cos(observation), MMR, the floor; skills/retrieval.py) with the configured
    embedder, callable macros, and with ``tests`` the lifecycle's paired tests (candidates, skill-free halves,
    Thompson-sampled versions; tasks/skill_trials.py). The rollout loop asks at reset, and every turn with
    skills.retrieval.mode per_step."""
    life = params.skills
    cfg = life.retrieval
    return SkillProgram(bank, k=cfg.k, alpha=cfg.alpha, floor=cfg.floor, embedder=life.embedder,
                        ucb_c=cfg.ucb_c if tests else 0.0, macros=life.macros, validate=tests and life.validate,
                        paired=tests and life.paired, skip_arm=tests and life.skip_arm, version_config=life.versions)


def skill_slot(skills: list[Skill], params: Params) -> SkillsFor | None:
    """The plain skill slot over ``skills`` (no tests): None when there is nothing to show."""
    if not skills or params.skills.retrieval.k <= 0:
        return None
    return skill_program(RoundBank(live=list(skills)), params, tests=False).skills_for


def load_skills(bank_dir: Path | None) -> list[Skill]:
    if bank_dir is None or not bank_dir.exists():
        return []
    return load_bank(bank_dir)


def evaluate_policy(engine: TransformersEngine, scenarios: list[Scenario], params: Params, *,
                    layout: Layout | None = None, skills: list[Skill] | None = None, label: str = ""
                    ) -> tuple[dict[str, Any], list[TrajectoryRecord]]:
    """One episode per held-out scenario (greedy by default); returns the summary and the trajectories. A ``label``
    (the policy's name) shows a progress bar "evaluate <label>"."""
    sampling = replace(params.evaluate.sampling, seed=params.pipeline.seed)
    trajectories = run_episodes(engine, engine.tokenizer, scenarios, group_size=1, sampling=sampling,
                                round_index=0, **play_options(params, layout),
                                skills_for=skill_slot(skills or [], params),
                                progress=bool(label), label=f"evaluate {label}", seed=params.pipeline.seed)
    summary = summarize(trajectories)
    envs_seen = sorted({t.env for t in trajectories})
    if len(envs_seen) > 1:
        summary["per_env"] = {name: summarize([t for t in trajectories if t.env == name]) for name in envs_seen}
    return summary, trajectories
