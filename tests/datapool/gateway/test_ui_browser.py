"""The inspection UI in a real browser: headless Chromium (the Debian ``chromium`` package) driven by Playwright.

A uvicorn server on a free loopback port serves the UI router over a seeded SQLite pool. The test types the API key,
filters by env, opens a trajectory, excludes a step, reloads and sees the exclusion persisted (and stored in the
pool), watches the live list pick up a new trajectory without a reload, and previews a GRPO batch.

Needs ``pip install playwright`` and ``apt-get install chromium`` (no ``playwright install``: the system browser is
used). Set ARLFLOW_CHROMIUM to use another Chromium binary.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from fastapi import FastAPI

from datapool.gateway.ui import router
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the UI browser test)")

CHROMIUM = os.environ.get("ARLFLOW_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
KEY = "browser-key"

if not os.path.exists(CHROMIUM) and os.environ.get("ARLFLOW_REQUIRE_SYSTEM_TESTS") == "1":
    raise RuntimeError(f"ARLFLOW_REQUIRE_SYSTEM_TESTS=1 but there is no Chromium at {CHROMIUM}: "
                       "run infra/install_system_deps.sh (apt-get install chromium)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM}: apt-get install chromium"),
]


def trajectory(tid: str, gid: str, env: str, rewards: list[float], *,
               invalid_step: int | None = None) -> TrajectoryRecord:
    steps = [StepRecord(trajectory_id=tid, group_id=gid, step_index=i, prompt_ids=[1, 2, 3, 4], response_ids=[5, 6],
                        logprobs=[-0.1, -0.2], prompt_text=f"prompt of {tid} step {i}",
                        observation=f"room {i} of {tid}",
                        action="" if i == invalid_step else "go north", response_text=f"<b>reply {i}</b>",
                        reward=r, anchor=f"room{i}", policy_version="v1", action_valid=i != invalid_step)
             for i, r in enumerate(rewards)]
    return TrajectoryRecord(trajectory_id=tid, group_id=gid, scenario="{}", env=env, split="train", round=0,
                            policy_version="v1", status="complete", episode_return=sum(rewards), won=False,
                            num_steps=len(steps), response_tokens=2 * len(steps), steps=steps)


@pytest.fixture
def served(tmp_path):
    """(base URL of /ui, the pool) with a uvicorn server in a thread for the duration of the test."""
    pool = DataPool(f"sqlite:///{tmp_path / 'pool.db'}")
    pool.add_trajectories([
        trajectory("maze-a", "g-maze", "maze", [0.0, 1.0]),
        trajectory("maze-b", "g-maze", "maze", [0.0, 0.0]),
        trajectory("box-a", "g-box", "boxes", [0.0, 0.0, 0.5], invalid_step=1),
        trajectory("box-b", "g-box", "boxes", [0.25]),
    ])
    app = FastAPI()
    app.include_router(router)
    app.state.pool = pool
    app.state.config = SimpleNamespace(api_keys=(KEY,), allow_no_auth=False, model_name="tiny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/ui", pool
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        pool.close()


@pytest.fixture
def page():
    with playwright_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.set_default_timeout(15_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield page
        browser.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


def row_ids(page) -> set[str]:
    return {row.get_attribute("data-id") for row in page.get_by_test_id("trajectory-row").all()}


def test_filter_open_exclude_reload_persisted(served, page):
    expect = playwright_api.expect
    base, pool = served
    page.goto(base)

    # the key is typed once, then the live list loads (newest first)
    page.get_by_test_id("key-input").fill(KEY)
    page.get_by_test_id("key-input").press("Enter")
    expect(page.get_by_test_id("trajectory-row")).to_have_count(4)
    assert row_ids(page) == {"maze-a", "maze-b", "box-a", "box-b"}
    expect(page.get_by_test_id("stats")).to_contain_text("trajectories: 4")

    # filter by env
    page.get_by_test_id("filter-env").fill("boxes")
    page.get_by_test_id("filter-env").press("Enter")
    expect(page.get_by_test_id("trajectory-row")).to_have_count(2)
    assert row_ids(page) == {"box-a", "box-b"}
    assert "env=boxes" in page.url  # the filter is kept in the address

    # the list is live: a trajectory written now shows up without a reload
    pool.add_trajectories([trajectory("box-c", "g-box", "boxes", [1.0])])
    expect(page.get_by_test_id("trajectory-row")).to_have_count(3)

    # open a trajectory: its steps, rewards, token counts and flags
    page.get_by_role("link", name="box-a").click()
    steps = page.get_by_test_id("step")
    expect(steps).to_have_count(3)
    step1 = page.locator('[data-testid="step"][data-index="1"]')
    expect(step1.get_by_test_id("step-flag")).to_have_text(["invalid_action"])
    expect(step1.get_by_test_id("step-observation")).to_have_text("room 1 of box-a")
    expect(page.locator('[data-testid="step"][data-index="2"]').get_by_test_id("step-reward")).to_have_text("0.500")
    expect(step1).to_contain_text("tokens 4 prompt / 2 response")

    # exclude step 1
    step1.get_by_test_id("step-exclude").check()
    expect(page.get_by_test_id("message")).to_have_text("saved step 1")
    expect(step1).to_have_class("step excluded")

    # reload: the exclusion is persisted
    page.reload()
    expect(page.get_by_test_id("step")).to_have_count(3)
    expect(page.locator('[data-testid="step"][data-index="1"]').get_by_test_id("step-exclude")).to_be_checked()
    for other in ("0", "2"):
        expect(page.locator(f'[data-testid="step"][data-index="{other}"]').get_by_test_id("step-exclude")) \
            .not_to_be_checked()
    stored = pool.curation_of("box-a")
    assert stored["steps"][1]["excluded"] is True and stored["trajectory"] is None
    assert set(stored["steps"]) == {1}

    # batch preview: two complete groups of two or more trajectories
    page.get_by_test_id("nav-batch").click()
    page.get_by_test_id("batch-run").click()
    expect(page.get_by_test_id("batch-group")).to_have_count(2)
    expect(page.get_by_test_id("batch-result")).to_contain_text("g-maze")
    expect(page.locator('[data-field="dropped.excluded_trajectories"]')).to_have_text("1")  # box-a, by its step
    if os.environ.get("ARLFLOW_SCREENSHOTS"):
        page.screenshot(path=os.path.join(os.environ["ARLFLOW_SCREENSHOTS"], "batch.png"), full_page=True)
