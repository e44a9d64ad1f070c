"""FrozenLake as a text env: gymnasium's real ``FrozenLake-v1`` on a random map per seed, seen as a text grid.

Observation: one grid row per line, cells separated by single spaces, the agent's cell shown as ``P``::

    P F F F
    F H F H
    F F F H
    H F F G

Actions are the words ``left, down, right, up`` (gymnasium's actions 0..3). Anything else is an invalid action:
no move, reward ``-invalid_penalty``, the step still counts towards ``max_steps``.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

import gymnasium
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from envs.base import check_reset_options, register_env

ACTIONS: tuple[str, ...] = ("left", "down", "right", "up")  # index == gymnasium FrozenLake action id
_MOVES: dict[str, tuple[int, int]] = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
RESET_OPTIONS: tuple[str, ...] = ("size", "p_frozen")  # what reset(options=...) may override
VERBOSITIES: tuple[str, ...] = ("short", "full")  # full adds a legend and the steps left under the grid


def _sizes(size: int | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """``size`` as a tuple of grid sizes: one int, or a list a scenario's seed picks from (``seed % len``)."""
    sizes = tuple(size) if isinstance(size, (list, tuple)) else (size,)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in sizes):
        raise ValueError(f"frozenlake: size must be >= 2: an int, or a non-empty list of ints, got {size!r}")
    return sizes


def map_id(desc: list[str]) -> str:
    """Short stable hash of a map (8 hex chars of sha1 over its rows): same map, same id, across processes."""
    return hashlib.sha1("\n".join(desc).encode("ascii")).hexdigest()[:8]


def render_grid(desc: list[str], row: int, col: int) -> str:
    """Text grid of ``desc`` with the agent's cell shown as ``P``."""
    lines = []
    for r, cells in enumerate(desc):
        shown = ["P" if (r, c) == (row, col) else cell for c, cell in enumerate(cells)]
        lines.append(" ".join(shown))
    return "\n".join(lines)


def shortest_path_actions(desc: list[str], row: int, col: int) -> list[str] | None:
    """Actions of a shortest path from (row, col) to G that never enters H; None if G is unreachable.

    BFS backwards from G gives every cell's distance to G; the path then takes, at each cell, the first action in
    ``ACTIONS`` order that lowers the distance by one, so ties always break the same way. Moves into the grid edge
    are not moves (as in gymnasium), so they never lower the distance.
    """
    size_r, size_c = len(desc), len(desc[0])
    goal = next((r, c) for r in range(size_r) for c in range(size_c) if desc[r][c] == "G")
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _MOVES.values():
            nr, nc = r - dr, c - dc  # predecessor that reaches (r, c) by that move
            if 0 <= nr < size_r and 0 <= nc < size_c and (nr, nc) not in dist and desc[nr][nc] != "H":
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    if (row, col) not in dist or desc[row][col] == "H":
        return None
    path = []
    while (row, col) != goal:
        for action in ACTIONS:
            dr, dc = _MOVES[action]
            nxt = (row + dr, col + dc)
            if dist.get(nxt, -1) == dist[(row, col)] - 1:
                path.append(action)
                row, col = nxt
                break
    return path


@register_env("frozenlake")
class FrozenLakeText:
    """FrozenLake-v1 behind the text-env contract (see envs/base.py).

    Rewards: 1.0 on reaching G, 0.0 otherwise, ``-invalid_penalty`` for an invalid action. A hole or the goal
    terminates; ``max_steps`` steps (valid or not) truncate. ``size`` is one grid size, or a list of them: a
    scenario then plays ``size[seed % len(size)]`` (a mix of map sizes in one env; ``reset(options={"size": n})``
    still overrides it).
    """

    def __init__(self, size: int | list[int] = 4, p_frozen: float = 0.8, is_slippery: bool = False, max_steps: int = 12,
                 invalid_penalty: float = 0.0, verbosity: str = "short") -> None:
        if max_steps < 1:
            raise ValueError(f"frozenlake: max_steps must be >= 1, got {max_steps}")
        if verbosity not in VERBOSITIES:
            raise ValueError(f"frozenlake: verbosity must be one of {list(VERBOSITIES)}, got {verbosity!r}")
        self.verbosity = verbosity
        self.sizes = _sizes(size)
        if not 0.0 < float(p_frozen) <= 1.0:
            raise ValueError(f"frozenlake: p_frozen must be in (0, 1], got {p_frozen}")
        self.p_frozen = float(p_frozen)
        self.is_slippery = bool(is_slippery)
        self.max_steps = int(max_steps)
        self.invalid_penalty = float(invalid_penalty)
        self._gym: Any = None
        self._desc: list[str] = []
        self._map_id = ""
        self._row = self._col = 0
        self._steps = 0
        self._done = True
        self._won = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("frozenlake", options, RESET_OPTIONS)
        size = int(options.get("size", self.sizes[(seed or 0) % len(self.sizes)]))
        p_frozen = float(options.get("p_frozen", self.p_frozen))
        if size < 2:
            raise ValueError(f"frozenlake: size must be >= 2, got {size}")
        if not 0.0 < p_frozen <= 1.0:
            raise ValueError(f"frozenlake: p_frozen must be in (0, 1], got {p_frozen}")
        self._desc = generate_random_map(size=size, p=p_frozen, seed=seed)
        self._map_id = map_id(self._desc)
        # gymnasium's TimeLimit never fires first: our own step counter also counts invalid actions.
        self._gym = gymnasium.make("FrozenLake-v1", desc=self._desc, is_slippery=self.is_slippery,
                                   max_episode_steps=self.max_steps + 1)
        state, _ = self._gym.reset(seed=seed)
        self._row, self._col = divmod(int(state), size)
        self._steps = 0
        self._done = False
        self._won = False
        return self._observation(), self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._gym is None:
            raise RuntimeError("frozenlake: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("frozenlake: the episode is over; call reset() before stepping again")
        word = action.strip().lower() if isinstance(action, str) else ""
        self._steps += 1
        terminated = False
        if word in ACTIONS:
            state, reward, terminated, _, _ = self._gym.step(ACTIONS.index(word))
            self._row, self._col = divmod(int(state), len(self._desc[0]))
            reward = float(reward)
            self._won = self._desc[self._row][self._col] == "G"
            valid = True
        else:
            reward = 0.0 - self.invalid_penalty
            valid = False
        terminated = bool(terminated)
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._observation(), reward, terminated, truncated, self._info(action_valid=valid)

    def task_description(self) -> str:
        return "Reach G without stepping on H. Moves: " + ", ".join(ACTIONS) + "."

    def expert_action(self) -> str | None:
        """Next action of a shortest hole-free path to G from the current cell; None if unreachable or done."""
        if self._gym is None or self._done:
            return None
        path = shortest_path_actions(self._desc, self._row, self._col)
        return path[0] if path else None

    # ----------------------------------------------------------------------------------------- helpers
    def _observation(self) -> str:
        grid = render_grid(self._desc, self._row, self._col)
        if self.verbosity == "full":
            grid += f"\nP you, F ice, H hole, G goal. Steps left: {self.max_steps - self._steps}."
        return grid

    def _info(self, *, action_valid: bool) -> dict:
        return {
            "anchor": f"{self._map_id}:{self._row},{self._col}",
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": list(ACTIONS),
            "map_id": self._map_id,
            "steps": self._steps,
        }
