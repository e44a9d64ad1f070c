"""The inspection UI over a pool written the way the rollout stage writes it, in headless Chromium.

A module fixture runs the real rollout loop (``agents.rollout.run_episodes`` on FrozenLake, with a scripted policy
standing in for the model), tags the ids as the stage does (``tasks.rollout.tag_attempt``) and stores them with
``DataPool.add_trajectories``: two rounds, ids like ``9df688cb14/frozenlake:train:1016164991|r2|round_1|3``. The
tests open such a trajectory from the list, check the Rounds view against numbers computed here from the records,
and screenshot every page into $ARLFLOW_SCREENSHOTS (default: the test's tmp folder), printing where.

One Chromium for the module (the system browser, as test_ui_browser.py drives it).
"""
from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from gateway_helpers import ThreadedServer
from test_ui import KEY, make_app
from test_ui_browser import CHROMIUM, playwright_api
from test_ui_browser import pytestmark as browser_marks

from agents.prompts import response_text
from agents.rollout import run_episodes, summarize
from datapool.records import TrajectoryRecord
from datapool.store import DataPool
from envs import make_scenarios, shortest_path_actions
from models.build import train_tokenizer
from models.engine import Generation, SamplingParams
from tasks.rollout import policy_version, tag_attempt

pytestmark = browser_marks  # slow, and skipped without Chromium
Image = pytest.importorskip("PIL.Image", reason="pip install pillow (decodes the screenshots)")
from PIL import ImageStat  # noqa: E402  (after the skip: Pillow is optional)

ROUNDS = {1: 0.3, 2: 0.8}
"""round -> how often the scripted policy plays the shortest path (the rest: random words, some invalid)."""
MOVES = ("left", "down", "right", "up", "jump")  # "jump" is no FrozenLake action: an invalid step
MAX_NEW_TOKENS = 6
MIN_PNG_BYTES = 20_000


class ScriptedPolicy:
    """An engine that plays FrozenLake by script: the shortest path with probability ``skill``, else a random word
    of MOVES; one response in six rambles on and is cut at max_new_tokens without eos (a truncated response)."""

    def __init__(self, tokenizer, version: str, skill: float) -> None:
        self.tokenizer, self.policy_version, self.skill = tokenizer, version, skill

    def generate(self, prompts, sampling):
        rng = random.Random(sampling.seed)  # the loop's per-turn seed: a rerun plays the same
        out = []
        for ids in prompts:
            action = shortest_move(self.tokenizer.decode(ids)) if rng.random() < self.skill else rng.choice(MOVES)
            tokens = self.tokenizer.encode(response_text(action), add_special_tokens=False)
            if rng.random() < 1 / 6:
                tokens = (tokens * sampling.max_new_tokens)[:sampling.max_new_tokens]
                out.append(Generation(tokens, [-1.0] * len(tokens), "length"))
            else:
                tokens = tokens + [self.tokenizer.eos_token_id]
                out.append(Generation(tokens, [-0.5] * len(tokens), "stop"))
        return out


def shortest_move(prompt: str) -> str:
    """The first shortest-path action for the last grid in a FrozenLake prompt."""
    grid = prompt.rsplit("State:\n", 1)[1].rsplit("\nAction:", 1)[0]
    rows = [line.split(" ") for line in grid.split("\n")]
    (r, c), = [(r, c) for r, row in enumerate(rows) for c, cell in enumerate(row) if cell == "P"]
    return (shortest_path_actions(["".join("F" if x == "P" else x for x in row) for row in rows], r, c)
            or ["left"])[0]


@pytest.fixture(scope="module")
def records(env_like_texts) -> list[TrajectoryRecord]:
    """What rollout_1 and rollout_2 would store: 4 scenarios x 4 episodes per round, ids tagged with the attempt."""
    tokenizer = train_tokenizer(env_like_texts, vocab_size=320)
    out = []
    for round_index, skill in ROUNDS.items():
        engine = ScriptedPolicy(tokenizer, policy_version(round_index), skill)
        trajs = run_episodes(engine, tokenizer, make_scenarios("frozenlake", "train", 4, seed=round_index),
                             group_size=4, round_index=round_index, progress=False, seed=round_index,
                             sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0),
                             env_kwargs={"frozenlake": {"max_steps": 8, "invalid_penalty": 0.1}})
        out += tag_attempt(trajs, hashlib.sha256(f"attempt {round_index}".encode()).hexdigest()[:10])
    return out


