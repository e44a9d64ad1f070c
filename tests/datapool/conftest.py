"""Data pool fixtures: ``pool_url`` / ``pool`` run a test on SQLite (WAL) and on a real PostgreSQL server.

The PostgreSQL server is a throwaway one this session starts (initdb into a temporary folder, a free port on
loopback, the unix socket in that folder; as user ``postgres`` when the tests run as root) and each test gets a
fresh database on it. Set ARLFLOW_TEST_POSTGRES_URL (``postgresql+psycopg://user@host:port/dbname``, a role that may
create databases) to use a running server instead. Without PostgreSQL binaries or the psycopg driver the postgres
params are skipped, saying why; ARLFLOW_REQUIRE_SYSTEM_TESTS=1 (CI, .ci/run) or ARLFLOW_REQUIRE_POSTGRES=1 turns
that skip into a failure.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from datapool.store import DataPool

BACKENDS = ("sqlite", "postgres")


def _postgres_bin() -> Path | None:
    """The folder with initdb/pg_ctl: $ARLFLOW_PG_BIN, the newest /usr/lib/postgresql/*/bin, or the PATH."""
    if os.environ.get("ARLFLOW_PG_BIN"):
        return Path(os.environ["ARLFLOW_PG_BIN"])
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _skip_or_fail(reason: str) -> None:
    if "1" in (os.environ.get("ARLFLOW_REQUIRE_SYSTEM_TESTS"), os.environ.get("ARLFLOW_REQUIRE_POSTGRES")):
        pytest.fail(f"PostgreSQL is required here (ARLFLOW_REQUIRE_SYSTEM_TESTS=1) but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """SQLAlchemy URL (psycopg 3) of a PostgreSQL server's maintenance database, for this test session."""
    try:
        import psycopg  # noqa: F401 - the driver the URLs name
    except ImportError:
        _skip_or_fail('the psycopg driver is not installed: pip install "psycopg[binary]>=3.1"')
    if os.environ.get("ARLFLOW_TEST_POSTGRES_URL"):
        yield os.environ["ARLFLOW_TEST_POSTGRES_URL"]
        return
    bin_dir = _postgres_bin()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        _skip_or_fail("PostgreSQL server binaries not found (apt-get install postgresql, or set ARLFLOW_PG_BIN)")
    root = Path(tempfile.mkdtemp(prefix="arlflow-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root: run the server as the postgres (or nobody) user
        user = "postgres" if shutil.which("runuser") and _user_exists("postgres") else "nobody"
        shutil.chown(root, user=user)
        as_user = ["runuser", "-u", user, "--"]
    data, log = root / "data", root / "server.log"
    port = _free_port()
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", "arlflow", "--auth=trust",
                    "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    started = subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(log),
                              "-w", "-t", "60", "start"], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"could not start PostgreSQL: {started.stdout}{started.stderr}\n{log.read_text()}")
    try:
        yield f"postgresql+psycopg://arlflow@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture
def postgres_database(postgres_server: str) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty databases on the session's server (each dropped after the test)."""
    admin = create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    created: list[str] = []

    def new() -> str:
        name = f"pool_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return make_url(postgres_server).set(database=name).render_as_string(hide_password=False)

    try:
        yield new
    finally:
        with admin.connect() as conn:
            for name in created:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def pool_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty data pool: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'pool.db'}"
    return request.getfixturevalue("postgres_database")()


@pytest.fixture
def pool(pool_url: str) -> Iterator[DataPool]:
    with DataPool(pool_url) as p:
        yield p
