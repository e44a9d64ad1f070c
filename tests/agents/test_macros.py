"""Executable macros in the harness: a skill's macro runs as one agent action, and demonstrations call it."""
from __future__ import annotations

import pytest

from agents.demos import expert_texts
from agents.rollout import SkillSlot, macro_call, run_episodes
from envs import expert_trajectory, make_scenarios
from models.build import train_tokenizer
from models.engine import Generation, SamplingParams

LAKE = {"size": 4, "p_frozen": 0.8, "max_steps": 12, "is_slippery": False}
SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)


def test_macro_call_parses_keywords_arguments_and_word_boundaries():
    macros = {"skill 1": ("go to {a}", "open {a}", "take {b} from {a}"), "skill 12": ("look", "look")}
    assert macro_call(" skill 1 fridge 1 apple 2", macros) == (
        "skill 1", ["go to fridge 1", "open fridge 1", "take apple 2 from fridge 1"])
    assert macro_call("skill 12", macros) == ("skill 12", ["look", "look"])        # longest keyword, whole words
    assert macro_call(" skill 1 fridge 1", macros) == ("skill 1", [])              # too few arguments: invalid
    assert macro_call(" skill 1 fridge 1 fridge 1", macros) == ("skill 1", [])     # two slots, one entity
    assert macro_call(" skill 123", macros) is None and macro_call(" go to fridge 1", macros) is None
    assert macro_call("<think>x</think> skill 12", {"skill 12": ("look",)}, fold=False) is None
    assert macro_call(" skill 1", {}) is None


@pytest.fixture(scope="module")
def path_scenario():
    for scenario in make_scenarios("frozenlake", "train", 50, seed=1):
        actions = [a for _, _, a in expert_trajectory(scenario, **LAKE)]
        if len(actions) == 6:
            return scenario, actions
    raise AssertionError("no 6-step map")


@pytest.fixture(scope="module")
def tokenizer(path_scenario):
    scenario, _ = path_scenario
    texts = [f"Skill 1: x\nTask: {t}\nState:\n{o}\nAction: {a}" for t, o, a in expert_trajectory(scenario, **LAKE)]
    return train_tokenizer(texts * 3 + [" skill 1"] * 5, vocab_size=280)


