"""The batched multi-turn rollout loop, expert demonstrations for warm-start SFT, and rollout summaries.

All live episodes advance together: one ``engine.generate`` call per turn over every live episode's prompt, then
every env steps in a thread pool with a per-call timeout. An env that raises or hangs fails only its own episode
(status ``"failed"``, ``error`` says why). The ids in each StepRecord are exactly the ids fed to and sampled by the
engine: responses are decoded for parsing only, never re-tokenized.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from agents.parser import parse_action
from agents.prompts import build_prompt, response_text
from datapool.records import StepRecord, TrajectoryRecord
from envs.base import Scenario, TextEnv, make_scenario_env
from envs.scenarios import expert_trajectory
from models.engine import Engine, Generation, SamplingParams

SkillsFor = Callable[[Scenario], tuple[str, list[str]]]  # scenario -> (skills text for the prompt, skill ids)


@dataclass
class _Episode:
    """Mutable state of one live episode (private to the loop)."""

    scenario: Scenario
    index: int
    group_id: str
    trajectory_id: str
    skills_text: str
    skill_ids: list[str]
    env: TextEnv | None = None
    task: str = ""
    observation: str = ""
    info: dict = field(default_factory=dict)
    history: list[tuple[str, str]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    status: str | None = None      # None while live
    error: str | None = None
    ended_at: float = 0.0


def run_episodes(engine: Engine, tokenizer: Any, scenarios: list[Scenario], *, group_size: int,
                 sampling: SamplingParams, round_index: int = 0, history_turns: int = 0,
                 skills_for: SkillsFor | None = None, env_kwargs: dict | None = None, step_timeout_s: float = 10.0,
                 workers: int = 4, progress: bool = True, seed: int = 0, max_turns: int = 256
                 ) -> list[TrajectoryRecord]:
    """Run ``group_size`` episodes of every scenario with ``engine``; one TrajectoryRecord per episode.

    Records come back in (scenario, episode index) order. ``history_turns`` earlier (observation, action) pairs
    go into each prompt. ``sampling.seed`` (or ``seed`` when it is None) seeds a per-turn seed derived from
    (base seed, round, turn), so a rerun with the same inputs samples the same tokens. ``max_turns`` is a safety
    stop for envs that never truncate: episodes still live then end as ``"truncated"``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if history_turns < 0:
        raise ValueError(f"history_turns must be >= 0, got {history_turns}")
    policy_version = str(engine.policy_version)
    env_kwargs = dict(env_kwargs or {})
    context_manager = "window" if history_turns else "none"
    started_at = time.monotonic()

    episodes: list[_Episode] = []
    for scenario in scenarios:
        skills_text, skill_ids = skills_for(scenario) if skills_for else ("", [])
        group_id = f"{scenario.scenario_id}|r{round_index}|{policy_version}"
        episodes.extend(_Episode(scenario=scenario, index=i, group_id=group_id, trajectory_id=f"{group_id}|{i}",
                                 skills_text=skills_text, skill_ids=list(skill_ids)) for i in range(group_size))

    with tqdm(total=len(episodes), desc=f"rollout r{round_index}", unit="ep", disable=not progress) as bar:
        resets = _call_all([partial(_start_episode, ep.scenario, env_kwargs) for ep in episodes],
                           workers=workers, timeout_s=step_timeout_s)
        for ep, (value, error) in zip(episodes, resets):
            if error is not None:
                _finish(ep, "failed", bar, error=f"env reset failed: {error}")
            else:
                ep.env, ep.task, ep.observation, ep.info = value

        turn = 0
        live = [ep for ep in episodes if ep.status is None]
        while live:
            if turn >= max_turns:
                for ep in live:
                    _finish(ep, "truncated", bar, error=None)
                break
            prompts = [build_prompt(ep.task, ep.observation, ep.history[-history_turns:] if history_turns else (),
                                    ep.skills_text) for ep in live]
            prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
            turn_sampling = dataclasses.replace(sampling, seed=_turn_seed(
                sampling.seed if sampling.seed is not None else seed, round_index, turn))
            generations = engine.generate(prompt_ids, turn_sampling)
            if len(generations) != len(live):
                raise RuntimeError(f"engine returned {len(generations)} generations for {len(live)} prompts: "
                                   f"an Engine must return exactly one Generation per prompt, in order")
            texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
            parsed = [_env_action(text, ep.info) for text, ep in zip(texts, live)]
            outcomes = _call_all([partial(ep.env.step, env_action) for ep, (env_action, _) in zip(live, parsed)],
                                 workers=workers, timeout_s=step_timeout_s)
            for ep, prompt, ids, gen, text, (env_action, action), (value, error) in zip(
                    live, prompts, prompt_ids, generations, texts, parsed, outcomes):
                if error is not None:
                    _finish(ep, "failed", bar, error=f"env step {len(ep.steps)} failed: {error}")
                    continue
                obs, reward, terminated, truncated, info = value
                valid = bool(info.get("action_valid", True)) and action != ""
                ep.steps.append(_step_record(ep, ids, gen, prompt, text, action if valid else "", float(reward),
                                             valid, policy_version, context_manager))
                ep.history.append((ep.observation, action if valid else text.strip()))
                ep.observation, ep.info = obs, info
                if terminated or truncated:
                    _finish(ep, "complete" if terminated else "truncated", bar, error=None)
            live = [ep for ep in live if ep.status is None]
            turn += 1

    return [_trajectory_record(ep, round_index, policy_version, started_at) for ep in episodes]


