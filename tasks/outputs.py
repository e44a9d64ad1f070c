"""Stage outputs that are replaced all together or not at all.

A stage declares the paths it produces and writes each one to a temporary sibling (``staged.path(target)``). Only
when the stage function has returned are they swapped in, together, under a commit journal:

1. every temporary output is complete (the stage returned);
2. the journal ``.arlflow/commits/<stage>.json`` is written and fsynced: from here on the commit is decided;
3. each existing target is renamed to a backup, then each temporary output renamed onto its target;
4. the backups and the journal are removed.

A stage that raises, or a process killed before step 2, leaves every target byte-identical (the temporaries are
removed, or swept by the next attempt). A process killed during steps 3-4 leaves a journal, and `recover` (run
before every stage) rolls the commit forward, so a reader never sees outputs of two different runs mixed.

Stages of asynchronous rounds run at the same time (threads of one flow, or processes): steps 2-4 and `recover` hold
an exclusive lock on ``.arlflow/commits/.lock`` (flock: per open file, so threads exclude each other too, and a killed
process releases it), so `recover` never rolls forward, and deletes, the journal of a commit that is still running.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

JOURNAL_DIR = Path(".arlflow") / "commits"


def _tmp_name(target: Path, token: str) -> Path:
    return target.with_name(f".{target.name}.tmp-{token}")


def _backup_name(target: Path, token: str) -> Path:
    return target.with_name(f".{target.name}.old-{token}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_journal(path: Path, entries: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump({"entries": entries}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _roll_forward(journal: Path) -> None:
    """Finish the commit a journal describes (idempotent: safe to run again after a crash inside it)."""
    entries = json.loads(journal.read_text())["entries"]
    for entry in entries:
        tmp, target, backup = Path(entry["tmp"]), Path(entry["target"]), Path(entry["backup"])
        if tmp.exists() or tmp.is_symlink():
            if (target.exists() or target.is_symlink()) and not (backup.exists() or backup.is_symlink()):
                os.replace(target, backup)
            elif target.exists() or target.is_symlink():
                _remove(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
    for entry in entries:
        _remove(Path(entry["backup"]))
    journal.unlink(missing_ok=True)


@contextmanager
def _commit_lock(root: Path) -> Iterator[None]:
    """Exclusive while a commit or a recovery runs under ``root`` (see the module docstring)."""
    folder = Path(root) / JOURNAL_DIR
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def recover(root: Path) -> list[str]:
    """Roll forward every commit a killed stage left half-done under ``root``; the stages it finished. A commit
    still running in another thread or process is waited for, not rolled forward under it."""
    folder = root / JOURNAL_DIR
    if not folder.is_dir():
        return []
    done = []
    with _commit_lock(root):
        for journal in sorted(folder.glob("*.json")):
            _roll_forward(journal)
            done.append(journal.stem)
    return done


class StagedOutputs:
    """Temporary siblings of a stage's outputs; see the module docstring."""

    def __init__(self, root: Path, stage: str, targets: Sequence[Path]) -> None:
        if len(set(targets)) != len(targets):
            raise ValueError(f"stage {stage}: an output is listed twice: {[str(t) for t in targets]}")
        self.root, self.stage = Path(root), stage
        self.targets = [Path(t) for t in targets]
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp = {target: _tmp_name(target, self.token) for target in self.targets}

    def path(self, target: Path) -> Path:
        """Where the stage writes ``target`` (a declared output) until it is committed."""
        try:
            return self._tmp[Path(target)]
        except KeyError:
            raise KeyError(f"stage {self.stage} writes {target}, which is not one of its declared outputs "
                           f"{[str(t) for t in self.targets]}") from None

    def sweep(self) -> None:
        """Remove temporaries and backups that earlier, killed attempts left beside the targets."""
        for target in self.targets:
            for stale in target.parent.glob(f".{target.name}.tmp-*") if target.parent.is_dir() else []:
                _remove(stale)
            for stale in target.parent.glob(f".{target.name}.old-*") if target.parent.is_dir() else []:
                _remove(stale)

    def commit(self) -> None:
        """Swap every written temporary in (an output the stage did not write keeps its old version)."""
        entries = [{"tmp": str(tmp), "target": str(target), "backup": str(_backup_name(target, self.token))}
                   for target, tmp in self._tmp.items() if tmp.exists() or tmp.is_symlink()]
        if not entries:
            return
        journal = self.root / JOURNAL_DIR / f"{self.stage}.json"
        with _commit_lock(self.root):
            _write_journal(journal, entries)
            _roll_forward(journal)

    def abort(self) -> None:
        for tmp in self._tmp.values():
            _remove(tmp)


@contextmanager
def staged_outputs(root: Path, stage: str, targets: Sequence[Path]) -> Iterator[StagedOutputs]:
    """``with staged_outputs(root, "train_3", [policy, metrics]) as out: save(out.path(policy))``: the outputs are
    replaced together when the block ends without an exception, and untouched otherwise."""
    recover(Path(root))
    staged = StagedOutputs(root, stage, targets)
    staged.sweep()
    for target in staged.targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staged
    except BaseException:
        staged.abort()
        raise
    staged.commit()
