"""Prefect flows and the `arlflow` CLI.

Prefect reads its settings when it is first imported, so the project-local defaults (state under ./.prefect, the
embedded server, analytics off) are set here, before any module of this package imports prefect. Set PREFECT_HOME or
PREFECT_API_URL yourself to use another home or a running Prefect server.
"""
import os
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", str(Path.cwd() / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
