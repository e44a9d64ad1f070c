"""Multi-round rock-paper-scissors against a scripted opponent whose strategy is hidden: memory matters.

Each seed draws one opponent strategy from ``STRATEGIES`` (kwarg or reset option ``opponent`` fixes it) and its
seeded details (opening move, pattern, favourite move). Every opponent move is a function of the seed and the
agent's earlier moves only, so it is fixed before the agent moves (no peeking at the current move):

- ``cycle``: opening move, then steps through rock, paper, scissors (``step`` +1) or backwards (``step`` -1).
- ``copy``: plays the agent's move of ``lag`` rounds ago (the opening move while there is none).
- ``beat_last``: plays what beats the agent's move of ``lag`` rounds ago (the opening move while there is none).
- ``biased``: plays its favourite move with probability ``p``, else one of the two others; the whole sequence is
  drawn from the seed at reset.
- ``counter_frequent``: plays what beats the agent's most frequent move so far (in the last ``window`` rounds
  when ``window`` > 0; ties go to the first in rock, paper, scissors order; the opening move before any history).
- ``pattern``: repeats a seeded sequence of ``length`` moves (at least two distinct moves).

Splits (``split_aware``): both splits draw from all six strategies, but their parameters differ, so held-out
opponents are unseen variants, not just unseen seeds (``SPLIT_PARAMS``): train has cycle +1, lag 1, p 0.8,
window all, pattern length 3; heldout has cycle -1, lag 2, p 0.6, window 3, pattern length 4.

Observation (short)::

    round 3/9
    last: you rock, opp paper (loss)
    score: you 1, opp 1

``"full"`` verbosity adds the whole move history (``history: rp ss``, agent's letter first). Reward per round:
+1 win, 0 tie, -1 loss, scaled by ``1 / rounds`` so a match's return lies in [-1, 1]. ``won`` becomes True when
all rounds are played with more rounds won than lost (a truncated match is not won). An invalid action plays no
round, gives ``-invalid_penalty`` and counts towards ``max_steps`` (default ``2 * rounds``).

Anchor: the agent's observable history, ``<rounds>:<pairs>`` with one letter pair (agent, opponent) per round
played, e.g. ``9:rp.ss``. It is the information state: it never names the hidden strategy, and, for a fixed
scenario, it pins down the whole state (every opponent depends on the full history, e.g. ``counter_frequent``), so
a last-k window would merge states whose futures differ.
Expert: knows the strategy and plays the move that beats the opponent's next move: it wins every round.
Scenario key (``scenario_key``): the opponent's behaviour, not its label: an opponent that ignores the agent
(cycle, pattern, biased; copy/beat_last with ``lag`` >= rounds) is its move sequence over the match, so a held-out
``cycle`` -1 from rock is the same scenario as a train ``pattern`` rock, scissors, paper; a reactive one is its
strategy, parameters and opening move.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import check_reset_options, register_env

MOVES: tuple[str, ...] = ("rock", "paper", "scissors")  # MOVES[(m + 1) % 3] beats MOVES[m]
STRATEGIES: tuple[str, ...] = ("cycle", "copy", "beat_last", "biased", "counter_frequent", "pattern")
RESET_OPTIONS: tuple[str, ...] = ("split", "opponent", "rounds")
SPLIT_PARAMS: dict[str, dict[str, Any]] = {
    "train": {"step": 1, "lag": 1, "p": 0.8, "window": 0, "length": 3},
    "heldout": {"step": -1, "lag": 2, "p": 0.6, "window": 3, "length": 4},
}


def beats(move: int) -> int:
    """Index of the move that beats ``move``."""
    return (move + 1) % 3


def outcome(agent: int, opp: int) -> int:
    """+1 if the agent's move wins, 0 on a tie, -1 if it loses."""
    return 0 if agent == opp else (1 if agent == beats(opp) else -1)


