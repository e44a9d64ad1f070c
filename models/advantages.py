"""Advantage estimators (docs/algorithms.md §1, §3, §4, §5): one batch record in, token-level advantages out.

Every estimator registered in ADVANTAGES has the signature `fn(batch: StepBatch, cfg: AdvantageConfig) ->
AdvantageResult`. A batch holds one row per (trajectory, step) (step-row layout) or one row per trajectory
(concatenated layout: step_index 0). Rows may come in any order; a trajectory's rows are ordered by step_index, and
"the next row" of a row is the next one in that order. Group and trajectory ids need not be contiguous.

The per-trajectory outcome functions `grpo_scores`, `dr_grpo_scores`, `rloo_scores` (`fn(scores[N],
group_index[N]) -> [N]`) are the low-level pieces the batch estimators build on.

Conventions shared by all estimators: math runs in float64 and is returned in the rewards' dtype (the default float
dtype for integer rewards); `std` is always the unbiased (n-1) standard deviation, for scenario groups, anchor
groups and turn groups alike; a group whose values are all equal gets exactly 0; token advantages are exactly 0
where response_mask is 0, and rows without a valid token never produce NaN.
"""
from __future__ import annotations

import difflib
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

from models.registry import Registry

ADVANTAGES = Registry("advantage")

GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8
ANCHOR_MODES = ("exact", "fuzzy")
_GOAL = -1  # graph node id of the goal; anchor cluster ids are >= 0


# ---------------------------------------------------------------------------------------------------------------
# Per-trajectory outcome functions (docs/algorithms.md §1)
# ---------------------------------------------------------------------------------------------------------------

def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element group size, centered value v_i - mean_g and unbiased group std, each [N], in float64.

    The centered value of a group whose values are all equal is exactly 0 (a float mean need not equal the value).
    """
    scores = scores.to(torch.float64)                                       # [N]
    _, inverse = torch.unique(group_index, return_inverse=True)             # [N] dense group ids 0..G-1
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, inverse, torch.ones_like(scores))  # [G]
    total = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, inverse, scores)                   # [G]
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce_(0, inverse, scores, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype).scatter_reduce_(0, inverse, scores, "amin")
    mean = total / count                                                    # [G]
    centered = scores - mean[inverse]                                       # [N]
    centered = torch.where((high == low)[inverse], torch.zeros_like(centered), centered)                # [N]
    sq = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, inverse, centered * centered)         # [G]
    std = torch.sqrt(sq / (count - 1).clamp_min(1))                         # [G] unbiased (n-1)
    return count[inverse], centered, std[inverse]                           # each [N]


def _out_dtype(values: Tensor) -> torch.dtype:
    return values.dtype if values.is_floating_point() else torch.get_default_dtype()


def _check(scores: Tensor, group_index: Tensor) -> None:
    if scores.ndim != 1 or group_index.shape != scores.shape:
        raise ValueError(
            f"scores and group_index must be 1-D of equal length, got {tuple(scores.shape)} and "
            f"{tuple(group_index.shape)}"
        )


def grpo_scores(scores: Tensor, group_index: Tensor, eps: float = GRPO_EPS) -> Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), std unbiased; [N] scores -> [N] advantages.

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arXiv:2402.03300. A group of one uses mean 0 and std 1 (A = s); an all-equal group gives exactly 0.
    """
    _check(scores, group_index)
    count, centered, std = _group_stats(scores, group_index)               # [N] each
    singleton = count == 1                                                  # [N]
    centered = torch.where(singleton, scores.to(torch.float64), centered)  # [N] singleton: mean 0
    std = torch.where(singleton, torch.ones_like(std), std)                 # [N] singleton: std 1
    return (centered / (std + eps)).to(_out_dtype(scores))                 # [N]


