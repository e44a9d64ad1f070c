"""Asynchronous rounds run stages at the same time: one stage's `recover` must not roll forward (and delete) the
journal of a commit another stage is still making (CI failure: mine_2's commit lost its journal to train's recover)."""
from __future__ import annotations

import threading
from pathlib import Path

import tasks.outputs as outputs
from tasks.outputs import JOURNAL_DIR, recover, staged_outputs


def test_recover_waits_for_a_commit_in_progress_instead_of_taking_its_journal(tmp_path, monkeypatch):
    target = tmp_path / "out" / "result.txt"
    target.parent.mkdir()
    target.write_text("old")
    journal_written, release = threading.Event(), threading.Event()
    real_roll_forward = outputs._roll_forward

    def roll_forward_after_a_pause(journal: Path) -> None:
        if journal.stem == "mine_2" and not release.is_set():
            journal_written.set()                       # the commit is decided and not yet done
            assert release.wait(10)
        real_roll_forward(journal)

    monkeypatch.setattr(outputs, "_roll_forward", roll_forward_after_a_pause)
    errors: list[BaseException] = []

    def stage() -> None:
        try:
            with staged_outputs(tmp_path, "mine_2", [target]) as staged:
                staged.path(target).write_text("new")
        except BaseException as err:                     # the failure mode: FileNotFoundError on the journal
            errors.append(err)

    committing = threading.Thread(target=stage)
    committing.start()
    assert journal_written.wait(10)
    recovered: list[list[str]] = []
    recovering = threading.Thread(target=lambda: recovered.append(recover(tmp_path)))
    recovering.start()
    recovering.join(0.5)
    assert recovering.is_alive(), "recover ran while another stage's commit held its journal"
    release.set()
    committing.join(10)
    recovering.join(10)
    assert not errors and not committing.is_alive() and not recovering.is_alive()
    assert recovered == [[]]                             # nothing was left half-done for it to finish
    assert target.read_text() == "new"
    assert not list((tmp_path / JOURNAL_DIR).glob("*.json"))
    assert sorted(p.name for p in target.parent.iterdir()) == ["result.txt"]
