"""Context managers (full / window / fold), fold tags, HIPIF process rewards, templates and tool-call parsing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.context import (CLOSE_TAG, CONTEXT_MANAGERS, OPEN_TAG, ContextView, Turn, expert_fold_response, fold_context,
                            fold_process_rewards, full_context, get_context_manager, parse_fold_tags, window_context)
from agents.rollout import env_action
from agents.templates import DEFAULT_TEMPLATE, TEMPLATES, render_prompt, response_text, template_for
from envs.tools import openai_tool_call, parse_tool_call, tool_call_text


def turns_from(responses: list[str], progress: list[int | None]) -> list[Turn]:
    return [Turn(f"o{i}", r, parse_fold_tags(r).rest.strip(), p) for i, (r, p) in enumerate(zip(responses, progress))]


def test_registry_names_and_unknown():
    assert sorted(CONTEXT_MANAGERS) == ["fold", "full", "window"]
    with pytest.raises(KeyError, match="valid: \\['fold', 'full', 'window'\\]"):
        get_context_manager("summary")


def test_full_and_window():
    turns = [Turn(f"o{i}", f" a{i}", f"a{i}") for i in range(4)]
    assert full_context(turns).history == tuple((f"o{i}", f"a{i}") for i in range(4))
    assert window_context(turns, 2).history == (("o2", "a2"), ("o3", "a3"))
    assert window_context(turns, 0).history == ()


def test_parse_fold_tags():
    tags = parse_fold_tags(" <done>took the apple</done> <subgoal>heat it</subgoal> go to microwave 1")
    assert (tags.closed, tags.opened, tags.rest.split()) == ("took the apple", "heat it", ["go", "to", "microwave", "1"])
    assert parse_fold_tags("look").closed is None and parse_fold_tags("look").rest == "look"
    assert parse_fold_tags("<subgoal>unclosed").opened is None  # an unterminated tag is no tag


def test_fold_keeps_only_the_open_subgoals_raw_turns():
    turns = turns_from([
        "<subgoal>find apple</subgoal> go to fridge 1",  # 0 opens A
        "open fridge 1",                                   # 1
        "take apple 1 from fridge 1",                      # 2
        "<done>took apple 1</done> <subgoal>heat apple</subgoal> go to microwave 1",  # 3 closes A, opens B
        "heat apple 1 with microwave 1",                   # 4
    ], [0, 0, 0, 1, 1])
    view = fold_context(turns)
    assert view.plan == (("find apple", "done"), ("heat apple", "open"))
    assert view.summaries == ("took apple 1",)
    assert [obs for obs, _ in view.history] == ["o3", "o4"]  # A's raw turns are folded away
    assert fold_context(turns, 1).history == (("o4", "heat apple 1 with microwave 1"),)
    # the full manager keeps everything
    assert len(full_context(turns).history) == 5


def test_fold_after_a_close_shows_turns_since_the_close():
    turns = turns_from(["<subgoal>a</subgoal> x", "<done>did a</done> y", "z"], [0, 1, 1])
    view = fold_context(turns)
    assert view.plan == (("a", "done"),) and [o for o, _ in view.history] == ["o1", "o2"]


def test_process_rewards_match_env_progress():
    # A closes after progress 0 -> 1 (+alpha); B closes with no progress (-alpha); C stays open (not scored)
    turns = turns_from(["<subgoal>A</subgoal> x", "y", "<done>A ok</done><subgoal>B</subgoal> z", "w",
                        "<done>B?</done> <subgoal>C</subgoal> v"], [0, 0, 1, 1, 1])
    assert fold_process_rewards(turns, 0.1) == [0.0, 0.0, 0.1, 0.0, -0.1]
    # opening a new subgoal while one is open closes it (judged the same way)
    turns = turns_from(["<subgoal>A</subgoal> x", "<subgoal>B</subgoal> y"], [0, 0])
    assert fold_process_rewards(turns, 0.2) == [0.0, -0.2]
    # envs without subgoals give no process reward
    assert fold_process_rewards(turns_from(["<subgoal>A</subgoal> x", "<done>a</done> y"], [None, None]), 0.1) == [0, 0]
    with pytest.raises(ValueError):
        fold_process_rewards(turns, -1.0)


def test_expert_fold_response_opens_and_closes_with_env_progress():
    names = ["take apple", "heat apple", "put apple"]
    body, open_index = expert_fold_response("go to fridge 1", names, 0, None)
    assert body == "<subgoal>take apple</subgoal> go to fridge 1" and open_index == 0
    body, open_index = expert_fold_response("take apple 1 from fridge 1", names, 0, open_index)
    assert body == "take apple 1 from fridge 1" and open_index == 0
    body, open_index = expert_fold_response("go to microwave 1", names, 1, open_index)
    assert body == "<done>take apple</done> <subgoal>heat apple</subgoal> go to microwave 1" and open_index == 1


@given(st.text(max_size=60))
def test_parse_fold_tags_never_raises_and_rest_has_no_complete_tags(text):
    tags = parse_fold_tags("<done>s</done>" + text + "<subgoal>g</subgoal>")
    assert CLOSE_TAG.search(tags.rest) is None and OPEN_TAG.search(tags.rest) is None
    assert tags.closed is not None and tags.opened is not None


def test_render_prompt_layout_and_admissible_listing():
    view = ContextView(history=(("o0", "a0"),), plan=(("take x", "done"), ("heat x", "open")), summaries=("took x",))
    prompt = render_prompt(TEMPLATES["household"], "T", view, "o1", admissible=["look", "go to a 1"], skills_text="S")
    assert prompt == ("S\nTask: T\nPlan: [x] take x; [ ] heat x\nDone: took x.\nState:\no0\nAction: a0\n"
                      "State:\no1\nActions: look | go to a 1\nAction:")
    # frozenlake (default-like) never lists actions: its prompts stay what the foundation trained on
    assert render_prompt(TEMPLATES["frozenlake"], "T", ContextView(), "o", admissible=["left"]) == "Task: T\nState:\no\nAction:"
    assert template_for("no_such_env") is DEFAULT_TEMPLATE


def test_tool_call_parsing_shapes():
    assert parse_tool_call('<tool_call>{"name": "search", "arguments": {"query": "alps"}}</tool_call>') == (
        "search", {"query": "alps"})
    assert parse_tool_call('{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}') == ("bash", {"command": "ls"})
    full = openai_tool_call("search", {"query": "x"})
    assert full == {"type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}
    assert parse_tool_call(json.dumps(full)) == ("search", {"query": "x"})
    for junk in ("search[alps]", "{not json", '{"name": 3}', '{"name": "a", "arguments": [1]}', "", None):
        assert parse_tool_call(junk) is None


@given(st.text(max_size=80))
def test_parse_tool_call_never_raises(text):
    parse_tool_call(text)


def test_env_action_maps_openai_tool_calls_to_the_env_grammar():
    search = TEMPLATES["search_qa"]
    assert env_action(' <tool_call>{"name": "search", "arguments": {"query": "Alma Verin"}}</tool_call>', {},
                      search) == ("search[Alma Verin]", "search[Alma Verin]")
    assert env_action(" search[alps]", {}, search) == ("search[alps]", "search[alps]")
    assert env_action('{"name": "rm_rf", "arguments": {}}', {}, search)[1] == ""  # unknown tool: invalid
    shell = TEMPLATES["terminal"]
    assert env_action('{"name": "bash", "arguments": {"command": "ls -a"}}', {}, shell) == ("ls -a", "ls -a")
    assert env_action('{"name": "submit", "arguments": {}}', {}, shell) == ("submit", "submit")
    # fold tags are stripped before parsing; admissible actions are matched
    house = TEMPLATES["household"]
    info = {"admissible_actions": ["look", "go to fridge 1"]}
    assert env_action(" <subgoal>find</subgoal> go to fridge 1", info, house, fold=True) == (
        "go to fridge 1", "go to fridge 1")


def test_response_text_tool_formats():
    search = TEMPLATES["search_qa"]
    assert response_text("search[alps]") == " search[alps]"
    openai = response_text("search[alps]", tool_format="openai", template=search)
    assert openai == " " + tool_call_text("search", {"query": "alps"})
    assert parse_tool_call(openai) == ("search", {"query": "alps"})
    assert response_text("left", tool_format="openai", template=TEMPLATES["frozenlake"]) == " left"
    with pytest.raises(ValueError, match="openai"):
        response_text("x", tool_format="xml")
