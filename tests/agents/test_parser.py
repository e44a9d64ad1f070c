"""parse_action: examples and hypothesis properties."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.parser import parse_action

ACTIONS = ("left", "down", "right", "up")


def test_examples():
    assert parse_action(" left", ACTIONS) == ("left", True)
    assert parse_action("  Right.\nbecause the goal", ACTIONS) == ("right", True)
    assert parse_action("'UP'!", ACTIONS) == ("up", True)
    assert parse_action("down<|endoftext|>", ACTIONS) == ("", False)  # junk glued to the word is not a word
    assert parse_action("leftover", ACTIONS) == ("", False)
    assert parse_action("go left", ACTIONS) == ("", False)  # the first word decides
    assert parse_action("", ACTIONS) == ("", False)
    assert parse_action("   \n\t", ACTIONS) == ("", False)
    assert parse_action("left", ()) == ("", False)


def test_multi_word_actions_match_longest():
    admissible = ["go", "go north", "take key"]
    assert parse_action(" Go north, quickly", admissible) == ("go north", True)
    assert parse_action("go south", admissible) == ("go", True)
    assert parse_action("take", admissible) == ("", False)


def test_returns_the_admissible_string_as_given():
    assert parse_action("LEFT", ["Left", "Right"]) == ("Left", True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(), admissible=st.lists(st.text(max_size=12), max_size=6))
def test_never_raises_and_result_is_consistent(text, admissible):
    action, valid = parse_action(text, admissible)
    assert isinstance(action, str) and isinstance(valid, bool)
    if valid:
        assert action in admissible and action.strip()
    else:
        assert action == ""


@settings(max_examples=300, deadline=None)
@given(action=st.sampled_from(ACTIONS),
       lead=st.text(alphabet=" \t\n", max_size=3),
       punct=st.text(alphabet=".,;:!?\"'()*", max_size=3),
       sep=st.text(alphabet=" \t\n", min_size=1, max_size=3),
       junk=st.text(),
       upper=st.booleans())
def test_valid_word_followed_by_junk_is_parsed(action, lead, punct, sep, junk, upper):
    word = action.upper() if upper else action
    assert parse_action(lead + word + punct + sep + junk, ACTIONS) == (action, True)
