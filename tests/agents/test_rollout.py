"""The batched rollout loop, prompts, expert demonstrations and summaries, with fake engines and a tiny tokenizer."""
from __future__ import annotations

import random
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agents.prompts import build_prompt, response_text
from agents.demos import expert_demonstrations
from agents.rollout import run_episodes, summarize
from datapool.records import StepRecord, TrajectoryRecord
from envs import ENVS, Scenario, expert_trajectory, make_scenarios, register_env, shortest_path_actions
from envs.frozenlake import FrozenLakeText
from models.engine import Generation, SamplingParams

SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in milliseconds on prompts and responses of a few expert episodes."""
    texts = []
    for scenario in make_scenarios("frozenlake", "train", 20, seed=123):
        history = []
        for task, obs, action in expert_trajectory(scenario):
            texts += [build_prompt(task, obs, history[-1:], "Skill: walk around holes."), response_text(action)]
            history.append((obs, action))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class FakeEngine:
    """Answers every prompt with ``choose(prompt text)`` + eos, and records each generate call."""

    def __init__(self, tokenizer, choose, policy_version: str = "v0"):
        self.tokenizer, self.choose, self.policy_version = tokenizer, choose, policy_version
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        out = []
        for ids in prompts:
            text = response_text(self.choose(self.tokenizer.decode(ids)))
            token_ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Generation(token_ids=token_ids, logprobs=[-0.5] * len(token_ids), finish_reason="stop"))
        return out


class RandomEngine:
    """Samples random ids (eos included sometimes) from a generator seeded by ``sampling.seed``."""

    policy_version = "rand"

    def __init__(self, vocab_size: int, eos: int):
        self.vocab_size, self.eos = vocab_size, eos
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        rng = random.Random(sampling.seed)
        out = []
        for _ in prompts:
            ids: list[int] = []
            while len(ids) < sampling.max_new_tokens:
                ids.append(rng.randrange(self.vocab_size))
                if ids[-1] == self.eos:
                    break
            out.append(Generation(ids, [-rng.random() for _ in ids], "stop" if ids[-1] == self.eos else "length"))
        return out


def oracle(prompt: str) -> str:
    """The shortest-path action for the last grid in a prompt (P's own cell is never a hole)."""
    grid_text = prompt.rsplit("State:\n", 1)[1].rsplit("\nAction:", 1)[0]
    rows = [line.split(" ") for line in grid_text.split("\n")]
    (r, c), = [(r, c) for r, row in enumerate(rows) for c, cell in enumerate(row) if cell == "P"]
    desc = ["".join("F" if cell == "P" else cell for cell in row) for row in rows]
    return shortest_path_actions(desc, r, c)[0]


def test_prompt_layout_is_exact():
    assert build_prompt("Do it.", "A B\nC D") == "Task: Do it.\nState:\nA B\nC D\nAction:"
    assert build_prompt("T", "o2", [("o0", "left"), ("o1", "up")], "SKILLS") == (
        "SKILLS\nTask: T\nState:\no0\nAction: left\nState:\no1\nAction: up\nState:\no2\nAction:")
    assert response_text("down") == " down"


def test_one_generate_call_per_turn_and_ids(tokenizer):
    scenarios = make_scenarios("frozenlake", "train", 3, seed=0)
    engine = FakeEngine(tokenizer, lambda _: "left")  # at the start corner "left" never moves
    trajs = run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SAMPLING, round_index=3,
                         env_kwargs={"frozenlake": {"max_steps": 4}}, progress=False)
    assert len(engine.calls) == 4 and all(len(prompts) == 6 for prompts, _ in engine.calls)
    assert [t.trajectory_id for t in trajs] == [
        f"{s.scenario_id}|r3|v0|{i}" for s in scenarios for i in range(2)]
    for t in trajs:
        assert t.group_id == t.trajectory_id.rsplit("|", 1)[0]
        assert (t.status, t.num_steps, t.won, t.episode_return, t.round) == ("truncated", 4, False, 0.0, 3)
        assert t.response_tokens == sum(len(s.response_ids) for s in t.steps) == 4 * 2
        assert Scenario.from_json(t.scenario).scenario_id == t.metadata["scenario_id"]
        for k, step in enumerate(t.steps):
            assert step.step_index == k and step.group_id == t.group_id
            assert step.prompt_ids == tokenizer.encode(step.prompt_text, add_special_tokens=False)
            assert step.prompt_ids == engine.calls[k][0][trajs.index(t)]
            assert step.prompt_text.endswith(f"State:\n{step.observation}\nAction:")
            assert step.response_ids[-1] == tokenizer.eos_token_id and len(step.logprobs) == len(step.response_ids)
            assert (step.action, step.response_text, step.action_valid, step.truncated) == ("left", " left", True,
                                                                                             False)
            assert step.anchor.endswith(":0,0") and step.context_manager == "window" and step.policy_version == "v0"


