"""Step-level advantage estimators (docs/algorithms.md §3, §4, §5) and the HIPIF process advantage (§10).

Registered in ADVANTAGES: gigpo (episode + anchor-state advantage), graphgpo (step return from the distance to the
goal on a state graph) and turn_level (turn returns normalized per step index). `add_process_advantages` folds the
process rewards into any estimator's result. Contract and conventions: models/advantages.py.
"""
from __future__ import annotations

import difflib
from collections import defaultdict, deque
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.advantage_core import (
    ADVANTAGES, GRPO_EPS, AdvantageResult, StepBatch, _group_stats, _Layout, _layout, _penalized, _penalty,
    _ranks_last_first, _row_result, broadcast_rows,
)
from models.outcome_advantages import grpo_scores

if TYPE_CHECKING:  # for annotations only: models.advantages imports this module
    from models.advantages import AdvantageConfig

_GOAL = -1  # graph node id of the goal; anchor cluster ids are >= 0


# ---------------------------------------------------------------------------------------------------------------
# Shared step pieces
# ---------------------------------------------------------------------------------------------------------------

def _discounted_returns(values: Tensor, lay: _Layout, gamma: float) -> Tensor:
    """R_t = v_t + gamma * R_{t+1} along each trajectory's rows in step order; [R] -> [R]."""
    returns = values.clone()                                                # [R]
    for at in _ranks_last_first(lay):
        nxt = lay.next_row[at]                                              # [r_k]
        returns[at] += gamma * torch.where(nxt >= 0, returns[nxt.clamp_min(0)], 0.0)  # [r_k]
    return returns


def _normalize_in_cells(values: Tensor, cell: Tensor, eps: float) -> Tensor:
    """(v - mean_c) / (std_c + eps) within cells, std unbiased; a singleton cell gives 0; [R] -> [R]."""
    count, centered, std = _group_stats(values, cell)                       # [R] each
    return torch.where(count > 1, centered / (std + eps), torch.zeros_like(centered))  # [R]


def _episode_advantages(rewards: Tensor, lay: _Layout, eps: float) -> Tensor:
    """A^E: GRPO over the trajectories' summed rewards, read back on every row; [R] -> [R]."""
    scores = torch.zeros(len(lay.traj_group), dtype=torch.float64).index_add_(0, lay.traj, rewards)  # [T]
    return grpo_scores(scores, lay.traj_group, eps)[lay.traj]               # [R]


def _similar(first: str, text: str, threshold: float) -> bool:
    matcher = difflib.SequenceMatcher(None, first, text, autojunk=False)   # autojunk skews long texts
    return (matcher.real_quick_ratio() >= threshold and matcher.quick_ratio() >= threshold
            and matcher.ratio() >= threshold)                               # cheap upper bounds first


def _anchor_cells(batch: StepBatch, cfg: AdvantageConfig) -> Tensor:
    """[R] anchor-group id of each row, unique across scenario groups; deterministic in row order.

    exact: rows of one scenario group with identical anchor text. fuzzy: a row joins the first (oldest) cluster of
    its scenario group whose first member is similar enough, else opens a new one.
    """
    known: dict[tuple[int, str], int] = {}
    firsts: dict[int, list[tuple[str, int]]] = defaultdict(list)   # group -> [(first member's text, cluster id)]
    cells, clusters = [], 0
    for group, anchor in zip(batch.group_index.tolist(), batch.anchors):
        cell = known.get((group, anchor))
        if cell is None:
            if cfg.anchor_mode == "fuzzy":
                cell = next((c for first, c in firsts[group] if _similar(first, anchor, cfg.fuzzy_threshold)), None)
            if cell is None:
                cell, clusters = clusters, clusters + 1
                firsts[group].append((anchor, cell))
            known[(group, anchor)] = cell
        cells.append(cell)
    return torch.tensor(cells, dtype=torch.long)                            # [R]


def _anchor_metrics(cell: Tensor) -> dict[str, float]:
    if not len(cell):
        return {"anchor_group_share": 0.0, "anchor_groups": 0.0}
    count = torch.bincount(cell)                                            # [C]
    return {"anchor_group_share": float((count[cell] > 1).double().mean()),
            "anchor_groups": float((count > 0).sum())}



# ---------------------------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------------------------

