"""Tree search as a text env: find a hidden goal leaf in a k-ary tree from noisy hints, backtracking when wrong.

The tree has ``branching`` children per node and leaves at ``depth``. The agent starts at the root. Nodes are named
by their path of child numbers (``2-1`` is the first child of the root's second child). Observation
(``verbosity="short"``)::

    node 2-1, depth 2 of 3
    signal: 1 low, 2 high, 3 low

Every inner node shows exactly one ``high`` child. On the goal's path, that child leads to the goal with probability
``hint_accuracy`` (otherwise it is one of the other children, uniformly); off the goal's path it is uniform, so a
bad hint can only be caught by reaching a dead end. Hints are drawn per node from ``[seed, node path]``: fixed for
the episode (revisiting a node shows the same hint) and the same for the same seed. A leaf shows ``dead end`` or
``goal found``. ``"full"`` adds the children already visited from this node and the steps left: remembering which
subtrees were explored is otherwise up to the agent.

Actions: ``child <i>`` (``i`` in ``1..branching``) and ``back`` (to the parent). ``back`` at the root, ``child`` at a
leaf, or any other text is an invalid action: no move, reward ``-invalid_penalty``, the step still counts.
Reward 1.0 on reaching the goal leaf (terminates, ``won``); 0.0 otherwise. ``max_steps`` defaults to
``2 * depth * branching``.

Experts (``expert``, default ``DEFAULT_EXPERT``): ``"dfs"`` searches as an agent could, knowing only what this
episode has shown: at a node it takes the ``high`` child if that subtree is not yet explored, else the first
unexplored child in order ``1..k``, else ``back``; a dead end is ``back``. A subtree is explored once every leaf below
it was seen. Followed from the start it wins within ``2 * (nodes - 1) - depth`` steps (``tree_nodes``), so
``max_steps >= 2 * nodes`` guarantees a win; at the default limit it loses trees whose hints mislead it high up.
``"oracle"`` knows the goal and walks the shortest path to it: it never goes ``back`` unless the agent strayed, so
its demonstrations teach no backtracking.
What a learner needs to imitate ``dfs``: with ``"full"`` the current observation is enough (on the expert's own
path the visited children are the explored ones); with ``"short"`` the same observation can ask for different
moves (first arrival vs. back from a child), and the previous turn settles it: after ``back`` from child ``c``
(the last number of that node's name) the move is the child after ``c`` in the order high, then ``1..k``.

Depth curriculum: reset options ``min_depth`` and ``max_depth`` (together) draw the depth per seed, uniformly in
``[min_depth, max_depth]``; or pass ``depth`` for a fixed one. Anchor: tree id (seed, shape, accuracy) + node path.
Scenario key (``scenario_key``): the whole tree an agent can explore: shape, step limit, goal leaf and the ``high``
child of every inner node (hints are fixed per node, so they are content). A tree of more than ``KEY_MAX_NODES``
inner nodes is keyed by its tree id instead: a repeat of that many independent hints is beyond chance.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
from typing import Collection

import numpy as np

from envs.base import check_reset_options, register_env

RESET_OPTIONS: tuple[str, ...] = ("depth", "branching", "min_depth", "max_depth")
VERBOSITIES: tuple[str, ...] = ("short", "full")
EXPERTS: tuple[str, ...] = ("dfs", "oracle")
DEFAULT_EXPERT = "oracle"  # not "dfs" yet: it loses trees at the default max_steps, and require_win demos refuse them
MAX_BRANCHING = 9  # child numbers stay single digits
KEY_MAX_NODES = 4096  # scenario_key lists every inner node's hint up to this many inner nodes
_GOAL, _HINT, _DEPTH = 0, 1, 2  # first seed words after the seed, so goal, hint and depth draws never share a stream

Path = tuple[int, ...]


def path_name(path: Path) -> str:
    return "-".join(str(i) for i in path) if path else "root"


def draw_goal(seed: int, branching: int, depth: int) -> Path:
    """The hidden goal leaf of the tree of ``seed``."""
    rng = np.random.default_rng([seed, _GOAL, branching, depth])
    return tuple(int(i) for i in rng.integers(1, branching + 1, size=depth))


def draw_hint(seed: int, path: Path, goal: Path, branching: int, accuracy: float) -> int:
    """The ``high`` child of the inner node ``path`` (see the module docstring); seeded by ``[seed, path]``."""
    rng = np.random.default_rng([seed, _HINT, len(path), *path])
    if goal[:len(path)] != path:
        return int(rng.integers(1, branching + 1))
    right = goal[len(path)]
    if rng.random() < accuracy:
        return right
    others = [i for i in range(1, branching + 1) if i != right]
    return others[int(rng.integers(len(others)))]


def expert_path(node: Path, goal: Path) -> list[str]:
    """Shortest action list from ``node`` to ``goal``: back up to their common prefix, then down."""
    common = 0
    while common < min(len(node), len(goal)) and node[common] == goal[common]:
        common += 1
    return ["back"] * (len(node) - common) + [f"child {i}" for i in goal[common:]]


def tree_nodes(branching: int, depth: int) -> int:
    """Nodes of the tree, root and leaves included."""
    return sum(branching ** level for level in range(depth + 1))


def dfs_move(node: Path, *, branching: int, depth: int, high: int | None, explored: Collection[int]) -> str | None:
    """The hint-first depth-first move at ``node``: the ``high`` child unless explored, else the first unexplored
    child in ``1..branching``, else ``back``; ``back`` at a leaf. None at a fully explored root (no move left)."""
    if len(node) == depth:
        return "back"
    order = [high] + [i for i in range(1, branching + 1) if i != high]
    child = next((i for i in order if i not in explored), None)
    if child is not None:
        return f"child {child}"
    return "back" if node else None


def parse_action(text: str, branching: int) -> str | int | None:
    """``"back"``, a child number in ``1..branching``, or None for anything else."""
    words = text.strip().lower().split() if isinstance(text, str) else []
    if words == ["back"]:
        return "back"
    if len(words) == 2 and words[0] == "child" and words[1].isdigit() and 1 <= int(words[1]) <= branching:
        return int(words[1])
    return None


@register_env("tree_search")
class TreeSearchText:
    """The tree-search game behind the text-env contract (see envs/base.py and the module docstring)."""

    def __init__(self, branching: int = 3, depth: int = 3, hint_accuracy: float = 0.8, max_steps: int | None = None,
                 invalid_penalty: float = 0.0, verbosity: str = "short", expert: str = DEFAULT_EXPERT) -> None:
        _check_shape(branching, depth)
        if not 0.0 <= hint_accuracy <= 1.0:
            raise ValueError(f"tree_search: hint_accuracy must be in [0, 1], got {hint_accuracy}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"tree_search: max_steps must be >= 1 or None (2 * depth * branching), got {max_steps}")
        if verbosity not in VERBOSITIES:
            raise ValueError(f"tree_search: unknown verbosity {verbosity!r}; valid: {list(VERBOSITIES)}")
        if expert not in EXPERTS:
            raise ValueError(f"tree_search: unknown expert {expert!r}; valid: {list(EXPERTS)}")
        self.branching, self.depth, self.hint_accuracy = int(branching), int(depth), float(hint_accuracy)
        self.max_steps = max_steps
        self.invalid_penalty = float(invalid_penalty)
        self.verbosity = verbosity
        self.expert = expert
        self._seed = 0
        self._k = self._d = 0  # this episode's branching and depth
        self._limit = 0  # this episode's max_steps
        self._goal: Path = ()
        self._node: Path = ()
        self._tree_id = ""
        self._hints: dict[Path, int] = {}
        self._visited: set[Path] = set()
        self._steps = 0
        self._done = True
        self._won = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("tree_search", options, RESET_OPTIONS)
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % 2**63)
        branching = int(options.get("branching", self.branching))
        depth = _episode_depth(seed, options, self.depth)
        _check_shape(branching, depth)
        self._seed, self._k, self._d = int(seed), branching, depth
        self._limit = self.max_steps if self.max_steps is not None else 2 * depth * branching
        self._goal = draw_goal(self._seed, branching, depth)
        key = f"{self._seed}:{branching}:{depth}:{self.hint_accuracy}"
        self._tree_id = hashlib.sha1(key.encode("ascii")).hexdigest()[:8]
        self._node, self._hints, self._visited = (), {}, {()}
        self._steps = 0
        self._done = self._won = False
        return self._observation(), self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._tree_id:
            raise RuntimeError("tree_search: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("tree_search: the episode is over; call reset() before stepping again")
        self._steps += 1
        parsed = parse_action(action, self._k)
        valid = (parsed == "back" and len(self._node) > 0) or (isinstance(parsed, int) and len(self._node) < self._d)
        if valid:
            self._node = self._node[:-1] if parsed == "back" else self._node + (parsed,)
            self._visited.add(self._node)
            self._won = self._node == self._goal
        reward = (1.0 if self._won else 0.0) if valid else (0.0 - self.invalid_penalty)
        terminated = self._won
        truncated = not terminated and self._steps >= self._limit
        self._done = terminated or truncated
        return self._observation(), reward, terminated, truncated, self._info(action_valid=valid)

    def task_description(self) -> str:
        return (f"Find the goal leaf of a tree with {self._k or self.branching} children per node. The child with "
                f"the high signal usually leads to the goal. Actions: child <number>, back.")

    def expert_action(self) -> str | None:
        """The ``expert``'s next move (module docstring); None once done."""
        if not self._tree_id or self._done:
            return None
        if self.expert == "oracle":
            return expert_path(self._node, self._goal)[0]
        leaf = len(self._node) == self._d
        explored = {i for i in range(1, self._k + 1) if self._explored(self._node + (i,))} if not leaf else set()
        return dfs_move(self._node, branching=self._k, depth=self._d, high=None if leaf else self._hint(self._node),
                        explored=explored)

    def scenario_key(self) -> str:
        """Shape, step limit, goal and every inner node's hint, in breadth-first order (module docstring)."""
        if not self._tree_id:
            raise RuntimeError("tree_search: scenario_key() before reset(); call reset(seed=...) first")
        head = f"{self._k}:{self._d}:{self._limit}:{path_name(self._goal)}"
        if sum(self._k ** level for level in range(self._d)) > KEY_MAX_NODES:
            return f"{head}:tree {self._tree_id}"
        level: list[Path] = [()]
        hints = []
        for _ in range(self._d):
            hints.append("".join(str(draw_hint(self._seed, path, self._goal, self._k, self.hint_accuracy))
                                 for path in level))
            level = [path + (i,) for path in level for i in range(1, self._k + 1)]
        return f"{head}:" + "/".join(hints)

    # ----------------------------------------------------------------------------------------- helpers
    def _hint(self, path: Path) -> int:
        if path not in self._hints:
            self._hints[path] = draw_hint(self._seed, path, self._goal, self._k, self.hint_accuracy)
        return self._hints[path]

    def _explored(self, path: Path) -> bool:
        """Whether every leaf below ``path`` was seen this episode (only visited nodes are walked)."""
        if path not in self._visited:
            return False
        return len(path) == self._d or all(self._explored(path + (i,)) for i in range(1, self._k + 1))

    def _admissible(self) -> list[str]:
        children = [f"child {i}" for i in range(1, self._k + 1)] if len(self._node) < self._d else []
        return children + (["back"] if self._node else [])

    def _observation(self) -> str:
        lines = [f"node {path_name(self._node)}, depth {len(self._node)} of {self._d}"]
        if len(self._node) == self._d:
            lines.append("goal found" if self._won else "dead end")
        else:
            high = self._hint(self._node)
            lines.append("signal: " + ", ".join(f"{i} {'high' if i == high else 'low'}"
                                                for i in range(1, self._k + 1)))
        if self.verbosity == "full":
            seen = [str(i) for i in range(1, self._k + 1) if self._node + (i,) in self._visited]
            lines.append(f"visited children: {' '.join(seen) or '-'}, steps left {self._limit - self._steps}")
        return "\n".join(lines)

    def _info(self, *, action_valid: bool) -> dict:
        return {
            "anchor": f"{self._tree_id}:{path_name(self._node)}",
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": self._admissible(),
            "tree_id": self._tree_id,
            "depth": self._d,
            "steps": self._steps,
        }


def _episode_depth(seed: int, options: dict, default: int) -> int:
    """``depth`` from the options, or drawn from ``[min_depth, max_depth]`` by the seed, or ``default``."""
    has_range = ("min_depth" in options, "max_depth" in options)
    if any(has_range) and not all(has_range):
        raise ValueError("tree_search: reset options 'min_depth' and 'max_depth' go together; pass both or neither")
    if all(has_range):
        if "depth" in options:
            raise ValueError("tree_search: pass either 'depth' or 'min_depth'/'max_depth', not both")
        low, high = int(options["min_depth"]), int(options["max_depth"])
        if not 1 <= low <= high:
            raise ValueError(f"tree_search: need 1 <= min_depth <= max_depth, got {low}, {high}")
        return int(np.random.default_rng([seed, _DEPTH]).integers(low, high + 1))
    return int(options.get("depth", default))


def _check_shape(branching: int, depth: int) -> None:
    if not 2 <= branching <= MAX_BRANCHING:
        raise ValueError(f"tree_search: branching must be in [2, {MAX_BRANCHING}], got {branching}")
    if depth < 1:
        raise ValueError(f"tree_search: depth must be >= 1, got {depth}")
