"""Batch advantage estimators (models.advantages.ADVANTAGES over a StepBatch): hand-computed values, a plain-loop
reference of every estimator checked against the vectorized code on random batches, properties, registry."""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models.skill_advantages  # noqa: F401  (registers skillc and d2skill, whatever the test import order)
from models.advantage_core import GRPO_EPS
from models.advantages import ADVANTAGES, AdvantageConfig, StepBatch, add_process_advantages, broadcast_rows
from models.outcome_advantages import compute_grpo_advantages
from models.step_advantages import compute_gigpo_advantages

NAMES = ADVANTAGES.names()  # every registered estimator gets the contract tests below, a new one included
TOKEN_LEVEL = {"reinforce_pp", "reinforce_pp_baseline"}
SQ2, SQ3 = math.sqrt(2.0), math.sqrt(3.0)


def row(traj, group, step, reward, anchor="s", won=False, mask=(1,), valid=True, turn=None) -> dict:
    return dict(traj=traj, group=group, step=step, reward=reward, anchor=anchor, won=won, mask=list(mask),
                valid=valid, turn=turn)


def make_batch(rows: list[dict], dtype=torch.float64, width: int = 4) -> StepBatch:
    width = len(rows[0]["mask"]) if rows else width
    turns = [r["turn"] for r in rows]
    return StepBatch(
        rewards=torch.tensor([r["reward"] for r in rows], dtype=dtype),
        traj_index=torch.tensor([r["traj"] for r in rows], dtype=torch.long),
        group_index=torch.tensor([r["group"] for r in rows], dtype=torch.long),
        step_index=torch.tensor([r["step"] for r in rows], dtype=torch.long),
        anchors=tuple(r["anchor"] for r in rows),
        won=torch.tensor([r["won"] for r in rows], dtype=torch.bool),
        action_valid=torch.tensor([r["valid"] for r in rows], dtype=torch.bool),
        response_mask=torch.tensor([r["mask"] for r in rows], dtype=torch.float32).reshape(len(rows), width),
        turn_rewards=None if None in turns else torch.tensor(turns, dtype=dtype),
    )


def run(name, rows, **cfg):
    return ADVANTAGES[name](make_batch(rows), AdvantageConfig(**cfg))


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=atol)


# ---------------------------------------------------------------------------------------------------------------
# Plain-loop reference: one trajectory, group, cluster at a time; no tensors
# ---------------------------------------------------------------------------------------------------------------

def trajectories(rows):
    out = defaultdict(list)
    for i, r in enumerate(rows):
        out[r["traj"]].append(i)
    return {t: sorted(ids, key=lambda i: rows[i]["step"]) for t, ids in out.items()}


def penalty(r, cfg):
    return 0.0 if r["valid"] else cfg.invalid_penalty


def normalize(values, eps, singleton):
    n = len(values)
    if n == 1:
        return [singleton(values[0])]
    if all(v == values[0] for v in values):
        return [0.0] * n
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return [(v - mean) / (std + eps) for v in values]


def normalize_by_key(values, keys, eps, singleton=lambda v: 0.0):
    members, out = defaultdict(list), [0.0] * len(values)
    for i, k in enumerate(keys):
        members[k].append(i)
    for ids in members.values():
        for i, a in zip(ids, normalize([values[i] for i in ids], eps, singleton)):
            out[i] = a
    return out


def discounted(values, rows, gamma):
    out = [0.0] * len(rows)
    for ids in trajectories(rows).values():
        running = 0.0
        for i in reversed(ids):
            running = values[i] + gamma * running
            out[i] = running
    return out


def trajectory_outcome(name, rows, cfg):
    """Row -> advantage of its trajectory for grpo / dr_grpo / rloo / the centered score of reinforce_pp_baseline."""
    trajs = trajectories(rows)
    score = {t: sum(rows[i]["reward"] - penalty(rows[i], cfg) for i in ids) for t, ids in trajs.items()}
    by_group = defaultdict(list)
    for t, ids in trajs.items():
        by_group[rows[ids[0]]["group"]].append(t)
    adv = {}
    for members in by_group.values():
        values, n = [score[t] for t in members], len(members)
        for t, s in zip(members, values):
            if name == "grpo":
                continue
            if n == 1:
                adv[t] = s
            elif name == "rloo":
                adv[t] = s - (sum(values) - s) / (n - 1)
            else:  # dr_grpo, reinforce_pp_baseline
                adv[t] = s - sum(values) / n
        if name == "grpo":
            adv.update(zip(members, normalize(values, cfg.eps, lambda s: s / (1 + cfg.eps))))
    return [adv[r["traj"]] for r in rows]


