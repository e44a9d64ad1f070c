"""The batched multi-turn rollout loop, its skill slot (SkillQuery, SkillSlot, SkillsFor), and rollout summaries.

All live episodes advance together: one ``engine.generate`` call per turn over every live episode's prompt, then
every env steps in a thread pool with a per-call timeout (agents/workers.py). An env that raises or hangs fails
only its own episode (status ``"failed"``, ``error`` says why). The ids in each StepRecord are exactly the ids fed
to and sampled by the engine: responses are decoded for parsing only, never re-tokenized. Each env gets its own
prompt template (agents/templates.py); the context manager (agents/context.py) decides what history a prompt shows.
Each StepRecord is complete when it is made (the fold process reward, and the plain prompt and macro sub-steps
internalization reads, included) and never changed afterwards. Expert demonstrations for warm-start SFT, built
with the same prompts, are in agents/demos.py.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from agents.context import Turn, fold_process_rewards, get_context_manager, parse_fold_tags
from agents.parser import parse_action
from agents.templates import PromptTemplate, encode_prompt, render_prompt, response_text, template_for
from envs.tools import parse_tool_call
from agents.workers import call_all
from datapool.records import StepRecord, TrajectoryRecord
from envs.base import ENVS, Scenario, TextEnv, close_env, make_scenario_env
from models.engine import Engine, Generation, SamplingParams
from skills.mdl import bind_macro_arguments

@dataclass(frozen=True)
class SkillQuery:
    """What a skill slot may ground its retrieval on: the episode's scenario and task, the current observation and
    the turn (0 at reset)."""

    scenario: Scenario
    task: str
    observation: str
    turn: int
    episode: int = 0
    """The episode's index within its group (0..G-1): paired validation and version selection give the halves of a
    group different skills."""


@dataclass(frozen=True)
class SkillSlot:
    """What a skill slot puts in one prompt: the text, the ids of the skills shown, and the executable macros among
    them: invocation keyword (e.g. ``"skill 1"``) -> action templates (slots ``{a}``, ``{b}``, ... bound from the
    entities that follow the keyword in the response, see skills.mdl.bind_macro_arguments)."""

    text: str
    ids: Sequence[str] = ()
    macros: Mapping[str, Sequence[str]] = field(default_factory=dict)


SkillsFor = Callable[[SkillQuery], "SkillSlot | tuple[str, list[str]]"]  # query -> what the slot shows
EnvKwargs = Mapping[str, Mapping[str, Any]]               # env name -> constructor kwargs


@dataclass
class _Episode:
    """Mutable state of one live episode (private to the loop)."""

    scenario: Scenario
    index: int
    group_id: str
    trajectory_id: str
    skills_text: str
    skill_ids: list[str]
    template: PromptTemplate
    env: TextEnv | None = None
    task: str = ""
    observation: str = ""
    info: dict = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    skill_tokens: int = 0          # prompt tokens the skill slot takes on the current turn (cost accounting)
    skill_tokens_total: int = 0    # summed over the episode's turns
    macros: Mapping[str, Sequence[str]] = field(default_factory=dict)   # executable macros of the current slot
    macro_calls: int = 0
    status: str | None = None      # None while live
    error: str | None = None
    ended_at: float = 0.0


def run_episodes(engine: Engine, tokenizer: Any, scenarios: list[Scenario], *, group_size: int,
                 sampling: SamplingParams, round_index: int = 0, context: str = "window", history_turns: int = 0,
                 process_alpha: float = 0.1, skills_for: SkillsFor | None = None, env_kwargs: EnvKwargs | None = None,
                 step_timeout_s: float = 10.0, workers: int = 4, progress: bool = True, seed: int = 0,
                 max_turns: int = 256, skills_per_step: bool = False, chat_template: bool = False,
                 action_space: str = "free", label: str | None = None) -> list[TrajectoryRecord]:
    """Run ``group_size`` episodes of every scenario with ``engine``; one TrajectoryRecord per episode.

    Records come back in (scenario, episode index) order. ``context`` names the context manager and
    ``history_turns`` its window (see agents/context.py); with ``fold`` every closed subgoal gets the process reward
    +-``process_alpha`` on its closing step. ``env_kwargs`` maps env name -> constructor kwargs (scenarios may mix
    envs). ``sampling.seed`` (or ``seed`` when it is None) seeds a per-turn seed derived from (base seed, round,
    turn), so a rerun with the same inputs samples the same tokens. ``max_turns`` is a safety stop for envs that
    never truncate: episodes still live then end as ``"truncated"``. ``skills_for`` fills the prompt's skill slot
    from a SkillQuery at reset, and again every turn with ``skills_per_step``. ``action_space="admissible"``
    restricts each response to the token sequences of the admissible actions shown (``action_choices``), recorded
    on the step for the trainer's mask. ``progress``: a tqdm bar named ``label`` (default ``rollout r<round>``)
    over episodes, with the episodes won and env steps taken so far.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if history_turns < 0:
        raise ValueError(f"history_turns must be >= 0, got {history_turns}")
    if process_alpha < 0:
        raise ValueError(f"process_alpha must be >= 0, got {process_alpha}")
    if action_space not in ("free", "admissible"):
        raise ValueError(f"action_space must be 'free' or 'admissible', got {action_space!r}")
    constrained = action_space == "admissible"
    choice_ids = partial(action_choices, tokenizer, cache={})
    manager = get_context_manager(context)
    kwargs_by_env = check_env_kwargs(env_kwargs)
    policy_version = str(engine.policy_version)
    started_at = time.monotonic()

    episodes: list[_Episode] = []
    for scenario in scenarios:
        group_id = f"{scenario.scenario_id}|r{round_index}|{policy_version}"
        episodes.extend(_Episode(scenario=scenario, index=i, group_id=group_id, trajectory_id=f"{group_id}|{i}",
                                 skills_text="", skill_ids=[], template=template_for(scenario.env))
                        for i in range(group_size))

    with tqdm(total=len(episodes), desc=label or f"rollout r{round_index}", unit="ep", disable=not progress) as bar:
        resets = call_all([partial(_start_episode, ep.scenario, kwargs_by_env.get(ep.scenario.env, {}))
                           for ep in episodes], workers=workers, timeout_s=step_timeout_s)
        for ep, (value, error) in zip(episodes, resets):
            if error is not None:
                _finish(ep, "failed", bar, error=f"env reset failed: {error}")
            else:
                ep.env, ep.task, ep.observation, ep.info = value

        fold = context == "fold"
        turn = 0
        live = [ep for ep in episodes if ep.status is None]
        while live:
            if turn >= max_turns:
                for ep in live:
                    _finish(ep, "truncated", bar, error=None)
                break
            if skills_for is not None and (turn == 0 or skills_per_step):
                for ep in live:
                    _fill_skill_slot(ep, skills_for, turn, tokenizer)
            prompts = [render_prompt(ep.template, ep.task, manager(ep.turns, history_turns), ep.observation,
                                     admissible=with_macros(ep.info.get("admissible_actions"), ep.macros),
                                     skills_text=ep.skills_text)
                       for ep in live]
            prompt_ids = [encode_prompt(tokenizer, p, chat=chat_template) for p in prompts]
            turn_sampling = dataclasses.replace(sampling, seed=_turn_seed(
                sampling.seed if sampling.seed is not None else seed, round_index, turn))
            if constrained:
                choices = [choice_ids(with_macros(ep.info.get("admissible_actions"), ep.macros)) for ep in live]
                generations = engine.generate(prompt_ids, turn_sampling, choices=choices)
            else:
                choices = [None] * len(live)
                generations = engine.generate(prompt_ids, turn_sampling)
            if len(generations) != len(live):
                raise RuntimeError(f"engine returned {len(generations)} generations for {len(live)} prompts: "
                                   f"an Engine must return exactly one Generation per prompt, in order")
            texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
            parsed = [env_action(text, ep.info, ep.template, fold=fold) for text, ep in zip(texts, live)]
            calls = [macro_call(text, ep.macros, fold=fold) for text, ep in zip(texts, live)]
            outcomes = call_all([partial(ep.env.step, sent) if call is None else partial(_run_macro, ep.env, call[1],
                                                                                          ep.observation, ep.info)
                                 for ep, (sent, _), call in zip(live, parsed, calls)],
                                workers=workers, timeout_s=step_timeout_s,
                                on_timeout=partial(_interrupt_env, [ep.env for ep in live]))
            parsed = [(sent, action) if call is None else (call[0], call[0])
                      for (sent, action), call in zip(parsed, calls)]
            for ep, prompt, ids, gen, text, (_, action), (value, error), choice in zip(
                    live, prompts, prompt_ids, generations, texts, parsed, outcomes, choices):
                if error is not None:
                    _finish(ep, "failed", bar, error=f"env step {len(ep.steps)} failed: {error}")
                    continue
                obs, reward, terminated, truncated, info = value
                valid = bool(info.get("action_valid", True)) and action != ""
                shown = action if valid else text.strip()
                trace = _skill_trace(ep, manager, history_turns, tokenizer, info.pop(_MACRO_TRACE, None),
                                     chat_template)
                ep.macro_calls += action in ep.macros
                ep.turns.append(Turn(ep.observation, text, shown, ep.info.get("subgoals_done")))
                process = _process_reward(ep.turns, process_alpha) if fold else 0.0
                ep.steps.append(_step_record(ep, ids, gen, prompt, text, action if valid else "", float(reward),
                                             valid, policy_version, context, info, process, trace, choice))
                ep.skill_tokens_total += ep.skill_tokens
                ep.observation, ep.info = obs, info
                if terminated or truncated:
                    _finish(ep, "complete" if terminated else "truncated", bar, error=None)
            live = [ep for ep in live if ep.status is None]
            turn += 1
            bar.set_postfix(won=sum(bool(ep.info.get("won")) for ep in episodes if ep.status),
                            steps=sum(len(ep.steps) for ep in episodes))

    return [_trajectory_record(ep, round_index, policy_version, started_at) for ep in episodes]


