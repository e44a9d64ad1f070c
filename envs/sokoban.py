"""Sokoban as a text env: small generated puzzles, solvable by construction, with a BFS expert.

Observation (``verbosity="short"``): one grid row per line, cells separated by single spaces::

    # # # # # #
    # # # # # #
    # _ _ O _ #
    # _ X P _ #
    # _ _ _ _ #
    # # # # # #

Legend: ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``*`` box on target, ``P`` player, ``S`` player on target.
``"full"`` adds a line ``boxes on target 0/1, steps left 20``.

Actions are the words ``up, down, left, right``. Walking into a wall, or pushing a box into a wall or another box,
is a valid action that does not move. Anything else is an invalid action: no move, reward ``-invalid_penalty``,
the step still counts towards ``max_steps``.

Rewards: +1.0 when every box is on a target (terminates, ``won``); ``box_reward`` for each box pushed onto a target
and ``-box_reward`` for each pushed off one (default 0). A box pushed into a corner that is not a target (two
orthogonal walls) can never move again: the episode terminates as lost with ``info["deadlock"] = True``.
No ``subgoals_*`` keys: boxes on target can go down again, so ``info["boxes_on_target"]`` reports the count instead.

Generation (per seed, deterministic): a room is carved by a random walk inside the border, boxes are put on
targets, then the player plays *backwards*: random moves that pull the box behind the player, if any. Every pull
undoes a push, so the result is solvable. The BFS solver then checks it; a puzzle whose shortest solution is longer
than ``max_steps`` or shorter than ``min_solution_len`` (default 3, capped at ``max_steps``; so never an already
solved one) is dropped for the next internal attempt (seeded ``[seed, attempt]``). Reset options: ``dim``,
``num_boxes``, and ``level`` (rows in the legend, e.g. ``["#####", "#PXO#", "#####"]``) for a hand-made level.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np

from envs.base import check_reset_options, register_env

ACTIONS: tuple[str, ...] = ("up", "down", "left", "right")
_DIRS: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
RESET_OPTIONS: tuple[str, ...] = ("dim", "num_boxes", "level")  # what reset(options=...) may override
VERBOSITIES: tuple[str, ...] = ("short", "full")
LEGEND = "# wall, _ floor, O target, X box, * box on target, P player, S player on target"
MAX_ATTEMPTS = 500  # generation attempts per seed before giving up with an error
_FLOOR_FRACTION = 0.75  # share of the interior the random walk carves
_PULL_PROB = 1.0  # chance a reverse move pulls the box behind the player (1.0 gave the longest solutions)

Pos = tuple[int, int]
Boxes = frozenset  # frozenset[Pos]


@dataclass(frozen=True)
class Room:
    """The static part of a level: walls (the border included) and targets."""

    height: int
    width: int
    walls: frozenset
    targets: frozenset

    def rows(self) -> list[str]:
        return ["".join("#" if (r, c) in self.walls else "O" if (r, c) in self.targets else "_"
                        for c in range(self.width)) for r in range(self.height)]


def room_id(room: Room) -> str:
    """Short stable hash of the walls and targets (8 hex chars of sha1): same room, same id, across processes."""
    return hashlib.sha1("\n".join(room.rows()).encode("ascii")).hexdigest()[:8]


def render(room: Room, player: Pos, boxes: Boxes) -> str:
    """Text grid (see the module docstring's legend), cells separated by single spaces."""
    lines = []
    for r in range(room.height):
        cells = []
        for c in range(room.width):
            pos, on_target = (r, c), (r, c) in room.targets
            if pos in room.walls:
                cells.append("#")
            elif pos == player:
                cells.append("S" if on_target else "P")
            elif pos in boxes:
                cells.append("*" if on_target else "X")
            else:
                cells.append("O" if on_target else "_")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def parse_level(rows: list[str] | tuple[str, ...]) -> tuple[Room, Pos, Boxes]:
    """A level from rows in the legend (spaces ignored): (room, player, boxes). Raises ValueError if malformed."""
    grid = [row.replace(" ", "") for row in rows]
    if not grid or any(len(row) != len(grid[0]) for row in grid):
        raise ValueError(f"sokoban: level rows must be non-empty and of equal length, got {list(rows)}")
    bad = sorted({ch for row in grid for ch in row} - set("#_OX*PS"))
    if bad:
        raise ValueError(f"sokoban: unknown level characters {bad}; legend: {LEGEND}")
    height, width = len(grid), len(grid[0])
    cells = {(r, c): ch for r, row in enumerate(grid) for c, ch in enumerate(row)}
    border = [p for p in cells if p[0] in (0, height - 1) or p[1] in (0, width - 1)]
    if any(cells[p] != "#" for p in border):
        raise ValueError("sokoban: the level's border must be all walls '#'")
    players = [p for p, ch in cells.items() if ch in "PS"]
    boxes = frozenset(p for p, ch in cells.items() if ch in "X*")
    targets = frozenset(p for p, ch in cells.items() if ch in "O*S")
    if len(players) != 1 or not boxes or len(boxes) != len(targets):
        raise ValueError(f"sokoban: a level needs exactly one player (P/S) and as many boxes as targets (>= 1); "
                         f"got {len(players)} players, {len(boxes)} boxes, {len(targets)} targets")
    walls = frozenset(p for p, ch in cells.items() if ch == "#")
    return Room(height, width, walls, targets), players[0], boxes


def move(room: Room, player: Pos, boxes: Boxes, action: str) -> tuple[Pos, Boxes]:
    """Sokoban dynamics: walk, or push one box; blocked moves leave the state unchanged."""
    dr, dc = _DIRS[action]
    nxt = (player[0] + dr, player[1] + dc)
    if nxt in room.walls:
        return player, boxes
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if beyond in room.walls or beyond in boxes:
            return player, boxes
        return nxt, (boxes - {nxt}) | {beyond}
    return nxt, boxes


def corner_deadlock(room: Room, boxes: Boxes) -> bool:
    """True if a box off target sits in a corner (a wall above or below and one left or right): it can't move."""
    for r, c in boxes:
        if (r, c) in room.targets:
            continue
        vertical = (r - 1, c) in room.walls or (r + 1, c) in room.walls
        horizontal = (r, c - 1) in room.walls or (r, c + 1) in room.walls
        if vertical and horizontal:
            return True
    return False


def solve(room: Room, player: Pos, boxes: Boxes, max_len: int | None = None) -> list[str] | None:
    """Shortest action sequence solving the level (BFS over (player, boxes)); None if none within ``max_len``.

    Moves are expanded in ``ACTIONS`` order, so ties break the same way every time. States with a corner deadlock
    are pruned (they can never be solved); blocked moves are skipped (they revisit the same state).
    """
    start = (player, boxes)
    if boxes <= room.targets:
        return []
    parent: dict = {start: None}
    queue = deque([(start, 0)])
    while queue:
        state, depth = queue.popleft()
        if max_len is not None and depth >= max_len:
            continue
        for action in ACTIONS:
            nxt = move(room, state[0], state[1], action)
            if nxt in parent or (nxt[1] != state[1] and corner_deadlock(room, nxt[1])):
                continue
            parent[nxt] = (state, action)
            if nxt[1] <= room.targets:
                path = []
                while parent[nxt] is not None:
                    nxt, action = parent[nxt]
                    path.append(action)
                return path[::-1]
            queue.append((nxt, depth + 1))
    return None


def _carve_room(rng: np.random.Generator, dim: int) -> set[Pos]:
    """Floor cells carved by a random walk inside the border (so they are connected)."""
    inner = dim - 2
    want = max(3, round(_FLOOR_FRACTION * inner * inner))
    pos = (int(rng.integers(1, dim - 1)), int(rng.integers(1, dim - 1)))
    floor = {pos}
    while len(floor) < want:
        dr, dc = _DIRS[ACTIONS[int(rng.integers(4))]]
        nxt = (pos[0] + dr, pos[1] + dc)
        if 1 <= nxt[0] <= inner and 1 <= nxt[1] <= inner:
            pos = nxt
            floor.add(pos)
    return floor


def _reverse_play(rng: np.random.Generator, floor: list[Pos], player: Pos, targets: frozenset,
                  n_moves: int) -> tuple[Pos, Boxes]:
    """Random reverse moves from the solved state; each pulls the box behind the player with prob. ``_PULL_PROB``.

    A pull (player p -> p+d, box p-d -> p) is exactly the inverse of a push, so the final state is solvable.
    """
    floor_set, boxes = set(floor), set(targets)
    for _ in range(n_moves):
        dr, dc = _DIRS[ACTIONS[int(rng.integers(4))]]
        nxt = (player[0] + dr, player[1] + dc)
        if nxt not in floor_set or nxt in boxes:
            continue
        behind = (player[0] - dr, player[1] - dc)
        if behind in boxes and rng.random() < _PULL_PROB:
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
    return player, frozenset(boxes)


def generate_puzzle(seed: int, dim: int, num_boxes: int, max_len: int,
                    min_len: int = 1) -> tuple[Room, Pos, Boxes, list[str]]:
    """A solvable level whose shortest solution has ``min(min_len, max_len)..max_len`` moves, and that solution.

    Deterministic in its arguments. Raises ValueError if ``MAX_ATTEMPTS`` attempts all fail.
    """
    walls_all = {(r, c) for r in range(dim) for c in range(dim)}
    min_len = max(1, min(min_len, max_len))
    for attempt in range(MAX_ATTEMPTS):
        rng = np.random.default_rng([seed, attempt])
        floor = sorted(_carve_room(rng, dim))
        if len(floor) < num_boxes + 2:
            continue
        picks = rng.choice(len(floor), size=num_boxes + 1, replace=False)
        targets = frozenset(floor[i] for i in picks[:num_boxes])
        player, boxes = _reverse_play(rng, floor, floor[picks[-1]], targets, n_moves=int(rng.integers(10, 10 * dim)))
        room = Room(dim, dim, frozenset(walls_all - set(floor)), targets)
        if corner_deadlock(room, boxes):  # cannot happen (a box is never pulled into a corner); kept as a guard
            continue
        solution = solve(room, player, boxes, max_len=max_len)
        if solution is not None and len(solution) >= min_len:
            return room, player, boxes, solution
    raise ValueError(f"sokoban: no puzzle with dim={dim}, num_boxes={num_boxes} solvable within max_steps={max_len} "
                     f"after {MAX_ATTEMPTS} attempts for seed {seed}: raise max_steps or dim, or lower num_boxes")


@register_env("sokoban")
class SokobanText:
    """Sokoban behind the text-env contract (see envs/base.py and the module docstring)."""

    def __init__(self, dim: int = 6, num_boxes: int = 1, max_steps: int = 20, invalid_penalty: float = 0.0,
                 box_reward: float = 0.0, min_solution_len: int = 3, verbosity: str = "short") -> None:
        if max_steps < 1:
            raise ValueError(f"sokoban: max_steps must be >= 1, got {max_steps}")
        if verbosity not in VERBOSITIES:
            raise ValueError(f"sokoban: unknown verbosity {verbosity!r}; valid: {list(VERBOSITIES)}")
        _check_size(dim, num_boxes)
        self.dim, self.num_boxes, self.max_steps = int(dim), int(num_boxes), int(max_steps)
        self.invalid_penalty, self.box_reward = float(invalid_penalty), float(box_reward)
        self.min_solution_len = int(min_solution_len)
        self.verbosity = verbosity
        self._room: Room | None = None
        self._room_id = ""
        self._player: Pos = (0, 0)
        self._boxes: Boxes = frozenset()
        self._plan_cache: dict = {}  # (player, boxes) -> next expert action (None: unsolvable)
        self._steps = 0
        self._done = True
        self._won = self._deadlock = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("sokoban", options, RESET_OPTIONS)
        if "level" in options:
            self._room, self._player, self._boxes = parse_level(options["level"])
        else:
            dim = int(options.get("dim", self.dim))
            num_boxes = int(options.get("num_boxes", self.num_boxes))
            _check_size(dim, num_boxes)
            if seed is None:
                seed = int(np.random.SeedSequence().entropy % 2**63)
            self._room, self._player, self._boxes, _ = generate_puzzle(seed, dim, num_boxes, self.max_steps,
                                                                         self.min_solution_len)
        self._room_id = room_id(self._room)
        self._plan_cache = {}
        self._steps = 0
        self._done = self._won = self._deadlock = False
        return self._observation(), self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._room is None:
            raise RuntimeError("sokoban: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("sokoban: the episode is over; call reset() before stepping again")
        word = action.strip().lower() if isinstance(action, str) else ""
        self._steps += 1
        terminated = False
        if word in ACTIONS:
            before = self._on_target()
            self._player, self._boxes = move(self._room, self._player, self._boxes, word)
            after = self._on_target()
            reward = self.box_reward * (after - before)
            self._won = after == len(self._boxes)
            self._deadlock = not self._won and corner_deadlock(self._room, self._boxes)
            reward += 1.0 if self._won else 0.0
            terminated = self._won or self._deadlock
            valid = True
        else:
            reward = 0.0 - self.invalid_penalty
            valid = False
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._observation(), float(reward), terminated, truncated, self._info(action_valid=valid)

    def task_description(self) -> str:
        return (f"Push every box onto a target. Legend: {LEGEND}. Moves: " + ", ".join(ACTIONS) + ".")

    def expert_action(self) -> str | None:
        """First move of a shortest solution from the current state (cached per state); None if none or done."""
        if self._room is None or self._done:
            return None
        state = (self._player, self._boxes)
        if state not in self._plan_cache:
            plan = solve(self._room, self._player, self._boxes)
            self._plan_cache[state] = plan[0] if plan else None
            player, boxes = state
            for action, nxt_action in zip(plan or [], (plan or [])[1:]):
                player, boxes = move(self._room, player, boxes, action)
                self._plan_cache[(player, boxes)] = nxt_action
        return self._plan_cache[state]

    # ----------------------------------------------------------------------------------------- helpers
    def _on_target(self) -> int:
        return len(self._boxes & self._room.targets)

    def _observation(self) -> str:
        grid = render(self._room, self._player, self._boxes)
        if self.verbosity == "short":
            return grid
        return (f"{grid}\nboxes on target {self._on_target()}/{len(self._boxes)}, "
                f"steps left {self.max_steps - self._steps}")

    def _info(self, *, action_valid: bool) -> dict:
        boxes = ";".join(f"{r},{c}" for r, c in sorted(self._boxes))
        return {
            "anchor": f"{self._room_id}:{self._player[0]},{self._player[1]}:{boxes}",
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": list(ACTIONS),
            "puzzle_id": self._room_id,
            "steps": self._steps,
            "boxes_on_target": self._on_target(),
            "deadlock": self._deadlock,
        }


def _check_size(dim: int, num_boxes: int) -> None:
    if dim < 4:
        raise ValueError(f"sokoban: dim must be >= 4 (grid side including the walls), got {dim}")
    if not 1 <= num_boxes <= (dim - 2) ** 2 // 3:
        raise ValueError(f"sokoban: num_boxes must be in [1, {(dim - 2) ** 2 // 3}] for dim={dim}, got {num_boxes}: "
                         f"lower num_boxes or raise dim")