@dataclass(frozen=True)
class Opponent:
    """One scripted opponent: its strategy and the seeded details it needs (see the module docstring)."""

    strategy: str
    opening: int
    step: int = 1
    lag: int = 1
    window: int = 0
    sequence: tuple[int, ...] = ()  # pattern (repeated) or biased (one move per round)

    def move(self, agent_history: list[int], round_index: int) -> int:
        """The opponent's move in round ``round_index`` (0-based) given the agent's earlier moves."""
        if self.strategy == "cycle":
            return (self.opening + self.step * round_index) % 3
        if self.strategy in ("pattern", "biased"):
            return self.sequence[round_index % len(self.sequence)]
        if self.strategy in ("copy", "beat_last"):
            if len(agent_history) < self.lag:
                return self.opening
            seen = agent_history[-self.lag]
            return seen if self.strategy == "copy" else beats(seen)
        if self.strategy == "counter_frequent":
            recent = agent_history[-self.window:] if self.window else agent_history
            if not recent:
                return self.opening
            counts = [recent.count(m) for m in range(3)]
            return beats(counts.index(max(counts)))
        raise ValueError(f"rps: unknown strategy {self.strategy!r}; valid strategies: {list(STRATEGIES)}")


def draw_opponent(seed: int | None, split: str, rounds: int, strategy: str | None = None) -> Opponent:
    """The seed's opponent for ``split``. Draws happen in a fixed order whatever ``strategy`` fixes, so fixing the
    strategy a seed would draw anyway gives the very same opponent."""
    rng = np.random.default_rng(seed)
    params = SPLIT_PARAMS[split]
    drawn = STRATEGIES[int(rng.integers(len(STRATEGIES)))]
    opening = int(rng.integers(3))
    pattern = [int(m) for m in rng.integers(3, size=params["length"])]
    if len(set(pattern)) == 1:  # a constant pattern is just "biased" with p = 1: make it change once
        pattern[-1] = (pattern[-1] + 1 + int(rng.integers(2))) % 3
    favourite = int(rng.integers(3))
    others = rng.integers(1, 3, size=rounds)  # [rounds] offset of the non-favourite move
    biased = np.where(rng.random(rounds) < params["p"], favourite, (favourite + others) % 3)  # [rounds]
    strategy = strategy or drawn
    sequence = tuple(pattern) if strategy == "pattern" else tuple(int(m) for m in biased)
    return Opponent(strategy=strategy, opening=opening, step=params["step"], lag=params["lag"],
                    window=params["window"], sequence=sequence if strategy in ("pattern", "biased") else ())


