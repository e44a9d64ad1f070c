"""The data gate's great-expectations Data Docs: a static site per validation, linked from validate's JSON report."""
from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from datapool.parquet import export_steps, read_steps
from datapool.quality import validate_steps, write_data_docs
from tasks import validate
from tasks.layout import Layout
from tests.datapool.test_quality import LIMITS, good_frame
from tests.tasks.test_validate_stage import PARAMS, write_round

REWARD_RANGE = "values must be greater than or equal to -1.0 and less than or equal to 1.0"
"""How GX renders the reward-range expectation of the suite (LIMITS' and PARAMS' reward limits)."""


def page_text(path: Path) -> str:
    """The page's text with GX's status icons as ✗ (failed) and ✓ (passed), whitespace collapsed."""
    page = path.read_text()
    page = re.sub(r"<i class=\"fas fa-times text-danger\"[^>]*></i>", " ✗ ", page)
    page = re.sub(r"<i class=\"fas fa-check-circle text-success\"[^>]*></i>", " ✓ ", page)
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def bad_frame():
    frame = good_frame()
    frame.at[3, "reward"] = math.inf  # trajectory g0-t1, step 1
    return frame


def test_data_docs_show_the_suite_and_the_failed_expectation(tmp_path: Path):
    report = validate_steps(bad_frame(), LIMITS, round=2)
    page = write_data_docs(report, tmp_path / "docs")
    site = tmp_path / "docs"
    assert (site / "index.html").is_file() and (site / "expectations" / "arlflow_steps.html").is_file()
    assert page.parts[:3] == ("validations", "arlflow_steps", "round_2") and page.name == "steps.html"
    text = page_text(site / page)
    assert "Expectation Suite: arlflow_steps" in text and "Status: ✗ Failed" in text
    assert "Run Name round_2" in text and "Unsuccessful Expectations 1" in text
    assert f"✗ {REWARD_RANGE}" in text  # the failed expectation, marked failed
    assert "inf 1 g0-t1 1 g0" in text  # its unexpected value, with the row's trajectory, step and group
    assert text.count("✗") == 2 and text.count("✓") == len(report.results) - 1  # the status + the one failure
    assert not list(site.rglob("*.gif"))  # GX's unused help animations are left out


def test_data_docs_of_a_passing_round(tmp_path: Path):
    report = validate_steps(good_frame(), LIMITS, round=1)
    text = page_text(tmp_path / write_data_docs(report, tmp_path))
    assert "Status: ✓ Succeeded" in text and "✗" not in text and f"✓ {REWARD_RANGE}" in text


def test_no_data_docs_when_no_expectation_ran(tmp_path: Path):
    report = validate_steps(good_frame().iloc[:0], LIMITS, round=1)
    assert not report.success and write_data_docs(report, tmp_path / "docs") is None
    assert not (tmp_path / "docs").exists()


def test_validate_publishes_data_docs_with_its_outputs(tmp_path: Path):
    layout = Layout(tmp_path)
    write_round(layout, [[1.0, 0.0], [0.0, 0.0]])
    validate.run(PARAMS, layout, 1)
    report_path = layout.round_metrics(1, "validate_report")
    report = json.loads(report_path.read_text())
    assert report["success"] and report["row_count"] == 8 and report["results"]  # the report as it was
    assert report["curation"] and report["failed"]
    docs = report_path.parent / "data_docs"
    assert (docs / "index.html").is_file() and report["data_docs"].startswith("data_docs/validations/")
    assert "Status: ✓ Succeeded" in page_text(report_path.parent / report["data_docs"])
    first = report["data_docs"]

    validate.run(PARAMS, layout, 1)  # a rerun replaces the site: one validation page, the new one
    again = json.loads(report_path.read_text())["data_docs"]
    assert again != first and [p.relative_to(report_path.parent).as_posix()
                               for p in (docs / "validations").rglob("*.html")] == [again]
    assert not [p.name for p in docs.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_failed_gate_leaves_data_docs_beside_the_failed_report(tmp_path: Path):
    layout = Layout(tmp_path)
    write_round(layout, [[1.0, 0.0], [0.0, 1.0]])
    validate.run(PARAMS, layout, 1)
    report_path = layout.round_metrics(1, "validate_report")
    passed = json.loads(report_path.read_text())["data_docs"]
    frame, meta = read_steps(layout.steps(1))
    frame.loc[frame.index[1], "reward"] = math.inf
    export_steps(frame, layout.steps(1), metadata=meta)

    with pytest.raises(validate.DataValidationError, match="data_docs.failed/validations/"):
        validate.run(PARAMS, layout, 1)
    failed = json.loads(report_path.with_name("validate_report.failed.json").read_text())
    assert failed["data_docs"].startswith("data_docs.failed/validations/")
    text = page_text(report_path.parent / failed["data_docs"])
    assert "Status: ✗ Failed" in text and f"✗ {REWARD_RANGE}" in text and "g0|0" in text
    assert json.loads(report_path.read_text())["data_docs"] == passed  # the outputs are as they were
    assert (report_path.parent / passed).is_file()

    export_steps(frame.assign(reward=0.0), layout.steps(1), metadata=meta)  # fixed: the failed docs go
    validate.run(PARAMS, layout, 1)
    assert not report_path.with_name("data_docs.failed").exists()


CHROMIUM = os.environ.get("ARLFLOW_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM}: apt-get install chromium")
def test_result_page_reads_offline_in_a_browser(tmp_path: Path):
    """The page a report links shows the failure with every network request refused (GX's CDN styles absent);
    its screenshot goes to $ARLFLOW_SCREENSHOTS (default: the test's tmp folder) as data-docs-result.png."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    site = tmp_path / "docs"
    page_path = site / write_data_docs(validate_steps(bad_frame(), LIMITS, round=2), site)
    shots = Path(os.environ.get("ARLFLOW_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.route("http*://**", lambda route: route.abort())
            page.goto(page_path.as_uri(), wait_until="load")
            text = page.inner_text("body")
            page.screenshot(path=str(shots / "data-docs-result.png"), full_page=True)
        finally:
            browser.close()
    assert "arlflow_steps" in text and "Failed" in text and REWARD_RANGE in text and "g0-t1" in text