def macro_call(text: str, macros: Mapping[str, Sequence[str]], *, fold: bool = False
               ) -> tuple[str, list[str]] | None:
    """(keyword, concrete actions) when the response invokes one of ``macros`` (``"skill 1"``, or ``"skill 2 apple 1
    fridge 1"`` for a macro with slots), else None. The keyword must open the response (after fold tags) as whole
    words; the longest keyword wins. Wrong arguments make the call invalid: ``(keyword, [])``."""
    if not macros:
        return None
    rest = (parse_fold_tags(text).rest if fold else text).strip()
    lowered = rest.lower()
    for keyword in sorted(macros, key=len, reverse=True):
        if lowered.startswith(keyword.lower()) and (len(rest) == len(keyword) or not rest[len(keyword)].isalnum()):
            actions = bind_macro_arguments(list(macros[keyword]), rest[len(keyword):])
            return keyword, actions or []
    return None


_MACRO_TRACE = "_macro_trace"   # private info key: the macro's sub-steps, popped by the loop


def _run_macro(env: TextEnv, actions: list[str], observation: str, info: dict
               ) -> tuple[str, float, bool, bool, dict]:
    """Step ``env`` through a macro's actions as one agent action: rewards add up; it stops at the end of the
    episode or at the first invalid action. An empty action list (bad arguments) is one invalid step."""
    if not actions:
        obs, reward, terminated, truncated, out = env.step("")
        return obs, reward, terminated, truncated, {**out, "action_valid": False, _MACRO_TRACE: []}
    total, sub = 0.0, []
    for action in actions:
        sub.append((observation, tuple(info.get("admissible_actions") or ()), action))
        observation, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        if terminated or truncated or not info.get("action_valid", True):
            break
    return observation, total, terminated, truncated, {**info, _MACRO_TRACE: sub}


