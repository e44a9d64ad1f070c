"""The sandbox's file tree for the terminal env: path checks, creation, symlink scans, digests and safe reads.

``SandboxPaths`` is the ``PathResolver`` the policy uses against a real sandbox: every path argument is resolved
with ``os.path.realpath`` (following symlinks) and refused if it lands outside the root; ``/sandbox`` is the
virtual absolute path of the root (so the temp dir's real name never reaches the agent). The tree helpers never
follow a symlink out of the root: the scan deletes such links, digests hash link targets as text, and reads
refuse anything that is not a regular file inside.
"""
from __future__ import annotations

import glob as globlib
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass

from envs.terminal_policy import VIRTUAL_ROOT, PolicyError, Word


class SandboxPaths:
    """Path checks against a real sandbox: ``root`` (already realpath'd) and the cwd relative to it."""

    def __init__(self, root: str, cwd: str = "") -> None:
        self.root = root
        self.cwd = cwd
        self.cwd_real = os.path.join(root, cwd) if cwd else root

    def inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)

    def full(self, arg: str) -> str:
        """The absolute, unresolved path ``arg`` names (virtual /sandbox mapped to the root)."""
        if not arg:
            raise PolicyError("empty path")
        if arg.startswith("/"):
            if arg != VIRTUAL_ROOT and not arg.startswith(VIRTUAL_ROOT + "/"):
                raise PolicyError(f"{arg}: absolute paths outside {VIRTUAL_ROOT} are not allowed; "
                                  f"use paths inside the sandbox")
            return os.path.join(self.root, arg[len(VIRTUAL_ROOT):].lstrip("/"))
        return os.path.join(self.cwd_real, arg)

    def path(self, arg: str, *, allow_root: bool = True) -> str:
        full = self.full(arg)
        real = os.path.realpath(full)
        if not self.inside(real):
            raise PolicyError(f"{arg}: leads outside the sandbox; stay inside {VIRTUAL_ROOT}")
        if not allow_root and real == self.root:
            raise PolicyError(f"{arg}: the sandbox root itself cannot be removed or moved")
        return os.path.relpath(full, self.cwd_real) if arg.startswith("/") else arg

    def symlink(self, target: str, link: str, *, no_dereference: bool = False) -> None:
        """Refuse ``ln -s target link`` unless the link it makes resolves inside the sandbox.

        GNU ln puts the link inside ``link`` when that is a directory, or a symlink to one (followed); with
        ``no_dereference`` (``-n``) a symlink to a directory is the link name itself (``-f`` replaces it), so the
        target resolves from the symlink's own directory, not from the directory it points to.
        """
        if target.startswith("/"):
            raise PolicyError("ln -s: the target must be a relative path inside the sandbox")
        link_full = self.full(link)
        into_dir = os.path.isdir(link_full) and not (no_dereference and os.path.islink(link_full))
        if into_dir:
            link_full = os.path.join(link_full, os.path.basename(target.rstrip("/")) or target)
        where = os.path.realpath(os.path.dirname(link_full))
        if not self.inside(os.path.realpath(os.path.join(where, target))):
            raise PolicyError(f"ln -s: {target} would point outside the sandbox; links must stay inside")

    def cd(self, arg: str | None) -> str:
        """The new cwd (relative to the root) for ``cd arg``."""
        if arg in (None, "~", VIRTUAL_ROOT):
            return ""
        if arg == "-":
            raise PolicyError("cd -: not supported; cd to a path")
        self.path(arg)
        real = os.path.realpath(self.full(arg))
        if not os.path.isdir(real):
            raise PolicyError(f"cd: {arg}: no such directory")
        rel = os.path.relpath(real, self.root)
        return "" if rel == "." else rel

    def expand(self, word: Word) -> list[str]:
        """Bash-like glob expansion of an unquoted pattern inside the cwd (sorted; no match keeps the word)."""
        if word.pattern is None:
            return [word.text]
        if word.pattern.startswith("/") or ".." in word.pattern.split("/"):
            raise PolicyError(f"{word.text}: globs must be relative paths without '..'")
        matches = sorted(globlib.glob(word.pattern, root_dir=self.cwd_real))
        for m in matches:
            if not self.inside(os.path.realpath(os.path.join(self.cwd_real, m))):
                raise PolicyError(f"{word.text}: matches a path outside the sandbox")
        return [f"./{m}" if m.startswith("-") else m for m in matches] or [word.text]