@ADVANTAGES.register("gigpo")
def compute_gigpo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978).

    A = A^E + omega * A^S. A^E: GRPO over the group's episode returns (sum of penalized rewards), on every row.
    A^S: R_t = sum_{k>=t} gamma^(k-t) r_k - invalid_penalty * [row t invalid] (as verl-agent: the penalty hits the
    row's own R_t once, not discounted into earlier steps), normalized within anchor groups (rows of one scenario
    group in the same state) with the unbiased std as A^E; a singleton anchor group gives A^S = 0, so when no state
    repeats GiGPO is GRPO (metric anchor_group_share = 0).
    """
    lay = _layout(batch)
    rewards = _penalized(batch.rewards, batch, cfg)                         # [R]
    step_return = _discounted_returns(batch.rewards.to(torch.float64), lay, cfg.gamma) - _penalty(batch, cfg)  # [R]
    cell = _anchor_cells(batch, cfg)                                        # [R]
    step_adv = _normalize_in_cells(step_return, cell, cfg.eps)              # [R]
    return _row_result(_episode_advantages(rewards, lay, cfg.eps) + cfg.omega * step_adv, batch, _anchor_metrics(cell))


def _goal_distances(predecessors: dict[int, set[int]]) -> dict[int, int]:
    """BFS from the goal over reversed edges: node -> number of transitions to the goal (goal itself 0)."""
    distance, frontier = {_GOAL: 0}, deque([_GOAL])
    while frontier:
        node = frontier.popleft()
        for previous in sorted(predecessors.get(node, ())):
            if previous not in distance:
                distance[previous] = distance[node] + 1
                frontier.append(previous)
    return distance


@ADVANTAGES.register("graphgpo")
def compute_graphgpo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """GraphGPO (verl-agent GraphGPO recipe): GiGPO whose step return is the distance to the goal on a state graph.

    Per scenario group: nodes = anchor groups (exact or fuzzy, as gigpo), edges = observed transitions (row -> the
    trajectory's next row; the last row of a won trajectory -> goal); d = BFS distance to the goal on the reversed
    graph, unreachable = max finite d + 1. R_t = graph_goal_reward * graph_decay ** d(s_{t+1}) with s_{t+1} the next
    row's state, the goal (d = 0) after a winning last step, an unreachable terminal after a losing one; minus
    invalid_penalty on invalid rows. A^S normalized within anchor groups as gigpo; A = A^E + A^S (no omega, as the
    recipe); a group without a success has A^S = 0.
    """
    lay = _layout(batch)
    rewards = _penalized(batch.rewards, batch, cfg)                         # [R]
    cell = _anchor_cells(batch, cfg)                                        # [R]
    groups, cells, nexts = batch.group_index.tolist(), cell.tolist(), lay.next_row.tolist()
    won = lay.traj_won[lay.traj].tolist()
    predecessors: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for row, (group, node, nxt) in enumerate(zip(groups, cells, nexts)):
        target = cells[nxt] if nxt >= 0 else (_GOAL if won[row] else None)
        if target is not None:
            predecessors[group][target].add(node)
    distances = {g: _goal_distances(p) for g, p in predecessors.items() if _GOAL in p}
    solved = torch.tensor([g in distances for g in groups], dtype=torch.bool)  # [R]
    hops = []
    for row, (group, nxt) in enumerate(zip(groups, nexts)):
        distance = distances.get(group, {_GOAL: 0})
        unreachable = max(distance.values()) + 1
        hops.append(distance.get(cells[nxt], unreachable) if nxt >= 0 else (0 if won[row] else unreachable))
    hop = torch.tensor(hops, dtype=torch.float64)                           # [R]
    step_return = cfg.graph_goal_reward * cfg.graph_decay ** hop - _penalty(batch, cfg)  # [R]
    step_adv = torch.where(solved, _normalize_in_cells(step_return, cell, cfg.eps), 0.0)  # [R]
    metrics = {**_anchor_metrics(cell), "graph_solved_group_share": len(distances) / max(len(set(groups)), 1)}
    return _row_result(_episode_advantages(rewards, lay, cfg.eps) + step_adv, batch, metrics)


@ADVANTAGES.register("turn_level")
def compute_turn_level_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """Turn-level advantage (MemoPilot; our formulation, docs/algorithms.md §5): R_{i,t} = sum_{k>=t} gamma^(k-t) r_k of the
    turn rewards (default the env rewards, minus invalid_penalty), normalized across the scenario group's
    trajectories at the same step_index: (R - mean) / (std_unbiased + eps); a step index only one trajectory reached
    gives 0. Broadcast to that turn's tokens.
    """
    lay = _layout(batch)
    turn_rewards = batch.rewards if batch.turn_rewards is None else batch.turn_rewards
    returns = _discounted_returns(_penalized(turn_rewards, batch, cfg), lay, cfg.gamma)  # [R]
    pairs = torch.stack([batch.group_index.long(), batch.step_index.long()], dim=1)     # [R, 2]
    cell = torch.unique(pairs, dim=0, return_inverse=True)[1] if len(pairs) else pairs[:, 0]  # [R]
    return _row_result(_normalize_in_cells(returns, cell, cfg.eps), batch)


def add_process_advantages(result: AdvantageResult, batch: StepBatch, process_rewards: Tensor, weight: float,
                           eps: float = GRPO_EPS) -> AdvantageResult:
    """HIPIF folding (docs/algorithms.md section 10): A = A + weight * A^proc.

    A^proc: the rows' process rewards (+-alpha on steps that closed a subgoal, 0 elsewhere) GRPO-normalized over all
    rows of their scenario group, the zeros of non-closing steps included: a group adds nothing only when every one
    of its rows has the same process reward (e.g. no close at all). ``process_rewards`` [R].
    """
    if process_rewards.shape != batch.group_index.shape:
        raise ValueError(f"process_rewards must be [R] = {tuple(batch.group_index.shape)}, got "
                         f"{tuple(process_rewards.shape)}")
    proc = weight * grpo_scores(process_rewards.to(torch.float64), batch.group_index, eps)         # [R]
    rows = result.row_advantages + proc.to(result.row_advantages.dtype)                            # [R]
    tokens = result.token_advantages + broadcast_rows(proc, batch.response_mask).to(result.token_advantages.dtype)
    closes = process_rewards != 0                                                                  # [R]
    metrics = {**result.metrics, "process_close_share": float(closes.double().mean()) if len(closes) else 0.0,
               "process_reward_mean": float(process_rewards[closes].double().mean()) if closes.any() else 0.0}
    return AdvantageResult(tokens, rows, metrics)
