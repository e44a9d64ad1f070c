"""Seconds each test file took, for scheduling: `make test` hands the longest files to its workers first.

xdist's ``--dist loadfile`` gives each worker a whole file at a time, in collection order (with
``--no-loadscope-reorder``); a long file taken last keeps one worker busy while the others idle. tests/conftest.py
sorts the collection by the seconds recorded here, longest first. A file missing from the record (a new one) goes
after the recorded ones; a stale record only costs scheduling, never a result.

Refresh after a CI run that wrote JUnit XML (``PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml make test``)::

    .venv/bin/python -m tests.durations /tmp/junit.xml
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

RECORD = Path(__file__).with_name("durations.json")


def file_seconds(junit_xml: Path) -> dict[str, float]:
    """tests/... .py -> the summed time of its test cases in a JUnit XML report, longest first."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time") or 0.0)
    return {name: round(total, 1) for name, total in seconds.most_common()}


def load() -> dict[str, float]:
    """The record, or {} when it is missing or unreadable (then the collection keeps its order)."""
    try:
        record = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in record.items()} if isinstance(record, dict) else {}


def order_by_duration(items: list, root: Path, record: dict[str, float]) -> None:
    """Sort pytest items in place: whole files, longest recorded first; unrecorded files after, in their order."""
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)

    def key(item) -> tuple[float, int]:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)
        return -record.get(name, -1.0), first[item.path]

    items.sort(key=key)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.durations JUNIT_XML")
    report = Path(sys.argv[1])
    if not report.is_file():
        sys.exit(f"{report}: no such file (write one with PYTEST_ADDOPTS=--junitxml={report} make test)")
    record = file_seconds(report)
    RECORD.write_text(json.dumps(record, indent=0) + "\n")
    print(f"{RECORD}: {len(record)} files, {sum(record.values()):.0f} s in all; longest: {next(iter(record), '-')}")