def create_sandbox(files: dict[str, str], base_dir: str | None, owner: tuple[int, int] | None) -> str:
    """A fresh temp dir holding ``files`` (path -> text; a path ending in / is an empty dir); its realpath.

    With ``owner`` (root host, commands run as that uid) the tree is chowned to it, and ``base_dir`` and its parents
    must be searchable by it: ValueError otherwise.
    """
    if owner:
        _check_searchable(base_dir or tempfile.gettempdir(), owner[0])
    root = os.path.realpath(tempfile.mkdtemp(prefix="arlflow-terminal-", dir=base_dir))
    for rel, text in sorted(files.items()):
        full = os.path.join(root, rel)
        os.makedirs(full if rel.endswith("/") else os.path.dirname(full), exist_ok=True)
        if not rel.endswith("/"):
            with open(full, "w", encoding="utf-8") as fh:
                fh.write(text)
    if owner:
        for dirpath, dirnames, filenames in os.walk(root):
            os.chown(dirpath, *owner)
            for name in filenames:
                os.chown(os.path.join(dirpath, name), *owner)
    return root


def _check_searchable(path: str, uid: int) -> None:
    path = os.path.realpath(path)
    while True:
        st = os.stat(path)
        if not st.st_mode & stat.S_IXOTH and st.st_uid != uid:
            raise ValueError(f"sandbox base dir: {path} is not searchable by the sandbox uid {uid} (mode "
                             f"{stat.S_IMODE(st.st_mode):o}); pass a base_dir whose parents are all o+x, e.g. /tmp")
        if path == "/":
            return
        path = os.path.dirname(path)


def ensure_root(root: str, owner: tuple[int, int] | None) -> None:
    if not os.path.isdir(root):
        os.makedirs(root, mode=0o700)
        if owner:
            os.chown(root, *owner)


def remove_escaping_symlinks(root: str) -> list[str]:
    """Delete every symlink under ``root`` that resolves outside it; their paths (relative, sorted)."""
    removed = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                continue
            real = os.path.realpath(full)
            if real != root and not real.startswith(root + os.sep):
                os.unlink(full)
                removed.append(os.path.relpath(full, root))
    return sorted(removed)


def tree_usage(root: str, max_entries: int) -> tuple[int, int]:
    """(bytes, entries) under ``root`` as ``tree_state`` counts them (lstat sizes, links not followed), cheaply.

    Safe while a command changes the tree (vanished entries are skipped); stops counting past ``max_entries``.
    """
    total = entries = 0
    stack = [root]
    while stack and entries <= max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    if entries > max_entries:
                        break
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                    except OSError:
                        continue
        except OSError:
            continue
    return total, entries


@dataclass(frozen=True)
class TreeState:
    digest: str  # 12 hex chars over names, kinds, sizes and content hashes (capped work)
    total_bytes: int
    entries: int


def tree_state(root: str, max_entries: int = 2000, hash_bytes: int = 1 << 16) -> TreeState:
    """Digest of the tree (sorted walk, no symlink following); hashing stops after ``max_entries`` entries."""
    h = hashlib.sha1()
    total = entries = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            entries += 1
            if entries > max_entries:
                return TreeState(h.hexdigest()[:12], total, entries)
            st = os.lstat(full)
            total += st.st_size
            if os.path.islink(full):
                h.update(f"l {rel} {os.readlink(full)}\n".encode())
            elif os.path.isdir(full):
                h.update(f"d {rel}\n".encode())
            else:
                with open(full, "rb") as fh:
                    h.update(f"f {rel} {st.st_size} ".encode() + hashlib.sha1(fh.read(hash_bytes)).digest())
    return TreeState(h.hexdigest()[:12], total, entries)


def read_text(root: str, rel: str, max_bytes: int = 1 << 20) -> str | None:
    """Text of a regular file inside ``root`` (None if missing, a dir, a link outside, or not a regular file)."""
    real = os.path.realpath(os.path.join(root, rel))
    if not real.startswith(root + os.sep) or not os.path.isfile(real):
        return None
    with open(real, "rb") as fh:
        return fh.read(max_bytes).decode("utf-8", "replace")


def list_files(root: str, under: str = "") -> list[str]:
    """Relative paths of the regular files under ``root/under`` (sorted, no symlinks)."""
    out = []
    for dirpath, _, filenames in os.walk(os.path.join(root, under)):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, root))
    return sorted(out)