def action_choices(tokenizer: Any, actions: Sequence[str] | None, *, cache: dict) -> list[list[int]] | None:
    """The token sequences constrained decoding allows for ``actions``: each as a demonstration writes it
    (``response_text`` + eos, agents/demos.py), so warm start and the constraint agree; None without actions (the
    step decodes freely). ``cache`` memoizes per action list (states repeat)."""
    if not actions:
        return None
    key = tuple(actions)
    if key not in cache:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("action_space admissible needs a tokenizer with an eos_token_id (every admissible "
                             "action ends with it)")
        cache[key] = [list(tokenizer.encode(response_text(a), add_special_tokens=False)) + [int(eos)]
                      for a in dict.fromkeys(actions)]
    return cache[key]


def with_macros(admissible: Sequence[str] | None, macros: Mapping[str, Sequence[str]]) -> Sequence[str]:
    """The admissible actions shown, plus the slot-free macro keywords (callable as they are)."""
    if not admissible or not macros:
        return admissible or ()
    return list(admissible) + [k for k, steps in macros.items() if "{" not in "".join(steps)]


SkillTrace = tuple[list[int], list[list[int]], list[list[int]]]
"""(plain_prompt_ids, macro_prompt_ids, macro_action_ids) of one step: the StepRecord fields SIRI reads."""