def clusters(rows, cfg):
    firsts, out = defaultdict(list), []
    for r in rows:
        found = None
        for first, cid in firsts[r["group"]]:
            if first == r["anchor"] or (cfg.anchor_mode == "fuzzy" and difflib.SequenceMatcher(
                    None, first, r["anchor"], autojunk=False).ratio() >= cfg.fuzzy_threshold):
                found = cid
                break
        if found is None:
            found = sum(len(c) for c in firsts.values())
            firsts[r["group"]].append((r["anchor"], found))
        out.append(found)
    return out


def goal_distances(edges):
    """Bellman-Ford style relaxation (a different algorithm from the BFS under test)."""
    dist, changed = {"goal": 0}, True
    while changed:
        changed = False
        for u, v in edges:
            if v in dist and dist[v] + 1 < dist.get(u, math.inf):
                dist[u], changed = dist[v] + 1, True
    return dist


def graph_step_advantages(rows, cfg):
    cl, trajs, out = clusters(rows, cfg), trajectories(rows), [0.0] * len(rows)
    for group in {r["group"] for r in rows}:
        ids_by_traj = [ids for ids in trajs.values() if rows[ids[0]]["group"] == group]
        edges = set()
        for ids in ids_by_traj:
            edges |= {(cl[a], cl[b]) for a, b in zip(ids, ids[1:])}
            if rows[ids[-1]]["won"]:
                edges.add((cl[ids[-1]], "goal"))
        if not any(v == "goal" for _, v in edges):
            continue  # no success: A^S = 0
        dist = goal_distances(edges)
        unreachable = max(dist.values()) + 1
        step_return = {}
        for ids in ids_by_traj:
            for a, b in zip(ids, ids[1:] + [None]):
                hop = dist.get(cl[b], unreachable) if b is not None else (0 if rows[a]["won"] else unreachable)
                step_return[a] = cfg.graph_goal_reward * cfg.graph_decay ** hop - penalty(rows[a], cfg)
        members = sorted(step_return)
        for i, a in zip(members, normalize_by_key([step_return[i] for i in members], [cl[i] for i in members],
                                                  cfg.eps)):
            out[i] = a
    return out


def episode_advantages(rows, cfg):
    return trajectory_outcome("grpo", rows, cfg)


def whiten(tokens, rows):
    cells = [(i, j) for i, r in enumerate(rows) for j, m in enumerate(r["mask"]) if m]
    out = [[0.0] * len(r["mask"]) for r in rows]
    values = [tokens[i][j] for i, j in cells]
    if len(values) < 2 or all(v == values[0] for v in values):
        return out
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) + 1e-8)
    for (i, j), v in zip(cells, values):
        out[i][j] = (v - mean) / std
    return out


def reinforce_pp_returns(rows, cfg):
    returns = [[0.0] * len(r["mask"]) for r in rows]
    for ids in trajectories(rows).values():
        chain, reward_at = [], []  # the trajectory's generated tokens in order, and the reward sitting on each
        for i in ids:
            for j, m in enumerate(rows[i]["mask"]):
                if m:
                    chain.append((i, j))
                    reward_at.append(0.0)
            if chain:  # the row's own last token, or (row without tokens) the last token before it
                reward_at[-1] += rows[i]["reward"] - penalty(rows[i], cfg)
        running = 0.0
        for (i, j), r in zip(reversed(chain), reversed(reward_at)):
            running = r + cfg.token_gamma * running
            returns[i][j] = running
    return returns


