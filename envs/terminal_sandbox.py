"""Sandbox runner of the terminal env: runs a policy-checked command in a per-episode directory, contained.

Threat model. The agent (a policy model under RL, so adversarial by accident if not by design) writes arbitrary
command text. It must not read or change anything outside its sandbox directory, reach the network, exhaust the
host (CPU, memory, disk, processes), hang the rollout, or see host details (the temp dir name) that would also break
determinism. Layers, outermost first:

1. No shell: ``terminal_policy`` lexes the text, refuses shell features (``;``, ``$(...)``, backticks, ...),
   allowlists programs and their options, and resolves every path argument (realpath, following symlinks) to check it
   stays inside the sandbox. Programs that change files cannot run inside a pipeline, and each ``&&`` segment is
   checked just before it runs, so a check cannot be raced by another stage of the same command.
2. Between commands the sandbox tree is scanned and any symlink that resolves outside it is deleted (however it
   got there: planted, or moved so its relative target now escapes), so recursive readers never meet one.
3. The process: exec'd directly (argv, no shell) with a minimal environment (PATH=/usr/bin:/bin, HOME=the sandbox,
   LC_ALL=C, nothing inherited), cwd inside the sandbox, stdin /dev/null, in a fresh network namespace (only a
   down loopback), with rlimits on CPU time, address space, file size, processes, open files and core dumps, and a
   wall-clock timeout that kills it; output is capped while reading. Running as root, the child also drops to an
   unprivileged uid (``nobody``) that owns only the sandbox. Not a container: there is no mount namespace, so the
   filesystem fence is layers 1-2 (plus file permissions when the uid drop is active).

Isolation is probed once per process (``detect_isolation``); ``Isolation.describe()`` tells the env what is active.
Namespaces, uid drop and rlimits are applied by exec-ing util-linux ``unshare``/``setpriv``/``prlimit`` in front of
the program (no fork of this Python process, see ``Isolation``); without util-linux, by a ``preexec_fn``.
Measured here: ~4-7 ms per simple command, ~15 ms for a 3-stage pipeline.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import pwd
import resource
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from envs.terminal_fs import SandboxPaths, ensure_root, remove_escaping_symlinks
from envs.terminal_policy import VIRTUAL_ROOT, PolicyError, parse, plan_stage

SAFE_PATH = "/usr/bin:/bin"
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one command (every stage of it)."""

    timeout_s: float = 2.0  # wall clock for the whole pipeline, then it is killed
    memory_bytes: int = 256 * 2**20  # RLIMIT_AS
    file_bytes: int = 2**20  # RLIMIT_FSIZE: largest file a command can write
    processes: int = 16  # RLIMIT_NPROC
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 * 2**10  # stdout+stderr read before the command is killed


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

    def prefix(self, limits: Limits) -> list[str]:
        """argv put before the program when ``launcher`` is set (each tool execs the next: one process)."""
        out: list[str] = []
        if self.netns:
            out += ["unshare", "-rn" if self.userns else "-n", "--"]
        if self.uid is not None:
            out += ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]
        cpu = max(1, math.ceil(limits.timeout_s))
        return out + ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_bytes}",
                      f"--fsize={limits.file_bytes}", f"--nproc={limits.processes}",
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


def _child_setup(limits: Limits, iso: Isolation, host_uid: int, host_gid: int) -> None:
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
                       (resource.RLIMIT_NPROC, (limits.processes,) * 2),
                       (resource.RLIMIT_NOFILE, (limits.open_files,) * 2),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)


def spawn_args(argv: tuple[str, ...], limits: Limits, iso: Isolation) -> dict:
    """Popen keyword arguments that start ``argv`` (program name first) under ``iso`` and ``limits``."""
    program_path(argv[0])  # refuses a program missing here before anything starts
    if iso.launcher:
        prefix = iso.prefix(limits)
        return {"args": prefix + list(argv), "executable": program_path(prefix[0])}
    host = (os.getuid(), os.getgid())
    return {"args": list(argv), "executable": program_path(argv[0]),
            "preexec_fn": lambda: _child_setup(limits, iso, *host)}


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


# ----------------------------------------------------------------------------------------------------- running
@dataclass(frozen=True)
class RunResult:
    """What one pipeline printed (stdout then stderr), its exit code, and why it was killed ('' if it was not)."""

    output: bytes
    exit_code: int
    note: str = ""


def _kill_note(code: int, limits: Limits) -> str:
    if code == -signal.SIGXFSZ:
        return f"file size limit ({limits.file_bytes // 1024} KiB) exceeded (killed)"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "CPU time limit exceeded (killed)"
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else ""


