"""HoldemText: rlcard limit hold'em behind the text contract: deals, payoffs, opponents, anchors, truncation."""
from __future__ import annotations

import numpy as np
import pytest

from envs import ENVS, make_env
from envs.holdem import (ACTIONS, OPPONENTS, HoldemText, caller_opponent, card_text, random_opponent,
                         rule_opponent, sort_cards)

SEED7_RULE_OBS = ("hand 1/1, preflop, you small blind\n"
                  "cards: Tc 7h | board: -\n"
                  "pot 3: you 1, opp 2\n"
                  "opp: -\n"
                  "legal: call raise fold")


def passive(info: dict) -> str:
    return "check" if "check" in info["admissible_actions"] else "call"


def play(env: HoldemText, seed: int, policy, options: dict | None = None) -> tuple[list, float, dict]:
    """Whole episode with ``policy(info, t) -> action``: (transcript, return, last info)."""
    obs, info = env.reset(seed=seed, options=options)
    transcript, total, t, done = [(obs, info["anchor"])], 0.0, 0, False
    while not done:
        action = policy(info, t)
        obs, reward, terminated, truncated, info = env.step(action)
        transcript.append((action, obs, reward, terminated, truncated, info["anchor"], info["won"]))
        total, t, done = total + reward, t + 1, terminated or truncated
    return transcript, total, info


def test_registered_and_seed7_observation_is_fixed_across_processes():
    # rlcard hashes the seed with sha512 before seeding numpy: this hard-coded deal holds in every process.
    assert ENVS["holdem"] is HoldemText
    env = make_env("holdem")
    obs, info = env.reset(seed=7)
    assert obs == SEED7_RULE_OBS
    assert info["anchor"] == "sb|Tc7h||"
    assert info["admissible_actions"] == ["call", "raise", "fold"]
    assert (info["action_valid"], info["won"], info["hand"], info["total_bb"]) == (True, False, 1, 0.0)
    assert env.expert_action() is None
    assert "call, raise, fold, check" in env.task_description()


def test_walks_are_redealt_and_not_counted():
    # seed 7's first deal makes the agent big blind (the caller calls it); the rule agent folds that 7-high hand
    # as small blind before the agent acts, so the env re-deals and the counted hand 1 is the second deal.
    _, caller_info = HoldemText(opponent="caller").reset(seed=7)
    assert caller_info["anchor"] == "bb|Tc4h||c"
    _, rule_info = HoldemText(opponent="rule").reset(seed=7)
    assert rule_info["anchor"] == "sb|Tc7h||" and rule_info["hand"] == 1 and rule_info["total_bb"] == 0.0
    for seed in range(60):  # every episode starts at an agent decision
        for opponent in OPPONENTS:
            _, info = HoldemText(opponent=opponent).reset(seed=seed)
            assert info["admissible_actions"] and info["hand"] == 1


def test_same_seed_same_transcript_with_the_random_opponent():
    def policy(info, t):
        return info["admissible_actions"][t % len(info["admissible_actions"])]

    first = play(HoldemText(opponent="random", hands=3), 123, policy)
    second = play(HoldemText(opponent="random", hands=3), 123, policy)
    assert first == second
    reused = HoldemText(opponent="random", hands=3)
    play(reused, 5, policy)
    assert play(reused, 123, policy) == first  # reset re-seeds the deck and the opponent
    deals = {HoldemText(opponent="random").reset(seed=s)[1]["anchor"] for s in range(20)}
    assert len(deals) == 20


def test_folding_preflop_loses_the_blind():
    env = HoldemText(opponent="caller")
    obs, info = env.reset(seed=0)  # agent is small blind, first to act
    assert info["anchor"] == "sb|Tc7s||" and "pot 3: you 1, opp 2" in obs
    obs, reward, terminated, truncated, info = env.step("fold")
    assert (reward, terminated, truncated, info["won"]) == (-0.5, True, False, False)
    assert obs.startswith("hand 1: you folded, you -0.5bb")
    assert info["admissible_actions"] == [] and info["anchor"] == "sb|Tc7s||f"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("call")

    env.reset(seed=1)  # agent is big blind, the caller limped: folding (even with check free) loses 2 chips
    _, reward, terminated, _, info = env.step("fold")
    assert (reward, terminated, info["total_bb"]) == (-1.0, True, -1.0)


def test_showdown_payoffs_hand_checked():
    # seed 8: agent Qc 8d vs caller's 4s 3s, board Qs 7d 5h Kc 3h: a pair of queens beats a pair of threes.
    transcript, total, info = play(HoldemText(opponent="caller"), 8, lambda i, t: passive(i))
    assert [step[0] for step in transcript[1:]] == ["call", "check", "check", "check"]
    assert total == 1.0 and info["won"] is True  # 2 chips each in, 2 won = +1bb
    assert transcript[-1][1].startswith("hand 1: showdown, opp had 4s 3s, you +1bb")
    assert info["anchor"] == "sb|Qc8d|Qs7d5hKc3h|ck/kk/kk/kk"
    # raising every street: preflop 1+3, flop +2, turn +4, river +4 = 14 chips each = +7bb.
    transcript, total, info = play(HoldemText(opponent="caller"), 8, lambda i, t: "raise")
    assert total == 7.0 and info["won"] is True
    assert "pot 8: you 4, opp 4" in transcript[1][1]  # after raise + call preflop
    # seed 6: both play the board's two pair (Ts Td 3c 3d K): split pot, payoff 0, not won.
    _, total, info = play(HoldemText(opponent="caller"), 6, lambda i, t: passive(i))
    assert total == 0.0 and info["won"] is False