def dr_grpo_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: A_i = s_i - mean_g (no std normalization); [N] -> [N].

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    A group of one uses mean 0 (A = s), as GRPO does.
    """
    _check(scores, group_index)
    count, centered, _ = _group_stats(scores, group_index)                 # [N] each
    advantages = torch.where(count == 1, scores.to(torch.float64), centered)  # [N] singleton: mean 0
    return advantages.to(_out_dtype(scores))


def rloo_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: A_i = n/(n-1) * (s_i - mean_g) = s_i - mean of the other n-1 rollouts; n = 1 gives A = s; [N] -> [N].

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", arXiv:2402.14740 (after Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!").
    """
    _check(scores, group_index)
    count, centered, _ = _group_stats(scores, group_index)                 # [N] each
    scaled = count / (count - 1).clamp_min(1) * centered                    # [N]
    return torch.where(count == 1, scores.to(torch.float64), scaled).to(_out_dtype(scores))  # [N]


# ---------------------------------------------------------------------------------------------------------------
# Batch record, config, result
# ---------------------------------------------------------------------------------------------------------------

class StepBatch(NamedTuple):
    """One row per step (step-row layout) or per trajectory (concatenated layout: one row, step_index 0)."""
    rewards: Tensor
    """[R] float, the env reward of the row's step (invalid-action penalty already included by the env)."""
    traj_index: Tensor
    """[R] long, trajectory of each row."""
    group_index: Tensor
    """[R] long, scenario group of each row (the G rollouts of one scenario, one policy version)."""
    step_index: Tensor
    """[R] long, turn number within the trajectory (unique within a trajectory)."""
    anchors: tuple[str, ...]
    """R canonical env states (the state the row's action was taken in)."""
    won: Tensor
    """[R] bool, the row's trajectory succeeded (the same on all its rows)."""
    action_valid: Tensor
    """[R] bool."""
    response_mask: Tensor
    """[R, L] float, 1 on the row's generated tokens."""
    turn_rewards: Tensor | None = None
    """[R] optional per-turn process rewards (turn_level); None = rewards."""


@dataclass(frozen=True)
class AdvantageConfig:
    eps: float = GRPO_EPS
    """Added to the std in every group normalization (episode, anchor and turn groups)."""
    gamma: float = 0.95
    """Per-step discount of the step returns R_t (gigpo, turn_level)."""
    omega: float = 1.0
    """Weight of the step advantage in gigpo: A = A^E + omega * A^S."""
    anchor_mode: str = "exact"
    """How gigpo/graphgpo group states: "exact" (identical anchor text) or "fuzzy" (similarity >= fuzzy_threshold)."""
    fuzzy_threshold: float = 0.95
    """Fuzzy mode: a row joins the first anchor cluster whose first member has similarity >= this (difflib ratio)."""
    invalid_penalty: float = 0.0
    """Extra penalty for an invalid action, subtracted from the row's reward and from its step return R_t
    (docs/algorithms.md §3.4). 0 by default because our envs already put it in the reward."""
    token_gamma: float = 1.0
    """REINFORCE++ per-token discount of the token returns."""
    graph_goal_reward: float = 10.0
    """GraphGPO step return of reaching the goal: R_t = graph_goal_reward * graph_decay ** d(s_{t+1})."""
    graph_decay: float = 0.1
    """GraphGPO decay per step of distance to the goal."""

    def __post_init__(self) -> None:
        if self.anchor_mode not in ANCHOR_MODES:
            raise ValueError(f"anchor_mode {self.anchor_mode!r} unknown; use one of {', '.join(ANCHOR_MODES)}")
        for name in ("gamma", "token_gamma", "graph_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} = {getattr(self, name)} must be in [0, 1] (a discount)")
        if not 0.0 < self.fuzzy_threshold <= 1.0:
            raise ValueError(f"fuzzy_threshold = {self.fuzzy_threshold} must be in (0, 1]; 0.95 is the reference")
        if self.eps <= 0.0:
            raise ValueError(f"eps = {self.eps} must be > 0 (it guards the division by the group std)")


