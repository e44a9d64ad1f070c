"""Sandbox runner of the terminal env: runs one agent action (a policy-checked command) in a per-episode directory.

Threat model. The agent (a policy model under RL, so adversarial by accident if not by design) writes arbitrary
command text. It must not read or change anything outside its sandbox directory, reach the network, exhaust the
host (CPU, memory, disk, processes), hang the rollout, or see host details (the temp dir name) that would also break
determinism. Layers, outermost first:

1. No shell: ``terminal_policy`` lexes the text, refuses shell features (``;``, ``$(...)``, backticks, ...),
   allowlists programs and their options, and resolves every path argument (realpath, following symlinks) to check it
   stays inside the sandbox. Programs that change files cannot run inside a pipeline, and each ``&&`` segment is
   checked just before it runs, so a check cannot be raced by another stage of the same command.
2. Between commands (and ``&&`` segments) the sandbox tree is scanned and any symlink that resolves outside it is
   deleted (however it got there: planted, or moved so its relative target now escapes), so recursive readers never
   meet one.
3. The process (``terminal_isolation``): exec'd directly (argv, no shell) with a minimal environment
   (PATH=/usr/bin:/bin, HOME=the sandbox, LC_ALL=C, nothing inherited), cwd inside the sandbox, stdin /dev/null, in
   a fresh network namespace (only a down loopback), with rlimits on CPU time, address space, file size, processes,
   open files and core dumps, at the lowest CPU priority (nice 19), each stage in a session (process group) of its
   own. Running as root, the child also drops to an unprivileged uid (``nobody``) that owns only the sandbox. Not a
   container: there is no mount namespace, so the filesystem fence is layers 1-2 (plus file permissions when the uid
   drop is active).
4. Per-action budgets (``Limits``, held by one ``Action``): every ``&&`` segment and pipeline stage of a command
   shares one wall-clock deadline, one output cap, the sandbox's disk quota and entry limit, and one process limit.
   Spending any of them kills all of the action's process groups (SIGKILL; a group is killed before its leader is
   reaped, so a recycled pid is never signalled), starts nothing more, and ends the output with ``error: <budget>
   ... <limit> (killed)``. ``Action.stop`` works from any thread: the env's ``interrupt`` (the rollout calls it when
   its step timeout fires) uses it.
   Disk bytes and entries (``tree_usage``) are measured before each segment, and while one runs (only then: no
   fixed sleep per command) from 2 ms after it starts, then as often as the tree grows (``watch_interval``: about one
   file-size limit of growth per poll, every 1-10 ms). The overshoot is what the command writes between two polls:
   measured here 0.5-3 MiB for a ``sed -i`` writing 600 MB/s over a 4 MiB quota, more when this thread waits for a
   CPU on a saturated host (stages run at nice 19 so that it rarely does); a ``cp`` may finish between polls, but it
   copies each source once, so at most the tree's own size, and the next segment does not start.
   Processes: each stage is a child of this process, exec'd after its uid drop, and RLIMIT_NPROC is checked when a
   process forks, not when it execs (``prlimit`` sets it after ``setpriv``, so not at the uid change either); under
   ``unshare -r`` each stage also has a user namespace, and so a process count, of its own. That is how a pipeline
   of 198 stages ran 198 processes against a limit of 16. Now a pipeline of more stages than ``Limits.processes`` is
   refused before anything runs, segments run one at a time (a segment's groups are killed before the next starts),
   and RLIMIT_NPROC bounds what stages fork (no allowlisted program does): one count shared by all stages with the
   uid drop, the limit split between them under user namespaces (``Isolation.nproc``). Root without the uid drop is
   exempt from RLIMIT_NPROC: there only the stage count holds.

Isolation is probed once per process (``detect_isolation``); ``Isolation.describe()`` tells the env what is active.
Measured here: ~4-7 ms per simple command, ~15 ms for a 3-stage pipeline.
"""
from __future__ import annotations

import math
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from envs.terminal_fs import SandboxPaths, ensure_root, remove_escaping_symlinks, tree_usage
from envs.terminal_isolation import SAFE_PATH, Isolation, Limits, detect_isolation, program_path, spawn_args
from envs.terminal_policy import VIRTUAL_ROOT, PolicyError, Segment, parse, plan_stage

__all__ = ["Action", "CommandResult", "Isolation", "Limits", "RunResult", "detect_isolation", "display_cwd",
           "program_path", "run_command", "run_pipeline", "size_text"]

WATCH_FIRST_S, WATCH_MIN_S, WATCH_MAX_S = 0.002, 0.001, 0.01  # polls of the sandbox tree while a command runs
SANDBOX_NICE = 19  # CPU priority of every stage: the lowest
INTERRUPTED = "interrupted: the harness gave up on this step (killed)"


