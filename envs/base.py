"""Text-environment contract, scenarios and the env registry.

A text env follows Gymnasium's contract with strings:
``reset(*, seed=None, options=None) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``.
``info`` always carries ``anchor`` (hashable canonical state), ``action_valid`` and ``won``;
``admissible_actions`` where the env knows them. Optional keys, with these exact names and meanings:

- ``subgoals_done`` / ``subgoals_total`` (int): progress on the env's subgoals (household, textworld_cooking, ...);
  ``subgoals_done`` never decreases within an episode. Context folding (agents/context.py) checks a closed subgoal
  against it.
- ``tool_call`` (dict | None): the tool call this step's action made, in OpenAI's function-call format
  ``{"type": "function", "function": {"name": ..., "arguments": <JSON string>}}``; None when the action was no tool
  call. ``tool_success`` (bool | None): whether the tool reported success. Tool envs also list their tools as OpenAI
  function schemas in the class attribute ``tools``.

Conventions every env follows: all constructor kwargs have defaults (``make_env(name)`` works), ``max_steps``
truncates, ``verbosity`` (``"short"`` default, ``"full"``) sets how much text an observation carries, unknown
``reset`` options raise ValueError naming the valid ones, and an invalid action never raises (``action_valid``
False, the step still counts). An env whose factory sets ``split_aware = True`` receives the scenario's split as
``options["split"]`` (``"train"`` or ``"heldout"``), so its held-out scenarios can differ in kind (unseen layouts),
not only in seed.

Scenario identity (``scenario_content_key``): two scenarios of one env, under the same constructor kwargs, are *the
same* when an agent could not tell them apart: every action sequence gives the same observations and rewards. By
default that is the task text plus the first observation after ``reset`` (right for fully observed, deterministic
envs such as frozenlake, sokoban, countdown). An env whose first observation hides part of what drives the episode
(a hidden opponent strategy, a hidden goal, cards, file contents, objects in closed receptacles) defines
``scenario_key(self) -> str``, called right after ``reset``, returning that whole hidden content. An env whose reset
is too slow to run for every candidate scenario, and whose content is a pure function of (seed, options, kwargs),
defines ``scenario_key_before_reset(self, *, seed, options) -> str`` instead (called instead of ``reset``).
Randomness the dynamics consume while playing (a slippery lake's slips, a random opponent's coin flips) is noise, not
content: a policy cannot see it before it happens. A key is built from content, never from the scenario's split
label or seed as such (textworld_cooking, whose content cannot be read without generating its game, and tree_search
trees too big to list, document the exception they make).
Pure module: no Prefect, MLflow, DVC or file paths.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


class TextEnv(Protocol):
    """What the rollout loop needs from an environment."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]: ...

    def task_description(self) -> str: ...

    def expert_action(self) -> str | None: ...


@dataclass(frozen=True)
class Scenario:
    """One env instance: frozen, hashable, serializable (one JSON line in a scenario file)."""

    env: str
    seed: int
    split: str
    options: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @property
    def scenario_id(self) -> str:
        return f"{self.env}:{self.split}:{self.seed}"

    def to_json(self) -> str:
        return json.dumps({"env": self.env, "seed": self.seed, "split": self.split, "options": dict(self.options)},
                          sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "Scenario":
        raw = json.loads(line)
        return cls(env=raw["env"], seed=int(raw["seed"]), split=raw["split"],
                   options=tuple(sorted(raw.get("options", {}).items())))


SPLIT_NAMES: tuple[str, ...] = ("train", "heldout")  # envs.scenarios.SPLITS; here so envs need not import it


def check_reset_options(env: str, options: dict | None, valid: Sequence[str]) -> dict:
    """A copy of ``options`` after checking its keys: unknown ones raise ValueError naming the valid ones; a
    ``split`` (when valid) must be one of SPLIT_NAMES."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{env}: unknown reset options {unknown}; valid options: {list(valid)}")
    if "split" in options and options["split"] not in SPLIT_NAMES:
        raise ValueError(f"{env}: unknown split {options['split']!r}; valid splits: {list(SPLIT_NAMES)}")
    return options


EnvFactory = Callable[..., TextEnv]
ENVS: dict[str, EnvFactory] = {}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: register an env factory under ``name`` (duplicates are an error)."""

    def wrap(factory: EnvFactory) -> EnvFactory:
        if name in ENVS:
            raise ValueError(f"env {name!r} is already registered; registered envs: {sorted(ENVS)}")
        ENVS[name] = factory
        return factory

    return wrap


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Instantiate a registered env; an unknown name lists the valid ones."""
    if name not in ENVS:
        raise KeyError(f"unknown env {name!r}; registered envs: {sorted(ENVS)}")
    return ENVS[name](**kwargs)


def close_env(env: Any) -> None:
    """Release an env's resources (temp dirs, game interpreters) if it has a ``close()``; a no-op otherwise."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def make_scenario_env(scenario: Scenario, **env_kwargs: Any) -> tuple[TextEnv, str, dict]:
    """Build the env of a scenario and reset it on the scenario's seed: (env, first observation, info)."""
    env = make_env(scenario.env, **env_kwargs)
    obs, info = env.reset(seed=scenario.seed, options=dict(scenario.options))
    return env, obs, info


def observation_key(env: TextEnv, observation: str) -> str:
    """The default content key: the task text and the first observation (see "Scenario identity" above)."""
    return f"{env.task_description()}\n{observation}"


def scenario_content_key(env: TextEnv, scenario: Scenario) -> str:
    """The content key of ``scenario`` on ``env`` (an instance of ``scenario.env``, built with the kwargs the
    scenario is played with): the env's ``scenario_key_before_reset``, else ``reset`` then the env's
    ``scenario_key``, else ``observation_key``. Equal keys mean the same scenario (module docstring)."""
    before_reset = getattr(env, "scenario_key_before_reset", None)
    if callable(before_reset):
        return str(before_reset(seed=scenario.seed, options=dict(scenario.options)))
    observation, _ = env.reset(seed=scenario.seed, options=dict(scenario.options))
    custom = getattr(env, "scenario_key", None)
    return str(custom()) if callable(custom) else observation_key(env, observation)


def scenario_content_keys(scenarios: Sequence[Scenario], **env_kwargs: Any) -> list[str]:
    """``scenario_content_key`` of every scenario (all of one env), on one env instance that is closed after."""
    names = sorted({s.env for s in scenarios})
    if len(names) > 1:
        raise ValueError(f"scenario_content_keys takes scenarios of one env, got {names}: call it once per env")
    if not names:
        return []
    env = make_env(names[0], **env_kwargs)
    try:
        return [scenario_content_key(env, scenario) for scenario in scenarios]
    finally:
        close_env(env)
