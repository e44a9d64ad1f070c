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
