"""RockPaperScissorsText: hand-checked opponent strategies, split parameters, rewards, expert, anchors."""
from __future__ import annotations

from collections import Counter

import pytest

from envs import ENVS, make_env, make_scenarios
from envs.rps import (MOVES, SPLIT_PARAMS, STRATEGIES, Opponent, RockPaperScissorsText, beats, draw_opponent,
                      outcome)
from envs.scenarios import expert_trajectory

R, P, S = 0, 1, 2


def opponent_moves(opp: Opponent, agent: list[int]) -> list[int]:
    """The opponent's move in each round when the agent plays ``agent``."""
    return [opp.move(agent[:i], i) for i in range(len(agent))]


def test_move_rules():
    assert [beats(m) for m in (R, P, S)] == [P, S, R]
    assert [outcome(P, R), outcome(R, P), outcome(S, S), outcome(R, S)] == [1, -1, 0, 1]


def test_cycle_forward_and_backward():
    assert opponent_moves(Opponent("cycle", opening=R, step=1), [R] * 5) == [R, P, S, R, P]
    assert opponent_moves(Opponent("cycle", opening=P, step=-1), [S] * 4) == [P, R, S, P]


def test_copy_and_beat_last_with_lags():
    agent = [S, R, R, P]
    assert opponent_moves(Opponent("copy", opening=P, lag=1), agent) == [P, S, R, R]
    assert opponent_moves(Opponent("copy", opening=P, lag=2), agent) == [P, P, S, R]
    assert opponent_moves(Opponent("beat_last", opening=R, lag=1), agent) == [R, R, P, P]
    assert opponent_moves(Opponent("beat_last", opening=R, lag=2), agent) == [R, R, R, P]


def test_counter_frequent_whole_history_and_window():
    agent = [S, S, R, R, R, P]
    # counts so far: -, S1, S2, S2R1, S2R2 (tie -> rock first), S2R3  => opening, R, R, R, P, P
    assert opponent_moves(Opponent("counter_frequent", opening=P), agent) == [P, R, R, R, P, P]
    # window 3: -, [S], [S S], [S S R], [S R R], [R R R] => opening, R, R, R, P, P
    windowed = Opponent("counter_frequent", opening=S, window=3)
    assert opponent_moves(windowed, agent) == [S, R, R, R, P, P]
    # three old scissors: the whole history says scissors (-> rock), the last 3 (P P R) say paper (-> scissors)
    assert Opponent("counter_frequent", opening=S).move([S, S, S, P, P, R], 6) == R
    assert windowed.move([S, S, S, P, P, R], 6) == S


def test_pattern_and_biased_replay_their_sequences():
    assert opponent_moves(Opponent("pattern", opening=R, sequence=(P, R, R)), [R] * 7) == [P, R, R, P, R, R, P]
    biased = Opponent("biased", opening=R, sequence=(S, S, R, S))
    assert opponent_moves(biased, [P, R, S, P]) == [S, S, R, S]  # independent of the agent's moves


def test_draw_opponent_is_seeded_and_uses_the_split_parameters():
    assert draw_opponent(1, "train", 9) == Opponent("beat_last", opening=P, step=1, lag=1, window=0)
    assert draw_opponent(0, "train", 9) == Opponent("pattern", opening=P, sequence=(P, R, R))
    held = draw_opponent(0, "heldout", 9)
    assert (held.step, held.lag, held.window, len(held.sequence)) == (-1, 2, 3, 4)
    for seed in range(40):
        drawn = draw_opponent(seed, "train", 9)
        assert draw_opponent(seed, "train", 9, strategy=drawn.strategy) == drawn  # fixing it changes nothing
        assert len(set(draw_opponent(seed, "heldout", 9, strategy="pattern").sequence)) >= 2
    favourites = {Counter(draw_opponent(seed, "train", 50, "biased").sequence).most_common(1)[0][0]
                  for seed in range(30)}
    assert favourites == {R, P, S}  # the favourite move is drawn per seed
    favourite_share = [max(Counter(draw_opponent(s, split, 400, "biased").sequence).values()) / 400
                       for split in ("train", "heldout") for s in range(3)]
    assert all(abs(f - 0.8) < 0.07 for f in favourite_share[:3])
    assert all(abs(f - 0.6) < 0.07 for f in favourite_share[3:])
    assert SPLIT_PARAMS["train"] != SPLIT_PARAMS["heldout"]


def test_strategy_is_drawn_per_seed_and_hidden():
    env = RockPaperScissorsText()
    drawn = Counter()
    for seed in range(120):
        obs, info = env.reset(seed=seed)
        drawn[env.opponent.strategy] += 1
        assert not any(name in obs for name in STRATEGIES) and not any(name in str(info) for name in STRATEGIES)
    assert set(drawn) == set(STRATEGIES)
    env.reset(seed=3, options={"opponent": "cycle"})
    assert env.opponent.strategy == "cycle"
    fixed = RockPaperScissorsText(opponent="copy")
    fixed.reset(seed=3)
    assert fixed.opponent.strategy == "copy"