class AdvantageResult(NamedTuple):
    token_advantages: Tensor
    """[R, L], exactly 0 where response_mask is 0."""
    row_advantages: Tensor
    """[R] the row's advantage; for token-level estimators (reinforce_pp*) the mean over the row's valid tokens
    (0 for a row without one)."""
    metrics: dict[str, float]
    """advantage_mean / advantage_std (population) over valid tokens; gigpo/graphgpo add anchor_group_share (share
    of rows in anchor groups of two or more) and anchor_groups (number of anchor groups, singletons included);
    graphgpo adds graph_solved_group_share (share of scenario groups with a success)."""


def broadcast_rows(row_values: Tensor, response_mask: Tensor) -> Tensor:
    """[R] row values -> [R, L]: the row's value on its generated tokens, exactly 0 elsewhere (never NaN)."""
    if row_values.ndim != 1 or response_mask.ndim != 2 or response_mask.shape[0] != row_values.shape[0]:
        raise ValueError(f"need row_values [R] and response_mask [R, L], got {tuple(row_values.shape)} and "
                         f"{tuple(response_mask.shape)}")
    values = row_values[:, None].expand(response_mask.shape)                # [R, L]
    return torch.where(response_mask != 0, values, torch.zeros_like(values))  # [R, L]


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------

class _Layout(NamedTuple):
    traj: Tensor        # [R] dense trajectory id 0..T-1
    order: Tensor       # [R] row ids sorted by (trajectory, step)
    rank: Tensor        # [R] position of the row within its trajectory (0 = first step)
    next_row: Tensor    # [R] the trajectory's next row, -1 on its last row
    traj_first: Tensor  # [T] position in `order` of the trajectory's first row
    traj_group: Tensor  # [T] scenario group of each trajectory
    traj_won: Tensor    # [T] bool


def _check_batch(batch: StepBatch) -> None:
    rows = batch.rewards.shape[0] if batch.rewards.ndim == 1 else -1
    bad = [name for name in ("rewards", "traj_index", "group_index", "step_index", "won", "action_valid")
           if tuple(getattr(batch, name).shape) != (rows,)]
    if batch.turn_rewards is not None and tuple(batch.turn_rewards.shape) != (rows,):
        bad.append("turn_rewards")
    if len(batch.anchors) != rows:
        bad.append("anchors")
    if batch.response_mask.ndim != 2 or batch.response_mask.shape[0] != rows:
        bad.append("response_mask")
    if bad:
        raise ValueError(f"StepBatch fields {bad} do not match rewards [R={rows}] (response_mask must be [R, L]); "
                         "build the batch with one entry per row")


def _constant_per_traj(values: Tensor, traj: Tensor, num_traj: int, what: str) -> Tensor:
    """[R] -> [T] value of each trajectory; raises if its rows disagree."""
    values = values.long()                                                  # [R]
    high = torch.full((num_traj,), torch.iinfo(torch.long).min).scatter_reduce_(0, traj, values, "amax")  # [T]
    low = torch.full((num_traj,), torch.iinfo(torch.long).max).scatter_reduce_(0, traj, values, "amin")   # [T]
    if not torch.equal(high, low):
        raise ValueError(f"rows of one trajectory disagree on {what}; every row of a trajectory must carry the same")
    return high


def _layout(batch: StepBatch) -> _Layout:
    _check_batch(batch)
    rows = batch.rewards.shape[0]
    _, traj = torch.unique(batch.traj_index, return_inverse=True)           # [R]
    num_traj = int(traj.max()) + 1 if rows else 0
    order = torch.argsort(batch.step_index, stable=True)                    # [R]
    order = order[torch.argsort(traj[order], stable=True)]                  # [R] by trajectory, then step
    sorted_traj, sorted_step = traj[order], batch.step_index[order]         # [R] each
    same_traj = sorted_traj[1:] == sorted_traj[:-1]
    if (same_traj & (sorted_step[1:] == sorted_step[:-1])).any():
        raise ValueError("a trajectory has two rows with the same step_index; step rows must be unique per step")
    position = torch.arange(rows)                                           # [R]
    traj_first = torch.full((num_traj,), rows).scatter_reduce_(0, sorted_traj, position, "amin")  # [T]
    rank, next_row = torch.empty_like(position), torch.full((rows,), -1)    # [R] each
    rank[order] = position - traj_first[sorted_traj]
    next_row[order[:-1]] = torch.where(same_traj, order[1:], -1)
    return _Layout(traj, order, rank, next_row, traj_first,
                   _constant_per_traj(batch.group_index, traj, num_traj, "group_index"),
                   _constant_per_traj(batch.won, traj, num_traj, "won").bool())


