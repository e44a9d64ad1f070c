"""transfer: the final skill bank with other models: the warm-start policy, a second tiny architecture warm-started
the same way, and real pretrained models (``transfer.pretrained``, e.g. SmolLM2-135M-Instruct) evaluated frozen and
zero-shot through their own chat template; each with and without the bank, and what carries over (success gain,
skill prompt tokens, macro calls)."""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from models.build import build_model, load_policy
from models.gguf import convert_packaged
from tasks.common import evaluate_policy, load_skills, read_scenarios, seed_everything, write_json
from tasks.engines import open_engine
from tasks.config import Params
from tasks.layout import Layout, require
from tasks.outputs import staged_outputs
from tasks.tracking import log_metrics
from tasks.warmstart import sft_policy


def build_transfer_model(params: Params, layout: Layout, target: Path) -> dict[str, Any]:
    """A second tiny model of another architecture with the base tokenizer, warm-started like the policy, saved to
    `target`; returns the SFT metrics."""
    cfg = params.transfer
    _, tokenizer = load_policy(require(layout.policy("base"), "bootstrap"))
    model = build_model(tokenizer, cfg.model, seed=params.pipeline.seed + 1)
    scenarios = read_scenarios(layout, "train")[: params.warmstart.demo_scenarios]
    return sft_policy(model, tokenizer, scenarios, params, target, layout)


def run(params: Params, layout: Layout) -> dict[str, Any]:
    seed_everything(params.pipeline.seed)
    heldout = read_scenarios(layout, "heldout")
    skills = load_skills(require(layout.skills(params.pipeline.rounds), f"mine_{params.pipeline.rounds}"))
    target = layout.policy(f"transfer_{params.transfer.model.arch}")
    with staged_outputs(layout.root, "transfer", [target, layout.transfer_metrics]) as out:
        report = transfer_report(params, layout, heldout, skills, target, out.path(target))
        write_json(out.path(layout.transfer_metrics), report)
    return report


def transfer_report(params: Params, layout: Layout, heldout, skills, target: Path, save_to: Path) -> dict[str, Any]:
    """Warm-start the second model into ``save_to``; evaluate it and the warm-start policy with and without the
    final bank."""
    sft_metrics = build_transfer_model(params, layout, save_to)
    policies = {"warmstart": (layout.policy("warmstart"), "warmstart", "warmstart"),
                f"{params.transfer.model.arch}_warmstart": (save_to, target.name, "transfer")}
    report: dict[str, Any] = {"models": {}, "skills_in_bank": len(skills), "engine": {}}
    for name, (folder, version, producer) in policies.items():
        with open_engine(params, layout, folder, version, producer,
                         stage=f"transfer-{name}") as (engine, report["engine"][name]):
            without, _ = evaluate_policy(engine, heldout, params, layout=layout, label=f"{name} without skills")
            with_skills, _ = evaluate_policy(engine, heldout, params, layout=layout, skills=skills,
                                             label=f"{name} with skills")
        report["models"][name] = _with_and_without(without, with_skills)
        log_metrics(without, prefix=f"{name}.without_skills.")
        log_metrics(with_skills, prefix=f"{name}.with_skills.")
    report["sft"] = {f"{params.transfer.model.arch}_warmstart": sft_metrics}
    report["pretrained"] = pretrained_report(params, layout, heldout, skills)
    return report


def _with_and_without(without: dict[str, Any], with_skills: dict[str, Any]) -> dict[str, Any]:
    return {"without_skills": without, "with_skills": with_skills,
            "carry_over": {"success_gain": with_skills["success_rate"] - without["success_rate"],
                           "skill_prompt_tokens_per_episode": with_skills["mean_skill_prompt_tokens"],
                           "macro_calls_per_episode": with_skills["macro_calls_per_episode"]}}


def pretrained_report(params: Params, layout: Layout, heldout, skills) -> dict[str, Any]:
    """Each of ``transfer.pretrained``, frozen: converted from its packaged GGUF into a temporary folder (never a
    stage output: 0.5 GB), prompted through its own chat template, on the first ``transfer.pretrained_scenarios``
    held-out scenarios, with and without the bank."""
    cfg = params.transfer
    scenarios = list(heldout[: cfg.pretrained_scenarios] if cfg.pretrained_scenarios else heldout)
    chat = replace(params, harness=replace(params.harness, chat_template=True))
    out: dict[str, Any] = {}
    for name in cfg.pretrained:
        scratch = layout.root / ".arlflow" / "tmp"            # ignored by git, outside every stage's outputs
        scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"transfer-{name}-", dir=scratch) as tmp:
            folder = convert_packaged(name, Path(tmp) / name)
            with open_engine(chat, layout, folder, name, "transfer", stage=f"transfer-{name}") as (engine, handoff):
                without, _ = evaluate_policy(engine, scenarios, chat, layout=layout, label=f"{name} without skills")
                with_skills, _ = evaluate_policy(engine, scenarios, chat, layout=layout, skills=skills,
                                                 label=f"{name} with skills")
        out[name] = {**_with_and_without(without, with_skills), "scenarios": len(scenarios), "engine": handoff}
        log_metrics(without, prefix=f"{name}.without_skills.")
        log_metrics(with_skills, prefix=f"{name}.with_skills.")
    return out
