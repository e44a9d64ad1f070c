"""Fixtures of the env tests."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest


@pytest.fixture()
def open_dir():
    """A temp dir the sandbox uid can enter (pytest's tmp_path has 0700 parents, closed to an unprivileged uid)."""
    path = tempfile.mkdtemp(prefix="terminal-test-")
    os.chmod(path, 0o777)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)