def reference(name, rows, cfg):
    """(token advantages [R][L], row advantages [R]) computed one element at a time."""
    if name in TOKEN_LEVEL:
        if name == "reinforce_pp":
            tokens = whiten(reinforce_pp_returns(rows, cfg), rows)
        else:
            centered = trajectory_outcome(name, rows, cfg)
            tokens = whiten([[c if m else 0.0 for m in r["mask"]] for c, r in zip(centered, rows)], rows)
        per_row = [sum(t) / max(sum(1 for m in r["mask"] if m), 1) for t, r in zip(tokens, rows)]
        return tokens, per_row
    if name in ("grpo", "dr_grpo", "rloo"):
        values = trajectory_outcome(name, rows, cfg)
    elif name in ("skillc", "d2skill"):  # a plain StepBatch carries no skill flags: both are exactly GRPO
        values = trajectory_outcome("grpo", rows, cfg)
    elif name == "gigpo":
        step_return = [s - penalty(r, cfg) for s, r in zip(discounted([r["reward"] for r in rows], rows, cfg.gamma),
                                                           rows)]
        step = normalize_by_key(step_return, clusters(rows, cfg), cfg.eps)
        values = [e + cfg.omega * s for e, s in zip(episode_advantages(rows, cfg), step)]
    elif name == "graphgpo":
        values = [e + s for e, s in zip(episode_advantages(rows, cfg), graph_step_advantages(rows, cfg))]
    elif name == "turn_level":
        turn = [(r["reward"] if r["turn"] is None else r["turn"]) - penalty(r, cfg) for r in rows]
        values = normalize_by_key(discounted(turn, rows, cfg.gamma), [(r["group"], r["step"]) for r in rows],
                                  cfg.eps)
    return [[v if m else 0.0 for m in r["mask"]] for v, r in zip(values, rows)], values


# ---------------------------------------------------------------------------------------------------------------
# Random batches
# ---------------------------------------------------------------------------------------------------------------

ANCHORS = ["kitchen: apple on table", "kitchen: apple on tables", "kitchen: pear on table", "hall", "hall."]
REWARDS = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.5]), st.floats(-5, 5, allow_nan=False, width=32))
MASKS = st.lists(st.sampled_from([0, 1]), min_size=4, max_size=4)


@st.composite
def step_rows(draw, min_trajs=1, max_groups=3, max_trajs=4, max_steps=4):
    """Rows of 1-3 scenario groups, shuffled; step indices with gaps, repeated anchors, empty masks, invalid rows."""
    rows, traj = [], 0
    for group in range(draw(st.integers(1, max_groups))):
        for _ in range(draw(st.integers(min_trajs, max_trajs))):
            won = draw(st.booleans())
            steps = draw(st.lists(st.integers(0, 9), min_size=1, max_size=max_steps, unique=True))
            for step in steps:
                rows.append(row(traj * 5 + 2, group * 7 + 3, step, draw(REWARDS), draw(st.sampled_from(ANCHORS)),
                                won, draw(MASKS), draw(st.booleans()), draw(st.one_of(st.none(), REWARDS))))
            traj += 1
    if any(r["turn"] is None for r in rows):
        for r in rows:
            r["turn"] = None
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


CONFIGS = st.builds(
    AdvantageConfig, gamma=st.sampled_from([0.95, 0.5, 1.0, 0.0]), omega=st.sampled_from([1.0, 0.5]),
    invalid_penalty=st.sampled_from([0.0, 0.1]), token_gamma=st.sampled_from([1.0, 0.9, 0.0]),
    anchor_mode=st.sampled_from(["exact", "fuzzy"]), fuzzy_threshold=st.sampled_from([0.95, 0.8]),
)
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(rows=step_rows(), cfg=CONFIGS)
def test_vectorized_matches_loop_reference(name, rows, cfg):
    batch = make_batch(rows)
    result = ADVANTAGES[name](batch, cfg)
    tokens, per_row = reference(name, rows, cfg)
    close(result.token_advantages, tokens, atol=1e-6)
    close(result.row_advantages, per_row, atol=1e-6)
    assert torch.isfinite(result.token_advantages).all()
    assert torch.equal(result.token_advantages[batch.response_mask == 0],
                       torch.zeros(int((batch.response_mask == 0).sum()), dtype=torch.float64))
    assert all(math.isfinite(v) for v in result.metrics.values())


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed values
# ---------------------------------------------------------------------------------------------------------------

