"""The harness over the whole env suite: every env runs in the batched loop; expert replays through fold and
OpenAI-format tool calls reproduce the warm-start prompts exactly, win, and record process rewards and tool calls."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agents.context import Turn, fold_process_rewards
from agents.demos import expert_texts
from agents.rollout import _process_reward, run_episodes, summarize
from envs import ENVS, make_scenarios
from models.engine import Generation, SamplingParams

SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)
FAST_ENVS = sorted(name for name in ENVS if name != "textworld_cooking" and not name.startswith("_test"))


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Task: State: Action: go to take put search answer"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class ReplayEngine:
    """Answers a prompt it knows with the recorded response (+ eos); anything else with ``fallback``."""

    policy_version = "replay"

    def __init__(self, tokenizer, pairs: list[tuple[str, str]], fallback: str = " nothing"):
        self.tokenizer, self.answers, self.fallback = tokenizer, dict(pairs), fallback
        self.unknown_prompts = 0

    def generate(self, prompts, sampling):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            if text not in self.answers:
                self.unknown_prompts += 1
            ids = self.tokenizer.encode(self.answers.get(text, self.fallback), add_special_tokens=False)
            ids.append(self.tokenizer.eos_token_id)
            out.append(Generation(ids, [-0.1] * len(ids), "stop"))
        return out


class RandomWordsEngine:
    """Responds with random admissible-looking words (so every env sees mostly invalid, some valid actions)."""

    policy_version = "random"
    WORDS = ["left", "up", "look", "go", "to", "1", "+", "2", "child", "back", "rock", "call", "search[x]", "ls"]

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling):
        rng = random.Random(sampling.seed)
        out = []
        for _ in prompts:
            text = " " + " ".join(rng.choice(self.WORDS) for _ in range(rng.randint(1, 3)))
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Generation(ids, [-1.0] * len(ids), "stop"))
        return out


@pytest.mark.parametrize("name", FAST_ENVS)
def test_every_env_runs_in_the_batched_loop(tokenizer, name):
    scenarios = make_scenarios(name, "heldout", 3, seed=0)
    trajectories = run_episodes(RandomWordsEngine(tokenizer), tokenizer, scenarios, group_size=2, sampling=SAMPLING,
                                context="window", history_turns=1, progress=False)
    assert len(trajectories) == 6
    for traj in trajectories:
        assert traj.status in ("complete", "truncated"), traj.error
        assert traj.num_steps == len(traj.steps) >= 1 and traj.env == name
        assert traj.metadata["prompt_tokens"] == sum(len(s.prompt_ids) for s in traj.steps) > 0
        assert all(s.context_manager == "window" for s in traj.steps)


def test_one_batch_mixes_envs(tokenizer):
    scenarios = make_scenarios("sokoban", "train", 2, seed=1) + make_scenarios("countdown", "train", 2, seed=1)
    engine = RandomWordsEngine(tokenizer)
    trajectories = run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SAMPLING, progress=False,
                                env_kwargs={"sokoban": {"max_steps": 3}, "countdown": {"max_steps": 2}})
    assert [t.env for t in trajectories] == ["sokoban"] * 4 + ["countdown"] * 4
    assert max(t.num_steps for t in trajectories if t.env == "sokoban") <= 3
    assert max(t.num_steps for t in trajectories if t.env == "countdown") <= 2
    with pytest.raises(ValueError, match="not registered envs"):
        run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SAMPLING, progress=False,
                     env_kwargs={"max_steps": 3})


def test_fold_expert_replay_wins_and_earns_process_rewards(tokenizer):
    scenarios = make_scenarios("household", "heldout", 6, seed=3)
    pairs = expert_texts(scenarios, context="fold")
    assert any("<subgoal>" in response for _, response in pairs) and any("<done>" in r for _, r in pairs)
    assert any("Plan: [x]" in prompt and "Done: " in prompt for prompt, _ in pairs)
    engine = ReplayEngine(tokenizer, pairs)
    trajectories = run_episodes(engine, tokenizer, scenarios, group_size=1, sampling=SAMPLING, context="fold",
                                process_alpha=0.15, progress=False)
    assert engine.unknown_prompts == 0  # rollout prompts are exactly the warm-start prompts
    assert all(t.won for t in trajectories)
    for traj in trajectories:
        closes = [s.process_reward for s in traj.steps if "<done>" in s.response_text]
        assert closes and all(r == pytest.approx(0.15) for r in closes)  # the expert closes after real progress
        assert all(s.process_reward == 0.0 for s in traj.steps if "<done>" not in s.response_text)
        assert all(s.context_manager == "fold" for s in traj.steps)


RESPONSES = st.sampled_from([" look", " <subgoal>a</subgoal> go", " <done>did a</done> go", "<done>x</done>",
                             " <done>s</done> <subgoal>b</subgoal> take", "<subgoal>c</subgoal>", " <done>"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(RESPONSES, st.integers(0, 1)), max_size=12), st.sampled_from([0.0, 0.1, 0.25]),
       st.booleans())
def test_a_steps_process_reward_is_final_when_the_step_is_made(turn_specs, alpha, subgoals):
    """The loop scores each step as it is recorded (its StepRecord never changes after): the reward of turn k from
    turns[:k + 1] equals fold_process_rewards over the whole episode, so no later turn could change it."""
    done, turns = 0, []
    for response, progress in turn_specs:
        turns.append(Turn("obs", response, "act", done if subgoals else None))
        done += progress
    assert [_process_reward(turns[:k + 1], alpha) for k in range(len(turns))] == fold_process_rewards(turns, alpha)


def test_fold_penalizes_a_close_without_progress(tokenizer):
    scenario = make_scenarios("household", "train", 1, seed=5)
    first_prompt = expert_texts(scenario, context="fold")[0][0]
    # opens "dance", looks around, then closes it with nothing achieved; later closes have nothing open
    engine = ReplayEngine(tokenizer, [(first_prompt, " <subgoal>dance</subgoal> look")],
                          fallback=" <done>danced</done> look")
    traj = run_episodes(engine, tokenizer, scenario, group_size=1, sampling=SAMPLING, context="fold",
                        process_alpha=0.1, progress=False, env_kwargs={"household": {"max_steps": 3}})[0]
    assert traj.steps[0].response_text.startswith(" <subgoal>dance")
    assert [s.process_reward for s in traj.steps] == [0.0, pytest.approx(-0.1), 0.0]
    assert "Plan: [x] dance" in traj.steps[2].prompt_text and "Done: danced." in traj.steps[2].prompt_text


def test_openai_tool_calls_replay_on_search_qa(tokenizer):
    scenarios = make_scenarios("search_qa", "heldout", 5, seed=2)
    pairs = expert_texts(scenarios, tool_format="openai")
    assert all(response.startswith(" <tool_call>{") for _, response in pairs)
    trajectories = run_episodes(ReplayEngine(tokenizer, pairs), tokenizer, scenarios, group_size=1,
                                sampling=SAMPLING, progress=False)
    assert all(t.won for t in trajectories)
    steps = [s for t in trajectories for s in t.steps]
    assert all(s.tool_calls == 1 for s in steps) and sum(s.tool_successes for s in steps) >= len(steps) - 1
    assert summarize(trajectories)["tool_calls_per_episode"] == pytest.approx(len(steps) / 5)


def test_skill_slot_token_cost_is_counted_per_step(tokenizer):
    scenarios = make_scenarios("sokoban", "train", 2, seed=4)
    skills = "Skill: push the box toward the target, never into a corner."
    per_step = len(tokenizer.encode(skills + "\n", add_special_tokens=False))
    with_skills = run_episodes(RandomWordsEngine(tokenizer), tokenizer, scenarios, group_size=2, sampling=SAMPLING,
                               progress=False, skills_for=lambda query: (skills, ["push-box"]),
                               env_kwargs={"sokoban": {"max_steps": 3}})
    for traj in with_skills:
        assert traj.metadata["skill_prompt_tokens"] == per_step * traj.num_steps
        assert all(s.prompt_text.startswith(skills) and s.skill_ids == ["push-box"] for s in traj.steps)
    summary = summarize(with_skills)
    assert summary["mean_skill_prompt_tokens"] == pytest.approx(sum(per_step * t.num_steps for t in with_skills) / 4)
    plain = run_episodes(RandomWordsEngine(tokenizer), tokenizer, scenarios, group_size=2, sampling=SAMPLING,
                         progress=False, env_kwargs={"sokoban": {"max_steps": 3}})
    assert summarize(plain)["mean_skill_prompt_tokens"] == 0.0


def test_skill_slot_is_asked_at_reset_or_every_turn_with_the_current_observation(tokenizer):
    scenarios = make_scenarios("sokoban", "train", 1, seed=6)
    for per_step in (False, True):
        queries = []

        def skills_for(query):
            queries.append(query)
            return f"Skill for turn {query.turn}.", [f"s{query.turn}"]

        (traj,) = run_episodes(RandomWordsEngine(tokenizer), tokenizer, scenarios, group_size=1, sampling=SAMPLING,
                               progress=False, skills_for=skills_for, skills_per_step=per_step,
                               env_kwargs={"sokoban": {"max_steps": 3}})
        assert [q.turn for q in queries] == (list(range(traj.num_steps)) if per_step else [0])
        assert all(q.scenario == scenarios[0] and q.task and q.observation == s.observation
                   for q, s in zip(queries, traj.steps))
        expected = [f"s{i}" if per_step else "s0" for i in range(traj.num_steps)]
        assert [s.skill_ids[0] for s in traj.steps] == expected
        assert all(s.prompt_text.startswith(f"Skill for turn {int(e[1:])}.") for s, e in zip(traj.steps, expected))