def test_batch_shrinks_as_episodes_finish_and_oracle_wins(tokenizer):
    scenarios = make_scenarios("frozenlake", "heldout", 6, seed=1)
    engine = FakeEngine(tokenizer, oracle)
    trajs = run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SAMPLING, progress=True)
    path_lengths = [len(expert_trajectory(s)) for s in scenarios for _ in range(2)]
    assert len(engine.calls) == max(path_lengths)
    assert [len(p) for p, _ in engine.calls] == [sum(n > k for n in path_lengths) for k in range(max(path_lengths))]
    assert all(t.status == "complete" and t.won and t.episode_return == 1.0 for t in trajs)
    stats = summarize(trajs)
    assert stats["success_rate"] == 1.0 and stats["failed_episodes"] == 0 and stats["invalid_action_rate"] == 0.0
    assert stats["mean_steps"] == pytest.approx(sum(path_lengths) / len(path_lengths))


def test_history_window_and_skills_in_prompts(tokenizer):
    scenarios = make_scenarios("frozenlake", "train", 2, seed=5)
    engine = FakeEngine(tokenizer, oracle)
    trajs = run_episodes(engine, tokenizer, scenarios, group_size=1, sampling=SAMPLING, history_turns=1,
                         skills_for=lambda query: ("Skill: walk around holes.", ["walk@1"]), progress=False)
    for t in trajs:
        first, second = t.steps[0], t.steps[1]
        assert first.prompt_text.startswith("Skill: walk around holes.\nTask: ")
        assert second.prompt_text == build_prompt("Reach G without stepping on H. Moves: left, down, right, up.",
                                                  second.observation, [(first.observation, first.action)],
                                                  "Skill: walk around holes.")
        assert t.steps[2].prompt_text.count("State:") == 2  # a window of one earlier turn
        assert all(s.skill_ids == ["walk@1"] and s.context_manager == "window" for s in t.steps)


def test_random_engine_is_reproducible_and_flags_invalid_and_truncated(tokenizer):
    scenarios = make_scenarios("frozenlake", "train", 4, seed=2)
    kwargs = dict(group_size=3, sampling=SAMPLING, progress=False, seed=9, env_kwargs={"frozenlake": {"max_steps": 5}})
    e1, e2 = RandomEngine(len(tokenizer), tokenizer.eos_token_id), RandomEngine(len(tokenizer), tokenizer.eos_token_id)
    a, b = run_episodes(e1, tokenizer, scenarios, **kwargs), run_episodes(e2, tokenizer, scenarios, **kwargs)
    assert [[s.response_ids for s in t.steps] for t in a] == [[s.response_ids for s in t.steps] for t in b]
    seeds = [sampling.seed for _, sampling in e1.calls]
    assert None not in seeds and len(set(seeds)) == len(seeds)
    steps = [s for t in a for s in t.steps]
    assert any(s.truncated for s in steps) and any(not s.action_valid for s in steps)
    assert all(s.truncated == (s.response_ids[-1] != tokenizer.eos_token_id) for s in steps)
    assert all(s.action == "" for s in steps if not s.action_valid)
    assert summarize(a)["invalid_action_rate"] == pytest.approx(sum(not s.action_valid for s in steps) / len(steps))