def test_outcome_estimators_sum_the_rows_and_broadcast_to_every_row():
    """Group 4: traj 10 rewards (0, 1) -> s = 1; traj 11 (0.5) -> 0.5; traj 12 (0, -0.5) -> -0.5. Group 9: traj 20
    alone, s = 2. Group 4: mean 1/3, deviations (2/3, 1/6, -5/6), sum of squares 42/36, var 7/12, std 0.763763.
    grpo: (0.872872, 0.218218, -1.091089); singleton 2 / (1 + 1e-6).
    dr_grpo: (2/3, 1/6, -5/6); singleton 2.  rloo: 1.5 * deviations = (1, 0.25, -1.25); singleton 2.
    Row 1 (traj 10, step 0) has no generated token: its tokens are 0 but its row value is the trajectory's.
    """
    rows = [row(10, 4, 1, 1.0, mask=(1, 1)), row(10, 4, 0, 0.0, mask=(0, 0)), row(11, 4, 0, 0.5, mask=(1, 0)),
            row(12, 4, 0, 0.0, mask=(0, 1)), row(12, 4, 3, -0.5, mask=(1, 1)), row(20, 9, 0, 2.0, mask=(1, 0))]
    std = math.sqrt(7 / 12)
    expected = {
        "grpo": [a / (std + 1e-6) for a in (2 / 3, 1 / 6, -5 / 6)] + [2 / (1 + 1e-6)],
        "dr_grpo": [2 / 3, 1 / 6, -5 / 6, 2.0],
        "rloo": [1.0, 0.25, -1.25, 2.0],
    }
    for name, (a10, a11, a12, a20) in expected.items():
        result = run(name, rows)
        close(result.row_advantages, [a10, a10, a11, a12, a12, a20])
        close(result.token_advantages, [[a10, a10], [0, 0], [a11, 0], [0, a12], [a12, a12], [a20, 0]])


def test_reinforce_pp_hand_computed():
    """token_gamma 0.5. Traj 0: step 3 tokens (x0, x1) reward 1, step 7 token (x2) reward 2 (rows given in reverse
    order). Traj 1: one row, tokens (y0, y1, y2), reward 4. Rewards sit on each row's last token:
    G(x2) = 2, G(x1) = 1 + 0.5 * 2 = 2, G(x0) = 0.5 * 2 = 1; G(y) = (1, 2, 4).
    Whitening over the 6 tokens: mean 2, deviations (-1, 0, 0, -1, 0, 2), var 6/5 -> A = dev / sqrt(1.2 + 1e-8).
    """
    rows = [row(0, 0, 7, 2.0, mask=(1, 0, 0)), row(0, 0, 3, 1.0, mask=(1, 1, 0)), row(1, 0, 0, 4.0, mask=(1, 1, 1))]
    s = math.sqrt(1.2 + 1e-8)
    result = run("reinforce_pp", rows, token_gamma=0.5)
    close(result.token_advantages, [[0, 0, 0], [-1 / s, 0, 0], [-1 / s, 0, 2 / s]])
    close(result.row_advantages, [0, -0.5 / s, 1 / (3 * s)])


def test_reinforce_pp_row_without_tokens_hands_its_reward_back():
    """token_gamma 0.5. Traj 0: step 0 (x0, x1) reward 1, step 1 no tokens reward 2, step 2 (x2) reward 0.
    Row 1's reward moves to x1: G(x2) = 0, G(x1) = 1 + 2 + 0.5 * 0 = 3, G(x0) = 1.5.
    Whitened: mean 1.5, deviations (0, 1.5, -1.5), var 4.5 / 2 = 2.25 -> A = (0, 1, -1).
    Adding traj 1 = (step 0: no tokens, reward 5: no earlier token, dropped; step 1: (z0) reward 1.5): G(z0) = 1.5;
    mean stays 1.5, var 4.5 / 3 = 1.5 -> A = (0, 1.5/sqrt(1.5), -1.5/sqrt(1.5)) and z0 -> 0.
    Concatenated layout: masked positions inside a row neither discount nor reset: mask (1, 0, 0, 1, 1), reward 1
    -> G = (0.25, 0.5, 1) on the valid tokens -> mean 7/12, var 0.145833 -> (-0.872872, -0.218218, 1.091089).
    """
    traj0 = [row(0, 0, 0, 1.0, mask=(1, 1)), row(0, 0, 1, 2.0, mask=(0, 0)), row(0, 0, 2, 0.0, mask=(1, 0))]
    close(run("reinforce_pp", traj0, token_gamma=0.5).token_advantages, [[0, 1], [0, 0], [-1, 0]])
    traj1 = [row(1, 1, 0, 5.0, mask=(0, 0)), row(1, 1, 1, 1.5, mask=(1, 0))]
    s = math.sqrt(1.5 + 1e-8)
    close(run("reinforce_pp", traj0 + traj1, token_gamma=0.5).token_advantages,
          [[0, 1.5 / s], [0, 0], [-1.5 / s, 0], [0, 0], [0, 0]])
    concatenated = run("reinforce_pp", [row(0, 0, 0, 1.0, mask=(1, 0, 0, 1, 1))], token_gamma=0.5)
    close(concatenated.token_advantages, [[-0.872872, 0, 0, -0.218218, 1.091089]])


