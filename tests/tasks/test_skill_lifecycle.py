"""The skill lifecycle on real FrozenLake rollouts with fixed seeds (issue 6's acceptance tests):

- pre-storage validation promotes a macro that truly helps (it walks the whole way in one agent action, so the
  horizon shrinks) and rejects one that hurts (it burns 8 of the 12 env steps against the walls);
- internalization (SIRI): distilling the beneficial skill-guided actions onto the plain prompt raises a tiny real
  policy's success WITHOUT skills in the prompt.

The acting policy of the rollouts is scripted (a noisy planner that calls the macro in the slot half the time), so the
test measures the lifecycle, not whether a tiny model learned to read skills; the rollout loop, envs, retrieval,
halves, trials table, bank and trainer are all the real ones.
"""
from __future__ import annotations

import random
import re

import pytest

from agents.rollout import run_episodes, summarize
from datapool.store import DataPool
from envs import expert_trajectory, make_scenarios
from envs.frozenlake import shortest_path_actions
from models.advantages import AdvantageConfig
from models.build import TinyModelConfig, build_model, train_tokenizer
from models.ds_engine import OptimizerConfig, make_ds_engine
from models.engine import Generation, SamplingParams
from models.hf_engine import TransformersEngine
from models.internalize import InternalizeConfig, internalization_pairs
from models.batching import UpdateConfig
from models.sft import sft_update
from skills.bank import Skill, load_bank
from skills.lifecycle import RoundBank, load_rejected, load_round_bank, save_round_bank
from tasks.config import parse_params
from tasks.sections import TrainConfig
from tasks.mine import lifecycle_round
from tasks.skill_trials import SkillProgram, episode_table, trial_frame
from tasks.train import guided_steps, training_rows

PATH = ("down", "down", "down", "right", "right", "right")
ACTIONS = ("left", "down", "right", "up")
LAKE = {"size": 4, "p_frozen": 0.8, "max_steps": 12, "is_slippery": False}
HELPFUL = Skill(name="down-then-right", when_to_use="Reach G without stepping on H: go down, then right.",
                procedure="Go down three times, then right three times.", macro=PATH)
HARMFUL = Skill(name="hug-the-walls", when_to_use="Reach G without stepping on H: feel the walls first.",
                procedure="Walk into the top-left walls.", macro=("left",) * 4 + ("up",) * 4)
GROUP = 8


def path_scenarios(split: str, n: int) -> list:
    """Maps whose shortest path is PATH (about 40% of 4x4 maps), so one macro can help every group."""
    pool = make_scenarios("frozenlake", split, 20 * n, seed=11)
    chosen = [s for s in pool if tuple(a for _, _, a in expert_trajectory(s, **LAKE)) == PATH]
    assert len(chosen) >= n
    return chosen[:n]


class NoisyPlanner:
    """Reads the grid in the prompt: calls a macro shown in the skill slot with probability 1/2, else takes the
    shortest-path action with probability 0.6 and a random move otherwise (seeded by the turn's sampling seed)."""

    policy_version = "planner"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def choose(self, prompt: str, rng: random.Random) -> str:
        if "Skill 1:" in prompt and rng.random() < 0.5:
            return "skill 1"
        state = prompt.rsplit("State:\n", 1)[1].split("\nAction:")[0]
        rows = [line.split(" ") for line in state.strip().splitlines()]
        row, col = next((r, c) for r, cells in enumerate(rows) for c, cell in enumerate(cells) if cell == "P")
        desc = ["".join("F" if cell == "P" else cell for cell in cells) for cells in rows]
        plan = shortest_path_actions(desc, row, col)
        return plan[0] if plan and rng.random() < 0.6 else rng.choice(ACTIONS)

    def generate(self, prompts, sampling):
        rng = random.Random(sampling.seed)
        out = []
        for ids in prompts:
            text = " " + self.choose(self.tokenizer.decode(ids), rng)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Generation(token_ids=token_ids, logprobs=[-0.5] * len(token_ids), finish_reason="stop"))
        return out


