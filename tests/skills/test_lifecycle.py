"""Bank changes with evidence: promote/reject/prune, rejected/ folder, one changelog line per change."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from skills.bank import Skill, SkillFormatError, load_bank, validate_skill_name, write_bank
from skills.lifecycle import BankChange, apply_changes, load_rejected, prune_skills


def skill(name: str, **stats) -> Skill:
    return Skill(name=name, when_to_use=f"when {name}", procedure=f"do {name}", version=int(stats.pop("version", 1)),
                 stats=stats)


def test_apply_changes_writes_live_rejected_and_the_changelog(tmp_path: Path):
    bank = tmp_path / "round_2"
    write_bank(bank, [skill("old-a", utility=0.4), skill("old-b", utility=0.0)], "round 1: mined 2 skill(s)")
    keep, promoted, rejected = skill("old-a", utility=0.4), skill("new-c", utility=0.3), skill("bad-d")
    changes = [BankChange("promoted", promoted, {"u": 0.3, "welch_t": 2.5}),
               BankChange("rejected", rejected, {"u": -0.2, "welch_t": -1.5}),
               BankChange("pruned", skill("old-b"), {"reason": "utility 0 < 0.05"})]
    apply_changes(bank, [keep, promoted], changes, header="round 2: 2 live skill(s); promoted 1, rejected 1, pruned 1")

    assert [s.name for s in load_bank(bank)] == ["new-c", "old-a"]  # old-b gone; rejected/ is not a live skill
    (back,) = load_rejected(bank)
    assert back.name == "bad-d" and back.stats["evidence"] == {"u": -0.2, "welch_t": -1.5}
    lines = (bank / "CHANGELOG.md").read_text().splitlines()
    assert lines[0] == "round 1: mined 2 skill(s)" and lines[1].startswith("round 2: 2 live")
    assert lines[2].startswith("promoted new-c v1 ") and json.loads(lines[2].split(" ", 3)[3]) == {"u": 0.3,
                                                                                                     "welch_t": 2.5}
    assert lines[3].startswith("rejected bad-d v1 ") and lines[4].startswith("pruned old-b v1 ")


def test_bad_changes_are_refused_before_anything_is_written(tmp_path: Path):
    bank = tmp_path / "bank"
    with pytest.raises(ValueError, match="unknown bank change"):
        BankChange("deleted", skill("x"))
    with pytest.raises(ValueError, match="both kept and"):
        apply_changes(bank, [skill("x")], [BankChange("retired", skill("x"))], header="h")
    assert not bank.exists()
    with pytest.raises(ValueError, match="reserved"):
        validate_skill_name("rejected")


def test_a_rejected_folder_never_breaks_loading_but_a_broken_skill_still_does(tmp_path: Path):
    bank = tmp_path / "bank"
    apply_changes(bank, [skill("ok")], [BankChange("rejected", skill("nope"), {"u": -1})], header="h")
    assert [s.name for s in load_bank(bank)] == ["ok"]
    (bank / "broken").mkdir()
    with pytest.raises(SkillFormatError, match="broken"):
        load_bank(bank)


def test_prune_by_utility_disuse_and_size():
    skills = [skill("low", utility=0.01, last_used_round=5), skill("idle", utility=0.5, last_used_round=1),
              skill("fresh", utility=0.3, last_used_round=5), skill("best", utility=0.9, last_used_round=5),
              skill("mid", utility=0.2, last_used_round=4), skill("unknown")]
    kept, pruned = prune_skills(skills, current_round=5, min_utility=0.05, max_idle_rounds=2, max_size=3)
    reasons = {c.skill.name: c.evidence["reason"] for c in pruned}
    # no utility estimate: never pruned by min_utility, but ranks as 0 under the size limit
    assert reasons == {"low": "utility 0.01 < 0.05", "idle": "unused since round 1", "unknown": "bank size limit 3"}
    assert sorted(s.name for s in kept) == ["best", "fresh", "mid"]
    assert all(c.verb == "pruned" for c in pruned)
    kept, pruned = prune_skills(skills, current_round=5)  # no rule: nothing pruned
    assert len(kept) == len(skills) and pruned == []
