"""The suite's scheduling record: longest files first, whole files together, unrecorded files last."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.durations import file_seconds, order_by_duration

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.a.test_x" name="t1" time="1.5"/><testcase classname="tests.b.test_y" name="t1" time="9"/>
<testcase classname="tests.a.test_x" name="t2" time="2.0"/><testcase classname="tests.a.test_z" name="t" time=""/>
</testsuite></testsuites>"""


def test_file_seconds_sums_each_files_cases_longest_first(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    seconds = file_seconds(tmp_path / "junit.xml")
    assert seconds == {"tests/b/test_y.py": 9.0, "tests/a/test_x.py": 3.5, "tests/a/test_z.py": 0.0}
    assert list(seconds) == ["tests/b/test_y.py", "tests/a/test_x.py", "tests/a/test_z.py"]


def test_order_keeps_files_whole_and_puts_the_longest_first_and_unrecorded_ones_last(tmp_path):
    def item(name: str, test: str):
        return SimpleNamespace(path=tmp_path / name, name=test)

    items = [item("tests/new.py", "n1"), item("tests/short.py", "s1"), item("tests/long.py", "l1"),
             item("tests/short.py", "s2"), item("tests/new.py", "n2"), item("tests/long.py", "l2")]
    order_by_duration(items, tmp_path, {"tests/long.py": 100.0, "tests/short.py": 0.0})
    assert [i.name for i in items] == ["l1", "l2", "s1", "s2", "n1", "n2"]
    order_by_duration(items, tmp_path, {})              # no record: the order stays
    assert [i.name for i in items] == ["l1", "l2", "s1", "s2", "n1", "n2"]


def test_the_committed_record_names_test_files():
    from tests.durations import load

    record, root = load(), Path(__file__).resolve().parents[1]
    assert len(record) > 50 and all(name.startswith("tests/") and name.endswith(".py") for name in record)
    assert sum((root / name).is_file() for name in record) >= 0.9 * len(record)   # refresh it when this fails