class Scripted:
    policy_version = "s"

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers = tokenizer, list(answers)

    def generate(self, prompts, sampling):
        out = []
        for _ in prompts:
            ids = self.tokenizer.encode(" " + self.answers.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Generation(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop"))
        return out


def test_a_macro_runs_as_one_action_and_records_what_internalization_needs(path_scenario, tokenizer):
    scenario, actions = path_scenario
    slot = SkillSlot(f"Skill 1: {' '.join(actions)}", ("walk",), {"skill 1": tuple(actions)})
    [traj] = run_episodes(Scripted(tokenizer, ["skill 1"]), tokenizer, [scenario], group_size=1, sampling=SAMPLING,
                          skills_for=lambda query: slot, env_kwargs={"frozenlake": LAKE}, progress=False)
    assert traj.won and traj.num_steps == 1 and traj.episode_return == pytest.approx(1.0)
    [step] = traj.steps
    assert step.action == "skill 1" and step.action_valid and step.skill_ids == ["walk"]
    assert traj.metadata["macro_calls"] == 1 and "skill_trace" not in traj.metadata  # the trace is step fields
    plain = tokenizer.decode(step.plain_prompt_ids)
    assert "Skill 1" not in plain and plain == step.prompt_text[step.prompt_text.index("Task:"):]
    assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in step.macro_action_ids] == \
        [" " + a for a in actions]
    assert all(ids[-1] == tokenizer.eos_token_id for ids in step.macro_action_ids)
    assert all("Skill" not in tokenizer.decode(ids) for ids in step.macro_prompt_ids)
    assert len({tuple(ids) for ids in step.macro_prompt_ids}) == len(actions)  # each sub-step: its own observation


def test_a_macro_stops_at_the_end_of_the_episode_and_bad_arguments_are_an_invalid_step(path_scenario, tokenizer):
    scenario, actions = path_scenario
    slot = SkillSlot("Skill 1: walk", ("walk",), {"skill 1": tuple(actions) + ("up", "up"), "skill 2": ("go {a}",)})
    [traj] = run_episodes(Scripted(tokenizer, ["skill 1"]), tokenizer, [scenario], group_size=1, sampling=SAMPLING,
                          skills_for=lambda query: slot, env_kwargs={"frozenlake": LAKE}, progress=False)
    assert traj.won and len(traj.steps[0].macro_prompt_ids) == len(actions)   # the trailing ups never ran
    assert len(traj.steps[0].macro_action_ids) == len(actions)
    answers = ["skill 2"] + ["up"] * 20
    [bad] = run_episodes(Scripted(tokenizer, answers), tokenizer, [scenario], group_size=1, sampling=SAMPLING,
                         skills_for=lambda query: slot, env_kwargs={"frozenlake": LAKE}, progress=False)
    assert not bad.steps[0].action_valid and bad.steps[0].action == ""


def test_skill_free_episodes_record_no_trace(path_scenario, tokenizer):
    scenario, actions = path_scenario
    [traj] = run_episodes(Scripted(tokenizer, actions), tokenizer, [scenario], group_size=1, sampling=SAMPLING,
                          env_kwargs={"frozenlake": LAKE}, progress=False)
    assert traj.won and traj.metadata["macro_calls"] == 0
    assert all(s.plain_prompt_ids == [] and s.macro_prompt_ids == [] == s.macro_action_ids for s in traj.steps)


def test_demonstrations_call_a_shown_macro_where_the_expert_would_run_it(path_scenario):
    scenario, actions = path_scenario
    macro = tuple(actions[2:5])
    slot = SkillSlot(f"Skill 1: {' '.join(macro)}", ("m",), {"skill 1": macro})
    pairs = expert_texts([scenario], skills_for=lambda query: slot, env_kwargs={"frozenlake": LAKE},
                         call_macros=True)
    assert [r for _, r in pairs] == [" " + a for a in actions[:2]] + [" skill 1"] + [" " + a for a in actions[5:]]
    assert all(p.startswith("Skill 1: ") for p, _ in pairs)
    plain = expert_texts([scenario], skills_for=lambda query: slot, env_kwargs={"frozenlake": LAKE})
    assert [r for _, r in plain] == [" " + a for a in actions]  # without call_macros the expert walks


def test_demonstrations_bind_a_macros_slots_from_the_expert_actions():
    household = make_scenarios("household", "train", 1, seed=2)[0]
    steps = [a for _, _, a in expert_trajectory(household)]
    go, then = steps[0], steps[1]
    assert go.startswith("go to ")
    target = go[len("go to "):]
    template = ("go to {a}", then.replace(target, "{a}"))
    slot = SkillSlot("Skill 1: go and act", ("m",), {"skill 1": template})
    first_prompt, first = expert_texts([household], skills_for=lambda query: slot, call_macros=True)[0]
    assert first == f" skill 1 {target}" and first_prompt.startswith("Skill 1: go and act\n")
    # a macro with slots is not listed as an admissible action (it needs arguments); a slot-free one is
    assert "skill 1" not in first_prompt.split("Actions:")[1]


def test_a_decision_budget_counts_a_macro_as_one_decision(path_scenario, tokenizer):
    scenario, actions = path_scenario
    slot = SkillSlot("Skill 1: first two", ("two",), {"skill 1": tuple(actions[:2])})
    play = dict(group_size=1, sampling=SAMPLING, env_kwargs={"frozenlake": LAKE}, progress=False, max_turns=5)
    [plain] = run_episodes(Scripted(tokenizer, actions), tokenizer, [scenario], **play)
    assert not plain.won and plain.status == "truncated" and plain.num_steps == 5
    [called] = run_episodes(Scripted(tokenizer, ["skill 1", *actions[2:]]), tokenizer, [scenario],
                            skills_for=lambda query: slot, **play)
    assert called.won and called.num_steps == 5 and called.metadata["macro_calls"] == 1


def test_harness_max_turns_reaches_evaluation_and_rejects_a_negative_budget(path_scenario, tokenizer):
    from tasks.common import evaluate_policy
    from tasks.config import ParamsError, load_params, params_to_dict, parse_params

    scenario, actions = path_scenario
    raw = params_to_dict(load_params())
    for budget, won in ((0, 1.0), (6, 1.0), (5, 0.0)):
        params = parse_params({**raw, "harness": {**raw["harness"], "max_turns": budget}})
        summary, _ = evaluate_policy(Scripted(tokenizer, actions), [scenario], params)
        assert summary["success_rate"] == won, budget
    with pytest.raises(ParamsError, match="harness.max_turns = -1: must be >= 0"):
        parse_params({**raw, "harness": {**raw["harness"], "max_turns": -1}})