@pytest.fixture(scope="module")
def base(records, tmp_path_factory):
    """The /ui address of a uvicorn server over the pool holding ``records``."""
    with DataPool(f"sqlite:///{tmp_path_factory.mktemp('pool') / 'pool.db'}") as pool:
        pool.add_trajectories(records)
        with ThreadedServer(make_app(pool)) as server:
            yield server.url + "/ui"


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, base):
    """A fresh tab (own localStorage) with the API key saved and the list shown; fails the test on a JS error."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base)
    page.get_by_test_id("key-input").fill(KEY)
    page.get_by_test_id("key-input").press("Enter")
    playwright_api.expect(page.get_by_test_id("trajectory-row").first).to_be_visible()
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def showcase(records: list[TrajectoryRecord]) -> TrajectoryRecord:
    """The round-2 trajectory with the most steps, preferring one with an invalid and a truncated step."""
    return max((t for t in records if t.round == 2),
               key=lambda t: (any(not s.action_valid for s in t.steps), any(s.truncated for s in t.steps),
                              t.num_steps, t.trajectory_id))


def expected_rounds(records: list[TrajectoryRecord]) -> dict[int, dict[str, float]]:
    """The Rounds table's columns, computed from the records (the rollout's own summary where it has them)."""
    out = {}
    for round_index in ROUNDS:
        trajs = [t for t in records if t.round == round_index]
        steps = [s for t in trajs for s in t.steps]
        summary = summarize(trajs)
        prompt = [len(s.prompt_ids) for s in steps]
        response = [len(s.response_ids) for s in steps]
        out[round_index] = {
            "trajectories": len(trajs), "success": summary["success_rate"], "mean return": summary["mean_return"],
            "truncated episodes": np.mean([t.status == "truncated" for t in trajs]),
            "failed episodes": np.mean([t.status == "failed" for t in trajs]), "steps": len(steps),
            "invalid actions": summary["invalid_action_rate"],
            "truncated responses": np.mean([s.truncated for s in steps]),
            "prompt tokens mean": summary["mean_prompt_tokens"],
            "prompt tokens p95": np.quantile(prompt, 0.95, method="inverted_cdf"),
            "response tokens mean": np.mean(response),
            "response tokens p95": np.quantile(response, 0.95, method="inverted_cdf")}
    return out


def shown(text: str) -> tuple[float, float]:
    """A table cell's number and the precision it was printed with ("12.5%" -> (0.125, 0.0005))."""
    if text.endswith("%"):
        return float(text[:-1]) / 100, 0.0005 + 1e-9
    decimals = len(text.partition(".")[2])
    return float(text), 0.5 * 10 ** -decimals + 1e-9


def test_records_look_like_a_pipeline_round(records):
    """The fixture's pool has what the views must show: ids with '/', '|' and ':', several groups per round,
    wins and losses, invalid and truncated steps, rounds that differ."""
    assert all(set("/|:") <= set(t.trajectory_id) for t in records)
    expected = expected_rounds(records)
    assert expected[1]["success"] < expected[2]["success"]
    for round_index in ROUNDS:
        assert 0 < expected[round_index]["invalid actions"] and 0 < expected[round_index]["truncated responses"]
    assert len({t.group_id for t in records}) == 8
    assert len({t.episode_return for t in records}) > 3


