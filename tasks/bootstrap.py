"""bootstrap: scenario sets (train / heldout) and the base policy (a tiny local model, or a given HF folder)."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

from agents.context import ContextView
from agents.demos import expert_texts
from agents.templates import encode_prompt, render_prompt, response_text, template_for
from envs.base import Scenario, close_env, make_scenario_env
from envs.scenarios import UnseenScenarioShortage, make_scenarios, unseen_heldout
from models.gguf import PACKAGED_MODELS, convert_packaged, packaged_gguf
from models.build import build_model, count_parameters, load_policy, save_policy, train_tokenizer
from skills.bank import Skill
from tasks.common import env_kwargs, pregenerate_games, seed_everything, write_json, write_scenarios
from tasks.config import Params
from tasks.skill_trials import MACRO_KEYWORD, render_slot
from tasks.layout import Layout
from tasks.outputs import staged_outputs


def tokenizer_corpus(scenarios: list[Scenario], params: Params, seed: int,
                     env_kwargs_by_env: dict[str, dict[str, Any]]) -> list[str]:
    """Text the envs produce: prompts + responses along expert episodes (half the scenarios) and random-admissible
    episodes (the rest), rendered as the rollout renders them, some with a skill slot."""
    rng = random.Random(seed)
    texts: list[str] = []
    options = {"context": params.harness.context, "history_turns": params.harness.history_turns,
               "env_kwargs": env_kwargs_by_env}
    for scenario in scenarios:
        skills_text = ""
        if rng.random() < 0.5:
            macro = tuple(rng.choice(("left", "right", "up", "down", "look", "open")) for _ in range(rng.randint(2, 4)))
            skills_text = render_slot([Skill(name="corpus", when_to_use="", procedure="", macro=macro)],
                                      macros=True).text
            texts.append(f" {MACRO_KEYWORD.format(index=rng.randint(1, 3))}")  # a macro call, as responses write it
        if rng.random() < 0.5:
            try:
                pairs = expert_texts([scenario], require_win=False, tool_format=params.harness.tool_format,
                                     skills_for=lambda _query, text=skills_text: (text, []), **options)
                texts.extend(prompt + response for prompt, response in pairs)
                continue
            except ValueError:  # no expert for this env or scenario: random play below
                pass
        texts.extend(random_play_texts(scenario, rng, skills_text, env_kwargs_by_env.get(scenario.env, {})))
    return texts


def random_play_texts(scenario: Scenario, rng: random.Random, skills_text: str, env_kwargs: dict) -> list[str]:
    """Prompt + response per step of an episode that takes random admissible actions (the expert's action, or a
    junk word, where the env lists none)."""
    env, obs, info = make_scenario_env(scenario, **env_kwargs)
    template = template_for(scenario.env)
    texts = []
    try:
        for _ in range(64):
            admissible = info.get("admissible_actions") or []
            action = rng.choice(admissible) if admissible else (env.expert_action() or "look")
            prompt = render_prompt(template, env.task_description(), ContextView(), obs, admissible=admissible,
                                   skills_text=skills_text)
            texts.append(prompt + response_text(action))
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
    finally:
        close_env(env)
    return texts


def make_scenario_sets(params: Params) -> tuple[list[Scenario], list[Scenario], dict[str, dict[str, int]]]:
    """(train, heldout, overlap report): per env of the mix (or env.name), its own seeded sets; train shuffled across
    envs so any prefix (warm-start demos, a round's batch) mixes them.

    Held-out means unseen (envs.scenarios.unseen_heldout): no held-out scenario has the content key of a train
    scenario of its env (envs.base.scenario_content_key: e.g. the same FrozenLake map), and no two held-out ones share
    a key (a repeat would evaluate the same scenario twice); candidates are drawn from the held-out seed range until
    bootstrap.heldout_scenarios such ones exist (at most MAX_CANDIDATES_PER_SCENARIO per scenario asked). The
    report, per env: ``heldout_overlap`` (kept scenarios a train one has: 0), ``heldout_overlap_before`` (of the
    plain seed draw of heldout_scenarios, how many a train one has), ``heldout_candidates`` (drawn),
    ``heldout_duplicates`` (candidates dropped as repeats of an earlier held-out one)."""
    cfg, seed = params.bootstrap, params.pipeline.seed
    kwargs_by_env = env_kwargs(params)
    train: list[Scenario] = []
    heldout: list[Scenario] = []
    report: dict[str, dict[str, int]] = {"heldout_overlap": {}, "heldout_overlap_before": {},
                                         "heldout_candidates": {}, "heldout_duplicates": {}}
    for name in params.env.names:
        n_train = params.env.mix.get(name, cfg.train_scenarios)
        env_train = make_scenarios(name, "train", n_train, seed)
        try:
            selection = unseen_heldout(name, env_train, cfg.heldout_scenarios, seed, kwargs_by_env.get(name, {}))
        except UnseenScenarioShortage as err:
            raise ValueError(f"bootstrap: {err.summary}: set bootstrap.heldout_scenarios to at most {err.found}, "
                             f"lower bootstrap.train_scenarios (or env.mix.{name}), or widen env.kwargs.{name} "
                             f"(frozenlake: a bigger size, p_frozen further below 1)") from err
        train += env_train
        heldout += selection.scenarios
        report["heldout_overlap"][name] = selection.overlap
        report["heldout_overlap_before"][name] = selection.overlap_before
        report["heldout_candidates"][name] = selection.candidates
        report["heldout_duplicates"][name] = selection.duplicates_dropped
    if len(params.env.names) > 1:
        random.Random(seed).shuffle(train)
    return train, heldout, report


def run(params: Params, layout: Layout) -> dict[str, Any]:
    """Scenario sets (and their generated games), the base policy and bootstrap.json, replaced together once all
    succeeded. Games already generated for an earlier run are reused (hard links), not regenerated."""
    cfg = params.bootstrap
    seed = params.pipeline.seed
    seed_everything(seed)
    if cfg.model in PACKAGED_MODELS:                                  # checked before anything is written
        packaged_gguf(cfg.model)
    elif cfg.model and not (Path(cfg.model) / "config.json").exists():
        raise FileNotFoundError(f"bootstrap.model = {cfg.model!r} is not a Hugging Face model folder "
                                "(no config.json) nor a packaged model "
                                f"({sorted(PACKAGED_MODELS)}); set it to a folder saved with save_pretrained, "
                                "a packaged name, or '' for the tiny local model")
    train, heldout, overlap = make_scenario_sets(params)
    target, metrics_path = layout.policy("base"), layout.metrics_dir / "bootstrap.json"
    with staged_outputs(layout.root, "bootstrap", [layout.scenarios_dir, target, metrics_path]) as out:
        scenarios_dir = out.path(layout.scenarios_dir)
        kwargs_by_env = env_kwargs(params, layout)
        if "textworld_cooking" in kwargs_by_env:
            kwargs_by_env["textworld_cooking"]["games_dir"] = str(scenarios_dir / layout.games_dir.name)
            link_existing_games(layout.games_dir, scenarios_dir / layout.games_dir.name)
        pregenerate_games(train + heldout, kwargs_by_env)
        write_scenarios(scenarios_dir / layout.scenarios("train").name, train)
        write_scenarios(scenarios_dir / layout.scenarios("heldout").name, heldout)
        if cfg.model in PACKAGED_MODELS:      # converted straight into the output folder
            model, tokenizer = load_policy(convert_packaged(cfg.model, out.path(target)))
        else:
            if cfg.model:
                model, tokenizer = load_policy(Path(cfg.model))
            else:
                corpus = tokenizer_corpus(train[: cfg.tokenizer_corpus_episodes], params, seed, kwargs_by_env)
                tokenizer = train_tokenizer(corpus, cfg.vocab_size)
                model = build_model(tokenizer, cfg.tiny, seed=seed)
            save_policy(model, tokenizer, out.path(target))
        first_prompts = []
        for scenario in heldout[:: max(1, len(heldout) // 50)]:
            env, obs, info = make_scenario_env(scenario, **kwargs_by_env.get(scenario.env, {}))
            try:
                prompt = render_prompt(template_for(scenario.env), env.task_description(), ContextView(), obs,
                                       admissible=info.get("admissible_actions") or ())
            finally:
                close_env(env)
            first_prompts.append(len(encode_prompt(tokenizer, prompt, chat=params.harness.chat_template)))
        metrics = {
            "parameters": count_parameters(model),
            "vocab_size": len(tokenizer),
            "train_scenarios": len(train),
            "heldout_scenarios": len(heldout),
            "mean_prompt_tokens": sum(first_prompts) / max(len(first_prompts), 1),
            **overlap,  # heldout_overlap / _overlap_before / _candidates / _duplicates, per env (make_scenario_sets)
        }
        write_json(out.path(metrics_path), metrics)
    return metrics


def link_existing_games(old: Path, new: Path) -> int:
    """Hard-link (or copy) the game files of an earlier bootstrap into the staged games folder; how many."""
    if not old.is_dir():
        return 0
    new.mkdir(parents=True, exist_ok=True)
    linked = 0
    for path in old.iterdir():
        if path.is_file():
            try:
                os.link(path, new / path.name)
            except OSError:
                shutil.copy2(path, new / path.name)
            linked += 1
    return linked