def _skill_trace(ep: _Episode, manager, history_turns: int, tokenizer: Any,
                 macro_steps: list[tuple[str, tuple[str, ...], str]] | None, chat: bool = False) -> SkillTrace:
    """What internalization (SIRI) needs of one step taken with skills in the prompt: the prompt WITHOUT the skill
    slot, and for a macro each sub-step's plain prompt and action tokens. Nothing for a skill-free prompt."""
    if not ep.skills_text:
        return [], [], []
    plain = render_prompt(ep.template, ep.task, manager(ep.turns, history_turns), ep.observation,
                          admissible=ep.info.get("admissible_actions") or ())
    prompts: list[list[int]] = []
    actions: list[list[int]] = []
    if macro_steps:
        eos = getattr(tokenizer, "eos_token_id", None)
        turns = list(ep.turns)
        for observation, admissible, action in macro_steps:
            prompt = render_prompt(ep.template, ep.task, manager(turns, history_turns), observation,
                                   admissible=admissible)
            ids = tokenizer.encode(response_text(action, template=ep.template), add_special_tokens=False)
            prompts.append(encode_prompt(tokenizer, prompt, chat=chat))
            actions.append(ids + ([eos] if eos is not None else []))
            turns.append(Turn(observation, " " + action, action, None))
    return encode_prompt(tokenizer, plain, chat=chat), prompts, actions


def _process_reward(turns: Sequence[Turn], alpha: float) -> float:
    """The fold process reward of the last of ``turns`` (the step being recorded). It depends on the turns so far
    only, and is 0 unless the turn opens or closes a subgoal, so only such turns pay for scoring the episode."""
    last = turns[-1].response
    if "<done>" not in last and "<subgoal>" not in last:
        return 0.0
    return fold_process_rewards(turns, alpha)[-1]


def env_action(text: str, info: dict, template: PromptTemplate, *, fold: bool = False) -> tuple[str, str]:
    """(what the env is sent, the parsed action or "" when invalid) for one response.

    Fold tags are removed first. A tool env's JSON tool call (OpenAI format, agents/tools.py) becomes the env's
    action string. With known admissible actions, the parsed action is sent, or the raw text when none matched
    (the env then judges it invalid and applies its penalty). Without them the env alone judges the stripped text.
    """
    rest = parse_fold_tags(text).rest if fold else text
    if template.tool_to_action is not None:
        call = parse_tool_call(rest)
        if call is not None:
            mapped = template.tool_to_action(*call)
            if mapped is None:
                return rest.strip(), ""
            rest = mapped
    admissible = info.get("admissible_actions")
    if admissible:
        action, valid = parse_action(rest, admissible)
        return (action, action) if valid else (rest.strip(), "")
    return rest.strip(), rest.strip()


def summarize(trajectories: Sequence[TrajectoryRecord]) -> dict[str, float]:
    """Episode-level means over all trajectories (failed ones included) and the rate of invalid actions per step."""
    n = len(trajectories)
    total_steps = sum(t.num_steps for t in trajectories)
    invalid = sum(not s.action_valid for t in trajectories for s in t.steps)
    tool_calls = sum(s.tool_calls for t in trajectories for s in t.steps)
    return {
        "episodes": n,
        "success_rate": sum(t.won for t in trajectories) / n if n else 0.0,
        "mean_return": sum(t.episode_return for t in trajectories) / n if n else 0.0,
        "mean_steps": total_steps / n if n else 0.0,
        "mean_response_tokens": sum(t.response_tokens for t in trajectories) / n if n else 0.0,
        "mean_prompt_tokens": (sum(len(s.prompt_ids) for t in trajectories for s in t.steps) / total_steps
                               if total_steps else 0.0),
        "invalid_action_rate": invalid / total_steps if total_steps else 0.0,
        "tool_calls_per_episode": tool_calls / n if n else 0.0,
        "mean_skill_prompt_tokens": (sum(t.metadata.get("skill_prompt_tokens", 0) for t in trajectories) / n
                                     if n else 0.0),
        "macro_calls_per_episode": sum(t.metadata.get("macro_calls", 0) for t in trajectories) / n if n else 0.0,
        "failed_episodes": sum(t.status == "failed" for t in trajectories),
    }


# --------------------------------------------------------------------------------------------------- helpers
def check_env_kwargs(env_kwargs: EnvKwargs | None) -> dict[str, dict[str, Any]]:
    """``env_kwargs`` as plain dicts, after checking every key is a registered env mapped to a mapping of kwargs."""
    env_kwargs = env_kwargs or {}
    unknown = sorted(str(name) for name, values in env_kwargs.items()
                     if name not in ENVS or not isinstance(values, Mapping))
    if unknown:
        raise ValueError(f"env_kwargs maps env name -> constructor kwargs; {unknown} are not registered envs "
                         f"with a mapping of kwargs (registered: {sorted(ENVS)}); e.g. "
                         f"{{'frozenlake': {{'max_steps': 8}}}}")
    return {name: dict(values) for name, values in env_kwargs.items()}