def run_pipeline(argvs: list[tuple[str, ...]], cwd: str, env: dict, limits: Limits, iso: Isolation,
                 stdin_path: str | None = None, stdout_path: str | None = None, append: bool = False,
                 owner: tuple[int, int] | None = None) -> RunResult:
    """Run ``argvs`` as one pipeline (argv[0] a program name) with ``iso`` and ``limits``; never raises OSError."""
    procs: list[subprocess.Popen] = []
    fds: list[int] = []
    try:
        stdin = os.open(stdin_path, os.O_RDONLY | os.O_CLOEXEC) if stdin_path else subprocess.DEVNULL
        if stdin_path:
            fds.append(stdin)
        out = None
        if stdout_path:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
            out = os.open(stdout_path, flags, 0o644)
            fds.append(out)
            if owner:
                os.fchown(out, *owner)
        err_r, err_w = os.pipe()
        fds += [err_r, err_w]
        prev = stdin
        for k, argv in enumerate(argvs):
            last = k == len(argvs) - 1
            proc = subprocess.Popen(**spawn_args(argv, limits, iso), stdin=prev, stderr=err_w, cwd=cwd, env=env,
                                    stdout=out if last and out is not None else subprocess.PIPE, close_fds=True,
                                    start_new_session=True)
            if k > 0:
                procs[-1].stdout.close()  # the next stage holds it now
            procs.append(proc)
            prev = proc.stdout
        os.close(err_w)
        fds.remove(err_w)
        readers = [err_r] + ([procs[-1].stdout.fileno()] if out is None else [])
        output, note = _read_all(readers, limits)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        for proc in procs:
            _kill(proc)
        return RunResult(f"error: {getattr(exc, 'strerror', None) or exc}".encode(), 126)
    finally:
        for fd in fds:
            os.close(fd)
    deadline = time.monotonic() + (0.5 if note else limits.timeout_s)
    for proc in procs:
        if note:
            _kill(proc)
        try:
            proc.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.wait()
            note = note or f"timed out after {limits.timeout_s:g}s (killed)"
        if proc.stdout:
            proc.stdout.close()
    code = procs[-1].returncode
    note = note or _kill_note(code, limits)
    return RunResult(output, 124 if "timed out" in note else (128 - code if code < 0 else code), note)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the stage's whole session (it and anything it forked)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _read_all(fds: list[int], limits: Limits) -> tuple[bytes, str]:
    """Read the pipes until EOF, the deadline, or the output cap: (stdout then stderr bytes, kill note)."""
    chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
    total, note = 0, ""
    deadline = time.monotonic() + limits.timeout_s
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not note:
            left = deadline - time.monotonic()
            if left <= 0:
                note = f"timed out after {limits.timeout_s:g}s (killed)"
                break
            for key, _ in sel.select(left):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                    continue
                total += len(data)
                chunks[key.fd].append(data)
                if total > limits.output_bytes:
                    note = f"output over {limits.output_bytes // 1024} KiB (killed)"
    return b"".join(b"".join(chunks[fd]) for fd in reversed(fds)), note


# ----------------------------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class CommandResult:
    """One agent command: its output text (virtual paths only), exit code (None when refused), and effects."""

    output: str
    exit_code: int | None
    valid: bool
    mutated: bool  # wrote files or changed the cwd (so an expert plan may need to restart)
    cwd: str


def child_env(root: str) -> dict:
    return {"PATH": SAFE_PATH, "HOME": root, "LC_ALL": "C", "LANG": "C", "TMPDIR": root}


def display_cwd(cwd: str) -> str:
    return f"{VIRTUAL_ROOT}/{cwd}" if cwd else VIRTUAL_ROOT


def run_command(command: str, root: str, cwd: str, limits: Limits, iso: Isolation,
                owner: tuple[int, int] | None = None) -> CommandResult:
    """Parse, check and run ``command`` (a ``&&`` chain, each segment checked just before it runs)."""
    try:
        segments = parse(command)
    except PolicyError as exc:
        return CommandResult(f"refused: {exc}", None, False, False, cwd)
    texts: list[str] = []
    code, mutated, valid = 0, False, True
    for seg in segments:
        texts += [f"removed symlink {p}: it pointed outside the sandbox" for p in remove_escaping_symlinks(root)]
        if cwd and not os.path.isdir(os.path.join(root, cwd)):
            texts.append(f"cwd {display_cwd(cwd)} no longer exists; back to {VIRTUAL_ROOT}")
            cwd = ""
        paths = SandboxPaths(root, cwd)
        try:
            stages = [[stage[0].text] + [x for w in stage[1:] for x in paths.expand(w)] for stage in seg.stages]
            if stages[0][0] in ("cd", "pwd"):
                if len(stages[0]) > 2:
                    raise PolicyError(f"{stages[0][0]}: too many arguments")
                if stages[0][0] == "cd":
                    cwd, mutated = paths.cd(stages[0][1] if len(stages[0]) > 1 else None), True
                else:
                    texts.append(display_cwd(cwd) + "\n")
                code = 0
                continue
            planned = [plan_stage(words, paths) for words in stages]
            if len(planned) > 1 and any(p.writes for p in planned):  # e.g. a glob gave uniq an output operand
                raise PolicyError("a command that changes files cannot be part of a pipeline; run it on its own")
            stdin = os.path.realpath(paths.full(paths.path(seg.stdin.text))) if seg.stdin else None
            stdout = os.path.realpath(paths.full(paths.path(seg.stdout.text))) if seg.stdout else None
        except PolicyError as exc:  # earlier segments of the chain have run: still tidy up below
            texts.append(f"refused: {exc}")
            code, valid = None, False
            break
        if stdout and os.path.isdir(stdout):
            texts.append(f"{seg.stdout.text}: Is a directory\n")
            code = 1
            break
        mutated = mutated or stdout is not None or any(p.writes for p in planned)
        result = run_pipeline([p.argv for p in planned], paths.cwd_real, child_env(root), limits, iso,
                              stdin, stdout, seg.append, owner)
        texts.append(result.output.decode("utf-8", "replace").replace(root, VIRTUAL_ROOT))
        if result.note:
            texts.append(f"error: {result.note}")
        code = result.exit_code
        if code != 0:
            break
    ensure_root(root, owner)
    texts += [f"removed symlink {p}: it pointed outside the sandbox" for p in remove_escaping_symlinks(root)]
    return CommandResult("".join(_lines(texts)), code, valid, mutated, cwd)


def _lines(texts: list[str]) -> list[str]:
    return [t if t.endswith("\n") else t + "\n" for t in texts if t]
