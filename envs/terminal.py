"""Terminal as a text env: shell tasks (create, find, count, rename, sort, edit files) in a per-episode sandbox.

Each episode gets a fresh temp directory holding the task's files (``terminal_tasks``), seen by the agent as
``/sandbox``. An action is one shell command (``grep -c ERROR app.log > count.txt``; ``|`` pipelines, ``&&`` chains,
``>``/``>>``/``<`` redirections, ``cd``/``pwd``) or ``submit``, which ends the episode: the task's verifier checks the
sandbox and the reward is 1.0 if it passes, else 0.0. The observation is the command's stdout then stderr, then
``[exit N]`` when N != 0, capped at ``max_output_chars``; paths show as /sandbox paths, never the temp dir.

Validity: a command that cannot be parsed or that the policy refuses (``terminal_policy``: allowlisted programs and
options, every path inside the sandbox) is an invalid action (``action_valid`` False, ``tool_success`` False, the
observation says why, nothing ran). A command that runs and fails is valid with ``tool_success`` False. A ``&&``
chain whose later segment is refused has already run its earlier segments (it is still invalid).
How commands are contained is in ``terminal_sandbox`` (threat model in its docstring); ``info["sandbox"]`` says which
protections are active. Budgets are per action: all segments and stages of one command share ``command_timeout_s``,
``max_processes`` and the sandbox's ``disk_quota_bytes``/``max_entries`` (watched while it runs); spending one kills
the command and the observation says which (``error: disk quota exceeded: the sandbox may hold 8 MiB (killed)``).
``interrupt()`` (any thread; the rollout calls it when its step timeout fires) kills the command in flight.
``admissible_actions`` is not set: free-form commands cannot be enumerated.
Scenario key (``scenario_key``): the task (template, instruction, every file's path and text, solution), not the
first observation, which lists only the top-level names.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import weakref

from envs.base import check_reset_options, register_env
from envs.terminal_policy import SPECS, VIRTUAL_ROOT
from envs.terminal_fs import create_sandbox, tree_state
from envs.terminal_sandbox import (INTERRUPTED, Action, CommandResult, Limits, detect_isolation, display_cwd,
                                   run_command, size_text)
from envs.terminal_tasks import TEMPLATES, Task, make_task

RESET_OPTIONS: tuple[str, ...] = ("split", "template")
VERBOSITIES: tuple[str, ...] = ("short", "full")
SUBMIT = "submit"


def bash_call(command: str) -> dict:
    return {"type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}


def submit_call() -> dict:
    return {"type": "function", "function": {"name": "submit", "arguments": "{}"}}


def top_listing(files: dict[str, str]) -> str:
    """``Files: a.log data/ ...``: the top level of a task's tree (directories with a trailing /)."""
    top = sorted({rel.split("/")[0] + ("/" if "/" in rel else "") for rel in files})
    return "Files: " + " ".join(top) if top else "Files: (none)"