def _interrupt_env(envs: list[TextEnv], i: int) -> None:
    """The step of ``envs[i]`` timed out: stop it if the env can (``interrupt()``, e.g. the terminal sandbox kills
    its command), so the abandoned worker ends now; envs without one just run on."""
    interrupt = getattr(envs[i], "interrupt", None)
    if callable(interrupt):
        interrupt()


def _start_episode(scenario: Scenario, env_kwargs: dict) -> tuple[TextEnv, str, str, dict]:
    env, obs, info = make_scenario_env(scenario, **env_kwargs)
    return env, env.task_description(), obs, info


def as_slot(value: "SkillSlot | tuple[str, Sequence[str]]") -> SkillSlot:
    """A skill slot's answer as a SkillSlot (a plain ``(text, ids)`` pair has no macros)."""
    if isinstance(value, SkillSlot):
        return value
    text, ids = value
    return SkillSlot(text, tuple(ids))


def _fill_skill_slot(ep: _Episode, skills_for: SkillsFor, turn: int, tokenizer: Any) -> None:
    slot = as_slot(skills_for(SkillQuery(ep.scenario, ep.task, ep.observation, turn, ep.index)))
    if slot.text != ep.skills_text:
        ep.skill_tokens = len(tokenizer.encode(slot.text + "\n", add_special_tokens=False)) if slot.text else 0
    ep.skills_text, ep.skill_ids, ep.macros = slot.text, list(slot.ids), dict(slot.macros)


def _turn_seed(base: int, round_index: int, turn: int) -> int:
    """A 31-bit seed for one turn's generate call, decorrelated across (base, round, turn)."""
    return int(np.random.SeedSequence([int(base), int(round_index), int(turn)]).generate_state(1)[0] & 0x7FFFFFFF)


def _step_record(ep: _Episode, prompt_ids: list[int], gen: Generation, prompt: str, text: str, action: str,
                 reward: float, valid: bool, policy_version: str, context: str, info: dict, process_reward: float,
                 trace: SkillTrace, choices: list[list[int]] | None = None) -> StepRecord:
    """The step as stored: complete when made (its process reward and skill trace included), never changed."""
    tool_call = info.get("tool_call")
    plain_prompt_ids, macro_prompt_ids, macro_action_ids = trace
    return StepRecord(
        trajectory_id=ep.trajectory_id, group_id=ep.group_id, step_index=len(ep.steps), prompt_ids=list(prompt_ids),
        response_ids=list(gen.token_ids), logprobs=list(gen.logprobs), prompt_text=prompt,
        observation=ep.observation, action=action, response_text=text, reward=reward,
        anchor=str(ep.info.get("anchor", "")), policy_version=policy_version, action_valid=valid,
        truncated=gen.finish_reason == "length", skill_ids=list(ep.skill_ids), context_manager=context,
        tool_calls=1 if tool_call else 0, tool_successes=1 if tool_call and info.get("tool_success") else 0,
        process_reward=process_reward, plain_prompt_ids=plain_prompt_ids, macro_prompt_ids=macro_prompt_ids,
        macro_action_ids=macro_action_ids, action_choices=[list(c) for c in choices or []])


def _finish(ep: _Episode, status: str, bar: tqdm, *, error: str | None) -> None:
    ep.status, ep.error, ep.ended_at = status, error, time.monotonic()
    try:
        close_env(ep.env)
    except Exception as err:  # noqa: BLE001  (a failing close must not lose the episode's data)
        ep.error = (ep.error + "; " if ep.error else "") + f"env close failed: {type(err).__name__}: {err}"
    bar.update(1)


def _trajectory_record(ep: _Episode, round_index: int, policy_version: str, started_at: float) -> TrajectoryRecord:
    return TrajectoryRecord(
        trajectory_id=ep.trajectory_id, group_id=ep.group_id, scenario=ep.scenario.to_json(), env=ep.scenario.env,
        split=ep.scenario.split, round=round_index, policy_version=policy_version, status=ep.status or "failed",
        episode_return=float(sum(s.reward for s in ep.steps)), won=bool(ep.info.get("won", False)),
        num_steps=len(ep.steps), response_tokens=sum(len(s.response_ids) for s in ep.steps),
        wall_time_s=max(0.0, ep.ended_at - started_at), error=ep.error,
        metadata={"scenario_id": ep.scenario.scenario_id, "episode_index": ep.index, "skill_ids": ep.skill_ids,
                  "prompt_tokens": sum(len(s.prompt_ids) for s in ep.steps), "turns": len(ep.steps),
                  "skill_prompt_tokens": ep.skill_tokens_total, "macro_calls": ep.macro_calls,
                  "context_manager": ep.steps[0].context_manager if ep.steps else ""},
        steps=ep.steps)