def test_open_a_rollout_trajectory_and_the_rounds_view(records, page):
    expect = playwright_api.expect
    expect(page.get_by_test_id("trajectory-row")).to_have_count(len(records))

    # the list links every rollout id; clicking one opens it with its steps
    traj = showcase(records)
    page.get_by_role("link", name=traj.trajectory_id, exact=True).click()
    expect(page.get_by_test_id("trajectory-title")).to_contain_text(traj.trajectory_id)
    expect(page.get_by_test_id("step")).to_have_count(traj.num_steps)
    expect(page.get_by_test_id("step-observation")).to_have_text([s.observation for s in traj.steps])
    for step in traj.steps:
        card = page.locator(f'[data-testid="step"][data-index="{step.step_index}"]')
        flags = [f for f, on in (("truncated", step.truncated), ("invalid_action", not step.action_valid)) if on]
        expect(card.get_by_test_id("step-flag")).to_have_text(flags)
        expect(card).to_contain_text(f"tokens {len(step.prompt_ids)} prompt / {len(step.response_ids)} response")

    # the Rounds view: one row per round, every number equal to the records'
    page.get_by_test_id("nav-rounds").click()
    expect(page.get_by_test_id("round-row")).to_have_count(len(ROUNDS))
    for round_index, columns in expected_rounds(records).items():
        row = page.locator(f'[data-testid="round-row"][data-round="{round_index}"]')
        for field, value in columns.items():
            cell = row.locator(f'td[data-field="{field}"]')
            assert float(cell.get_attribute("data-value")) == pytest.approx(value, rel=1e-9, abs=1e-12), field
            number, precision = shown(cell.inner_text())
            assert abs(number - value) <= precision, (round_index, field, cell.inner_text(), value)
    expect(page.get_by_test_id("round-chart")).to_have_count(7)

    # the groups of the latest round by default, of round 1 from its link: min/mean/max of each group's returns
    for round_index in (2, 1):
        if round_index == 1:
            page.locator('[data-testid="round-row"][data-round="1"] a').click()
        expect(page.get_by_test_id("groups-title")).to_have_text(f"Groups of round {round_index}")
        groups: dict[str, list[float]] = {}
        for t in records:
            if t.round == round_index:
                groups.setdefault(t.group_id, []).append(t.episode_return)
        expect(page.get_by_test_id("group-row")).to_have_count(len(groups))
        for group_id, returns in groups.items():
            row = page.locator(f'[data-testid="group-row"][data-group="{group_id}"]')
            for field, value in (("min_return", min(returns)), ("mean_return", np.mean(returns)),
                                 ("max_return", max(returns))):
                assert float(row.locator(f'td[data-field="{field}"]').get_attribute("data-value")) == \
                    pytest.approx(value), (group_id, field)
            expect(row.locator("svg.strip circle")).to_have_count(len(returns))


def assert_not_blank(path: Path) -> None:
    """A real page, not a blank or near-blank image: big enough, with contrast, and many colours (text, bars)."""
    assert path.stat().st_size > MIN_PNG_BYTES, f"{path} is only {path.stat().st_size} bytes"
    with Image.open(path) as image:
        gray = image.convert("L")
        assert ImageStat.Stat(gray).stddev[0] > 15, f"{path} is nearly one shade"
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or ()) > 50, f"{path} has few colours"


def test_screenshots_of_every_page(records, page, tmp_path, capsys):
    """list, one trajectory, rounds and batch preview, each saved as PNG and checked to show something."""
    expect = playwright_api.expect
    folder = Path(os.environ.get("ARLFLOW_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    traj = showcase(records)
    pages = {
        "list": ("#/", lambda: expect(page.get_by_test_id("trajectory-row")).to_have_count(len(records))),
        "trajectory": ("#/t/" + quote(traj.trajectory_id, safe=""),  # as the list's links (encodeURIComponent)
                       lambda: expect(page.get_by_test_id("step")).to_have_count(traj.num_steps)),
        "rounds": ("#/rounds", lambda: expect(page.get_by_test_id("group-row").first).to_be_visible()),
        "batch": ("#/batch", lambda: (page.get_by_test_id("batch-run").click(),
                                      expect(page.get_by_test_id("batch-group").first).to_be_visible())),
    }
    saved = []
    for name, (hash_, ready) in pages.items():
        page.evaluate("hash => { location.hash = hash; }", hash_)
        ready()
        path = folder / f"ui-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert_not_blank(path)
        saved.append(path)
    assert len({hashlib.sha256(p.read_bytes()).digest() for p in saved}) == len(saved)  # four different pages
    with capsys.disabled():
        print("\nUI screenshots:", *(f"  {p} ({p.stat().st_size // 1024} KiB)" for p in saved), sep="\n")