def test_a_raising_or_hanging_env_fails_only_its_episodes(tokenizer):
    name = "_test_flaky_frozenlake"

    @register_env(name)
    class Flaky(FrozenLakeText):
        def reset(self, *, seed=None, options=None):
            if seed == 2:
                raise OSError("reset exploded")
            self._seed = seed
            return super().reset(seed=seed, options=options)

        def step(self, action):
            if self._seed == 1 and self._steps == 1:
                raise RuntimeError("simulator crashed")
            if self._seed == 3:
                time.sleep(0.4)
            return super().step(action)

    try:
        scenarios = [Scenario(env=name, seed=s, split="train") for s in range(5)]
        engine = FakeEngine(tokenizer, oracle)
        trajs = run_episodes(engine, tokenizer, scenarios, group_size=2, sampling=SAMPLING, step_timeout_s=0.15,
                             workers=2, progress=False)
    finally:
        ENVS.pop(name)
    by_seed = {s: [t for t in trajs if Scenario.from_json(t.scenario).seed == s] for s in range(5)}
    assert all(t.status == "failed" and "simulator crashed" in t.error and t.num_steps == 1 for t in by_seed[1])
    assert all(t.status == "failed" and "reset exploded" in t.error and t.num_steps == 0 for t in by_seed[2])
    assert all(t.status == "failed" and "timed out" in t.error for t in by_seed[3])
    assert all(t.status == "complete" and t.won and t.error is None for s in (0, 4) for t in by_seed[s])
    assert summarize(trajs)["failed_episodes"] == 6


def test_engine_must_return_one_generation_per_prompt(tokenizer):
    class Short(FakeEngine):
        def generate(self, prompts, sampling):
            return super().generate(prompts, sampling)[:-1]

    with pytest.raises(RuntimeError, match="one Generation per prompt"):
        run_episodes(Short(tokenizer, oracle), tokenizer, make_scenarios("frozenlake", "train", 1, seed=0),
                     group_size=2, sampling=SAMPLING, progress=False)


def test_expert_demonstrations(tokenizer):
    scenarios = make_scenarios("frozenlake", "train", 4, seed=3)
    pairs = expert_demonstrations(tokenizer, scenarios, history_turns=1)
    trajectories = [expert_trajectory(s) for s in scenarios]
    assert len(pairs) == sum(len(t) for t in trajectories)
    flat = [(k, step) for t in trajectories for k, step in enumerate(t)]
    for (prompt_ids, response_ids), (k, (task, obs, action)) in zip(pairs, flat):
        assert response_ids == tokenizer.encode(" " + action, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert tokenizer.decode(response_ids, skip_special_tokens=True) == " " + action
        prompt = tokenizer.decode(prompt_ids)
        assert prompt.endswith(f"State:\n{obs}\nAction:") and prompt.count("State:") == (1 if k == 0 else 2)


def test_summarize_hand_computed():
    def traj(status, ret, won, valid_flags, tokens):
        steps = [StepRecord("t", "g", i, [1], [2] * tokens, [0.0] * tokens, "", "", "", "", 0.0, "a", "v",
                            action_valid=v) for i, v in enumerate(valid_flags)]
        return TrajectoryRecord("t", "g", "{}", "e", "train", 0, "v", status, ret, won, len(steps),
                                tokens * len(steps), steps=steps)

    trajs = [traj("complete", 1.0, True, [True, True], 3),
             traj("truncated", -0.5, False, [False, True, False, True], 1),
             traj("failed", 0.0, False, [], 0)]
    assert summarize(trajs) == {"episodes": 3, "success_rate": pytest.approx(1 / 3),
                                "mean_return": pytest.approx(0.5 / 3), "mean_steps": 2.0,
                                "mean_response_tokens": pytest.approx(10 / 3), "invalid_action_rate": 2 / 6,
                                "failed_episodes": 1, "mean_prompt_tokens": 1.0, "tool_calls_per_episode": 0.0,
                                "mean_skill_prompt_tokens": 0.0, "macro_calls_per_episode": 0.0}
    assert summarize([])["episodes"] == 0


def test_a_hung_env_call_does_not_keep_the_process_alive():
    """Before: ThreadPoolExecutor joins its threads at interpreter exit, so a stage whose env call hung (and timed
    out) exited only when that call returned. The script below would then take 10 minutes."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import time\nfrom agents.workers import call_all\n"
              "print(call_all([lambda: time.sleep(600), lambda: 1], workers=2, timeout_s=0.2))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "[(None, 'timed out after 0.2 s'), (1, None)]" in done.stdout
