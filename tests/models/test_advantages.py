"""Per-trajectory outcome functions (grpo_scores, dr_grpo_scores, rloo_scores): hand-computed values, loop
reference vs vectorized, properties; and the Registry class. The batch estimators are in test_step_advantages.py."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.advantages import ADVANTAGES
from models.outcome_advantages import dr_grpo_scores, grpo_scores, rloo_scores
from models.registry import Registry

SCORE_FNS = {"grpo": grpo_scores, "dr_grpo": dr_grpo_scores, "rloo": rloo_scores}


def loop_reference(name: str, scores: list[float], groups: list[int]) -> list[float]:
    """Plain-Python version of each estimator, one group at a time."""
    out = [0.0] * len(scores)
    for g in set(groups):
        members = [i for i, gi in enumerate(groups) if gi == g]
        values = [scores[i] for i in members]
        n = len(values)
        mean = sum(values) / n if n > 1 else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 1.0
        all_equal = n > 1 and len(set(values)) == 1
        for i in members:
            if all_equal:
                out[i] = 0.0
            elif name == "grpo":
                out[i] = (scores[i] - mean) / (std + 1e-6)
            elif name == "dr_grpo":
                out[i] = scores[i] - mean
            elif name == "rloo":
                out[i] = scores[i] if n == 1 else n / (n - 1) * (scores[i] - mean)
    return out


def test_grpo_hand_computed():
    # group 0: [1, 0, 0, 1] mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.5/0.57735 = +-0.866024
    # group 5 (single): A = s = 2.5; group 9: all equal -> 0
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.5, 0.3, 0.3, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 5, 9, 9, 9])
    a = grpo_scores(scores, groups)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(a, torch.tensor([expected, -expected, -expected, expected, 2.5, 0.0, 0.0, 0.0]))
    assert torch.equal(a[5:], torch.zeros(3))  # exactly zero, although 0.3 * 3 / 3 != 0.3 in floating point
    # eps is a parameter: [1, 0] mean 0.5, std sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-sqrt(0.5) with eps 0
    half = math.sqrt(0.5)
    torch.testing.assert_close(grpo_scores(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.0),
                               torch.tensor([half, -half]))


def test_dr_grpo_and_rloo_hand_computed():
    scores = torch.tensor([3.0, 1.0, 2.0, 4.0, -1.0])
    groups = torch.tensor([1, 1, 1, 2, 3])  # group 1 mean 2; group 2 and 3 singletons
    torch.testing.assert_close(dr_grpo_scores(scores, groups), torch.tensor([1.0, -1.0, 0.0, 4.0, -1.0]))
    # rloo: 3 - mean(1, 2) = 1.5; 1 - mean(3, 2) = -1.5; 2 - mean(3, 1) = 0
    torch.testing.assert_close(rloo_scores(scores, groups), torch.tensor([1.5, -1.5, 0.0, 4.0, -1.0]))


def test_unsorted_group_ids_and_dtypes():
    scores = torch.tensor([1, 0, 1, 1], dtype=torch.int64)
    groups = torch.tensor([7, 3, 7, 3])
    a = rloo_scores(scores, groups)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, torch.tensor([0.0, -1.0, 0.0, 1.0]))
    assert grpo_scores(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="1-D"):
        grpo_scores(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_registry_names_and_errors():
    assert {"grpo", "dr_grpo", "rloo"} <= set(ADVANTAGES.names())
    with pytest.raises(KeyError, match="dr_grpo, gigpo, graphgpo, grpo"):
        ADVANTAGES["gae"]
    registry = Registry("thing")
    registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda: 2)


groups_and_scores = st.lists(
    st.tuples(st.integers(0, 4), st.floats(-100, 100, allow_nan=False, width=32)), min_size=1, max_size=24
)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@settings(max_examples=60, deadline=None)
@given(data=groups_and_scores)
def test_vectorized_matches_loop(name, data):
    groups, scores = [g for g, _ in data], [s for _, s in data]
    got = SCORE_FNS[name](torch.tensor(scores, dtype=torch.float64), torch.tensor(groups))
    expected = torch.tensor(loop_reference(name, scores, groups), dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@settings(max_examples=60, deadline=None)
@given(data=groups_and_scores, shift=st.floats(-50, 50, allow_nan=False))
def test_invariant_to_reward_shift_in_groups_of_two_or_more(name, data, shift):
    groups = torch.tensor([g for g, _ in data])
    scores = torch.tensor([s for _, s in data], dtype=torch.float64)
    fn = SCORE_FNS[name]
    sizes = torch.bincount(groups)[groups]
    shared = sizes > 1  # singletons keep their raw score by definition
    torch.testing.assert_close(fn(scores + shift, groups)[shared], fn(scores, groups)[shared], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@given(value=st.floats(-1e6, 1e6, allow_nan=False), size=st.integers(2, 16))
def test_all_equal_group_gives_exactly_zero(name, value, size):
    scores = torch.full((size,), value, dtype=torch.float32)
    assert torch.equal(SCORE_FNS[name](scores, torch.zeros(size, dtype=torch.long)), torch.zeros(size))
