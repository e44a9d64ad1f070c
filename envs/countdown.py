"""Countdown numbers game as a text env: combine numbers step by step to reach a target, with an exhaustive expert.

Observation (``verbosity="short"``)::

    target 36
    numbers 2 5 7 13

``"full"`` adds a line with the last move (``last 13 - 7 = 6``) and the moves left.

An action combines two of the remaining numbers: ``"a op b"`` with ``op`` one of ``+ - * /``, e.g. ``"13 - 7"``.
Both numbers are replaced by the result. Every result must be a positive integer: ``a - b`` needs ``a > b``, and
``a / b`` needs ``b`` to divide ``a``. ``admissible_actions`` lists every legal move once (``+`` and ``*`` with the
larger number first), sorted by (first number, second number, op); ``"5 + 13"`` is accepted as ``"13 + 5"``.
A malformed, illegal or unavailable move is an invalid action: nothing changes, reward ``-invalid_penalty``, the step
still counts towards ``max_steps``.

Rewards and ends: 1.0 when the target appears among the remaining numbers (terminates, ``won``); the episode also
terminates, lost, when a single number is left. ``info["reachable"]`` says whether the target can still be reached.
Anchor: target and the sorted remaining numbers, so the same multiset reached by different orders groups together.

Generation (per seed, deterministic): ``num_numbers`` numbers drawn uniformly from ``1..max_number``, then random
legal moves (``num_numbers - 2`` or ``num_numbers - 1`` of them, at least one); the last result is the target. A
target that is one of the starting numbers, above ``MAX_TARGET``, or (with 3+ numbers) reachable in a single move is
dropped for the next internal attempt (seeded ``[seed, attempt]``); the solver then confirms the target is reachable.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import re

import numpy as np

from envs.base import check_reset_options, register_env

OPS: tuple[str, ...] = ("+", "-", "*", "/")
RESET_OPTIONS: tuple[str, ...] = ("num_numbers", "numbers", "target")  # what reset(options=...) may override
VERBOSITIES: tuple[str, ...] = ("short", "full")
MAX_TARGET = 999
MAX_NUMBERS = 6  # the exhaustive solver stays fast up to here
MAX_ATTEMPTS = 1000
_MOVE_RE = re.compile(r"^\s*(\d+)\s*([-+*/])\s*(\d+)\s*$")

Move = tuple[int, str, int]  # (a, op, b) in canonical order


def apply_op(a: int, op: str, b: int) -> int | None:
    """The result of ``a op b``, or None when it is not a positive integer (or ``op`` is unknown)."""
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    if op == "-":
        return a - b if a > b else None
    if op == "/":
        return a // b if b > 0 and a % b == 0 else None
    return None


def legal_moves(numbers: tuple[int, ...]) -> list[Move]:
    """Every legal move on ``numbers`` once (commutative ops larger-first), sorted by (a, b, op index)."""
    moves = set()
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            a, b = max(numbers[i], numbers[j]), min(numbers[i], numbers[j])
            for op in OPS:
                if apply_op(a, op, b) is not None:
                    moves.add((a, op, b))
    return sorted(moves, key=lambda m: (m[0], m[2], OPS.index(m[1])))


def format_move(move: Move) -> str:
    return f"{move[0]} {move[1]} {move[2]}"


def parse_move(text: str, numbers: tuple[int, ...]) -> Move | None:
    """The canonical legal move ``text`` names on ``numbers``, or None (malformed, illegal, or numbers not there)."""
    match = _MOVE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    if op in "+*":
        a, b = max(a, b), min(a, b)
    if apply_op(a, op, b) is None:
        return None
    remaining = list(numbers)
    for n in (a, b):
        if n not in remaining:
            return None
        remaining.remove(n)
    return a, op, b


def combine(numbers: tuple[int, ...], move: Move) -> tuple[int, ...]:
    """``numbers`` (sorted) with the move's two operands replaced by its result."""
    remaining = list(numbers)
    remaining.remove(move[0])
    remaining.remove(move[2])
    remaining.append(apply_op(*move))
    return tuple(sorted(remaining))