def test_reinforce_pp_baseline_hand_computed():
    """Group 0: traj 0 score 1 (2 tokens), traj 1 score 0 (1 token): centered +0.5, -0.5. Group 1: traj 2 alone,
    score 3, centered 3 (mean 0). Tokens (0.5, 0.5, -0.5, 3): mean 0.875, deviations (-0.375, -0.375, -1.375,
    2.125), sum of squares 6.6875, var 6.6875 / 3 = 2.229167, std 1.493039 -> (-0.251165, -0.251165, -0.920937,
    1.423271)."""
    rows = [row(0, 0, 0, 1.0, mask=(1, 1)), row(1, 0, 0, 0.0, mask=(1, 0)), row(2, 1, 0, 3.0, mask=(0, 1))]
    result = run("reinforce_pp_baseline", rows)
    close(result.token_advantages, [[-0.251165, -0.251165], [-0.920937, 0], [0, 1.423271]])
    close(result.row_advantages, [-0.251165, -0.920937, 1.423271])


def test_gigpo_hand_computed():
    """gamma 0.5, one group. A: states (s0, s1) rewards (0, 1); B: (s0, s2) (0, 0); C: (s0, s1) (0, 0.5).
    Episode: R^E = (1, 0, 0.5), mean 0.5, std 0.5 -> A^E = (1, -1, 0).
    Step returns: A (0.5, 1), B (0, 0), C (0.25, 0.5).
    s0 = {A 0.5, B 0, C 0.25}: mean 0.25, std 0.25 -> (1, -1, 0). s1 = {A 1, C 0.5}: mean 0.75, std sqrt(0.125)
    -> (+0.707107, -0.707107). s2 = {B}: singleton -> 0.
    A = A^E + A^S: A (2, 1.707107), B (-2, -1), C (0, -0.707107); 5 of 6 rows share an anchor, 3 anchor groups.
    """
    rows = [row(0, 0, 0, 0.0, "s0"), row(0, 0, 1, 1.0, "s1"), row(1, 0, 0, 0.0, "s0"), row(1, 0, 1, 0.0, "s2"),
            row(2, 0, 0, 0.0, "s0"), row(2, 0, 1, 0.5, "s1")]
    result = run("gigpo", rows, gamma=0.5)
    close(result.row_advantages, [2, 1 + 1 / SQ2, -2, -1, 0, -1 / SQ2])
    assert result.metrics["anchor_group_share"] == pytest.approx(5 / 6)
    assert result.metrics["anchor_groups"] == 3
    # omega weighs the step part: A = A^E + 0.5 A^S
    close(run("gigpo", rows, gamma=0.5, omega=0.5).row_advantages, [1.5, 1 + 0.5 / SQ2, -1.5, -1, 0, -0.5 / SQ2])


def test_gigpo_invalid_penalty_hits_the_reward_and_its_own_step_return_once():
    """gamma 0.5, penalty 0.5. A: (s0 r 0, s1 r 1 invalid); B: (s0 r 0, s1 r 1).
    R^E = (0.5, 1) -> A^E = (-0.707107, +0.707107).
    R_t from env rewards, then the penalty on the invalid row only: A (0.5, 1 - 0.5), B (0.5, 1).
    s0 = {0.5, 0.5}: equal -> 0 (the penalty is not discounted into step 0). s1 = {0.5, 1} -> (-0.707107, +0.707107).
    """
    rows = [row(0, 0, 0, 0.0, "s0"), row(0, 0, 1, 1.0, "s1", valid=False),
            row(1, 0, 0, 0.0, "s0"), row(1, 0, 1, 1.0, "s1")]
    close(run("gigpo", rows, gamma=0.5, invalid_penalty=0.5).row_advantages,
          [-1 / SQ2, -SQ2, 1 / SQ2, SQ2])


