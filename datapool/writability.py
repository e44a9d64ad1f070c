"""Whether a data pool can take writes: which driver and OS errors mean "no space" or "no permission", and the
one-line messages that say what to do about them.

``DataPool`` turns such a failed write into ``PoolUnwritableError`` (the gateway answers 503 ``pool_unwritable``
and /health reports the pool unwritable); every other error keeps its own type. The write that failed was one
transaction, rolled back: nothing of it was stored.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from sqlalchemy.engine import URL

FULL, READ_ONLY = "full", "read-only"

_SQLITE_CODES = {13: FULL, 8: READ_ONLY, 3: READ_ONLY}  # SQLITE_FULL, SQLITE_READONLY (+ extended), SQLITE_PERM
_SQLITE_IOERR = 10  # an I/O error is "full" only when the disk is (an immutable file or a full tmpfs give it too)
_PG_STATES = {"53100": FULL, "25006": READ_ONLY, "42501": READ_ONLY}  # disk_full, read_only_sql_transaction,
#                                                                      insufficient_privilege
_OS_ERRNOS = {errno.ENOSPC: FULL, errno.EDQUOT: FULL, errno.EROFS: READ_ONLY, errno.EACCES: READ_ONLY,
              errno.EPERM: READ_ONLY}
_TEXTS = (("database or disk is full", FULL), ("readonly database", READ_ONLY), ("read-only transaction", READ_ONLY))
NEARLY_FULL_BYTES = 64 * 1024
"""Free bytes below which a SQLite I/O error is taken for a full disk."""


class PoolUnwritableError(RuntimeError):
    """A write failed because the pool cannot be written (disk full; read-only file, mount, database or role; no
    permission). Nothing of the write was stored. Not a ValueError: the request was fine, the pool is not."""


def sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL (also ``file:...?mode=ro`` URIs); None for other backends and in-memory pools."""
    database = url.database if url.get_backend_name() == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file::memory:"):
        return None
    return Path(database[len("file:"):] if database.startswith("file:") else database)


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing folder), None when unknown."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def unwritable_kind(err: BaseException, pool_file: Path | None = None) -> str | None:
    """FULL or READ_ONLY when ``err`` (SQLAlchemy's, the driver's or the OS's) means the pool refuses writes for
    lack of space or permission, else None."""
    for cause in (err, getattr(err, "orig", None), err.__cause__):
        if cause is None:
            continue
        if isinstance(cause, OSError) and cause.errno in _OS_ERRNOS:
            return _OS_ERRNOS[cause.errno]
        code = getattr(cause, "sqlite_errorcode", None)
        if isinstance(code, int):
            if code & 0xFF in _SQLITE_CODES:
                return _SQLITE_CODES[code & 0xFF]
            if code & 0xFF == _SQLITE_IOERR and pool_file is not None:
                free = free_bytes(pool_file)
                return FULL if free is not None and free < NEARLY_FULL_BYTES else None
        state = getattr(cause, "sqlstate", None)  # psycopg 3
        if state in _PG_STATES:
            return _PG_STATES[state]
    text = str(getattr(err, "orig", None) or err).lower()
    return next((kind for needle, kind in _TEXTS if needle in text), None)


def unwritable_message(kind: str, pool: str, detail: str, pool_file: Path | None) -> str:
    """What ``PoolUnwritableError`` says: what happened and what to do, in one line."""
    if kind == FULL:
        where = f"the disk holding {pool_file.parent}" if pool_file is not None else "the database server's disk"
        return (f"the data pool {pool} cannot be written: its disk is full ({detail}): free space on {where} (or "
                "move the pool to a bigger disk), then retry; nothing was written")
    where = (f"{pool_file} and its folder {pool_file.parent} writable by this process (permissions, a read-only "
             "mount, chattr -i; SQLite writes -wal and -shm files beside the pool)" if pool_file is not None
             else "the database writable for this role (INSERT/UPDATE rights, not a read-only standby or "
                  "default_transaction_read_only)")
    return f"the data pool {pool} cannot be written: it is read-only ({detail}): make {where}, then retry; " \
           "nothing was written"


def space_problem(pool: str, pool_file: Path | None, min_free_bytes: int) -> str | None:
    """The message for a SQLite pool whose disk has less than ``min_free_bytes`` free, else None."""
    if pool_file is None or min_free_bytes <= 0:
        return None
    free = free_bytes(pool_file)
    if free is None or free >= min_free_bytes:
        return None
    return unwritable_message(FULL, pool, f"{free} bytes free, fewer than the {min_free_bytes} required", pool_file)


def open_hint(pool_file: Path | None) -> str:
    """What to check when a pool cannot be opened: a full disk or an unwritable folder when that is the case."""
    if pool_file is not None:
        free = free_bytes(pool_file)
        if free is not None and free < NEARLY_FULL_BYTES:
            return f"the disk holding {pool_file.parent} is full ({free} bytes free): free space there, then retry"
        folder = pool_file.parent
        if folder.is_dir() and not os.access(folder, os.W_OK):
            return (f"folder {folder} is not writable (permissions, a read-only mount or chattr +i): SQLite needs to "
                    "create the pool's -wal and -shm files beside it; make the folder writable or move the pool")
    return ("check that the path is a pool file (not a folder or another file) in a writable folder, or that the "
            "database server is running and reachable")
