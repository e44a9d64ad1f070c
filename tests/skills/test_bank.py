"""SKILL.md files and the skill bank folder."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skills.bank import (
    Skill,
    SkillFormatError,
    load_bank,
    read_skill,
    skill_from_text,
    skill_to_text,
    validate_skill_name,
    write_bank,
    write_skill,
)


def make_skill(name: str = "seq-right-down", **overrides) -> Skill:
    fields = dict(name=name, when_to_use="When the goal is down and right.", procedure="Move right, then down.",
                  version=2, parent="seq-right", provenance=("t1", "t2"),
                  stats={"support": 0.4, "count": 8, "uses": 0}, macro=("right", "down"))
    fields.update(overrides)
    return Skill(**fields)


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    skill = make_skill()
    path = write_skill(tmp_path, skill)
    assert path == tmp_path / "seq-right-down" / "SKILL.md"
    text = path.read_text()
    assert text.startswith("---\nname: seq-right-down\n") and text.endswith("---\nMove right, then down.\n")
    assert read_skill(path) == skill
    assert [p.name for p in path.parent.iterdir()] == ["SKILL.md"]  # no temporary file left


def test_optional_keys_default_and_lists_become_tuples() -> None:
    skill = skill_from_text("---\nname: a1\nwhen_to_use: w\nversion: 1\n---\n\n# Steps\n1. do\n\n")
    assert skill == Skill(name="a1", when_to_use="w", procedure="# Steps\n1. do")
    assert skill.parent is None and skill.provenance == () and skill.macro == () and skill.stats == {}
    assert hash(skill) == hash(Skill(name="a1", when_to_use="w", procedure="# Steps\n1. do"))


@pytest.mark.parametrize("name", ["", "..", "../x", "a/b", "a\\b", ".hidden", "-dash", "Upper", "sp ace",
                                  "a" * 65, "é", "a.b", None])
def test_bad_names_are_rejected(name) -> None:
    with pytest.raises(ValueError, match="invalid skill name"):
        validate_skill_name(name)


@pytest.mark.parametrize("name", ["a", "0", "seq-right-right-down", "a_b", "z" * 64])
def test_good_names_are_accepted(name: str) -> None:
    assert validate_skill_name(name) == name


MALFORMED = [
    ("name: a\nwhen_to_use: w\nversion: 1\n", 1, "missing YAML front matter"),
    ("---\nname: a\nwhen_to_use: w\nversion: 1\n", 1, "never closed"),
    ("---\nname: a\nwhen_to_use: [unclosed\nversion: 1\n---\nbody\n", 4, "bad YAML"),
    ("---\n- just\n- a list\n---\nbody\n", 2, "must be a YAML mapping"),
    ("---\nname: a\nversion: 1\n---\nbody\n", 4, "missing required key 'when_to_use'"),
    ("---\nname: a\nwhen_to_use: w\nversion: one\n---\nbody\n", 4, "key 'version' must be int >= 1"),
    ("---\nname: a\nwhen_to_use: w\nversion: 1\nmacro: right\n---\nbody\n", 5, "key 'macro' must be list of str"),
    ("---\nname: a\nwhen_to_use: w\nversion: 1\ndescription: x\n---\nbody\n", 5, "unknown keys ['description']"),
    ("---\nname: ../evil\nwhen_to_use: w\nversion: 1\n---\nbody\n", 2, "invalid skill name"),
]


@pytest.mark.parametrize("text, line, message", MALFORMED, ids=[m[2].split()[0] + str(i) for i, m in
                                                                  enumerate(MALFORMED)])
def test_malformed_files_name_the_path_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = tmp_path / "SKILL.md"
    path.write_text(text)
    with pytest.raises(SkillFormatError) as err:
        read_skill(path)
    assert err.value.path == path and err.value.line == line
    assert str(err.value).startswith(f"{path}:{line}: ") and message in str(err.value)


def test_load_bank_is_sorted_and_never_skips_a_bad_file(tmp_path: Path) -> None:
    for name in ("zeta", "alpha", "mid"):
        write_skill(tmp_path, make_skill(name))
    (tmp_path / "CHANGELOG.md").write_text("round 0\n")
    (tmp_path / ".gitignore").write_text("x\n")
    assert [s.name for s in load_bank(tmp_path)] == ["alpha", "mid", "zeta"]

    (tmp_path / "mid" / "SKILL.md").write_text("no front matter\n")
    with pytest.raises(SkillFormatError, match="mid/SKILL.md:1"):
        load_bank(tmp_path)


def test_load_bank_rejects_stray_folders_and_name_mismatch(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SkillFormatError, match="has no SKILL.md"):
        load_bank(tmp_path)
    (tmp_path / "empty").rmdir()
    write_skill(tmp_path, make_skill("beta"))
    (tmp_path / "beta").rename(tmp_path / "gamma")
    with pytest.raises(SkillFormatError, match="differs from its folder name"):
        load_bank(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing"):
        load_bank(tmp_path / "nope")


def test_write_bank_replaces_skills_and_appends_changelog(tmp_path: Path) -> None:
    write_bank(tmp_path, [make_skill("a"), make_skill("b")], "round 1: added a, b")
    write_bank(tmp_path, [make_skill("b", version=3), make_skill("c")], "round 2: dropped a, added c")
    bank = load_bank(tmp_path)
    assert [(s.name, s.version) for s in bank] == [("b", 3), ("c", 2)]
    assert not (tmp_path / "a").exists()
    assert (tmp_path / "CHANGELOG.md").read_text() == "round 1: added a, b\nround 2: dropped a, added c\n"


def test_write_bank_validates_before_touching_the_bank(tmp_path: Path) -> None:
    write_bank(tmp_path, [make_skill("a")], "round 1")
    with pytest.raises(ValueError, match="one non-empty line"):
        write_bank(tmp_path, [make_skill("b")], "two\nlines")
    with pytest.raises(ValueError, match="duplicate"):
        write_bank(tmp_path, [make_skill("b"), make_skill("b")], "dup")
    with pytest.raises(TypeError, match="not YAML-safe"):
        write_bank(tmp_path, [make_skill("b", stats={"x": object()})], "bad stats")
    assert [s.name for s in load_bank(tmp_path)] == ["a"]
    assert (tmp_path / "CHANGELOG.md").read_text() == "round 1\n"


def test_numpy_stats_are_written_as_plain_numbers(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    path = write_skill(tmp_path, make_skill(stats={"support": np.float64(0.5), "count": np.int64(3)}))
    assert read_skill(path).stats == {"support": 0.5, "count": 3}


names = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from("\n\t"),
                max_size=40)
words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=10)


@settings(max_examples=60, deadline=None)
@given(name=names, when=texts, procedure=texts, version=st.integers(1, 10**6), parent=st.none() | names,
       provenance=st.lists(words, max_size=4), macro=st.lists(words, max_size=4),
       stats=st.dictionaries(words, st.integers() | st.floats(allow_nan=False) | words | st.booleans(), max_size=3))
def test_any_skill_round_trips(name, when, procedure, version, parent, provenance, macro, stats) -> None:
    skill = Skill(name=name, when_to_use=when, procedure=procedure, version=version, parent=parent,
                  provenance=tuple(provenance), stats=stats, macro=tuple(macro))
    assert skill_from_text(skill_to_text(skill)) == skill
    with tempfile.TemporaryDirectory() as tmp:
        assert read_skill(write_skill(tmp, skill)) == skill