def test_graphgpo_hand_computed():
    """Group 0: A won (a -> b -> goal); B lost (a -> c -> end); C lost (a -> b -> c -> end).
    Edges a->b, b->goal, a->c, b->c. BFS back from goal: d(b) = 1, d(a) = 2, c unreachable -> max finite 2 + 1 = 3.
    R_t = 10 * 0.1^d(next): A (d(b)=1: 1, goal: 10); B (d(c)=3: 0.01, lost end: 0.01); C (1, 0.01, 0.01).
    Anchor a = {1, 0.01, 1} -> (1/sqrt3, -2/sqrt3, 1/sqrt3); b = {A 10, C 0.01} -> (+1/sqrt2, -1/sqrt2);
    c = {0.01, 0.01} -> 0. Episode R^E = (1, 0, 0), mean 1/3, std 1/sqrt3 -> A^E = (2/sqrt3, -1/sqrt3, -1/sqrt3).
    A: (sqrt3, 2/sqrt3 + 1/sqrt2); B: (-sqrt3, -1/sqrt3); C: (0, -1/sqrt3 - 1/sqrt2, -1/sqrt3).
    Group 1 has no success: A^S = 0, so D, E rewards (0, 0), (0, 1) give only A^E = -1/sqrt2, +1/sqrt2.
    """
    rows = [row(0, 0, 0, 0.0, "a", True), row(0, 0, 1, 1.0, "b", True),
            row(1, 0, 0, 0.0, "a"), row(1, 0, 1, 0.0, "c"),
            row(2, 0, 0, 0.0, "a"), row(2, 0, 1, 0.0, "b"), row(2, 0, 2, 0.0, "c"),
            row(3, 1, 0, 0.0, "x"), row(3, 1, 1, 0.0, "y"), row(4, 1, 0, 0.0, "x"), row(4, 1, 1, 1.0, "y")]
    result = run("graphgpo", rows)
    close(result.row_advantages, [SQ3, 2 / SQ3 + 1 / SQ2, -SQ3, -1 / SQ3, 0, -1 / SQ3 - 1 / SQ2, -1 / SQ3,
                                  -1 / SQ2, -1 / SQ2, 1 / SQ2, 1 / SQ2])
    assert result.metrics["anchor_groups"] == 5 and result.metrics["anchor_group_share"] == 1.0
    assert result.metrics["graph_solved_group_share"] == 0.5


def test_turn_level_hand_computed():
    """gamma 0.5, turn rewards (env rewards all 0). Group 0: T0 (1, 0, 2), T1 (0, 1), T2 (0). Turn returns:
    T0 (1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2) = (1.5, 1, 2); T1 (0.5, 1); T2 (0).
    Step 0 = {1.5, 0.5, 0}: mean 2/3, deviations (5/6, -1/6, -2/3), var (42/36) / 2 = 7/12, std 0.763763
    -> (1.091089, -0.218218, -0.872872). Step 1 = {1, 1}: equal -> 0. Step 2 = {T0}: one trajectory -> 0.
    Group 1: T3 alone at step 0 -> 0 (groups are not mixed).
    """
    turns = {0: (1.0, 0.0, 2.0), 1: (0.0, 1.0), 2: (0.0,)}
    rows = [row(t, 0, k, 0.0, turn=v) for t, values in turns.items() for k, v in enumerate(values)]
    rows.append(row(3, 1, 0, 0.0, turn=1.0))
    std = math.sqrt(7 / 12) + 1e-6
    close(run("turn_level", rows, gamma=0.5).row_advantages,
          [(5 / 6) / std, 0, 0, (-1 / 6) / std, 0, (-2 / 3) / std, 0])
    for r in rows:  # without turn rewards the env rewards are used: all zero -> all zero
        r["turn"] = None
    assert torch.equal(run("turn_level", rows, gamma=0.5).row_advantages, torch.zeros(len(rows), dtype=torch.float64))


def test_fuzzy_anchors_join_the_first_similar_cluster_in_row_order():
    """a = 20 x "a", b = a + "b", c = a + "bbb". ratio(a, b) = 40/41 = 0.976, ratio(b, c) = 42/44 = 0.955,
    ratio(a, c) = 40/43 = 0.930. Rows (a, b, c): b joins a's cluster; c is compared with the cluster's first member
    a only (no chaining) -> clusters {a, b}, {c}. Rows (c, b, a): b joins c; a is too far from c -> {c, b}, {a}.
    Exact mode: three singletons. A row of another scenario group (anchor a) never joins these clusters: 3 anchor
    groups in fuzzy mode with 2 of 4 rows in a shared one, 4 singletons in exact mode."""
    a = "a" * 20
    b, c = a + "b", a + "bbb"
    for anchors in ((a, b, c), (c, b, a)):
        rows = [row(i, 0, 0, float(i), anchor) for i, anchor in enumerate(anchors)] + [row(9, 1, 0, 0.0, a)]
        fuzzy = run("gigpo", rows, anchor_mode="fuzzy").metrics
        assert (fuzzy["anchor_groups"], fuzzy["anchor_group_share"]) == (3, 0.5)
        exact = run("gigpo", rows).metrics
        assert (exact["anchor_groups"], exact["anchor_group_share"]) == (4, 0.0)
    # two single-step trajectories: fuzzy pairs them, so A = A^E + A^S = 2 * A^E = (-sqrt2, +sqrt2)
    rows = [row(0, 0, 0, 0.0, ANCHORS[0]), row(1, 0, 0, 1.0, ANCHORS[1])]
    close(run("gigpo", rows, anchor_mode="fuzzy").row_advantages, [-SQ2, SQ2])
    close(run("gigpo", rows).row_advantages, [-1 / SQ2, 1 / SQ2])


