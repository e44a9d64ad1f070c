"""A fork server for stage processes: it imports ``arlflow``'s CLI once (~20 s on a loaded 2-core machine), then
forks one child per request and runs ``arlflow stage NAME [--round N] --root ROOT`` in it: what dvc.yaml's ``cmd``
runs (flows/cli.py: the Prefect stage flow -> the MLflow stage run -> the stage function), minus the import. The
test SIGKILLs the child by its process group; this process reaps it and says how it ended. A child that returns
exits as the CLI's interpreter would (joining worker threads, atexit handlers), minus the C-level teardown.

Protocol, one JSON object per line. Request on stdin: ``{"argv": [...], "root": DIR, "log": PATH,
"prefect_api_url": URL, "kill_at": null | "commit" | "mlflow-store"}``. Replies: ``{"pid": N}`` once the child
runs, then ``{"pid": N, "exit": CODE, "wall_s": S}`` (CODE -9: killed). ``kill_at: "commit"`` makes the child
SIGKILL itself inside its stage's output commit (tasks/outputs.py), right after the first temporary -> target
rename: the narrowest window a crash can hit, where a reader could see outputs of two runs mixed;
``"mlflow-store"`` kills it while MLflow creates a new tracking store (in the middle of its migrations).
Run as ``python tests/faults/stage_runner.py``; it ends when its stdin closes.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback

# replies go to the real stdout; everything else printed (imports' warnings, the children's logs) goes elsewhere
REPLIES = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import alembic.ddl.impl as alembic_impl  # noqa: E402
import prefect.settings  # noqa: E402
import tasks.outputs as outputs  # noqa: E402
import flows.pipeline  # noqa: E402,F401  (the expensive import, done once before any fork: the CLI imports it
import tasks.config  # noqa: E402,F401   lazily, inside the stage command)
from flows.cli import app  # noqa: E402


def kill_inside_commit() -> None:
    """SIGKILL this process right after the first temporary -> target rename of the next commit's roll-forward."""
    real_roll_forward, real_replace = outputs._roll_forward, os.replace

    def replace_then_die(src, dst):
        real_replace(src, dst)
        if not os.path.basename(os.fspath(dst)).startswith("."):   # a target, not a backup or a temporary
            os.kill(os.getpid(), signal.SIGKILL)

    def roll_forward(journal):
        os.replace = replace_then_die
        try:
            real_roll_forward(journal)
        finally:
            os.replace = real_replace

    outputs._roll_forward = roll_forward


def kill_inside_mlflow_store_creation() -> None:
    """SIGKILL this process in the middle of MLflow's migrations of a new store: right after the first table a
    migration creates (on SQLite each DDL statement commits on its own; the schema version is stamped at the end)."""
    real_create_table = alembic_impl.DefaultImpl.create_table

    def create_then_die(self, table, **kw):
        real_create_table(self, table, **kw)
        os.kill(os.getpid(), signal.SIGKILL)

    alembic_impl.DefaultImpl.create_table = create_then_die


def run_child(request: dict) -> int:
    """The body of a forked child: ``arlflow stage ...`` with its output in the request's log file."""
    os.setsid()
    os.chdir(request["root"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if request.get("kill_at") == "commit":
        kill_inside_commit()
    elif request.get("kill_at") == "mlflow-store":
        kill_inside_mlflow_store_creation()
    try:
        with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL:
                                                          request["prefect_api_url"]}):
            app(request["argv"], standalone_mode=False)
        return 0
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - the log says what failed; the exit code says that it did
        traceback.print_exc()
        return 1


def exit_like_the_cli(code: int) -> None:
    """The interpreter's exit up to its C-level teardown: join the non-daemon threads (a hung env call's worker
    too) and their exit hooks, run the atexit handlers, flush; then leave without the ~3 s of freeing modules
    that follow (nothing a stage writes happens there)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reply(message: dict) -> None:
    REPLIES.write(json.dumps(message) + "\n")
    REPLIES.flush()


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            REPLIES.close()
            exit_like_the_cli(run_child(request))
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"pid": pid, "exit": os.waitstatus_to_exitcode(status), "wall_s": time.monotonic() - started})


if __name__ == "__main__":
    main()
