"""Terminal sandbox budgets are per action: one deadline, disk quota, entry limit and process limit for every ``&&``
segment and pipeline stage of a command, enforced while it runs; and the rollout's step timeout kills the command."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest

from agents.rollout import run_episodes
from agents.workers import call_all
from envs import make_scenarios
from envs.terminal import TerminalEnv
from envs.terminal_fs import tree_usage
from envs.terminal_sandbox import Isolation, Limits, detect_isolation, run_pipeline, watch_interval
from models.build import train_tokenizer
from models.engine import Generation, SamplingParams

ENVS_DIR = str(pathlib.Path(__file__).resolve().parents[2] / "envs")


def fresh(open_dir, **kwargs) -> TerminalEnv:
    env = TerminalEnv(base_dir=str(open_dir), max_steps=50, **kwargs)
    env.reset(seed=0, options={"template": "sort_lines"})
    return env


def alive(marker: str) -> int:
    """How many processes run ``sleep [--] <marker>`` (a duration no other test uses)."""
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")[:-1]
        except OSError:
            continue
        found += argv[:1] == [b"sleep"] and argv[-1:] == [marker.encode()]
    return found


def gone(marker: str, within_s: float = 1.0) -> bool:
    end = time.monotonic() + within_s
    while alive(marker) and time.monotonic() < end:
        time.sleep(0.02)
    return alive(marker) == 0


def add_files(env: TerminalEnv, folder: str, count: int, text: str) -> None:
    """A folder of files written straight into the sandbox (owned by the sandbox uid, as the agent's own are)."""
    paths = [os.path.join(env._root, folder)]
    os.mkdir(paths[0])
    for i in range(count):
        paths.append(os.path.join(paths[0], f"f{i:03d}"))
        pathlib.Path(paths[-1]).write_text(text)
    for path in paths if env._owner else []:
        os.chown(path, *env._owner)


# ----------------------------------------------------------------------------------------------------- time
def test_one_deadline_for_all_segments_of_a_chain(open_dir):
    env = fresh(open_dir, command_timeout_s=0.6)
    start = time.monotonic()
    obs, _, terminated, _, info = env.step(" && ".join(["sleep 0.25"] * 6))  # 1.5 s of segments, each under 0.6 s
    took = time.monotonic() - start
    assert took < 1.0, took
    assert "error: timed out after 0.6s, the time limit of the whole command (killed)" in obs
    assert info["exit_code"] == 124 and not terminated and env.step("pwd")[0] == "/sandbox"


# ----------------------------------------------------------------------------------------------------- disk
def test_disk_quota_stops_a_doubling_cp_chain(open_dir):
    """The attack: double a folder with ``cp -r`` in one chain (before: all 8 doublings ran, 63 MiB against 2 MiB)."""
    file_bytes, quota = 256 * 2**10, 2 * 2**20
    env = fresh(open_dir, max_file_bytes=file_bytes, disk_quota_bytes=quota)
    assert env.step(f"mkdir d && yes | head -c {file_bytes - 4096} > d/f")[4]["exit_code"] == 0
    obs, _, terminated, _, info = env.step(" && ".join(f"cp -r d d{i} && mv d{i} d/x{i}" for i in range(8)))
    size, _ = tree_usage(env._root, 10**6)
    assert "error: disk quota exceeded: the sandbox may hold 2 MiB (killed)" in obs, obs
    assert terminated and info["exit_code"] == 137 and "episode over" in obs
    assert size <= 2 * quota + 16 * 2**10, size  # the segment in flight copies the tree at most once
    assert not os.path.exists(os.path.join(env._root, "d", "x7"))


def test_disk_quota_kills_a_single_writer_while_it_runs(open_dir):
    """One ``sed -i`` blowing 150 small files up to 135 MB (before: all written, then the episode ended): killed
    mid-run. Measured here 0.5-3 MiB over a 4 MiB quota; the bound leaves room for a host so loaded that the
    watcher waits ~50 ms for a CPU."""
    quota = 4 * 2**20
    env = fresh(open_dir, disk_quota_bytes=quota, command_timeout_s=5.0)
    add_files(env, "g", 150, "x\n" * 1000)
    obs, _, terminated, _, _ = env.step("sed -i s/x/" + "y" * 900 + "/ g/*")
    size, _ = tree_usage(env._root, 10**6)
    files = os.listdir(os.path.join(env._root, "g"))
    grown = sum(os.path.getsize(os.path.join(env._root, "g", f)) > 10**5 for f in files)
    assert "error: disk quota exceeded: the sandbox may hold 4 MiB (killed)" in obs and terminated, obs
    assert grown < 150 and size <= quota + 32 * env.limits.file_bytes, (grown, size)


def test_entry_limit_is_enforced_during_the_action(open_dir):
    """Before: all 12 copies ran (~1,300 entries against 300), and only then did the episode end."""
    env = fresh(open_dir, max_entries=300)
    add_files(env, "d", 100, "")
    obs, _, terminated, _, _ = env.step(" && ".join(f"cp -r d d{i}" for i in range(12)))
    _, entries = tree_usage(env._root, 10**6)
    assert "error: entry limit exceeded: the sandbox may hold 300 files and directories (killed)" in obs, obs
    assert terminated and entries <= 2 * 300, entries


def test_watch_interval_follows_growth():
    limits = Limits(file_bytes=2**20, entries=2000)
    assert watch_interval(0.004, 0.0, 0, 0, limits) == pytest.approx(0.005)  # idle: back off slowly
    assert watch_interval(0.004, 0.0, 4096, 1, limits) == pytest.approx(0.005)  # slow growth too (not elapsed / units)
    assert watch_interval(0.009, 0.0, 0, 0, limits) == 0.01  # capped: a writer may speed up at any time
    assert watch_interval(0.004, 0.0, 4 * 2**20, 0, limits) == 0.001  # 4 units in 4 ms: one per ms
    assert watch_interval(0.004, 0.0, 0, 124, limits) == pytest.approx(0.002)  # 2 x 62 entries
    assert watch_interval(0.004, 0.005, 4 * 2**20, 0, limits) == 0.02  # never more than 1/5 of the time walking


# ----------------------------------------------------------------------------------------------------- processes
def test_a_pipeline_over_the_process_limit_is_refused_before_it_runs(open_dir):
    """Before: a 199-stage pipeline ran 199 processes at once against a limit of 16."""
    env = fresh(open_dir, max_processes=16)
    obs, _, _, _, info = env.step(" | ".join(["sleep 0.31"] * 17))
    assert obs == ("refused: a pipeline of 17 programs is over the process limit (16 at once); use fewer stages, "
                   "or split it into steps") and not info["action_valid"] and alive("0.31") == 0
    _, _, _, _, info = env.step(" | ".join(["sleep 0.01"] * 16))
    assert info["exit_code"] == 0


FORK_SCRIPT = r"""
import sys, tempfile, threading, time, types
pkg = types.ModuleType("envs"); pkg.__path__ = [sys.argv[1]]; sys.modules["envs"] = pkg  # skip envs/__init__
try:
    from envs.terminal_sandbox import Isolation, Limits, run_pipeline
except (ImportError, OSError) as err:  # e.g. a checkout this uid cannot read
    sys.exit(f"unavailable: {err}")
iso, marker = eval(sys.argv[2]), sys.argv[3]
root, env = tempfile.mkdtemp(), {"PATH": "/usr/bin:/bin"}
if run_pipeline([("true",)], root, env, Limits(), iso).exit_code != 0:
    sys.exit("unavailable")
peak, stop = [0], []
def count():
    while not stop:
        found = 0
        for pid in filter(str.isdigit, __import__("os").listdir("/proc")):
            try:
                found += open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:2] == [b"sleep", marker.encode()]
            except OSError:
                pass
        peak[0] = max(peak[0], found)
        time.sleep(0.03)
watcher = threading.Thread(target=count)
watcher.start()
stage = ("bash", "-c", "for i in " + " ".join(map(str, range(20))) + f"; do sleep {marker} & done; wait")
run_pipeline([stage] * 4, root, env, Limits(timeout_s=0.8, processes=16), iso)
stop.append(1)
watcher.join()
print(peak[0])
"""


def forked_sleeps(iso: Isolation, marker: str, as_nobody: bool) -> int:
    """Peak of sleeps forked by 4 bash stages (20 each) under ``iso`` with a process limit of 16."""
    python = shutil.which("python3", path="/usr/bin:/bin") if as_nobody else sys.executable
    if python is None or not shutil.which("bash", path="/usr/bin:/bin"):
        pytest.skip("needs python3 and bash in /usr/bin")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_nobody else []
    done = subprocess.run(prefix + [python, "-c", FORK_SCRIPT, ENVS_DIR, repr(iso), marker], capture_output=True,
                          text=True, timeout=30, cwd="/")
    if "unavailable" in done.stderr:
        pytest.skip(f"{iso} does not run here as this user: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_stages_share_one_process_limit_as_non_root():
    """Under ``unshare -r`` each stage had its own namespace and process count: 4 stages forked 60 sleeps."""
    as_nobody = os.geteuid() == 0
    if as_nobody and not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: cannot test as a non-root user")
    peak = forked_sleeps(Isolation(netns=True, userns=True), "3.13", as_nobody)
    assert 0 < peak <= 16 - 4, peak  # the 4 bash stages count too
    assert gone("3.13")


def test_stages_share_one_process_limit_with_the_uid_drop(open_dir):
    iso = detect_isolation()
    if iso.uid is None:
        pytest.skip("no uid drop here (not root)")
    stage = ("bash", "-c", "for i in " + " ".join(map(str, range(20))) + "; do sleep 3.17 & done; wait")
    result = run_pipeline([stage] * 4, str(open_dir), {"PATH": "/usr/bin:/bin"}, Limits(timeout_s=0.5), iso)
    assert result.exit_code == 124 and b"Resource temporarily unavailable" in result.output and gone("3.17")


# ----------------------------------------------------------------------------------------------------- interrupts
def test_interrupt_through_call_all_kills_the_command_at_the_timeout(open_dir):
    env = fresh(open_dir, command_timeout_s=10.0)
    start = time.monotonic()
    [(value, error)] = call_all([lambda: env.step("sleep 3.23 && sleep 3.23")], workers=1, timeout_s=0.3,
                                on_timeout=lambda i: env.interrupt())
    assert error == "timed out after 0.3 s" and time.monotonic() - start < 1.0
    assert gone("3.23", within_s=0.5)
    threads_end = time.monotonic() + 1.0
    while any(t.name.startswith("arlflow-env") for t in threading.enumerate()) and time.monotonic() < threads_end:
        time.sleep(0.02)
    assert not any(t.name.startswith("arlflow-env") for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="reset"):
        env.step("ls")


def test_a_failing_timeout_hook_is_reported():
    def boom(i: int) -> None:
        raise OSError(f"cannot stop {i}")

    [(_, error)] = call_all([lambda: time.sleep(0.3)], workers=1, timeout_s=0.05, on_timeout=boom)
    assert error == "timed out after 0.05 s; on_timeout failed: OSError: cannot stop 0"


def test_close_during_a_command_kills_it_and_leaves_no_directory(open_dir):
    env = fresh(open_dir, command_timeout_s=10.0)
    out: list = []
    worker = threading.Thread(target=lambda: out.append(env.step("sleep 3.29")))
    worker.start()
    time.sleep(0.3)
    start = time.monotonic()
    env.close()
    worker.join(2.0)
    assert time.monotonic() - start < 1.0 and not worker.is_alive() and gone("3.29")
    obs, reward, terminated, truncated, info = out[0]
    assert "interrupted" in obs and (reward, terminated, truncated, info["tool_success"]) == (0.0, False, True, False)
    assert os.listdir(open_dir) == []  # not recreated by the step that was cut short


class SleepEngine:
    """Always answers with a command that outlives the rollout's step timeout."""

    policy_version = "v0"

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode(" sleep 3.37 && sleep 3.37", add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(self, prompts, sampling):
        return [Generation(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


def test_rollout_step_timeout_kills_the_sandbox_processes(open_dir):
    """Before: the episode failed at the timeout, but its sleeps ran on (and the interpreter waited for them)."""
    tokenizer = train_tokenizer(["sleep 3.37 && sleep 3.37"] * 4, vocab_size=300)
    start = time.monotonic()
    [traj] = run_episodes(SleepEngine(tokenizer), tokenizer, make_scenarios("terminal", "train", 1, seed=0),
                          group_size=1, sampling=SamplingParams(max_new_tokens=32), step_timeout_s=0.4, workers=1,
                          progress=False, env_kwargs={"terminal": {"command_timeout_s": 10.0,
                                                                    "base_dir": str(open_dir)}})
    assert traj.status == "failed" and "timed out after 0.4 s" in traj.error and time.monotonic() - start < 2.0
    assert gone("3.37", within_s=0.5)
    assert os.listdir(open_dir) == []
