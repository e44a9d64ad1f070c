"""transfer: the final skill bank with other models (the warm-start policy and a second architecture)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from models.build import build_model, load_policy
from tasks.common import evaluate_policy, load_engine, load_skills, read_scenarios, seed_everything, write_json
from tasks.config import Params
from tasks.layout import Layout, require
from tasks.tracking import log_metrics
from tasks.warmstart import sft_policy


def build_transfer_model(params: Params, layout: Layout, target: Path) -> dict[str, Any]:
    """A second tiny model of another architecture with the base tokenizer, warm-started like the policy, saved to
    `target`; returns the SFT metrics."""
    cfg = params.transfer
    _, tokenizer = load_policy(require(layout.policy("base"), "bootstrap"))
    model = build_model(cfg.arch, tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                        intermediate_size=cfg.intermediate_size,
                        max_position_embeddings=params.bootstrap.max_position_embeddings,
                        seed=params.pipeline.seed + 1)
    scenarios = read_scenarios(layout, "train")[: params.warmstart.demo_scenarios]
    return sft_policy(model, tokenizer, scenarios, params, target, layout)


def run(params: Params, layout: Layout) -> dict[str, Any]:
    seed_everything(params.pipeline.seed)
    heldout = read_scenarios(layout, "heldout")
    skills = load_skills(require(layout.skills(params.pipeline.rounds), f"mine_{params.pipeline.rounds}"))
    target = layout.policy(f"transfer_{params.transfer.arch}")
    if target.exists():
        shutil.rmtree(target)
    sft_metrics = build_transfer_model(params, layout, target)

    engines = {"warmstart": load_engine(layout.policy("warmstart"), "warmstart", "warmstart"),
               f"{params.transfer.arch}_warmstart": load_engine(target, target.name, "transfer")}
    report: dict[str, Any] = {"models": {}, "skills_in_bank": len(skills)}
    for name, engine in engines.items():
        without, _ = evaluate_policy(engine, heldout, params, layout=layout, label=f"{name} without skills")
        with_skills, _ = evaluate_policy(engine, heldout, params, layout=layout, skills=skills,
                                         label=f"{name} with skills")
        report["models"][name] = {"without_skills": without, "with_skills": with_skills}
        log_metrics(without, prefix=f"{name}.without_skills.")
        log_metrics(with_skills, prefix=f"{name}.with_skills.")
    report["sft"] = {f"{params.transfer.arch}_warmstart": sft_metrics}
    write_json(layout.transfer_metrics, report)
    return report
