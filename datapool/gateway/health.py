"""What ``GET /health`` says about the data pool, answered at once: no blocking I/O on the event loop and nothing
in the thread pool that runs generations, so a load balancer's probe is never queued behind the load.

The answer is the pool's ``write_problem``: set by every write that failed for lack of space or permission (so
the first 503 ``pool_unwritable`` shows at once), and refreshed by a probe (``DataPool.check_writable``: a write
that changes nothing, the disk's free space, SQLite's page limit) run on this module's own thread when /health
finds the last one older than ``recheck_s`` while a problem is known (to see the pool come back) or ``refresh_s``
otherwise (to see it become read-only or full while idle). /health waits at most ``wait_s`` for a probe it
started (one waiting for the write lock under load is not waited for: the last known answer is given).
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("arlflow.gateway")


class PoolWritability:
    def __init__(self, pool, *, min_free_bytes: int, recheck_s: float = 0.5, refresh_s: float = 5.0,
                 wait_s: float = 0.05) -> None:
        self.pool = pool
        self.min_free_bytes = min_free_bytes
        self.recheck_s = recheck_s
        self.refresh_s = refresh_s
        self.wait_s = wait_s
        self._probe: Future | None = None
        self._probed_at = -math.inf  # the first /health starts one
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-pool-probe")

    async def problem(self) -> str | None:
        """Why the pool cannot take writes, as last seen, or None; starts a probe when one is due."""
        probe = self._start_probe_if_due()
        if probe is not None:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(probe)), self.wait_s)
            except asyncio.TimeoutError:
                pass
        return self.pool.write_problem

    def _start_probe_if_due(self) -> Future | None:
        with self._lock:
            due = self.recheck_s if self.pool.write_problem else self.refresh_s
            if time.monotonic() - self._probed_at < due or (self._probe is not None and not self._probe.done()):
                return None
            self._probed_at = time.monotonic()
            self._probe = self._executor.submit(self._run_probe)
            return self._probe

    def _run_probe(self) -> None:
        try:
            self.pool.check_writable(min_free_bytes=self.min_free_bytes)
        except Exception as exc:  # noqa: BLE001 - a busy or unreachable pool: keep what is known, say why in the log
            log.warning("pool writability probe failed: %s: %s", type(exc).__name__, exc)
        finally:
            with self._lock:
                self._probed_at = time.monotonic()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)  # a probe waiting for the write lock ends alone