def test_illegal_and_garbage_actions_are_invalid_and_change_nothing():
    env = HoldemText(opponent="caller", invalid_penalty=0.25)
    obs0, info0 = env.reset(seed=0)
    for action in ("check", "@@", "", "raise it", None):  # check is illegal when facing the big blind
        obs, reward, terminated, truncated, info = env.step(action)
        assert (obs, reward, terminated, truncated) == (obs0, -0.25, False, False)
        assert info["action_valid"] is False and info["anchor"] == info0["anchor"]
    _, _, _, _, info = env.step("  CALL ")
    assert info["action_valid"] is True and info["anchor"] == "sb|Tc7s|KsJcTh|ck/"


def test_truncation_counts_invalid_actions_and_is_not_a_win():
    env = HoldemText(opponent="caller", max_steps=3)
    env.reset(seed=8)
    env.step("call")
    env.step("nonsense")
    obs, reward, terminated, truncated, info = env.step("check")
    assert (terminated, truncated, info["won"], info["steps"]) == (False, True, False, 3)
    assert info["admissible_actions"] == [] and "turn" in obs
    with pytest.raises(RuntimeError, match="reset"):
        env.step("check")
    assert HoldemText(hands=3).max_steps == 48


def test_several_hands_carry_a_running_total():
    env = HoldemText(opponent="caller")
    obs, info = env.reset(seed=8, options={"hands": 3})
    assert obs.startswith("hand 1/3, preflop, you small blind, total +0bb")
    assert info["anchor"].startswith("h1|")
    rewards, hands_seen, done = [], {1}, False
    while not done:
        obs, reward, terminated, truncated, info = env.step("fold")
        rewards.append(reward)
        hands_seen.add(info["hand"])
        done = terminated or truncated
        if not done:
            assert f"total {sum(rewards):+g}bb" in obs.split("\n")[0] and "last hand" in obs
    assert terminated and len(rewards) == 3 and hands_seen == {1, 2, 3}
    assert all(r in (-0.5, -1.0) for r in rewards) and info["total_bb"] == sum(rewards)
    assert obs.split("\n")[1] == f"match over: total {sum(rewards):+g}bb" and info["won"] is False


def test_opponent_policies():
    def state(hand, public, legal):
        return {"raw_obs": {"hand": hand, "public_cards": public}, "raw_legal_actions": legal}

    assert rule_opponent(state(["SA", "HA"], [], ["call", "raise", "fold"]), None) == "raise"  # pair
    assert rule_opponent(state(["S7", "H2"], [], ["raise", "fold", "check"]), None) == "fold"  # rlcard's rule
    assert rule_opponent(state(["SA", "HA"], [], ["call", "fold"]), None) == "call"  # raise capped -> call
    assert caller_opponent(state([], [], ["raise", "fold", "check"]), None) == "check"
    assert caller_opponent(state([], [], ["call", "raise", "fold"]), None) == "call"
    picks = {random_opponent(state([], [], ["call", "raise", "fold"]), np.random.default_rng(s)) for s in range(30)}
    assert picks == {"call", "raise", "fold"}


def test_cards_and_anchor_are_canonical():
    assert card_text("SA") == "As" and card_text("HT") == "Th"
    assert sort_cards(["2c", "Ah", "Td", "As"]) == ["Ah", "As", "Td", "2c"]
    env = HoldemText(opponent="caller", verbosity="full")
    obs, _ = env.reset(seed=8)
    assert "betting: -" in obs
    obs, _, _, _, info = env.step("call")
    assert "betting: ck" in obs and info["anchor"] == "sb|Qc8d|Qs7d5h|ck/"
    assert set(ACTIONS) == {"call", "raise", "fold", "check"}


def test_bad_kwargs_and_options_say_what_is_valid():
    with pytest.raises(ValueError, match="valid opponents"):
        HoldemText(opponent="shark")
    with pytest.raises(ValueError, match="hands must be"):
        HoldemText(hands=0)
    env = HoldemText()
    with pytest.raises(ValueError, match="valid options"):
        env.reset(seed=0, options={"split": "train"})
    with pytest.raises(ValueError, match="valid opponents"):
        env.reset(seed=0, options={"opponent": "pro"})
    with pytest.raises(ValueError, match="non-negative"):
        env.reset(seed=-1)
    with pytest.raises(RuntimeError, match="reset"):
        HoldemText().step("call")
    obs, info = env.reset(seed=None)  # an unseeded reset still deals a playable hand
    assert info["admissible_actions"]