class CountdownSolver:
    """Exhaustive DFS with a memo over sorted number multisets, for one target.

    ``plan(numbers)`` is a shortest move list reaching the target (ties: the first in ``legal_moves`` order), or
    None when unreachable.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self._memo: dict[tuple[int, ...], list[Move] | None] = {}

    def plan(self, numbers: tuple[int, ...]) -> list[Move] | None:
        numbers = tuple(sorted(numbers))
        if self.target in numbers:
            return []
        if len(numbers) == 1:
            return None
        if numbers not in self._memo:
            best = None
            for move in legal_moves(numbers):
                rest = self.plan(combine(numbers, move))
                if rest is not None and (best is None or len(rest) + 1 < len(best)):
                    best = [move] + rest
                    if len(best) == 1:
                        break
            self._memo[numbers] = best
        return self._memo[numbers]


def generate_instance(seed: int, num_numbers: int, max_number: int) -> tuple[tuple[int, ...], int]:
    """(sorted numbers, target) with the target reachable; deterministic in its arguments (module docstring)."""
    for attempt in range(MAX_ATTEMPTS):
        rng = np.random.default_rng([seed, attempt])
        start = tuple(sorted(int(x) for x in rng.integers(1, max_number + 1, size=num_numbers)))
        numbers = start
        n_moves = int(rng.integers(max(1, num_numbers - 2), num_numbers))  # [1, n-1] moves, mostly the longer ones
        for _ in range(n_moves):
            moves = legal_moves(numbers)
            move = moves[int(rng.integers(len(moves)))]
            numbers = combine(numbers, move)
            target = apply_op(*move)
        if target in start or target > MAX_TARGET:
            continue
        plan = CountdownSolver(target).plan(start)
        if plan is None or (num_numbers >= 3 and len(plan) < 2):
            continue
        return start, target
    raise ValueError(f"countdown: no instance after {MAX_ATTEMPTS} attempts for seed {seed} "
                     f"(num_numbers={num_numbers}, max_number={max_number}): raise max_number")


@register_env("countdown")
class CountdownText:
    """The Countdown numbers game behind the text-env contract (see envs/base.py and the module docstring)."""

    def __init__(self, num_numbers: int = 4, max_number: int = 25, max_steps: int = 6, invalid_penalty: float = 0.0,
                 verbosity: str = "short") -> None:
        if max_steps < 1:
            raise ValueError(f"countdown: max_steps must be >= 1, got {max_steps}")
        if max_number < 2:
            raise ValueError(f"countdown: max_number must be >= 2, got {max_number}")
        if verbosity not in VERBOSITIES:
            raise ValueError(f"countdown: unknown verbosity {verbosity!r}; valid: {list(VERBOSITIES)}")
        _check_num_numbers(num_numbers)
        self.num_numbers, self.max_number, self.max_steps = int(num_numbers), int(max_number), int(max_steps)
        self.invalid_penalty = float(invalid_penalty)
        self.verbosity = verbosity
        self._numbers: tuple[int, ...] = ()
        self._target = 0
        self._solver: CountdownSolver | None = None
        self._last = ""
        self._steps = 0
        self._done = True
        self._won = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("countdown", options, RESET_OPTIONS)
        if ("numbers" in options) != ("target" in options):
            raise ValueError("countdown: reset options 'numbers' and 'target' go together; pass both or neither")
        if "numbers" in options:
            numbers, target = tuple(sorted(int(n) for n in options["numbers"])), int(options["target"])
            _check_num_numbers(len(numbers))
            if min(numbers) < 1 or target < 1 or target in numbers:
                raise ValueError(f"countdown: numbers and target must be positive and the target not among the "
                                 f"numbers, got numbers={list(numbers)}, target={target}")
        else:
            num_numbers = int(options.get("num_numbers", self.num_numbers))
            _check_num_numbers(num_numbers)
            if seed is None:
                seed = int(np.random.SeedSequence().entropy % 2**63)
            numbers, target = generate_instance(seed, num_numbers, self.max_number)
        self._numbers, self._target = numbers, target
        self._solver = CountdownSolver(target)
        self._last = ""
        self._steps = 0
        self._done = self._won = False
        return self._observation(), self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._solver is None:
            raise RuntimeError("countdown: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("countdown: the episode is over; call reset() before stepping again")
        self._steps += 1
        move = parse_move(action, self._numbers)
        terminated = False
        if move is not None:
            self._numbers = combine(self._numbers, move)
            self._last = f"{format_move(move)} = {apply_op(*move)}"
            self._won = self._target in self._numbers
            reward = 1.0 if self._won else 0.0
            terminated = self._won or len(self._numbers) == 1
        else:
            reward = 0.0 - self.invalid_penalty
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._observation(), reward, terminated, truncated, self._info(action_valid=move is not None)

    def task_description(self) -> str:
        return ("Reach the target number. Each move combines two of the numbers, written like '13 - 7' "
                "(ops + - * /), and replaces them with the result; results must be positive whole numbers.")

    def expert_action(self) -> str | None:
        """First move of a shortest plan from the current numbers; None if the target is unreachable or done."""
        if self._solver is None or self._done:
            return None
        plan = self._solver.plan(self._numbers)
        return format_move(plan[0]) if plan else None

    # ----------------------------------------------------------------------------------------- helpers
    def _observation(self) -> str:
        text = f"target {self._target}\nnumbers " + " ".join(str(n) for n in self._numbers)
        if self.verbosity == "short":
            return text
        return f"{text}\nlast {self._last or '-'}, moves left {self.max_steps - self._steps}"

    def _info(self, *, action_valid: bool) -> dict:
        return {
            "anchor": f"{self._target}:" + ",".join(str(n) for n in self._numbers),
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": [format_move(m) for m in legal_moves(self._numbers)],
            "numbers": list(self._numbers),
            "target": self._target,
            "steps": self._steps,
            "reachable": self._solver.plan(self._numbers) is not None,
        }


def _check_num_numbers(num_numbers: int) -> None:
    if not 2 <= num_numbers <= MAX_NUMBERS:
        raise ValueError(f"countdown: num_numbers must be in [2, {MAX_NUMBERS}], got {num_numbers}")