@pytest.fixture(scope="module")
def tokenizer():
    texts = []
    for scenario in make_scenarios("frozenlake", "train", 60, seed=5):
        for task, obs, action in expert_trajectory(scenario, **LAKE):
            texts += [f"Skill 1: {' '.join(PATH)}\nTask: {task}\nState:\n{obs}\nAction:", f" {action}", " skill 1"]
    return train_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def validated_round(tokenizer, tmp_path_factory):
    """One rollout round testing both candidates (80 scenarios x 8 episodes), then the mine stage's lifecycle pass."""
    scenarios = path_scenarios("train", 80)
    bank = RoundBank(candidates=[HELPFUL, HARMFUL])
    program = SkillProgram(bank, k=1, alpha=0.5, floor=0.0)
    program.plan(scenarios, GROUP, seed=7)
    trajectories = run_episodes(NoisyPlanner(tokenizer), tokenizer, scenarios, group_size=GROUP,
                                sampling=SamplingParams(max_new_tokens=4, temperature=1.0, seed=3), round_index=2,
                                skills_for=program.skills_for, env_kwargs={"frozenlake": LAKE}, progress=False, seed=3)
    trials = trial_frame(trajectories, program)
    root = tmp_path_factory.mktemp("lifecycle")
    with DataPool(f"sqlite:///{root / 'pool.db'}") as pool:
        pool.add_trajectories(trajectories)
        frame = pool.steps_frame(round=2)
    params = parse_params({"mine": {"min_support": 0.5}})
    new_bank, changes, metrics = lifecycle_round(bank, episode_table(trials), frame, params, round_index=2)
    save_round_bank(root / "bank", new_bank, changes, header="round 2: test")
    return {"trajectories": trajectories, "trials": trials, "frame": frame, "bank": new_bank, "changes": changes,
            "metrics": metrics, "dir": root / "bank"}


def test_the_halves_share_scenarios_and_differ_only_by_the_candidate(validated_round):
    trials, trajectories = validated_round["trials"], validated_round["trajectories"]
    episodes = episode_table(trials)
    assert set(episodes["test"]) == {"candidate"}
    for _, group in episodes.groupby("group_id"):
        assert sorted(group["arm"]) == ["aug"] * (GROUP // 2) + ["base"] * (GROUP // 2)
        candidate = group["candidate"].iloc[0]
        assert all(candidate in shown for shown in group.loc[group["arm"] == "aug", "skills"])
        assert not any(shown for shown in group.loc[group["arm"] == "base", "skills"])
    # the macro ran as one agent action: a call is one step whose action is the keyword
    calls = sum(t.metadata["macro_calls"] for t in trajectories)
    assert calls > 0 and summarize(trajectories)["macro_calls_per_episode"] == pytest.approx(calls / len(trajectories))
    assert sum(bool(s.macro_prompt_ids) for t in trajectories for s in t.steps) == calls


def test_validation_promotes_the_helpful_macro_and_rejects_the_harmful_one(validated_round):
    bank, metrics, folder = validated_round["bank"], validated_round["metrics"], validated_round["dir"]
    helpful, harmful = metrics["validation"][HELPFUL.name], metrics["validation"][HARMFUL.name]
    assert helpful["u"] > 0.2 and helpful["welch_t"] > 1.0, helpful
    assert harmful["u"] < 0, harmful
    assert [s.name for s in bank.live] == [HELPFUL.name]
    assert [s.name for s in load_bank(folder)] == [HELPFUL.name]
    promoted = load_bank(folder)[0]
    assert promoted.stats["validation"]["decision"] == "promoted" and promoted.stats["utility"] == helpful["u"]
    rejected = load_rejected(folder)
    assert [s.name for s in rejected] == [HARMFUL.name] and rejected[0].stats["evidence"]["u"] == harmful["u"]
    changelog = (folder / "CHANGELOG.md").read_text()
    assert re.search(rf"^promoted {HELPFUL.name} v1 .*\"u\": {helpful['u']}", changelog, re.MULTILINE)
    assert re.search(rf"^rejected {HARMFUL.name} v1 ", changelog, re.MULTILINE)
    # both were tested, so neither waits any more; the round's own successes were mined into new candidates
    waiting = load_round_bank(folder).candidates
    assert {s.name for s in waiting}.isdisjoint({HELPFUL.name, HARMFUL.name})
    assert len(waiting) == changelog.count("\nadded ") == validated_round["metrics"]["added"]


def plain_success(model, tokenizer, scenarios) -> float:
    engine = TransformersEngine(model, tokenizer, policy_version="eval")
    runs = run_episodes(engine, tokenizer, scenarios, group_size=1, env_kwargs={"frozenlake": LAKE}, progress=False,
                        sampling=SamplingParams(max_new_tokens=4, temperature=0.0, seed=0))
    return summarize(runs)["success_rate"]


@pytest.mark.slow
def test_internalization_raises_plain_prompt_success(validated_round, tokenizer):
    frame, trials = validated_round["frame"], validated_round["trials"]
    _, _, result = training_rows(frame, TrainConfig(), tokenizer, trials)
    steps = guided_steps(frame, trials, result.row_advantages)
    # coef 4: token weights around 0.6 (u = 0.33, A_t ~ 0.45). With coef 1 (weights ~0.15) 30 epochs left the tiny
    # model at the marginal ("down" everywhere, 0.00 held-out) on some machines, as measured on 2026-12-01.
    pairs, weights, metrics = internalization_pairs(steps, InternalizeConfig(coef=4.0, w_max=1.0))
    assert metrics["selected_steps"] > 20
    # the distilled pairs are plain prompts (no skill slot) -> primitive actions, never the macro keyword
    assert all("Skill" not in tokenizer.decode(p) and "skill" not in tokenizer.decode(r) for p, r in pairs)

    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=256), seed=0)
    heldout = path_scenarios("heldout", 20)
    before = plain_success(model, tokenizer, heldout)
    engine = make_ds_engine(model, OptimizerConfig(lr=3e-3, zero_stage=0), micro_batch_size=64)
    sft_update(engine, pairs, weights=weights, pad_id=tokenizer.pad_token_id, seed=0, progress=False,
               update=UpdateConfig(epochs=30, micro_batch_size=64))
    after = plain_success(engine.module, tokenizer, heldout)
    print(f"SIRI: plain-prompt held-out success {before:.2f} -> {after:.2f} ({len(pairs)} pairs)")
    assert after >= before + 0.5, (before, after)


