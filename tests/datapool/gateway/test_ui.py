"""The inspection UI's HTTP side: page and static files, auth, the JSON API over a real SQLite DataPool.

The app here is a bare FastAPI app that mounts ``datapool.gateway.ui.router`` and sets ``app.state.pool`` and
``app.state.config`` the way ``create_app`` does; the last test goes through the real ``create_app`` and its
security middleware (with an upstream that is never called).
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway import ui
from datapool.gateway.ui import PROMPT_TAIL_CHARS, router
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import DataPool
from models.build import train_tokenizer

KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_IDS, RESPONSE_IDS = 10, 5  # every seeded step: 15 tokens


def make_step(tid: str, gid: str, index: int, *, reward: float = 0.0, **overrides) -> StepRecord:
    fields = dict(trajectory_id=tid, group_id=gid, step_index=index, prompt_ids=list(range(PROMPT_IDS)),
                  response_ids=list(range(100, 100 + RESPONSE_IDS)), logprobs=[-0.5] * RESPONSE_IDS,
                  prompt_text=f"system: play\n{'history ' * 100}\nobs {tid}/{index}", observation=f"obs {tid}/{index}",
                  action="left", response_text="<act>left</act>", reward=reward, anchor=f"s{index}",
                  policy_version="v1")
    fields.update(overrides)
    return StepRecord(**fields)


def make_traj(tid: str, gid: str, env: str, steps: list[StepRecord], *, status: str = "complete",
              won: bool = False) -> TrajectoryRecord:
    return TrajectoryRecord(trajectory_id=tid, group_id=gid, scenario='{"seed": 1}', env=env, split="train",
                            round=0, policy_version="v1", status=status,
                            episode_return=sum(s.reward for s in steps), won=won, num_steps=len(steps),
                            response_tokens=RESPONSE_IDS * len(steps), steps=steps)


def seed_pool(pool: DataPool) -> None:
    """2 envs. GRPO-complete groups: g-fl-a (2 trajectories, 4 steps, 60 tokens), g-sk (2 complete + 1 failed;
    5 complete steps, 75 tokens). g-fl-b has a single trajectory (never a whole GRPO group)."""
    pool.add_trajectories([
        make_traj("fl-1", "g-fl-a", "frozenlake", [make_step("fl-1", "g-fl-a", 0), make_step("fl-1", "g-fl-a", 1,
                  reward=1.0)], won=True),
        make_traj("fl-2", "g-fl-a", "frozenlake", [make_step("fl-2", "g-fl-a", 0),
                                                   make_step("fl-2", "g-fl-a", 1, truncated=True)]),
        make_traj("fl-3", "g-fl-b", "frozenlake", [make_step("fl-3", "g-fl-b", 0, reward=0.25)]),
        make_traj("sk-1", "g-sk", "sokoban", [make_step("sk-1", "g-sk", 0), make_step("sk-1", "g-sk", 1,
                  action="", action_valid=False), make_step("sk-1", "g-sk", 2, reward=0.5)]),
        make_traj("sk-2", "g-sk", "sokoban", [make_step("sk-2", "g-sk", 0, tool_calls=2, tool_successes=1),
                                              make_step("sk-2", "g-sk", 1, reward=-1.0)]),
        make_traj("sk-3", "g-sk", "sokoban", [make_step("sk-3", "g-sk", 0)], status="failed"),
    ])


def make_app(pool: DataPool, *, api_keys: tuple[str, ...] = (KEY,), allow_no_auth: bool = False) -> FastAPI:
    """What create_app does for the UI: mount the router, expose the pool and the config on app.state."""
    app = FastAPI()
    app.include_router(router)
    app.state.pool = pool
    app.state.config = SimpleNamespace(api_keys=api_keys, allow_no_auth=allow_no_auth, model_name="tiny")
    return app


@pytest.fixture
def pool(tmp_path):
    with DataPool(f"sqlite:///{tmp_path / 'pool.db'}") as pool:
        seed_pool(pool)
        yield pool


@pytest.fixture
def client(pool):
    with TestClient(make_app(pool)) as client:
        yield client


def ids(response) -> set[str]:
    assert response.status_code == 200, response.text
    return {row["trajectory_id"] for row in response.json()["trajectories"]}


def assert_openai_error(response, status: int, *, contains: str = "", param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert contains.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param
    return error


# ------------------------------------------------------------------------------------ page and auth

def test_page_and_static_files_are_served_without_a_key(client):
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="ui/static/app.js"' in page.text and "cdn" not in page.text.lower()
    script = client.get("/ui/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "fetch(" in script.text and "innerHTML" not in script.text  # agent text is never parsed as HTML
    assert client.get("/ui/static/style.css").headers["content-type"].startswith("text/css")
    assert client.get("/ui/", follow_redirects=False).headers["location"].endswith("/ui")


@pytest.mark.parametrize("name", ["missing.js", "..%2Fui.py", "%2E%2E%2F%2E%2E%2Fstore.py"])
def test_static_route_serves_only_its_own_files(client, name):
    response = client.get(f"/ui/static/{name}")
    assert response.status_code == 404 and "import" not in response.text


def test_api_needs_a_valid_bearer_key(client):
    assert client.get("/ui/config").json()["auth_required"] is True
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        for path in ("/ui/api/trajectories", "/ui/api/stats", "/ui/api/rounds", "/ui/api/trajectories/fl-1"):
            error = assert_openai_error(client.get(path, headers=headers), 401, contains="API key")
            assert error["type"] == "authentication_error"
    response = client.post("/ui/api/trajectories/fl-1/curation", json={"excluded": True})
    assert_openai_error(response, 401)
    assert client.app.state.pool.curation_of("fl-1")["trajectory"] is None  # a rejected request writes nothing
    assert ids(client.get("/ui/api/trajectories", headers=AUTH)) == {"fl-1", "fl-2", "fl-3", "sk-1", "sk-2", "sk-3"}


def test_allow_no_auth_opens_the_api(pool):
    with TestClient(make_app(pool, api_keys=(), allow_no_auth=True)) as client:
        assert client.get("/ui/config").json()["auth_required"] is False
        assert len(ids(client.get("/ui/api/trajectories"))) == 6


# ---------------------------------------------------------------------------------------- the list

@pytest.mark.parametrize("query, expected", [
    ("env=sokoban", {"sk-1", "sk-2", "sk-3"}),
    ("env=frozenlake&min_return=0.2", {"fl-1", "fl-3"}),
    ("max_return=0", {"fl-2", "sk-2", "sk-3"}),
    ("status=failed", {"sk-3"}),
    ("flag=truncated", {"fl-2"}),
    ("flag=invalid_action", {"sk-1"}),
    ("flag=tool_failure", {"sk-2"}),
    ("flag=retokenized", set()),
    ("flag=prefix_break", set()),
    ("round=0&env=frozenlake&status=", {"fl-1", "fl-2", "fl-3"}),  # an empty filter means "any"
    ("round=1", set()),
])
def test_list_filters(client, query, expected):
    assert ids(client.get(f"/ui/api/trajectories?{query}", headers=AUTH)) == expected


def test_list_pages_newest_first_without_the_scenario(client):
    first = client.get("/ui/api/trajectories?limit=4", headers=AUTH).json()["trajectories"]
    rest = client.get("/ui/api/trajectories?limit=4&offset=4", headers=AUTH).json()["trajectories"]
    assert len(first) == 4 and len(rest) == 2
    assert {r["trajectory_id"] for r in first} | {r["trajectory_id"] for r in rest} == {
        "fl-1", "fl-2", "fl-3", "sk-1", "sk-2", "sk-3"}
    assert "scenario" not in first[0] and {"excluded", "labels", "episode_return", "env"} <= set(first[0])


@pytest.mark.parametrize("query, param", [
    ("flag=bogus", "flag"), ("limit=0", "limit"), ("limit=100000", "limit"), ("round=-1", "round"),
    ("min_return=abc", "min_return"), ("excluded=maybe", "excluded"),
])
def test_list_rejects_bad_filters_in_openai_shape(client, query, param):
    assert_openai_error(client.get(f"/ui/api/trajectories?{query}", headers=AUTH), 400, param=param)


def test_stats(client):
    stats = client.get("/ui/api/stats", headers=AUTH).json()
    assert (stats["trajectories"], stats["steps"], stats["excluded_steps"]) == (6, 11, 0)
    assert stats["by_env"] == {"frozenlake": 3, "sokoban": 3} and stats["by_round"] == {"0": 6}
    client.post("/ui/api/trajectories/sk-1/curation", headers=AUTH, json={"step_index": 2, "excluded": True})
    assert client.get("/ui/api/stats", headers=AUTH).json()["excluded_steps"] == 1


# ------------------------------------------------------------------------------------------ rounds view

def add_round_1(pool: DataPool) -> None:
    """Round 1, one group: r1-a won in 19 steps of 10 prompt tokens; r1-b hit the step limit after 1 step of 50
    prompt tokens, its response cut and its action invalid. 20 steps: nearest-rank p95 is the 19th, 10 tokens."""
    won = [make_step("r1-a", "g-r1", k, reward=1.0 if k == 18 else 0.0) for k in range(19)]
    cut = [make_step("r1-b", "g-r1", 0, prompt_ids=list(range(50)), truncated=True, action="", action_valid=False)]
    pool.add_trajectories([replace(make_traj("r1-a", "g-r1", "frozenlake", won, won=True), round=1),
                           replace(make_traj("r1-b", "g-r1", "frozenlake", cut, status="truncated"), round=1)])


def rounds_view(client, query: str = "") -> dict:
    response = client.get(f"/ui/api/rounds{query}", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def test_rounds_view_summarizes_every_round(client, pool):
    add_round_1(pool)
    view = rounds_view(client)
    first, second = view["rounds"]
    # round 0 (seed_pool): returns 1, 0, .25, .5, -1, 0; fl-1 won; sk-3 failed; 11 steps of 10 + 5 tokens,
    # sk-1's step 1 invalid, fl-2's step 1 cut
    assert first == {"round": 0, "trajectories": 6, "mean_return": pytest.approx(0.125),
                     "success_rate": pytest.approx(1 / 6), "truncated_episode_rate": 0.0,
                     "failed_episode_rate": pytest.approx(1 / 6), "steps": 11,
                     "invalid_action_rate": pytest.approx(1 / 11), "truncated_response_rate": pytest.approx(1 / 11),
                     "prompt_tokens": {"mean": 10.0, "p95": 10}, "response_tokens": {"mean": 5.0, "p95": 5}}
    assert second == {"round": 1, "trajectories": 2, "mean_return": 0.5, "success_rate": 0.5,
                      "truncated_episode_rate": 0.5, "failed_episode_rate": 0.0, "steps": 20,
                      "invalid_action_rate": 0.05, "truncated_response_rate": 0.05,
                      "prompt_tokens": {"mean": 12.0, "p95": 10}, "response_tokens": {"mean": 5.0, "p95": 5}}
    # the groups of the latest round by default
    assert (view["group_round"], view["groups_total"]) == (1, 1)
    assert view["groups"] == [{"group_id": "g-r1", "env": "frozenlake", "trajectories": 2, "won": 1,
                               "min_return": 0.0, "mean_return": 0.5, "max_return": 1.0, "returns": [0.0, 1.0]}]


def test_rounds_view_groups_of_a_round_and_an_env(client, pool, monkeypatch):
    add_round_1(pool)
    groups = rounds_view(client, "?round=0")["groups"]
    assert [(g["group_id"], g["returns"], g["won"]) for g in groups] == [
        ("g-fl-a", [0.0, 1.0], 1), ("g-fl-b", [0.25], 0), ("g-sk", [-1.0, 0.0, 0.5], 0)]
    assert groups[2]["mean_return"] == pytest.approx(-1 / 6) and groups[2]["min_return"] == -1.0
    sokoban = rounds_view(client, "?env=sokoban")
    assert [r["round"] for r in sokoban["rounds"]] == [0] and sokoban["rounds"][0]["trajectories"] == 3
    assert sokoban["group_round"] == 0 and [g["group_id"] for g in sokoban["groups"]] == ["g-sk"]
    assert rounds_view(client, "?round=7")["groups"] == [] and rounds_view(client, "?env=none")["rounds"] == []
    monkeypatch.setattr(ui, "MAX_GROUPS", 2)
    capped = rounds_view(client, "?round=0")
    assert [g["group_id"] for g in capped["groups"]] == ["g-fl-a", "g-fl-b"] and capped["groups_total"] == 3
    assert_openai_error(client.get("/ui/api/rounds?round=-1", headers=AUTH), 400, param="round")


# ------------------------------------------------------------------------------------ one trajectory

def test_trajectory_page_data(client, pool):
    traj = client.get("/ui/api/trajectories/sk-2", headers=AUTH).json()
    assert (traj["env"], traj["group_id"], traj["status"], traj["num_steps"]) == ("sokoban", "g-sk", "complete", 2)
    assert traj["curation"] == {"excluded": False, "label": None, "note": "", "updated_at": None}
    first, last = traj["steps"]
    assert [first["step_index"], last["step_index"]] == [0, 1]
    assert (first["prompt_tokens"], first["response_tokens"]) == (PROMPT_IDS, RESPONSE_IDS)
    assert first["flags"] == ["tool_failure"] and last["flags"] == []
    assert last["reward"] == -1.0 and first["observation"] == "obs sk-2/0" and first["action"] == "left"
    stored = pool.get_trajectory("sk-2").steps[0].prompt_text
    assert len(stored) > PROMPT_TAIL_CHARS and first["prompt_tail"] == stored[-PROMPT_TAIL_CHARS:]
    assert first["mean_logprob"] == pytest.approx(-0.5)
    flags = {s["step_index"]: s["flags"] for s in client.get("/ui/api/trajectories/sk-1", headers=AUTH).json()["steps"]}
    assert flags == {0: [], 1: ["invalid_action"], 2: []}


def test_unknown_trajectory_is_404(client):
    assert_openai_error(client.get("/ui/api/trajectories/nope", headers=AUTH), 404, contains="unknown trajectory")


# -------------------------------------------------------------------------------------------- curation

def test_exclude_and_label_a_step_persist_in_the_pool(client, pool):
    response = client.post("/ui/api/trajectories/fl-2/curation", headers=AUTH,
                           json={"step_index": 1, "excluded": True, "label": "bad-format", "note": "cut off"})
    assert response.status_code == 200, response.text
    assert response.json()["steps"]["1"]["excluded"] is True
    stored = pool.curation_of("fl-2")
    assert stored["trajectory"] is None
    assert stored["steps"][1]["excluded"] is True and stored["steps"][1]["label"] == "bad-format"
    steps = client.get("/ui/api/trajectories/fl-2", headers=AUTH).json()["steps"]
    assert [s["curation"]["excluded"] for s in steps] == [False, True]
    assert steps[1]["curation"]["label"] == "bad-format" and steps[1]["curation"]["note"] == "cut off"
    # included again: the row is kept and updated, never deleted
    client.post("/ui/api/trajectories/fl-2/curation", headers=AUTH, json={"step_index": 1, "excluded": False})
    assert pool.curation_of("fl-2")["steps"][1]["excluded"] is False


def test_exclude_and_label_a_trajectory_changes_the_list(client):
    client.post("/ui/api/trajectories/sk-1/curation", headers=AUTH, json={"excluded": True, "label": "loops"})
    assert ids(client.get("/ui/api/trajectories?excluded=true", headers=AUTH)) == {"sk-1"}
    assert "sk-1" not in ids(client.get("/ui/api/trajectories?excluded=false", headers=AUTH))
    assert ids(client.get("/ui/api/trajectories?label=loops", headers=AUTH)) == {"sk-1"}
    row = next(r for r in client.get("/ui/api/trajectories?env=sokoban", headers=AUTH).json()["trajectories"]
               if r["trajectory_id"] == "sk-1")
    assert row["excluded"] is True and row["labels"] == ["loops"]


@pytest.mark.parametrize("body, status, param", [
    ({"excluded": "yes"}, 400, "excluded"),
    ({"step_index": -1, "excluded": True}, 400, "step_index"),
    ({"step_index": 7, "excluded": True}, 404, None),
    ({"label": "x" * 201}, 400, "label"),
])
def test_bad_curation_writes_nothing(client, pool, body, status, param):
    assert_openai_error(client.post("/ui/api/trajectories/fl-1/curation", headers=AUTH, json=body), status,
                        param=param)
    assert pool.curation_of("fl-1") == {"trajectory": None, "steps": {}}


def test_malformed_json_and_unknown_trajectory(client, pool):
    response = client.post("/ui/api/trajectories/fl-1/curation", headers={**AUTH, "Content-Type": "application/json"},
                           content=b'{"excluded": tru')
    assert_openai_error(response, 400, contains="not valid JSON")
    assert_openai_error(client.post("/ui/api/trajectories/nope/curation", headers=AUTH, json={"excluded": True}),
                        404, contains="unknown trajectory")
    assert pool.curation_of("fl-1") == {"trajectory": None, "steps": {}}


# --------------------------------------------------------------------------------------- batch preview

def preview(client, **body):
    response = client.post("/ui/api/batch-preview", headers=AUTH, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_grpo_preview_takes_whole_complete_groups(client):
    batch = preview(client, algorithm="grpo", token_budget=10_000)
    assert batch["groups"] == [
        {"group_id": "g-fl-a", "trajectories": 2, "steps": 4, "tokens": 60},
        {"group_id": "g-sk", "trajectories": 2, "steps": 5, "tokens": 75},  # the failed sk-3 is left out
    ]
    assert batch["summary"]["tokens"] == 135 and batch["summary"]["groups"] == 2
    only_sokoban = preview(client, algorithm="grpo", token_budget=10_000, env="sokoban")
    assert [g["group_id"] for g in only_sokoban["groups"]] == ["g-sk"]


def test_preview_respects_the_budget_and_exclusions(client):
    small = preview(client, algorithm="grpo", token_budget=70)
    assert sum(g["tokens"] for g in small["groups"]) <= 70
    assert all(g["trajectories"] == 2 for g in small["groups"])  # never a partial group
    client.post("/ui/api/trajectories/fl-2/curation", headers=AUTH, json={"excluded": True})
    after = preview(client, algorithm="grpo", token_budget=10_000)
    assert [g["group_id"] for g in after["groups"]] == ["g-sk"]  # g-fl-a has one trajectory left


def test_gigpo_preview_returns_step_rows(client):
    batch = preview(client, algorithm="gigpo", token_budget=10_000)
    assert {g["group_id"] for g in batch["groups"]} == {"g-fl-a", "g-sk"}
    assert sum(g["steps"] for g in batch["groups"]) == 9


@pytest.mark.parametrize("body, param", [
    ({"algorithm": "ppo", "token_budget": 100}, "algorithm"),
    ({"algorithm": "grpo", "token_budget": 0}, "token_budget"),
    ({"algorithm": "grpo"}, "token_budget"),
])
def test_preview_rejects_bad_requests(client, body, param):
    assert_openai_error(client.post("/ui/api/batch-preview", headers=AUTH, json=body), 400, param=param)


# ------------------------------------------------------------------------------------- inside the gateway

class _NoUpstream:
    """The UI never samples: an upstream that would fail loudly if it were asked to."""
    name = "none"

    def generate(self, prompt_ids, sampling, n=1):
        raise AssertionError("the UI must not call the upstream")

    def health(self) -> bool:
        return True


def test_served_by_create_app_behind_the_gateway_auth(pool, env_like_texts):
    """The page, its files and /ui/config open without a key; /ui/api needs one (the gateway's middleware)."""
    tokenizer = train_tokenizer(env_like_texts[:20], vocab_size=300)
    app = create_app(GatewayConfig(api_keys=(KEY,)), _NoUpstream(), pool, tokenizer)
    with TestClient(app) as client:
        for path in ("/ui", "/ui/static/app.js", "/ui/static/style.css", "/ui/config"):
            assert client.get(path).status_code == 200, path
        assert_openai_error(client.get("/ui/api/trajectories"), 401)
        assert_openai_error(client.post("/ui/api/trajectories/fl-1/curation", json={"excluded": True}), 401)
        assert ids(client.get("/ui/api/trajectories?env=sokoban", headers=AUTH)) == {"sk-1", "sk-2", "sk-3"}
        response = client.post("/ui/api/trajectories/fl-1/curation", headers=AUTH, json={"excluded": True})
        assert response.status_code == 200, response.text
    assert pool.curation_of("fl-1")["trajectory"]["excluded"] is True


def test_rollout_ids_with_slashes_open_in_the_ui_and_the_read_routes(pool, env_like_texts):
    """Issue 15: rollout trajectory ids hold '/', '|' and ':' (attempt/scenario|round|policy|episode); before, the
    UI's /ui/api/trajectories/{id} and GET /v1/trajectories/{id} were 404 "no such route" for every one of them."""
    tid = "9df688cb14/frozenlake:train:ab12|r1|round_0|2"
    pool.add_trajectories([make_traj(tid, "9df688cb14/frozenlake:train:ab12|r1|round_0", "frozenlake",
                                     [make_step(tid, "9df688cb14/frozenlake:train:ab12|r1|round_0", 0)],
                                     status="open")])
    tokenizer = train_tokenizer(env_like_texts[:20], vocab_size=300)
    with TestClient(create_app(GatewayConfig(api_keys=(KEY,)), _NoUpstream(), pool, tokenizer)) as client:
        for path in (f"/ui/api/trajectories/{quote(tid, safe='')}", f"/v1/trajectories/{quote(tid, safe='')}"):
            response = client.get(path, headers=AUTH)
            assert response.status_code == 200 and response.json()["trajectory_id"] == tid, (path, response.text)
        curated = client.post(f"/ui/api/trajectories/{quote(tid, safe='')}/curation", headers=AUTH,
                              json={"label": "good"})
        assert curated.status_code == 200, curated.text
        done = client.post(f"/v1/trajectories/{quote(tid, safe='')}/complete", headers=AUTH,
                           json={"status": "complete", "won": True})
        assert done.status_code == 200 and done.json()["status"] == "complete", done.text
    assert pool.curation_of(tid)["trajectory"]["label"] == "good" and pool.get_trajectory(tid).won is True
