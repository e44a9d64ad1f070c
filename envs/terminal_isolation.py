"""How the terminal sandbox starts one program: budgets (``Limits``), process isolation (``Isolation``) and its probe.

Namespaces, the uid drop and rlimits are applied by exec-ing util-linux ``unshare``/``setpriv``/``prlimit`` in front
of the program (no fork of this Python process, see ``Isolation``); without util-linux, by a ``preexec_fn``.
The threat model, and how these pieces add up to per-action budgets, is in ``terminal_sandbox``.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import pwd
import resource
import shutil
import subprocess
from dataclasses import dataclass

from envs.terminal_policy import PolicyError

SAFE_PATH = "/usr/bin:/bin"
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Limits:
    """Budgets of one agent action: all its ``&&`` segments and pipeline stages together, unless marked per process."""

    timeout_s: float = 2.0  # wall clock for the whole action, then everything still running is killed
    memory_bytes: int = 256 * 2**20  # RLIMIT_AS, per process
    file_bytes: int = 2**20  # RLIMIT_FSIZE: largest file a process can write
    processes: int = 16  # programs alive at once (pipeline stages, and RLIMIT_NPROC for what they fork)
    open_files: int = 64  # RLIMIT_NOFILE, per process
    output_bytes: int = 64 * 2**10  # stdout+stderr read (all segments) before the action is killed
    disk_bytes: int = 8 * 2**20  # size of the sandbox tree (lstat bytes), checked while the action runs
    entries: int = 2000  # files, directories and links in the sandbox tree, checked likewise


@dataclass(frozen=True)
class Isolation:
    """Which process-level protections the runner applies (what the probe found to work here).

    ``launcher`` True: the child is started by exec-ing util-linux ``unshare``/``setpriv``/``prlimit`` in front of
    the program (no fork of this Python process: ~6 ms whatever its size, and thread-safe). False: the same
    protections from a ``preexec_fn`` (``resource.setrlimit``, ``unshare(2)``), which forks this process: slow
    once it holds a model (26 ms at 286 MB RSS, measured) and unsafe in threaded parents; used only without util-linux.
    """

    netns: bool = False  # fresh network namespace
    userns: bool = False  # via an unprivileged user namespace (non-root hosts)
    uid: int | None = None  # drop to this uid/gid (root hosts)
    gid: int | None = None
    launcher: bool = True

    def describe(self) -> dict:
        return {"policy": True, "rlimits": True, "netns": self.netns, "uid_drop": self.uid is not None,
                "mount_ns": False, "launcher": "util-linux" if self.launcher else "preexec_fn"}

    def nproc(self, limits: Limits, stages: int) -> int:
        """RLIMIT_NPROC of each of ``stages`` stages, so that together they stay within ``limits.processes``.

        The kernel counts processes per (user namespace, uid). With the uid drop, or no namespace, all stages share
        one count, so each gets the whole limit; under ``unshare -r`` every stage has a namespace (and count) of
        its own, so they split it.
        """
        return max(1, limits.processes // stages) if self.userns else limits.processes

    def prefix(self, limits: Limits, stages: int = 1) -> list[str]:
        """argv put before the program when ``launcher`` is set (each tool execs the next: one process)."""
        out: list[str] = []
        if self.netns:
            out += ["unshare", "-rn" if self.userns else "-n", "--"]
        if self.uid is not None:
            out += ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]
        cpu = max(1, math.ceil(limits.timeout_s))
        return out + ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_bytes}",
                      f"--fsize={limits.file_bytes}", f"--nproc={self.nproc(limits, stages)}",
                      f"--nofile={limits.open_files}", "--core=0", "--"]


def _write_proc(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _unshare(flags: int) -> None:
    if _LIBC.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")


def _child_setup(limits: Limits, iso: Isolation, nproc: int, host_uid: int, host_gid: int) -> None:
    """preexec_fn variant (``launcher`` False): namespaces, uid drop, then rlimits (NPROC counts the final uid)."""
    if iso.netns and not iso.userns:
        _unshare(_CLONE_NEWNET)
    if iso.uid is not None:
        os.setgroups([])
        os.setgid(iso.gid)
        os.setuid(iso.uid)
    if iso.userns:
        _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        _write_proc("/proc/self/uid_map", f"{host_uid} {host_uid} 1")
        _write_proc("/proc/self/setgroups", "deny")
        _write_proc("/proc/self/gid_map", f"{host_gid} {host_gid} 1")
    cpu = max(1, math.ceil(limits.timeout_s))
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_AS, (limits.memory_bytes,) * 2),
                       (resource.RLIMIT_FSIZE, (limits.file_bytes,) * 2),
                       (resource.RLIMIT_NPROC, (nproc,) * 2),
                       (resource.RLIMIT_NOFILE, (limits.open_files,) * 2),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)


def spawn_args(argv: tuple[str, ...], limits: Limits, iso: Isolation, stages: int = 1) -> dict:
    """Popen keyword arguments that start ``argv`` (program name first), one of ``stages``, under ``iso``/``limits``."""
    program_path(argv[0])  # refuses a program missing here before anything starts
    if iso.launcher:
        prefix = iso.prefix(limits, stages)
        return {"args": prefix + list(argv), "executable": program_path(prefix[0])}
    host = (os.getuid(), os.getgid())
    nproc = iso.nproc(limits, stages)
    return {"args": list(argv), "executable": program_path(argv[0]),
            "preexec_fn": lambda: _child_setup(limits, iso, nproc, *host)}


def _probe(iso: Isolation) -> bool:
    try:
        done = subprocess.run(**spawn_args(("true",), Limits(), iso), env={"PATH": SAFE_PATH},
                              stdin=subprocess.DEVNULL, timeout=10, check=False)
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError, PolicyError):
        return False


@functools.lru_cache(maxsize=1)
def detect_isolation() -> Isolation:
    """The strongest isolation that works on this host, probed once per process."""
    launcher = all(shutil.which(t, path=SAFE_PATH) for t in ("unshare", "setpriv", "prlimit"))
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody") if _has_user("nobody") else None
        uid, gid = (nobody.pw_uid, nobody.pw_gid) if nobody else (65534, 65534)
        candidates = [Isolation(netns=True, uid=uid, gid=gid), Isolation(netns=True), Isolation()]
    else:
        candidates = [Isolation(netns=True, userns=True), Isolation()]
    for iso in candidates:
        iso = Isolation(iso.netns, iso.userns, iso.uid, iso.gid, launcher)
        if _probe(iso):
            return iso
    return Isolation(launcher=launcher)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@functools.lru_cache(maxsize=None)
def program_path(name: str) -> str:
    found = shutil.which(name, path=SAFE_PATH)
    if found is None:
        raise PolicyError(f"{name} is not installed on this machine")
    return found