# ----------------------------------------------------------------------------------------------------- running
def size_text(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Action:
    """The budgets one agent action shares across its ``&&`` segments and pipeline stages (module docstring, 4).

    ``stop`` may be called from any thread: it kills every live process group of the action, and no further stage
    or segment starts. A stage's group is tracked from its start until ``release``, which kills what is left of it
    after its leader exited but before the leader is reaped, so the pid is still ours when it is signalled.
    """

    def __init__(self, limits: Limits, root: str | None = None) -> None:
        self.limits = limits
        self.root = root  # the sandbox whose size and entries are watched (None: not watched)
        self.deadline = time.monotonic() + limits.timeout_s
        self.output_left = limits.output_bytes
        self.reason = ""  # why the action was stopped; '' while it may go on
        self.exit_code = 0  # what a stopped action reports: 124 after its deadline, else 137 (killed)
        self.usage = (0, 0)  # (bytes, entries) of the tree at the last check
        self.finished = threading.Event()  # set when run_command returns
        self._groups: set[int] = set()
        self._lock = threading.Lock()

    def stop(self, reason: str, exit_code: int = 137) -> None:
        with self._lock:
            if not self.reason:
                self.reason, self.exit_code = reason, exit_code
            for pgid in self._groups:
                _killpg(pgid)

    def track(self, pid: int) -> None:
        with self._lock:
            self._groups.add(pid)
            if self.reason:
                _killpg(pid)

    def release(self, pid: int) -> None:
        with self._lock:
            if pid in self._groups:
                self._groups.discard(pid)
                _killpg(pid)

    def check(self) -> bool:
        """Stop the action if its time, entry or disk budget is spent; whether it is stopped."""
        limits = self.limits
        if not self.reason and time.monotonic() >= self.deadline:
            self.stop(f"timed out after {limits.timeout_s:g}s, the time limit of the whole command (killed)", 124)
        elif not self.reason and self.root is not None:
            size, entries = self.usage = tree_usage(self.root, limits.entries)
            if entries > limits.entries:
                self.stop(f"entry limit exceeded: the sandbox may hold {limits.entries} files and directories "
                          f"(killed)")
            elif size > limits.disk_bytes:
                self.stop(f"disk quota exceeded: the sandbox may hold {size_text(limits.disk_bytes)} (killed)")
        return bool(self.reason)


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
        return f"CPU time limit ({max(1, math.ceil(limits.timeout_s))}s per process) exceeded (killed)"
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else ""


def run_pipeline(argvs: list[tuple[str, ...]], cwd: str, env: dict, limits: Limits, iso: Isolation,
                 stdin_path: str | None = None, stdout_path: str | None = None, append: bool = False,
                 owner: tuple[int, int] | None = None, action: Action | None = None) -> RunResult:
    """Run ``argvs`` as one pipeline (argv[0] a program name) with ``iso``, on ``action``'s budgets (a fresh
    ``Action(limits)`` if None: time, output and processes, not the tree); never raises OSError."""
    action = action or Action(limits)
    if action.reason:
        return RunResult(b"", action.exit_code, action.reason)
    procs: list[subprocess.Popen] = []
    fds: list[int] = []
    output, error = b"", ""
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
            if action.reason:  # stopped from another thread while the pipeline was starting
                break
            last = k == len(argvs) - 1
            proc = subprocess.Popen(**spawn_args(argv, limits, iso, len(argvs)), stdin=prev, stderr=err_w, cwd=cwd,
                                    env=env, stdout=out if last and out is not None else subprocess.PIPE,
                                    close_fds=True, start_new_session=True)
            procs.append(proc)
            action.track(proc.pid)
            _lower_priority(proc.pid)
            if k > 0:
                procs[-2].stdout.close()  # the next stage holds it now
            prev = proc.stdout
        os.close(err_w)
        fds.remove(err_w)
        readers = [err_r] + ([procs[-1].stdout.fileno()] if out is None and procs and procs[-1].stdout else [])
        output = _supervise(procs, readers, action)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        error = f"error: {getattr(exc, 'strerror', None) or exc}"
    finally:
        for proc in procs:  # kills what is left (after a stop or an error), then reaps
            action.release(proc.pid)
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
        for fd in fds:
            os.close(fd)
    if error:
        return RunResult(error.encode(), 126)
    if action.reason or not procs:
        return RunResult(output, action.exit_code, action.reason)
    code = procs[-1].returncode
    return RunResult(output, 128 - code if code < 0 else code, _kill_note(code, limits))


def watch_interval(elapsed_s: float, walk_s: float, grown_bytes: int, grown_entries: int, limits: Limits) -> float:
    """Seconds to the next measure of the tree, which grew by ``grown_*`` in the last ``elapsed_s``.

    Aims at one unit of growth per poll (a file-size limit of bytes, or 1/32 of the entry limit), so the overshoot
    stays about one unit however fast a program writes; while the tree grows slower than that, or not at all, it
    backs off slowly (x1.25 a poll) to every 10 ms, as a writer may speed up at any time (a ``sleep`` in a small
    tree: ~100 walks of ~0.1 ms a second); never walks more than a fifth of the time (4 x the walk's own CPU time
    ``walk_s``, which makes it ~20 ms in a 2000-entry tree).
    """
    units = max(grown_bytes / limits.file_bytes, grown_entries / max(16, limits.entries // 32))
    wanted = elapsed_s / max(units, 0.8)
    return max(WATCH_MIN_S, 4 * walk_s, min(WATCH_MAX_S, wanted))


def _lower_priority(pid: int) -> None:
    """Nice 19 for a stage (before its program starts: the launcher chain is still exec-ing), so that under CPU
    contention the watcher, and the host, run ahead of it rather than behind it."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, SANDBOX_NICE)
    except OSError:
        pass


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it (so its pid, and group id, stay ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _supervise(procs: list[subprocess.Popen], readers: list[int], action: Action) -> bytes:
    """Read the pipes and reap the stages until all have exited and closed their output, or the action is stopped
    (its deadline, output cap, disk or entry budget, or ``stop`` from another thread); stdout then stderr bytes."""
    chunks: dict[int, list[bytes]] = {fd: [] for fd in readers}
    running = {proc.pid: proc for proc in procs}
    pidfds: list[int] = []
    with selectors.DefaultSelector() as sel:
        for fd in readers:
            sel.register(fd, selectors.EVENT_READ)
        try:
            for proc in procs:  # readable once the stage exits: no polling for exits
                pidfds.append(os.pidfd_open(proc.pid))
                sel.register(pidfds[-1], selectors.EVENT_READ, proc.pid)
        except (AttributeError, OSError):
            pass  # no pidfds (old kernel): exits are polled every 5 ms below
        open_pipes = len(readers)
        checked, usage, interval = time.monotonic(), action.usage, WATCH_FIRST_S
        next_watch = checked + interval
        try:
            while True:
                for pid in [pid for pid in running if _exited(pid)]:
                    action.release(pid)
                    running.pop(pid).wait()
                if (not running and not open_pipes) or action.reason:
                    break
                now = time.monotonic()
                if now >= next_watch or now >= action.deadline:
                    cpu = time.thread_time()  # the walk's cost, not the time a busy host kept this thread waiting
                    if action.check():
                        break
                    interval = watch_interval(now - checked, time.thread_time() - cpu, action.usage[0] - usage[0],
                                              action.usage[1] - usage[1], action.limits)
                    checked, usage, next_watch = now, action.usage, time.monotonic() + interval
                wait = max(0.0, min(next_watch, action.deadline) - time.monotonic())
                for key, _ in sel.select(wait if len(pidfds) == len(procs) else min(wait, 0.005)):
                    if key.data is not None:  # a stage's pidfd: it exited (reaped at the top of the loop)
                        sel.unregister(key.fd)
                        continue
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        open_pipes -= 1
                        continue
                    chunks[key.fd].append(data)
                    action.output_left -= len(data)
                    if action.output_left < 0:
                        action.stop(f"output over {action.limits.output_bytes // 1024} KiB (killed)")
        finally:
            for fd in pidfds:
                os.close(fd)
    return b"".join(b"".join(chunks[fd]) for fd in reversed(readers))


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
                owner: tuple[int, int] | None = None, action: Action | None = None) -> CommandResult:
    """Parse, check and run ``command`` (a ``&&`` chain, each segment checked just before it runs) as one action:
    its segments share the budgets of ``action`` (a fresh ``Action(limits, root)`` if None)."""
    action = action or Action(limits, root)
    try:
        return _run_segments(command, root, cwd, limits, iso, owner, action)
    finally:
        action.finished.set()


def check_process_budget(segments: list[Segment], limits: Limits) -> None:
    widest = max(len(seg.stages) for seg in segments)
    if widest > limits.processes:
        raise PolicyError(f"a pipeline of {widest} programs is over the process limit ({limits.processes} at "
                          f"once); use fewer stages, or split it into steps")


def _run_segments(command: str, root: str, cwd: str, limits: Limits, iso: Isolation,
                  owner: tuple[int, int] | None, action: Action) -> CommandResult:
    try:
        segments = parse(command)
        check_process_budget(segments, limits)
    except PolicyError as exc:
        return CommandResult(f"refused: {exc}", None, False, False, cwd)
    texts: list[str] = []
    code, mutated, valid = 0, False, True
    for seg in segments:
        texts += [f"removed symlink {p}: it pointed outside the sandbox" for p in remove_escaping_symlinks(root)]
        if action.reason or action.check():  # the budget is shared: a later segment gets what is left
            texts.append(f"error: {action.reason}")
            code = action.exit_code
            break
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
                              stdin, stdout, seg.append, owner, action)
        texts.append(result.output.decode("utf-8", "replace").replace(root, VIRTUAL_ROOT))
        if result.note:
            texts.append(f"error: {result.note}")
        code = result.exit_code
        if code != 0:
            break
    if action.reason != INTERRUPTED:  # interrupted: the env may be removing the tree
        ensure_root(root, owner)
    texts += [f"removed symlink {p}: it pointed outside the sandbox" for p in remove_escaping_symlinks(root)]
    return CommandResult("".join(_lines(texts)), code, valid, mutated, cwd)


def _lines(texts: list[str]) -> list[str]:
    return [t if t.endswith("\n") else t + "\n" for t in texts if t]
