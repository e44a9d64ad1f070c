"""A thread pool that runs env calls with a per-call timeout: a call that raises or hangs fails alone.

Python cannot kill a thread, so a call that times out keeps its worker; calls that have not started yet move to a
fresh pool instead of waiting behind it, and the old pool is shut down without waiting. Its threads are daemons, so
a call that never returns cannot keep the process alive after the stage is done (``ThreadPoolExecutor`` joins its
threads at interpreter exit: a stage with one hung env call used to exit only when that call did). ``on_timeout`` lets the
caller stop what the abandoned call started (the rollout interrupts the env: the terminal sandbox kills its command's
processes), so the worker ends soon instead of running on until the interpreter exits.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable


class DaemonPool:
    """``workers`` daemon threads running submitted calls (a minimal executor: submit and shutdown)."""

    def __init__(self, workers: int, name: str = "arlflow-env") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{k}", daemon=True) for k in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Stop the threads once they finish what they run; never waits (pending calls: cancel them first)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001  (handed to the caller through the future)
                future.set_exception(exc)


def call_all(calls: list[Callable[[], Any]], *, workers: int, timeout_s: float,
             on_timeout: Callable[[int], None] | None = None) -> list[tuple[Any, str | None]]:
    """Run ``calls`` in a thread pool; per call (value, None) or (None, reason) when it raised or ran too long.

    A call's timeout counts from when it starts, not from when it was queued. Python cannot kill a thread: a call
    that times out keeps its worker, so calls that have not started yet move to a fresh pool instead of waiting
    behind it; the old pool is shut down without waiting. ``on_timeout(i)`` runs (in this thread) as soon as call
    ``i`` is given up, to stop what it is doing; if it raises, the reason says so.
    """
    results: list[tuple[Any, str | None]] = [(None, "not run")] * len(calls)
    timed_out: set[int] = set()
    todo = list(range(len(calls)))
    poll_s = max(0.001, min(timeout_s, 0.05))
    while todo:
        started: dict[int, float] = {}

        def timed(i: int) -> Any:
            started[i] = time.monotonic()
            return calls[i]()

        pool = DaemonPool(max(1, workers))
        futures = {pool.submit(timed, i): i for i in todo}
        todo = []
        waiting = set(futures)
        while waiting:
            _, waiting = wait(waiting, timeout=poll_s)
            now = time.monotonic()
            hung = False
            for fut in list(waiting):
                i = futures[fut]
                if i in started and now - started[i] > timeout_s and not fut.done():
                    waiting.discard(fut)
                    results[i] = (None, f"timed out after {timeout_s:g} s" + _stop(on_timeout, i))
                    timed_out.add(i)
                    hung = True
            if hung:
                for fut in list(waiting):
                    if fut.cancel():
                        waiting.discard(fut)
                        todo.append(futures[fut])
        for fut, i in futures.items():
            if fut.done() and not fut.cancelled() and i not in timed_out:
                exc = fut.exception()
                results[i] = (None, f"{type(exc).__name__}: {exc}") if exc is not None else (fut.result(), None)
        for fut in futures:
            fut.cancel()
        pool.shutdown()
    return results


def _stop(on_timeout: Callable[[int], None] | None, i: int) -> str:
    """Run the timeout hook for call ``i``; '' or what went wrong (it must not hide the timeout)."""
    if on_timeout is None:
        return ""
    try:
        on_timeout(i)
    except Exception as err:  # noqa: BLE001  (a failing hook must not lose the other calls' results)
        return f"; on_timeout failed: {type(err).__name__}: {err}"
    return ""