def expert_demonstrations(tokenizer: Any, scenarios: list[Scenario], *, history_turns: int = 0,
                          skills_for: SkillsFor | None = None, env_kwargs: dict | None = None,
                          require_win: bool = True) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per expert step of every scenario, for warm-start SFT.

    Prompts are built exactly as in ``run_episodes``; response ids are ``" " + action`` followed by eos.
    Raises ValueError for a scenario the env's solver cannot solve (see ``envs.scenarios.expert_trajectory``).
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: set one (e.g. eos_token='<|endoftext|>') so responses "
                         "can end")
    pairs: list[tuple[list[int], list[int]]] = []
    for scenario in scenarios:
        skills_text, _ = skills_for(scenario) if skills_for else ("", [])
        history: list[tuple[str, str]] = []
        for task, obs, action in expert_trajectory(scenario, require_win=require_win, **(env_kwargs or {})):
            shown = history[-history_turns:] if history_turns else ()
            prompt = build_prompt(task, obs, shown, skills_text)
            pairs.append((tokenizer.encode(prompt, add_special_tokens=False),
                          tokenizer.encode(response_text(action), add_special_tokens=False) + [eos]))
            history.append((obs, action))
    return pairs


def summarize(trajectories: Sequence[TrajectoryRecord]) -> dict[str, float]:
    """Episode-level means over all trajectories (failed ones included) and the rate of invalid actions per step."""
    n = len(trajectories)
    total_steps = sum(t.num_steps for t in trajectories)
    invalid = sum(not s.action_valid for t in trajectories for s in t.steps)
    return {
        "episodes": n,
        "success_rate": sum(t.won for t in trajectories) / n if n else 0.0,
        "mean_return": sum(t.episode_return for t in trajectories) / n if n else 0.0,
        "mean_steps": total_steps / n if n else 0.0,
        "mean_response_tokens": sum(t.response_tokens for t in trajectories) / n if n else 0.0,
        "invalid_action_rate": invalid / total_steps if total_steps else 0.0,
        "failed_episodes": sum(t.status == "failed" for t in trajectories),
    }


# --------------------------------------------------------------------------------------------------- helpers
def _start_episode(scenario: Scenario, env_kwargs: dict) -> tuple[TextEnv, str, str, dict]:
    env, obs, info = make_scenario_env(scenario, **env_kwargs)
    return env, env.task_description(), obs, info


def _env_action(text: str, info: dict) -> tuple[str, str]:
    """(what the env is sent, the parsed action or "" when invalid).

    With known admissible actions, the parsed action is sent, or the raw text when none matched (the env then
    judges it invalid and applies its penalty). Without them the env alone judges the stripped text.
    """
    admissible = info.get("admissible_actions")
    if admissible:
        action, valid = parse_action(text, admissible)
        return (action, action) if valid else (text.strip(), "")
    return text.strip(), text.strip()


