"""The gateway when things break: a 500 leaves the keep-alive connection usable; a pool that cannot be written
(read-only file, read-only PostgreSQL database, SQLite page limit, a really full disk) is a 503 pool_unwritable with
nothing half-written, /health says so and sees it recover; /health answers at once under load; the CLI refuses
to start on an unwritable pool, a busy port and other bad arguments with one line and exit code 2.

Read-only and full are made for real: SQLite's ``mode=ro``, ``chattr +i`` (as root: chmod does not stop root) or
chmod 0444 (as another user), ``PRAGMA max_page_count``, a small tmpfs (root only; skipped elsewhere)."""
from __future__ import annotations

import asyncio
import errno
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from gateway_helpers import AUTH, KEY, ROOT, ScriptedUpstream, ThreadedServer, free_port, tiny_engine
from sqlalchemy import create_engine, event, text
from typer.testing import CliRunner

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.store import DataPool
from flows.gateway_cli import gateway_app

CHAT = {"messages": [{"role": "user", "content": "take key"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    return tiny_engine(tiny_policy_dir)[1]


def make_app(pool, tokenizer, *, upstream=None, **config):
    config = {"api_keys": (KEY,), "policy_version": "tiny-v0", "min_free_bytes": 0, **config}
    return create_app(GatewayConfig(**config), upstream or ScriptedUpstream(tokenizer), pool, tokenizer)


def unwritable(response) -> str:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "pool_unwritable" and "nothing was written" in error["message"], error
    return error["message"]


def wait_for_health(client, status: int, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.get("/health")
        if response.status_code == status or time.monotonic() > deadline:
            assert response.status_code == status, response.text
            return response.json()
        time.sleep(0.05)


def seeded(url: str) -> str:
    """A pool at ``url`` holding trajectory "seed" with one step, made through a writable gateway."""
    with DataPool(url) as pool:
        pool.open_trajectory("seed", group_id="seed", policy_version="tiny-v0")
    return url


def snapshot(url: str) -> tuple:
    with DataPool(url) as pool:
        seed = pool.get_trajectory("seed")
        return pool.counts(), seed.status, seed.episode_return, seed.num_steps


# ---------------------------------------------------------------------------------------- 500 and keep-alive


def test_a_500_leaves_the_keep_alive_connection_usable(tokenizer, tmp_path):
    """Before: Starlette re-raised after sending the 500 and uvicorn closed the connection, so the next request on
    it failed (ConnectionResetError / RemoteDisconnected, 10 of 10)."""
    pool = DataPool(str(tmp_path / "pool.db"))
    with pool.engine.begin() as conn:  # a real fault in the real engine: every step insert is aborted
        conn.execute(text("CREATE TRIGGER injected_fault BEFORE INSERT ON steps "
                          "BEGIN SELECT RAISE(ABORT, 'injected fault'); END"))
    with ThreadedServer(make_app(pool, tokenizer)) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        headers = {**AUTH, "Content-Type": "application/json"}
        sockets = []
        for method, path, body, status in [("POST", "/t/a/v1/chat/completions", CHAT, 500),
                                           ("GET", "/v1/models", None, 200),
                                           ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, 500),
                                           ("GET", "/health", None, 200),
                                           ("POST", "/t/b/v1/chat/completions", CHAT, 500),
                                           ("POST", "/t/b/v1/chat/completions", CHAT, 500)]:
            conn.request(method, path, None if body is None else json.dumps(body), headers)
            response = conn.getresponse()
            payload = response.read()
            assert response.status == status, payload
            assert response.getheader("connection") != "close"
            assert status == 200 or b"internal gateway error (IntegrityError)" in payload, payload
            sockets.append(conn.sock)
        assert sockets[0] is not None and all(s is sockets[0] for s in sockets), "the connection was reopened"
        conn.close()
    pool.close()


# ------------------------------------------------------------------------------------ unwritable pool: 503


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_read_only_pool_is_a_503_and_health_says_unwritable(backend, tokenizer, tmp_path, request):
    """A SQLite file opened read-only (mode=ro) and a PostgreSQL database with default_transaction_read_only.
    Before: every write was a 500 "internal gateway error (OperationalError)" and /health said ok."""
    if backend == "sqlite":
        writable = seeded(f"sqlite:///{tmp_path / 'pool.db'}")
        read_only = f"sqlite:///file:{tmp_path / 'pool.db'}?mode=ro&uri=true"
    else:
        writable = seeded(request.getfixturevalue("postgres_database")())
        admin = create_engine(writable, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            name = conn.scalar(text("SELECT current_database()"))
            conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
        admin.dispose()
        read_only = writable
    before = snapshot(writable)
    pool = DataPool(read_only)
    client = TestClient(make_app(pool, tokenizer))
    chat = client.post("/t/new/v1/chat/completions", headers=AUTH, json=CHAT)
    assert "read-only" in unwritable(chat) and "make " in unwritable(chat)
    unwritable(client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2}))
    unwritable(client.post("/v1/chat/completions", headers={**AUTH, "Idempotency-Key": "k1"}, json=CHAT))
    unwritable(client.post("/v1/trajectories/seed/complete", headers=AUTH, json={"status": "complete"}))
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["pool"] == "unwritable", health.text
    assert health.json()["status"] == "pool_unwritable" and "read-only" in health.json()["pool_problem"]
    assert client.get("/v1/trajectories/seed", headers=AUTH).status_code == 200      # reads still work
    pool.close()
    assert snapshot(writable) == before                                               # nothing half-written


def cap_pages(pool: DataPool, pages: int):
    """Every new connection of ``pool`` may grow the file to ``pages`` pages at most (SQLite's real limit)."""
    def on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")
    event.listen(pool.engine, "connect", on_connect)
    pool.engine.dispose()
    return on_connect


def fill_until_refused(client) -> tuple[int, int]:
    """Send requests (trajectory ids t-0, t-1, ...) until one is refused; (index refused, how many answered)."""
    for index in range(400):
        response = client.post(f"/t/t-{index}/v1/chat/completions", headers=AUTH,
                               json={**CHAT, "messages": [{"role": "user", "content": "x" * 200}]})
        if response.status_code != 200:
            assert "disk is full" in unwritable(response)
            return index, index
    raise AssertionError("the pool never filled up")


def test_a_full_pool_is_a_503_with_nothing_half_written_then_recovers(tokenizer, tmp_path):
    """SQLite's page limit makes the real engine answer "database or disk is full". Before: 500s, /health ok."""
    pool = DataPool(str(tmp_path / "pool.db"))
    with pool.engine.connect() as conn:
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
    cap = cap_pages(pool, pages + 2)
    client = TestClient(make_app(pool, tokenizer))
    refused, answered = fill_until_refused(client)
    unwritable(client.post("/v1/completions", headers=AUTH, json={"prompt": "y" * 300, "max_tokens": 2}))
    health = wait_for_health(client, 503)
    assert health["pool"] == "unwritable" and "disk is full" in health["pool_problem"]
    time.sleep(0.6)  # past the recheck interval: the probe sees the page limit still reached
    assert client.get("/health").status_code == 503
    counts = pool.counts()
    assert counts == {"trajectories": answered, "steps": answered}, counts              # nothing half-written
    with pytest.raises(KeyError):
        pool.get_trajectory(f"t-{refused}")
    event.remove(pool.engine, "connect", cap)
    pool.engine.dispose()                                                              # the limit is lifted
    assert wait_for_health(client, 200)["pool"] == "writable"
    assert client.post(f"/t/t-{refused}/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200
    pool.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted at tmp_path/disk (root only)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root; the page-limit test covers a full pool here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the page-limit test covers a full pool")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill_disk(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` to the last byte with one file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as out:
        for chunk in (1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    out.write(b"\0" * chunk)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
    return filler


def test_a_full_disk_is_a_503_and_health_sees_it_recover(tokenizer, small_disk):
    """A real full filesystem. Before: 500 "internal gateway error (OperationalError)", /health ok."""
    pool = DataPool(str(small_disk / "pool.db"))
    client = TestClient(make_app(pool, tokenizer, min_free_bytes=256 * 1024))
    assert client.post("/t/first/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200
    filler = fill_disk(small_disk)
    refused, answered = fill_until_refused(client)
    unwritable(client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2}))
    assert "disk is full" in wait_for_health(client, 503)["pool_problem"]
    assert pool.counts() == {"trajectories": answered + 1, "steps": answered + 1}        # nothing half-written
    filler.unlink()
    assert wait_for_health(client, 200)["pool"] == "writable"
    assert client.post(f"/t/t-{refused}/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200
    pool.close()


# ------------------------------------------------------------------------------------------ /health under load


@pytest.mark.slow
def test_health_answers_at_once_while_generations_queue(tokenizer, tmp_path):
    """120 slow generations (0.8 s each) on 40 worker threads (anyio's default): 80 wait for a thread for up to
    1.6 s. /health probes sent while they wait must not wait with them. Before: /health ran in that thread pool and
    queued behind every waiting generation (6.9 s at 256 clients)."""
    clients, workers = 120, 40
    pool = DataPool(str(tmp_path / "pool.db"))
    upstream = ScriptedUpstream(tokenizer, delay_s=0.8)
    health: list[tuple[int, float]] = []
    done = threading.Event()

    def probe(port: int) -> None:  # one /health on its own connection
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        health.append((status, time.perf_counter() - start))
        conn.close()

    def prober(port: int) -> None:
        while upstream.calls < workers and not done.is_set():
            time.sleep(0.005)
        threads = []
        while upstream.calls < clients and not done.is_set():  # some generations still wait for a thread
            threads.append(threading.Thread(target=probe, args=(port,)))
            threads[-1].start()
            time.sleep(0.04)
        for thread in threads:
            thread.join()

    async def load(url: str) -> list[float]:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits, timeout=120) as client:
            async def one(index: int) -> float:
                start = time.perf_counter()
                response = await client.post("/v1/completions", json={"prompt": f"hi {index}", "max_tokens": 2})
                assert response.status_code == 200, response.text
                return time.perf_counter() - start
            return await asyncio.gather(*[one(i) for i in range(clients)])

    with ThreadedServer(make_app(pool, tokenizer, upstream=upstream)) as server:
        httpx.get(f"{server.url}/health")                                  # the first probe of the pool is done
        watcher = threading.Thread(target=prober, args=(server.port,))
        watcher.start()
        try:
            chat_s = asyncio.run(load(server.url))
        finally:
            done.set()
            watcher.join()
    pool.close()
    latencies = sorted(seconds for _, seconds in health)
    assert {status for status, _ in health} == {200} and len(latencies) >= 5, health
    health_p95 = latencies[int(0.95 * (len(latencies) - 1))]
    assert health_p95 < statistics.median(chat_s) / 5, (latencies, statistics.median(chat_s))


# ----------------------------------------------------------------------------------------------------- CLI


def make_read_only(path: Path):
    """Make ``path`` really read-only for this process; returns the undo. As root only ``chattr +i`` does it."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        return lambda: path.chmod(0o644)
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True) \
        if shutil.which("chattr") else None
    if done is None or done.returncode != 0:
        pytest.skip(f"as root only chattr +i makes a file read-only, and it failed here: "
                    f"{done.stderr.strip() if done else 'no chattr'}")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=False)


def cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "flows.gateway_cli", "serve", "--api-key", KEY, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def one_error_line(output: str, exit_code: int) -> str:
    assert exit_code == 2 and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), output
    return errors[0]


@pytest.mark.slow
def test_the_real_cli_refuses_to_start_on_a_read_only_pool(tiny_policy_dir, tmp_path):
    """``python -m flows.gateway_cli serve`` as a user runs it (one subprocess: its imports take ~10 s of CPU).
    Before: it started on an immutable pool, /health said ok and every request was a 500."""
    pool_file = tmp_path / "pool.db"
    DataPool(str(pool_file)).close()
    undo = make_read_only(pool_file)
    try:
        proc = cli("--policy", str(tiny_policy_dir), "--pool-url", str(pool_file), "--port", str(free_port()))
        try:
            output = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the gateway started on a read-only pool: {proc.communicate()[0][-2000:]}")
    finally:
        undo()
    line = one_error_line(output, proc.returncode)
    assert "cannot be written: it is read-only" in line and "the gateway did not start" in line


def test_the_cli_says_in_one_line_what_else_is_wrong(tiny_policy_dir, tmp_path):
    """The command itself, in-process (the subprocess above shows the real entry behaves the same). Before:
    uvicorn's own line and exit code 3 for a busy port, tracebacks for a port out of range and a pool path under a
    file, and a garbage --upstream URL started a gateway that failed every request."""
    (tmp_path / "a-file").write_text("x")
    busy = socket.create_server(("127.0.0.1", 0))
    cases = {"busy port": (["--port", str(busy.getsockname()[1])], "Address already in use: stop the process "
                                                                   "using it or pick another --port"),
             "port": (["--port", "70000"], "--port 70000 is not a TCP port"),
             "under a file": (["--pool-url", str(tmp_path / "a-file" / "pool.db")], "cannot create its folder"),
             "upstream": (["--upstream", "notaurl"], "is not an http(s) URL"),
             "host": (["--host", "no.such.host.invalid", "--port", str(free_port())], "cannot be resolved")}
    try:
        for name, (args, says) in cases.items():
            argv = ["serve", "--policy", str(tiny_policy_dir), "--api-key", KEY, "--pool-url",
                    str(tmp_path / "p.db"), *args]
            result = CliRunner().invoke(gateway_app, argv)
            assert isinstance(result.exception, SystemExit), (name, result.output, result.exception)
            assert says in one_error_line(result.output, result.exit_code), (name, result.output)
    finally:
        busy.close()


def test_the_cli_refuses_a_full_disk(tiny_policy_dir, small_disk):
    DataPool(str(small_disk / "pool.db")).close()
    fill_disk(small_disk)
    result = CliRunner().invoke(gateway_app, ["serve", "--policy", str(tiny_policy_dir), "--api-key", KEY,
                                              "--pool-url", str(small_disk / "pool.db")])
    assert isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert "disk is full" in one_error_line(result.output, result.exit_code)