@pytest.mark.parametrize("name", ["skillc", "d2skill"])
def test_skill_credit_estimators_read_skill_used_from_the_trials(validated_round, tokenizer, name):
    frame, trials = validated_round["frame"], validated_round["trials"]
    _, metrics, result = training_rows(frame, TrainConfig(advantage=AdvantageConfig(name=name)), tokenizer, trials)
    assert metrics["skill_traj_share"] == pytest.approx(0.5)  # the augmented half of every group
    _, blind, blind_result = training_rows(frame, TrainConfig(advantage=AdvantageConfig(name=name)), tokenizer, None)
    assert blind["skill_traj_share"] == 0.0
    assert not (result.row_advantages == blind_result.row_advantages).all()


def test_thompson_sampling_on_real_rollouts_moves_to_the_better_version_and_retires_the_worse(tokenizer, tmp_path):
    """Two versions of one live skill (the helpful macro as v1, the wall-hugging one as v2), drawn per episode
    within each group; after one round the mine stage's update retires v2, and the next round draws v1."""
    walk_v1 = Skill(name="walk", when_to_use=HELPFUL.when_to_use, procedure=HELPFUL.procedure, macro=PATH)
    walk_v2 = Skill(name="walk", when_to_use=HELPFUL.when_to_use, procedure=HARMFUL.procedure,
                    macro=HARMFUL.macro, version=2, parent="walk")
    bank = RoundBank(live=[walk_v1], versions={"walk": [walk_v2]})
    params = parse_params({"skills": {"versions": {"min_uses": 20}}, "mine": {"min_support": 0.9}})
    scenarios = path_scenarios("train", 24)
    program = SkillProgram(bank, k=1, alpha=0.5, floor=0.0, paired=False)
    program.plan(scenarios, GROUP, seed=5)
    draws = [label for plan in program.plans.values() for label in plan.versions["walk"]]
    assert {"v1", "v2"} <= set(draws)  # both versions in every group (the distinct-versions floor)
    trajectories = run_episodes(NoisyPlanner(tokenizer), tokenizer, scenarios, group_size=GROUP,
                                sampling=SamplingParams(max_new_tokens=4, temperature=1.0, seed=9), round_index=3,
                                skills_for=program.skills_for, env_kwargs={"frozenlake": LAKE}, progress=False, seed=9)
    trials = trial_frame(trajectories, program)
    with DataPool(f"sqlite:///{tmp_path / 'pool.db'}") as pool:
        pool.add_trajectories(trajectories)
        frame = pool.steps_frame(round=3)
    new_bank, changes, _ = lifecycle_round(bank, episode_table(trials), frame, params, round_index=3)
    assert any(c.verb == "retired" and c.skill.version == 2 for c in changes), [c.line() for c in changes]
    [walk] = new_bank.live
    assert walk.version == 1 and walk.macro == PATH and new_bank.versions == {}
    from skills.versions import from_dict
    state = from_dict(walk.stats["versions"])
    assert state["v1"].mean > 0.7 > 0.3 > state["v2"].mean and state["v2"].retired
    nxt = SkillProgram(new_bank, k=1, alpha=0.5, floor=0.0, paired=False)
    nxt.plan(scenarios, GROUP, seed=6)
    assert all(set(plan.versions.get("walk", ("v1",))) == {"v1"} for plan in nxt.plans.values())