@register_env("rps")
class RockPaperScissorsText:
    """Rock-paper-scissors over ``rounds`` rounds against a hidden scripted opponent (see envs/base.py)."""

    split_aware = True

    def __init__(self, opponent: str | None = None, rounds: int = 9, max_steps: int | None = None,
                 verbosity: str = "short", invalid_penalty: float = 0.0) -> None:
        self.opponent_name = _check_strategy(opponent)
        self.rounds = _check_rounds(rounds)
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"rps: max_steps must be >= 1 (or None for 2 * rounds), got {max_steps}")
        if verbosity not in ("short", "full"):
            raise ValueError(f"rps: verbosity must be 'short' or 'full', got {verbosity!r}")
        self._max_steps_arg = max_steps
        self.max_steps = int(max_steps) if max_steps is not None else 2 * self.rounds
        self.verbosity = verbosity
        self.invalid_penalty = float(invalid_penalty)
        self.opponent: Opponent | None = None  # hidden from observations; the expert reads it
        self._match_rounds = self.rounds
        self._agent: list[int] = []
        self._opp: list[int] = []
        self._steps = 0
        self._done = True
        self._won = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("rps", options, RESET_OPTIONS)
        split = options.get("split", "train")
        strategy = _check_strategy(options.get("opponent", self.opponent_name))
        self._match_rounds = _check_rounds(options.get("rounds", self.rounds))
        if self._max_steps_arg is None:
            self.max_steps = 2 * self._match_rounds
        self.opponent = draw_opponent(seed, split, self._match_rounds, strategy)
        self._agent, self._opp = [], []
        self._steps, self._done, self._won = 0, False, False
        return self._observation(), self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.opponent is None:
            raise RuntimeError("rps: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("rps: the match is over; call reset() before stepping again")
        word = action.strip().lower() if isinstance(action, str) else ""
        self._steps += 1
        valid = word in MOVES
        reward = 0.0 - self.invalid_penalty
        if valid:
            mine = MOVES.index(word)
            theirs = self.opponent.move(self._agent, len(self._agent))
            self._agent.append(mine)
            self._opp.append(theirs)
            reward = outcome(mine, theirs) / self._match_rounds
        terminated = len(self._agent) >= self._match_rounds
        if terminated:
            self._won = self._score()[0] > self._score()[1]
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._observation(), reward, terminated, truncated, self._info(action_valid=valid)

    def task_description(self) -> str:
        return (f"Rock-paper-scissors, {self._match_rounds} rounds against an opponent with a hidden strategy: "
                f"win more rounds than you lose. Moves: {', '.join(MOVES)}.")

    def expert_action(self) -> str | None:
        """The move that beats the opponent's next move (the expert knows the hidden strategy); None when done."""
        if self.opponent is None or self._done:
            return None
        return MOVES[beats(self.opponent.move(self._agent, len(self._agent)))]

    def scenario_key(self) -> str:
        """The match's opponent behaviour (module docstring), read right after ``reset``."""
        if self.opponent is None:
            raise RuntimeError("rps: scenario_key() before reset(); call reset(seed=...) first")
        opp, rounds = self.opponent, self._match_rounds
        if opp.strategy in ("cycle", "pattern", "biased") or (opp.strategy in ("copy", "beat_last")
                                                             and opp.lag >= rounds):
            return f"{rounds}:fixed:" + "".join(MOVES[opp.move([], r)][0] for r in range(rounds))
        if opp.strategy in ("copy", "beat_last"):
            detail = f"lag {opp.lag}"
        else:  # counter_frequent: a window as long as the history it can see is the whole history
            detail = f"window {opp.window if 0 < opp.window < rounds - 1 else 0}"
        return f"{rounds}:{opp.strategy}:{detail}:opening {MOVES[opp.opening]}"

    # ----------------------------------------------------------------------------------------- helpers
    def _score(self) -> tuple[int, int]:
        results = [outcome(a, o) for a, o in zip(self._agent, self._opp)]
        return results.count(1), results.count(-1)

    def _observation(self) -> str:
        mine, theirs = self._score()
        played = len(self._agent)
        if played >= self._match_rounds:
            verdict = "won" if mine > theirs else ("lost" if mine < theirs else "tied")
            head = f"match over: you {verdict}"
        else:
            head = f"round {played + 1}/{self._match_rounds}"
        if played:
            result = {1: "win", 0: "tie", -1: "loss"}[outcome(self._agent[-1], self._opp[-1])]
            last = f"last: you {MOVES[self._agent[-1]]}, opp {MOVES[self._opp[-1]]} ({result})"
        else:
            last = "last: -"
        lines = [head, last, f"score: you {mine}, opp {theirs}"]
        if self.verbosity == "full":
            lines.append(f"history: {self._history(' ') or '-'}")
        return "\n".join(lines)

    def _history(self, sep: str) -> str:
        return sep.join(MOVES[a][0] + MOVES[o][0] for a, o in zip(self._agent, self._opp))

    def _info(self, *, action_valid: bool) -> dict:
        mine, theirs = self._score()
        return {
            "anchor": f"{self._match_rounds}:{self._history('.')}",
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": list(MOVES),
            "round": len(self._agent),
            "score": (mine, theirs),
            "steps": self._steps,
        }


def _check_strategy(strategy: Any) -> str | None:
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"rps: unknown opponent {strategy!r}; valid opponents: {list(STRATEGIES)} "
                         f"(or None to draw one per seed)")
    return strategy


def _check_rounds(rounds: Any) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ValueError(f"rps: rounds must be an int >= 1, got {rounds!r}")
    return int(rounds)