def _penalty(batch: StepBatch, cfg: AdvantageConfig) -> Tensor:
    """[R] cfg.invalid_penalty on rows whose action was invalid, else 0 (float64)."""
    return cfg.invalid_penalty * (~batch.action_valid.bool()).double()     # [R]


def _penalized(values: Tensor, batch: StepBatch, cfg: AdvantageConfig) -> Tensor:
    """[R] values in float64 minus the invalid-action penalty."""
    return values.to(torch.float64) - _penalty(batch, cfg)                 # [R]


def _ranks_last_first(lay: _Layout) -> Iterator[Tensor]:
    """Row ids of each step rank, the last rank first: the order of a backward pass along all trajectories."""
    for k in range(int(lay.rank.max()) if len(lay.rank) else -1, -1, -1):
        yield torch.nonzero(lay.rank == k).squeeze(1)                       # [r_k]


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


def _result(tokens: Tensor, rows: Tensor, batch: StepBatch, extra: dict[str, float] | None = None) -> AdvantageResult:
    dtype = _out_dtype(batch.rewards)
    valid = tokens[batch.response_mask != 0]                                # [n]
    metrics = {"advantage_mean": float(valid.mean()) if len(valid) else 0.0,
               "advantage_std": float(valid.std(correction=0)) if len(valid) else 0.0, **(extra or {})}
    return AdvantageResult(tokens.to(dtype), rows.to(dtype), metrics)


def _row_result(rows: Tensor, batch: StepBatch, extra: dict[str, float] | None = None) -> AdvantageResult:
    return _result(broadcast_rows(rows, batch.response_mask), rows, batch, extra)


def _masked_whiten(values: Tensor, valid: Tensor) -> Tensor:
    """(v - mean) / sqrt(var + 1e-8) over the valid entries of the whole batch, var unbiased; 0 elsewhere."""
    picked = values[valid]                                                  # [n]
    out = torch.zeros_like(values)                                          # [R, L]
    if len(picked) < 2 or bool(picked.max() == picked.min()):
        return out                                                          # no spread: exactly 0
    centered = picked - picked.mean()                                       # [n]
    out[valid] = centered / torch.sqrt(centered.square().sum() / (len(picked) - 1) + WHITEN_EPS)
    return out


def _token_result(tokens: Tensor, batch: StepBatch) -> AdvantageResult:
    valid = batch.response_mask != 0                                        # [R, L]
    rows = tokens.sum(dim=1) / valid.sum(dim=1).clamp_min(1)                # [R] mean over valid tokens
    return _result(tokens, rows, batch)


# ---------------------------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------------------------

def _outcome(batch: StepBatch, cfg: AdvantageConfig, scores_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """[R] trajectory advantage of each row from s_i = sum of the trajectory's (penalized) row rewards."""
    lay = _layout(batch)
    rewards = _penalized(batch.rewards, batch, cfg)                         # [R]
    scores = torch.zeros(len(lay.traj_group), dtype=torch.float64).index_add_(0, lay.traj, rewards)  # [T]
    return scores_fn(scores, lay.traj_group)[lay.traj]                      # [R]


@ADVANTAGES.register("grpo")
def compute_grpo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """GRPO (Shao et al. 2024, arXiv:2402.03300) on s_i = sum of the trajectory's rewards, on all its tokens."""
    return _row_result(_outcome(batch, cfg, partial(grpo_scores, eps=cfg.eps)), batch)


@ADVANTAGES.register("dr_grpo")
def compute_dr_grpo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): s_i - mean_g, broadcast to the trajectory's tokens."""
    return _row_result(_outcome(batch, cfg, dr_grpo_scores), batch)


