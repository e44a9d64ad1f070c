"""``faulty``: another registered env whose resets and steps raise or hang in a seeded fraction of calls.

The fault suite (tests/faults) runs the pipeline on it to check that a failing env fails only its own episode.
Configured through env kwargs (params.yaml ``env.kwargs.faulty``)::

    faulty: {inner: frozenlake, inner_kwargs: {max_steps: 6}, raise_rate: 0.05, hang_rate: 0.05, hang_s: 2.0,
             fault_seed: 0}

Every ``reset`` and ``step`` first draws u in [0, 1) from a hash of (fault_seed, the scenario's seed, the call, and
for a step its number and the action text): ``u < raise_rate`` raises ``InjectedFault``; ``u < raise_rate +
hang_rate`` sleeps ``hang_s`` seconds (a hang for any caller whose timeout is shorter: Python cannot interrupt it),
then carries on as the inner env; otherwise the call is the inner env's, unchanged. So the same scenario played with
the same actions faults at the same calls in every run and process, while the episodes of one group (one scenario,
different sampled actions) fault at different steps; a reset fault depends on the scenario only, so it fails the
whole group. With both rates 0 (the defaults) the env is the inner env exactly and follows the env contract.

Never faulting: ``task_description``, ``expert_action``, ``close`` and the content key (``scenario_key_before_reset``
computes the inner env's key on a fresh inner env), so bootstrap's unseen held-out check is not affected.
Stages that play envs outside the rollout loop (bootstrap's tokenizer corpus, warm start's expert demonstrations,
evaluate's baselines) do see the faults. The prompt template is the default one (templates are keyed by env name).
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Mapping

from envs.base import ENVS, Scenario, close_env, make_env, register_env, scenario_content_key

NAME = "faulty"


class InjectedFault(RuntimeError):
    """The error a ``faulty`` env raises on purpose."""


def fault_draw(fault_seed: int, scenario_seed: int | None, call: str) -> float:
    """A uniform number in [0, 1) that depends only on its arguments (sha256: the same in every process)."""
    digest = hashlib.sha256(f"{fault_seed}|{scenario_seed}|{call}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@register_env(NAME)
class FaultyEnv:
    """``inner`` (a registered env, built with ``inner_kwargs``; ``max_steps`` and ``verbosity``, when given, are
    passed on to it) behind calls that raise with probability ``raise_rate`` and hang ``hang_s`` seconds with
    probability ``hang_rate`` (module docstring)."""

    def __init__(self, inner: str = "frozenlake", inner_kwargs: Mapping[str, Any] | None = None,
                 raise_rate: float = 0.0, hang_rate: float = 0.0, hang_s: float = 2.0, fault_seed: int = 0,
                 max_steps: int | None = None, verbosity: str | None = None) -> None:
        if inner == NAME or inner not in ENVS:
            raise ValueError(f"faulty: inner must be another registered env, got {inner!r}; registered: "
                             f"{sorted(n for n in ENVS if n != NAME)}")
        if not (0.0 <= raise_rate <= 1.0 and 0.0 <= hang_rate <= 1.0 and raise_rate + hang_rate <= 1.0):
            raise ValueError(f"faulty: raise_rate and hang_rate must be in [0, 1] with a sum <= 1, got {raise_rate} "
                             f"and {hang_rate}")
        if hang_s < 0:
            raise ValueError(f"faulty: hang_s must be >= 0, got {hang_s}")
        self.inner_name, self.inner_kwargs = inner, dict(inner_kwargs or {})
        # the env conventions' own kwargs (envs/base.py), given to the inner env
        self.inner_kwargs.update({k: v for k, v in (("max_steps", max_steps), ("verbosity", verbosity))
                                  if v is not None})
        self.raise_rate, self.hang_rate, self.hang_s = float(raise_rate), float(hang_rate), float(hang_s)
        self.fault_seed = int(fault_seed)
        self.inner = make_env(inner, **self.inner_kwargs)
        self._seed: int | None = None
        self._steps = 0

    def _maybe_fault(self, call: str) -> None:
        u = fault_draw(self.fault_seed, self._seed, call)
        if u < self.raise_rate:
            raise InjectedFault(f"faulty: injected error in {call} (scenario seed {self._seed}, fault_seed "
                                f"{self.fault_seed}, draw {u:.4f} < raise_rate {self.raise_rate:g})")
        if u < self.raise_rate + self.hang_rate:
            time.sleep(self.hang_s)

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self._seed, self._steps = seed, 0
        self._maybe_fault("reset")
        return self.inner.reset(seed=seed, options=options)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self._steps += 1
        self._maybe_fault(f"step {self._steps}: {action!r}")
        return self.inner.step(action)

    def task_description(self) -> str:
        return self.inner.task_description()

    def expert_action(self) -> str | None:
        return self.inner.expert_action()

    def scenario_key_before_reset(self, *, seed: int, options: dict | None = None) -> str:
        """The inner env's content key of this scenario, on a fresh inner env (never faults)."""
        env = make_env(self.inner_name, **self.inner_kwargs)
        try:
            return scenario_content_key(env, Scenario(env=self.inner_name, seed=seed, split="train",
                                                      options=tuple(sorted((options or {}).items()))))
        finally:
            close_env(env)

    def close(self) -> None:
        close_env(self.inner)