@register_env("terminal")
class TerminalEnv:
    """Sandboxed shell tasks behind the text-env contract (see envs/base.py and the module docstring).

    Episodes end on ``submit`` (terminated), when the sandbox outgrows ``disk_quota_bytes``/``max_entries``
    (terminated, lost), after ``max_steps`` steps (truncated, lost; the verifier only runs on submit), or when
    ``interrupt``/``close`` stops a command in flight (truncated, lost).
    """

    split_aware = True
    tools = [
        {"type": "function", "function": {
            "name": "bash",
            "description": ("Run one command in the task's sandbox (/sandbox; cd persists). Supports | pipelines, && "
                            "chains and > >> < redirections, not ; $() backticks or globs outside. Programs: "
                            + " ".join(sorted(SPECS)) + " cd pwd."),
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string", "description": "the command line, e.g. grep -c ERROR app.log"}},
                "required": ["command"]}}},
        {"type": "function", "function": {
            "name": "submit", "description": "Finish: the sandbox is checked against the task.",
            "parameters": {"type": "object", "properties": {}, "required": []}}},
    ]

    def __init__(self, max_steps: int = 20, verbosity: str = "short", max_output_chars: int = 400,
                 command_timeout_s: float = 2.0, memory_bytes: int = 256 * 2**20, max_file_bytes: int = 2**20,
                 max_processes: int = 16, disk_quota_bytes: int = 8 * 2**20, max_entries: int = 2000,
                 invalid_penalty: float = 0.0, base_dir: str | None = None) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if verbosity not in VERBOSITIES:
            raise ValueError(f"verbosity must be one of {list(VERBOSITIES)}, got {verbosity!r}")
        if max_output_chars < 40:
            raise ValueError(f"max_output_chars must be >= 40 (room for an error line), got {max_output_chars}")
        if command_timeout_s <= 0 or min(memory_bytes, max_file_bytes, max_processes, disk_quota_bytes,
                                         max_entries) <= 0:
            raise ValueError("command_timeout_s, memory_bytes, max_file_bytes, max_processes, disk_quota_bytes and "
                             "max_entries must be > 0")
        self.max_steps = int(max_steps)
        self.verbosity = verbosity
        self.max_output_chars = int(max_output_chars)
        self.limits = Limits(timeout_s=float(command_timeout_s), memory_bytes=int(memory_bytes),
                             file_bytes=int(max_file_bytes), processes=int(max_processes),
                             disk_bytes=int(disk_quota_bytes), entries=int(max_entries))
        self.disk_quota_bytes = int(disk_quota_bytes)
        self.max_entries = int(max_entries)
        self.invalid_penalty = float(invalid_penalty)
        self.base_dir = base_dir
        self.isolation = detect_isolation()
        self._owner = (self.isolation.uid, self.isolation.gid) if self.isolation.uid is not None else None
        self._task: Task | None = None
        self._root: str | None = None
        self._cleanup: weakref.finalize | None = None
        self._action: Action | None = None  # the command in flight, for interrupt()
        self._cwd = ""
        self._steps = 0
        self._expert_pos = 0
        self._done = True
        self._won = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("terminal", options, RESET_OPTIONS)
        split = options.get("split", "train")
        template = options.get("template")
        if template is not None and template not in TEMPLATES:
            raise ValueError(f"terminal: unknown template {template!r}; valid templates: {sorted(TEMPLATES)}")
        self.close()
        self._task = make_task(random.randrange(2**31) if seed is None else seed, split, template)
        self._root = create_sandbox(self._task.files, self.base_dir, self._owner)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._root, True)
        self._cwd = ""
        self._steps = 0
        self._expert_pos = 0
        self._done = False
        self._won = False
        return top_listing(self._task.files), self._info(action_valid=True, tool_call=None, tool_success=None)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._task is None or self._root is None:
            raise RuntimeError("terminal: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("terminal: the episode is over; call reset() before stepping again")
        self._steps += 1
        command = action.strip() if isinstance(action, str) else ""
        if command.lower() == SUBMIT:
            self._won = bool(self._task.check(self._root))
            self._done = True
            obs = "submitted: task complete" if self._won else "submitted: task not complete"
            return obs, float(self._won), True, False, self._info(True, submit_call(), self._won)
        root = self._root
        budget = self._action = Action(self.limits, root)
        if self._done:  # interrupt() or close() came in since the check above
            budget.stop(INTERRUPTED)
        try:
            result = run_command(command, root, self._cwd, self.limits, self.isolation, self._owner, budget)
        finally:
            self._action = None
        self._cwd = result.cwd
        self._track_expert(command, result)
        obs = self._render(command, result)
        if budget.reason == INTERRUPTED:  # the harness gave up on this step; the tree may be gone
            self._done = True
            info = self._info(result.valid, bash_call(command), False, digest="interrupted")
            return obs, 0.0, False, True, info | {"exit_code": result.exit_code}
        state = tree_state(self._root, self.max_entries)
        terminated = state.total_bytes > self.disk_quota_bytes or state.entries > self.max_entries
        if terminated:
            obs += f"\nerror: the sandbox is over its quota ({size_text(self.disk_quota_bytes)}, " \
                   f"{self.max_entries} entries): episode over"
        truncated = not terminated and self._steps >= self.max_steps
        self._done = self._done or terminated or truncated  # interrupt() may have ended it meanwhile
        reward = 0.0 if result.valid else 0.0 - self.invalid_penalty
        info = self._info(result.valid, bash_call(command), result.valid and result.exit_code == 0, state.digest)
        info["exit_code"] = result.exit_code
        return obs, reward, terminated, truncated, info

    def task_description(self) -> str:
        if self._task is None:
            return "Solve a shell task in /sandbox with one command per step, then submit."
        return f"{self._task.text} Use one shell command per step in {VIRTUAL_ROOT}, then submit."

    def expert_action(self) -> str | None:
        """``submit`` once the task checks; else the next command of the template's solution.

        The solution restarts from its first command whenever the agent ran some other command that could change
        files or the cwd (solution commands are safe to re-run); None if the whole solution ran and the task still
        does not check (the agent destroyed an input file).
        """
        if self._task is None or self._root is None or self._done:
            return None
        if self._task.check(self._root):
            return SUBMIT
        if self._cwd:
            return f"cd {VIRTUAL_ROOT}"
        solution = self._task.solution
        return solution[self._expert_pos] if self._expert_pos < len(solution) else None

    def scenario_key(self) -> str:
        """The episode's task (module docstring), read right after ``reset``."""
        if self._task is None:
            raise RuntimeError("terminal: scenario_key() before reset(); call reset(seed=...) first")
        task = self._task
        return repr((task.template, task.text, sorted(task.files.items()), task.solution, self.max_steps))

    def interrupt(self) -> None:
        """Kill the command in flight, if any, and end the episode; safe from any thread.

        The rollout calls it when its step timeout fires (``agents/workers.call_all``): the step returns at once
        (truncated, with an ``interrupted`` line) instead of running on in an abandoned thread; later steps raise
        until ``reset``.
        """
        self._done = True
        action = self._action
        if action is not None:
            action.stop(INTERRUPTED)

    def close(self) -> None:
        """Kill the command in flight (``interrupt``) and remove this episode's sandbox directory (also done on
        reset and when the env is garbage collected)."""
        action = self._action
        self.interrupt()
        if action is not None:
            action.finished.wait(5.0)  # its step reaps the killed processes: then nothing writes in the tree
        if self._cleanup is not None:
            self._cleanup()
        self._cleanup = None
        self._root = None

    # ----------------------------------------------------------------------------------------- helpers
    def _track_expert(self, command: str, result: CommandResult) -> None:
        solution = self._task.solution
        if self._expert_pos < len(solution) and command == solution[self._expert_pos]:
            self._expert_pos += 1
        elif result.mutated:
            self._expert_pos = 0

    def _render(self, command: str, result: CommandResult) -> str:
        text = result.output.rstrip("\n")
        if result.exit_code not in (0, None) or (self.verbosity == "full" and result.exit_code is not None):
            text += f"\n[exit {result.exit_code}]"
        text = text.strip("\n") or "(no output)"
        if self.verbosity == "full":
            text = f"{display_cwd(self._cwd)}$ {command}\n{text}"
        if len(text) > self.max_output_chars:
            marker = "\n...[truncated]"
            text = text[:self.max_output_chars - len(marker)] + marker
        return text

    def _info(self, action_valid: bool, tool_call: dict | None, tool_success: bool | None,
              digest: str | None = None) -> dict:
        digest = digest or tree_state(self._root, self.max_entries).digest
        task_key = hashlib.sha1(self._task.text.encode()).hexdigest()[:8]
        return {
            "anchor": f"{self._task.template}:{task_key}:{self._cwd}:{digest}",
            "action_valid": action_valid,
            "won": self._won,
            "tool_call": tool_call,
            "tool_success": tool_success,
            "sandbox": self.isolation.describe(),
            "template": self._task.template,
            "cwd": display_cwd(self._cwd),
            "steps": self._steps,
        }