@ADVANTAGES.register("rloo")
def compute_rloo_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): s_i - mean of the others, on the trajectory's tokens."""
    return _row_result(_outcome(batch, cfg, rloo_scores), batch)


@ADVANTAGES.register("reinforce_pp")
def compute_reinforce_pp_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arXiv:2501.03262): token returns G_t = r_t + token_gamma * G_{t+1}, then whitened over the batch's valid tokens.

    The generated tokens of a trajectory form one chain: its rows in step order, each row's valid tokens in order
    (masked tokens are skipped, neither discounted nor a reset); the chain ends with the trajectory. A row's reward
    sits on its last valid token; a row without valid tokens hands its reward to the last valid token before it in
    the trajectory (dropped if there is none), so with token_gamma = 1 the first token's return is the episode score.
    Whitening as verl's masked_whiten: (G - mean) / sqrt(var_unbiased + 1e-8).
    """
    lay = _layout(batch)
    valid = batch.response_mask != 0                                        # [R, L]
    count = valid.sum(dim=1)                                                # [R] valid tokens per row
    rewards = _penalized(batch.rewards, batch, cfg)                         # [R]
    rows, gamma = len(rewards), cfg.token_gamma
    # each row's reward goes to the latest row at or before it (in its trajectory) that has a valid token
    position = torch.arange(rows)                                           # [R] positions in lay.order
    holder = torch.cummax(torch.where(count[lay.order] > 0, position, -1), 0).values  # [R] in lay.order
    kept = holder >= lay.traj_first[lay.traj[lay.order]]                    # [R] holder is in the same trajectory
    row_reward = torch.zeros(rows, dtype=torch.float64).index_add_(
        0, lay.order[holder[kept]], rewards[lay.order][kept])               # [R]
    # G at a row's last token = its reward + gamma * G at the first token of the next row that has tokens
    last_return = torch.zeros(rows, dtype=torch.float64)                    # [R]
    carry = torch.zeros(rows, dtype=torch.float64)                          # [R] G entering the row from the right
    for at in _ranks_last_first(lay):
        nxt = lay.next_row[at]                                              # [r_k]
        after = torch.where(nxt >= 0, carry[nxt.clamp_min(0)], 0.0)         # [r_k]
        has_tokens = count[at] > 0                                          # [r_k]
        last_return[at] = torch.where(has_tokens, row_reward[at] + gamma * after, 0.0)  # [r_k]
        first_return = gamma ** (count[at] - 1).clamp_min(0).double() * last_return[at]  # [r_k]
        carry[at] = torch.where(has_tokens, first_return, after)            # [r_k]
    tokens_after = count[:, None] - torch.cumsum(valid.long(), dim=1)       # [R, L] valid tokens after each one
    returns = gamma ** tokens_after.clamp_min(0).double() * last_return[:, None]  # [R, L]
    returns = torch.where(valid, returns, torch.zeros_like(returns))        # [R, L]
    return _token_result(_masked_whiten(returns, valid), batch)


@ADVANTAGES.register("reinforce_pp_baseline")
def compute_reinforce_pp_baseline_advantages(batch: StepBatch, cfg: AdvantageConfig) -> AdvantageResult:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262; as verl): (s_i - mean_g) on the trajectory's tokens (a group
    of one keeps s_i), then whitened over the batch's valid tokens as reinforce_pp."""
    valid = batch.response_mask != 0                                        # [R, L]
    centered = broadcast_rows(_outcome(batch, cfg, dr_grpo_scores), batch.response_mask)  # [R, L]
    return _token_result(_masked_whiten(centered, valid), batch)


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

    A^proc: the rows' process rewards (+-alpha on steps that closed a subgoal, 0 elsewhere) GRPO-normalized within
    their scenario group, so a group whose closes all scored alike adds nothing. ``process_rewards`` [R].
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
