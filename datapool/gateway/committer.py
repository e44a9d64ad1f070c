"""Group commit: the one-step trajectories of concurrent requests are written in one transaction.

A durable commit costs an fsync (SQLite WAL with synchronous=FULL: ~1-4 ms on our disks), which is most of a
request's cost once generation is fast; committed one by one, requests queue behind each other's fsyncs. Here a
single writer thread takes every record waiting, writes them with one ``DataPool.add_trajectories`` call (one
transaction, one fsync), and then releases all their requests: each response still leaves only after its record
is durable, and a lone request pays no extra wait (the batch is whatever arrived during the previous commit).
Used for requests without a trajectory id or idempotency key; the others need ``append_step``'s per-step
semantics (next index, stored response) and commit on their own.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

from datapool.records import TrajectoryRecord


class GroupCommitter:
    def __init__(self, pool, *, max_batch: int = 256) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self._pending: list[tuple[list[TrajectoryRecord], Future]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gateway-group-commit", daemon=True)
        self._thread.start()

    def commit(self, trajectories: list[TrajectoryRecord]) -> None:
        """Block until ``trajectories`` are durable in the pool; raise the pool's error if they cannot be."""
        done: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the gateway is shutting down: retry the request")
            self._pending.append((trajectories, done))
            self._cond.notify()
        done.result()

    def close(self) -> None:
        """Commit what is waiting, then stop the writer thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            try:
                self.pool.add_trajectories([t for trajectories, _ in batch for t in trajectories])
            except Exception:  # noqa: BLE001 - one bad record must not fail the others: commit each request alone
                for trajectories, done in batch:
                    try:
                        self.pool.add_trajectories(trajectories)
                    except Exception as exc:  # noqa: BLE001 - handed to the waiting request
                        done.set_exception(exc)
                    else:
                        done.set_result(None)
            else:
                for _, done in batch:
                    done.set_result(None)