def _turn_seed(base: int, round_index: int, turn: int) -> int:
    """A 31-bit seed for one turn's generate call, decorrelated across (base, round, turn)."""
    return int(np.random.SeedSequence([int(base), int(round_index), int(turn)]).generate_state(1)[0] & 0x7FFFFFFF)


def _step_record(ep: _Episode, prompt_ids: list[int], gen: Generation, prompt: str, text: str, action: str,
                 reward: float, valid: bool, policy_version: str, context_manager: str) -> StepRecord:
    return StepRecord(
        trajectory_id=ep.trajectory_id, group_id=ep.group_id, step_index=len(ep.steps), prompt_ids=list(prompt_ids),
        response_ids=list(gen.token_ids), logprobs=list(gen.logprobs), prompt_text=prompt,
        observation=ep.observation, action=action, response_text=text, reward=reward,
        anchor=str(ep.info.get("anchor", "")), policy_version=policy_version, action_valid=valid,
        truncated=gen.finish_reason == "length", skill_ids=list(ep.skill_ids), context_manager=context_manager)


def _finish(ep: _Episode, status: str, bar: tqdm, *, error: str | None) -> None:
    ep.status, ep.error, ep.ended_at = status, error, time.monotonic()
    bar.update(1)


def _trajectory_record(ep: _Episode, round_index: int, policy_version: str, started_at: float) -> TrajectoryRecord:
    return TrajectoryRecord(
        trajectory_id=ep.trajectory_id, group_id=ep.group_id, scenario=ep.scenario.to_json(), env=ep.scenario.env,
        split=ep.scenario.split, round=round_index, policy_version=policy_version, status=ep.status or "failed",
        episode_return=float(sum(s.reward for s in ep.steps)), won=bool(ep.info.get("won", False)),
        num_steps=len(ep.steps), response_tokens=sum(len(s.response_ids) for s in ep.steps),
        wall_time_s=max(0.0, ep.ended_at - started_at), error=ep.error,
        metadata={"scenario_id": ep.scenario.scenario_id, "episode_index": ep.index, "skill_ids": ep.skill_ids},
        steps=ep.steps)


def _call_all(calls: list[Callable[[], Any]], *, workers: int, timeout_s: float) -> list[tuple[Any, str | None]]:
    """Run ``calls`` in a thread pool; per call (value, None) or (None, reason) when it raised or ran too long.

    A call's timeout counts from when it starts, not from when it was queued. Python cannot kill a thread: a call
    that times out keeps its worker, so calls that have not started yet move to a fresh pool instead of waiting
    behind it; the old pool is shut down without waiting.
    """
    results: list[tuple[Any, str | None]] = [(None, "not run")] * len(calls)
    timed_out: set[int] = set()
    todo = list(range(len(calls)))
    poll_s = max(0.001, min(timeout_s, 0.05))
    while todo:
        started: dict[int, float] = {}

        def timed(i: int) -> Any:
            started[i] = time.monotonic()
            return calls[i]()

        pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="arlflow-env")
        futures = {pool.submit(timed, i): i for i in todo}
        todo = []
        waiting = set(futures)
        while waiting:
            _, waiting = wait(waiting, timeout=poll_s)
            now = time.monotonic()
            hung = False
            for fut in list(waiting):
                i = futures[fut]
                if i in started and now - started[i] > timeout_s and not fut.done():
                    waiting.discard(fut)
                    results[i] = (None, f"timed out after {timeout_s:g} s")
                    timed_out.add(i)
                    hung = True
            if hung:
                for fut in list(waiting):
                    if fut.cancel():
                        waiting.discard(fut)
                        todo.append(futures[fut])
        for fut, i in futures.items():
            if fut.done() and not fut.cancelled() and i not in timed_out:
                exc = fut.exception()
                results[i] = (None, f"{type(exc).__name__}: {exc}") if exc is not None else (fut.result(), None)
        pool.shutdown(wait=False, cancel_futures=True)
    return results
