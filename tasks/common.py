"""Helpers the stage functions share: scenario files, metrics files, policy engines, skill slots, evaluation."""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from agents.rollout import SkillQuery, SkillsFor, run_episodes, summarize
from datapool.records import TrajectoryRecord
from envs.base import Scenario
from envs.textworld_cooking import TextWorldCooking, generate_games
from models.build import load_policy
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine
from skills.bank import Skill, load_bank
from skills.embeddings import CachedEmbedder, TfidfEmbedder
from skills.retrieval import SkillRetriever, render_skills, skill_text
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
    return {"context": params.rollout.context, "history_turns": params.rollout.history_turns,
            "env_kwargs": env_kwargs(params, layout)}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_engine(path: Path, policy_version: str, produced_by: str) -> TransformersEngine:
    model, tokenizer = load_policy(require(path, produced_by))
    return TransformersEngine(model, tokenizer, policy_version=policy_version)


def skill_slot(skills: list[Skill], params: Params) -> SkillsFor | None:
    """State-grounded skill retrieval for the prompt's skill slot (None when the bank is empty or skills_k is 0):
    TF-IDF over the bank's skills, score = alpha*cos(task) + (1-alpha)*cos(observation), MMR, the embedder's floor
    (skills/retrieval.py). The rollout loop asks at reset, and every turn with evaluate.skills_per_step."""
    cfg = params.evaluate
    if not skills or cfg.skills_k <= 0:
        return None
    retriever = SkillRetriever(skills, CachedEmbedder(TfidfEmbedder([skill_text(s) for s in skills])),
                               alpha=cfg.skills_alpha, k=cfg.skills_k, floor=cfg.skills_floor)

    def skills_for(query: SkillQuery) -> tuple[str, list[str]]:
        chosen = [skill for skill, _ in retriever.retrieve(query.task, query.observation)]
        return render_skills(chosen), [s.name for s in chosen]

    return skills_for


def load_skills(bank_dir: Path | None) -> list[Skill]:
    if bank_dir is None or not bank_dir.exists():
        return []
    return load_bank(bank_dir)


def evaluate_policy(engine: TransformersEngine, scenarios: list[Scenario], params: Params, *,
                    layout: Layout | None = None, skills: list[Skill] | None = None, label: str = ""
                    ) -> tuple[dict[str, Any], list[TrajectoryRecord]]:
    """One episode per held-out scenario (greedy by default); returns the summary and the trajectories."""
    sampling = SamplingParams(max_new_tokens=params.rollout.max_new_tokens, temperature=params.evaluate.temperature,
                              seed=params.pipeline.seed)
    trajectories = run_episodes(engine, engine.tokenizer, scenarios, group_size=1, sampling=sampling,
                                round_index=0, **episode_options(params, layout),
                                process_alpha=params.rollout.process_alpha,
                                skills_for=skill_slot(skills or [], params),
                                skills_per_step=params.evaluate.skills_per_step,
                                step_timeout_s=params.rollout.step_timeout_s,
                                progress=bool(label), seed=params.pipeline.seed)
    summary = summarize(trajectories)
    envs_seen = sorted({t.env for t in trajectories})
    if len(envs_seen) > 1:
        summary["per_env"] = {name: summarize([t for t in trajectories if t.env == name]) for name in envs_seen}
    return summary, trajectories