# ---------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,cfg", [("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("reinforce_pp_baseline", {}),
                                      ("gigpo", {"omega": 0.0})])  # gigpo with omega 0 = its episode part
@PROPERTY
@given(rows=step_rows(min_trajs=2), shift=st.floats(-50, 50, allow_nan=False))
def test_invariant_to_a_shift_of_every_score(name, cfg, rows, shift):
    shifted = [dict(r) for r in rows]
    for ids in trajectories(shifted).values():
        shifted[ids[0]]["reward"] += shift  # s_i + shift for every trajectory
    torch.testing.assert_close(run(name, shifted, **cfg).token_advantages, run(name, rows, **cfg).token_advantages,
                               rtol=1e-6, atol=1e-6)


@st.composite
def identical_copies(draw):
    """Groups of 2-4 identical trajectories (anchors dissimilar within a trajectory), masks differing per copy."""
    rows, traj = [], 0
    for group in range(draw(st.integers(1, 3))):
        steps = draw(st.integers(1, 4))
        anchors = draw(st.permutations(["kitchen", "hall", "garden", "cellar"]))[:steps]
        rewards = draw(st.lists(REWARDS, min_size=steps, max_size=steps))
        valid = draw(st.lists(st.booleans(), min_size=steps, max_size=steps))
        won = draw(st.booleans())
        for _ in range(draw(st.integers(2, 4))):
            rows += [row(traj, group, k, rewards[k], anchors[k], won, draw(MASKS), valid[k], rewards[k] * 2)
                     for k in range(steps)]
            traj += 1
    return rows


@pytest.mark.parametrize("name", sorted(set(NAMES) - {"reinforce_pp"}))  # reinforce_pp has no group baseline
@PROPERTY
@given(rows=identical_copies(), cfg=CONFIGS)
def test_groups_of_identical_trajectories_get_exactly_zero(name, rows, cfg):
    result = ADVANTAGES[name](make_batch(rows), cfg)
    assert torch.equal(result.token_advantages, torch.zeros_like(result.token_advantages))
    assert torch.equal(result.row_advantages, torch.zeros_like(result.row_advantages))


@PROPERTY
@given(rows=step_rows(), cfg=CONFIGS)
def test_gigpo_is_grpo_when_no_state_repeats(rows, cfg):
    rows = [dict(r, anchor=f"state {i}") for i, r in enumerate(rows)]
    cfg = dataclasses.replace(cfg, anchor_mode="exact")  # "state 1" and "state 2" would be fuzzy neighbours
    gigpo = compute_gigpo_advantages(make_batch(rows), cfg)
    assert gigpo.metrics["anchor_group_share"] == 0.0
    assert gigpo.metrics["anchor_groups"] == len(rows)
    torch.testing.assert_close(gigpo.token_advantages, compute_grpo_advantages(make_batch(rows), cfg).token_advantages)