def test_scripted_match_observations_and_rewards():
    env = make_env("rps")  # seed 1: beat_last, opening paper
    obs, info = env.reset(seed=1)
    assert obs == "round 1/9\nlast: -\nscore: you 0, opp 0"
    assert info["anchor"] == "9:" and info["admissible_actions"] == ["rock", "paper", "scissors"]
    steps = [env.step(a) for a in ("rock", "rock", "paper", "scissors")]
    # opp: paper (opening), paper (beats rock), paper (beats rock), scissors (beats paper)
    assert [round(s[1] * 9) for s in steps] == [-1, -1, 0, 0]
    assert steps[-1][0] == "round 5/9\nlast: you scissors, opp scissors (tie)\nscore: you 0, opp 2"
    assert steps[-1][4]["anchor"] == "9:rp.rp.pp.ss" and steps[-1][4]["score"] == (0, 2)


def test_winning_and_losing_matches_end_on_the_last_round():
    env = RockPaperScissorsText(opponent="cycle", rounds=3)
    env.reset(seed=0, options={"split": "train"})  # cycle from paper: P, S, R
    results = [env.step(a) for a in ("scissors", "rock", "rock")]  # win, win, tie
    obs, reward, terminated, truncated, info = results[-1]
    assert [r[2] for r in results] == [False, False, True] and not truncated
    assert sum(r[1] for r in results) == pytest.approx(2 / 3) and info["won"] is True
    assert obs.startswith("match over: you won") and env.expert_action() is None
    env.reset(seed=0)
    *_, (obs, _, terminated, _, info) = [env.step(a) for a in ("rock", "paper", "scissors")]  # all losses
    assert terminated and info["won"] is False and obs.startswith("match over: you lost")


def test_invalid_actions_and_truncation():
    env = RockPaperScissorsText(rounds=2, invalid_penalty=0.5)
    obs0, info0 = env.reset(seed=4)
    obs, reward, terminated, truncated, info = env.step("lizard")
    assert (obs, reward, terminated, truncated, info["action_valid"]) == (obs0, -0.5, False, False, False)
    assert info["anchor"] == info0["anchor"] and info["round"] == 0
    assert env.step(" Rock\n")[4]["action_valid"] is True
    env.step(None)
    _, _, terminated, truncated, info = env.step("")  # 4th step = 2 * rounds
    assert (terminated, truncated, info["won"]) == (False, True, False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("rock")
    with pytest.raises(RuntimeError, match="reset"):
        RockPaperScissorsText().step("rock")


def test_anchor_is_the_observable_history_not_the_strategy():
    c, d = RockPaperScissorsText(opponent="cycle"), RockPaperScissorsText(opponent="pattern")
    c.reset(seed=0)
    d.reset(seed=0)  # both open with paper (seed 0's opening and its pattern start)
    assert c.step("rock")[4]["anchor"] == d.step("rock")[4]["anchor"] == "9:rp"  # same info state
    assert (c.step("rock")[4]["anchor"], d.step("rock")[4]["anchor"]) == ("9:rp.rs", "9:rp.rr")


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_expert_wins_every_round_of_every_scenario(split):
    env_cls = ENVS["rps"]
    assert env_cls.split_aware is True
    for scenario in make_scenarios("rps", split, 150, seed=0):
        assert dict(scenario.options)["split"] == split
        steps = expert_trajectory(scenario)  # raises unless won
        env = make_env("rps")
        env.reset(seed=scenario.seed, options=dict(scenario.options))
        total = sum(env.step(action)[1] for _, _, action in steps)
        assert len(steps) == 9 and total == pytest.approx(1.0)


def test_same_seed_same_transcript_and_full_verbosity():
    def run():
        env = RockPaperScissorsText(verbosity="full")
        out = [env.reset(seed=99, options={"split": "heldout"})]
        out += [env.step(MOVES[i % 3]) for i in range(9)]
        return [(o[0], o[-1]["anchor"]) for o in out]

    first = run()
    assert first == run()
    obs, anchor = first[3]  # after 3 rounds
    assert obs.split("\n")[-1] == "history: " + anchor.split(":")[1].replace(".", " ")
    assert first[0][0].endswith("history: -")


def test_bad_kwargs_and_options_say_what_is_valid():
    with pytest.raises(ValueError, match="valid opponents"):
        RockPaperScissorsText(opponent="mirror")
    with pytest.raises(ValueError, match="rounds must be"):
        RockPaperScissorsText(rounds=0)
    env = RockPaperScissorsText()
    with pytest.raises(ValueError, match="valid options"):
        env.reset(seed=0, options={"hands": 2})
    with pytest.raises(ValueError, match="valid splits"):
        env.reset(seed=0, options={"split": "test"})
    obs, _ = env.reset(seed=0, options={"rounds": 4})
    assert obs.startswith("round 1/4") and env.max_steps == 8