@pytest.mark.parametrize("name", NAMES)
def test_all_masks_empty_and_empty_batch_give_zeros_never_nan(name):
    rows = [row(0, 0, 0, 1.0, "s", True, (0, 0)), row(0, 0, 1, 2.0, "t", True, (0, 0)), row(1, 0, 0, 0.0, mask=(0, 0))]
    result = run(name, rows)
    assert torch.equal(result.token_advantages, torch.zeros(3, 2, dtype=torch.float64))
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert result.metrics["advantage_mean"] == 0.0 and result.metrics["advantage_std"] == 0.0
    empty = ADVANTAGES[name](make_batch([]), AdvantageConfig())
    assert empty.token_advantages.shape == (0, 4) and empty.row_advantages.shape == (0,)
    if name in TOKEN_LEVEL:
        assert torch.equal(result.row_advantages, torch.zeros(3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# Registry, records, validation
# ---------------------------------------------------------------------------------------------------------------

def test_registry_rejects_duplicates_and_unknown_names():
    assert {"grpo", "gigpo", "graphgpo", "skillc"} <= set(NAMES)  # the skill estimators are registered on import
    with pytest.raises(ValueError, match="'gigpo' is already registered"):
        ADVANTAGES.register("gigpo")(lambda batch, cfg: None)
    assert ADVANTAGES["gigpo"] is compute_gigpo_advantages  # the failed registration changed nothing
    with pytest.raises(KeyError, match="valid names: " + ", ".join(NAMES)):
        ADVANTAGES["gae"]


def test_dtypes_and_metrics():
    rows = [row(0, 0, 0, 1.0, mask=(1, 1)), row(1, 0, 0, 0.0, mask=(1, 0))]
    result = ADVANTAGES["grpo"](make_batch(rows, dtype=torch.float32), AdvantageConfig())
    assert result.token_advantages.dtype == result.row_advantages.dtype == torch.float32
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # tokens (a, a, -a): mean a/3, population std sqrt(8/9) a
    assert result.metrics["advantage_mean"] == pytest.approx(a / 3)
    assert result.metrics["advantage_std"] == pytest.approx(math.sqrt(8 / 9) * a)
    integer = make_batch(rows)._replace(rewards=torch.tensor([1, 0]))
    assert ADVANTAGES["rloo"](integer, AdvantageConfig()).token_advantages.dtype == torch.get_default_dtype()


def test_broadcast_rows():
    values = torch.tensor([2.0, -1.0, torch.inf])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(broadcast_rows(values, mask), torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, 0.0], [0.0] * 3]))
    with pytest.raises(ValueError, match=r"row_values \[R\]"):
        broadcast_rows(values, mask[:2])


def test_malformed_batches_and_configs_are_rejected_with_a_fix():
    good = [row(0, 0, 0, 1.0), row(0, 0, 1, 1.0), row(1, 0, 0, 0.0)]
    with pytest.raises(ValueError, match="same step_index"):
        run("grpo", [good[0], dict(good[1], step=0), good[2]])
    with pytest.raises(ValueError, match="disagree on group_index"):
        run("grpo", [good[0], dict(good[1], group=5), good[2]])
    with pytest.raises(ValueError, match="disagree on won"):
        run("graphgpo", [good[0], dict(good[1], won=True), good[2]])
    with pytest.raises(ValueError, match=r"\['anchors'\]"):
        ADVANTAGES["gigpo"](make_batch(good)._replace(anchors=("s",)), AdvantageConfig())
    with pytest.raises(ValueError, match="response_mask"):
        ADVANTAGES["grpo"](make_batch(good)._replace(response_mask=torch.ones(2, 1)), AdvantageConfig())
    with pytest.raises(ValueError, match=r"\['exact', 'fuzzy'\]"):
        AdvantageConfig(anchor_mode="hash")
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=1.5)


def test_process_advantages_hand_computed():
    """HIPIF: A += w * grpo(process rewards per group). Group 0: [0.1, 0, -0.1] -> mean 0, unbiased std 0.1 ->
    [1, 0, -1]; group 1 all zero -> 0. With w = 0.5 and the eps of GRPO the added values are +-0.5/(1+eps/0.1)."""
    rows = [row(0, 0, 0, 0.0, mask=(1, 1)), row(0, 0, 1, 1.0, mask=(1, 0)), row(1, 0, 0, 0.0, mask=(1, 0)),
            row(2, 1, 0, 0.0, mask=(1, 0)), row(3, 1, 0, 0.0, mask=(1, 0))]
    batch = make_batch(rows)
    base = ADVANTAGES["grpo"](batch, AdvantageConfig())
    process = torch.tensor([0.1, 0.0, -0.1, 0.0, 0.0], dtype=torch.float64)
    out = add_process_advantages(base, batch, process, weight=0.5)
    added = out.row_advantages - base.row_advantages
    scale = 0.5 * 0.1 / (0.1 + GRPO_EPS)
    close(added, [scale, 0.0, -scale, 0.0, 0.0])
    close(out.token_advantages - base.token_advantages, broadcast_rows(added, batch.response_mask))
    assert out.metrics["process_close_share"] == pytest.approx(2 / 5) and out.metrics["process_reward_mean"] == 0.0
    with pytest.raises(ValueError, match="process_rewards"):
        add_process_advantages(base, batch, process[:3], weight=0.5)
