"""The gateway app in-process (FastAPI TestClient) over a real SQLite DataPool: recording, prefix consistency,
tools, idempotency, n, completions, streaming, rewards, and every rejected request writing nothing."""
from __future__ import annotations

import copy
import json

import pytest
from fastapi.testclient import TestClient
from gateway_helpers import AUTH, KEY, FailingUpstream, RecordingUpstream, ScriptedUpstream

from datapool.gateway.app import create_app
from datapool.gateway.chat import ChatRenderer
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import LocalEngineUpstream, UpstreamResult

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"city": {"type": "string"}}}}}
TOOL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def make_client(pool, upstream, tokenizer, **config) -> TestClient:
    config = {"api_keys": (KEY,), "policy_version": "tiny-v0", **config}
    return TestClient(create_app(GatewayConfig(**config), upstream, pool, tokenizer))


@pytest.fixture
def local(pool, engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    upstream = RecordingUpstream(LocalEngineUpstream(engine))
    return make_client(pool, upstream, tokenizer), upstream


@pytest.fixture
def scripted(pool, engine_and_tokenizer):
    _, tokenizer = engine_and_tokenizer
    upstream = ScriptedUpstream(tokenizer)
    return make_client(pool, upstream, tokenizer), upstream


def chat(client, messages, *, path="/v1/chat/completions", headers=None, **body):
    return client.post(path, headers={**AUTH, **(headers or {})},
                       json={"messages": messages, "max_tokens": 6, "return_token_ids": True, **body})


def assert_nothing_written(pool) -> None:
    counts = pool.counts()
    assert counts == {"trajectories": 0, "steps": 0}, counts


# ------------------------------------------------------------------------------------------- recording


def test_chat_records_exactly_the_sampled_ids(local, pool):
    client, upstream = local
    response = chat(client, [{"role": "user", "content": "take key"}], path="/t/ep-1/v1/chat/completions", seed=3)
    assert response.status_code == 200, response.text
    body = response.json()
    sampled = upstream.results[-1]
    assert body["choices"][0]["token_ids"] == sampled.token_ids
    assert body["prompt_token_ids"] == sampled.prompt_ids
    assert response.headers["x-trajectory-id"] == "ep-1" and response.headers["x-step-index"] == "0"
    traj = pool.get_trajectory("ep-1")
    assert traj.status == "open" and traj.num_steps == 1 and traj.policy_version == "tiny-v0"
    step = traj.steps[0]
    assert step.response_ids == sampled.token_ids and step.prompt_ids == sampled.prompt_ids
    assert step.logprobs == pytest.approx(sampled.logprobs, abs=1e-6)
    assert step.response_text == body["choices"][0]["message"]["content"]
    assert step.truncated == (sampled.finish_reason == "length") and step.retokenized is False


def test_ids_are_only_returned_when_asked(local):
    client, _ = local
    body = chat(client, [{"role": "user", "content": "hi"}], return_token_ids=False).json()
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]


def test_prefix_consistency_over_three_turns(local, pool):
    client, _ = local
    messages = [{"role": "system", "content": "You play a text game."}, {"role": "user", "content": "look"}]
    for turn in range(3):
        body = chat(client, messages, headers={"X-Trajectory-Id": "ep-2"}).json()
        messages += [body["choices"][0]["message"], {"role": "user", "content": f"go north {turn}"}]
    steps = pool.get_trajectory("ep-2").steps
    assert [s.step_index for s in steps] == [0, 1, 2]
    for before, after in zip(steps, steps[1:]):
        prefix = before.prompt_ids + before.response_ids
        assert after.prompt_ids[: len(prefix)] == prefix
        assert len(after.prompt_ids) > len(prefix)


def test_an_edited_reply_is_rendered_from_scratch(local, pool, engine_and_tokenizer):
    client, _ = local
    _, tokenizer = engine_and_tokenizer
    messages = [{"role": "user", "content": "look"}]
    chat(client, messages, headers={"X-Trajectory-Id": "ep-3"})
    messages += [{"role": "assistant", "content": "something the model never said"}, {"role": "user", "content": "ok"}]
    chat(client, messages, headers={"X-Trajectory-Id": "ep-3"})
    renderer = ChatRenderer(tokenizer)
    second = pool.get_trajectory("ep-3").steps[1]
    assert second.prompt_ids == renderer.encode(renderer.render(messages, None, add_generation_prompt=True))


def test_tool_calls_are_parsed_and_the_conversation_stays_prefix_consistent(scripted, pool):
    client, upstream = scripted
    upstream.set_text(TOOL_TEXT)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    body = chat(client, messages, tools=[WEATHER_TOOL], max_tokens=200, headers={"X-Trajectory-Id": "ep-4"}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    upstream.set_text(" It is sunny.")
    messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21C"}]
    second = chat(client, messages, tools=[WEATHER_TOOL], max_tokens=200, headers={"X-Trajectory-Id": "ep-4"}).json()
    assert second["choices"][0]["message"] == {"role": "assistant", "content": " It is sunny."}
    first, step = pool.get_trajectory("ep-4").steps
    assert first.tool_calls == 1 and step.tool_calls == 0
    assert step.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids


def test_tool_choice_none_keeps_the_text(scripted):
    client, upstream = scripted
    upstream.set_text(TOOL_TEXT)
    body = chat(client, [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], tool_choice="none",
                max_tokens=200).json()
    assert body["choices"][0]["message"]["content"] == TOOL_TEXT and body["choices"][0]["finish_reason"] == "stop"


def test_idempotency_key_replays_the_stored_response(scripted, pool):
    client, upstream = scripted
    headers = {"Idempotency-Key": "req-42", "X-Trajectory-Id": "ep-5"}
    first = chat(client, [{"role": "user", "content": "hi"}], headers=headers)
    again = chat(client, [{"role": "user", "content": "hi"}], headers=headers)
    assert first.json() == again.json() and again.headers["x-idempotent-replay"] == "true"
    assert upstream.calls == 1 and pool.counts() == {"trajectories": 1, "steps": 1}
    assert pool.lookup_request("req-42")["id"] == first.json()["id"]
    assert "arlflow_request_sha256" not in again.json()                      # the body hash stays server-side


def test_an_idempotency_key_is_bound_to_its_trajectory_and_body(scripted, pool):
    """Before: a reused key with another body silently replayed the first answer, and reused on trajectory B it gave
    B A's response and recorded nothing for B."""
    client, upstream = scripted
    first = chat(client, [{"role": "user", "content": "hi"}], headers={"Idempotency-Key": "k-1", "X-Trajectory-Id": "A"})
    assert first.status_code == 200
    other_body = chat(client, [{"role": "user", "content": "bye"}],
                      headers={"Idempotency-Key": "k-1", "X-Trajectory-Id": "A"})
    assert "another request body" in _error(other_body, 422)["message"]
    other_trajectory = chat(client, [{"role": "user", "content": "hi"}],
                            headers={"Idempotency-Key": "k-1", "X-Trajectory-Id": "B"})
    assert "was used for trajectory 'A', not 'B'" in _error(other_trajectory, 422)["message"]
    assert upstream.calls == 1 and pool.counts() == {"trajectories": 1, "steps": 1}


def test_n_choices_become_one_group_of_trajectories(local, pool):
    client, upstream = local
    body = chat(client, [{"role": "user", "content": "hi"}], n=3, headers={"X-Group-Id": "g-7"}).json()
    ids = [c["trajectory_id"] for c in body["choices"]]
    assert len(set(ids)) == 3 and body["group_id"] == "g-7"
    for choice, tid in zip(body["choices"], ids):
        traj = pool.get_trajectory(tid)
        assert traj.group_id == "g-7" and traj.steps[0].response_ids == choice["token_ids"]
    refused = chat(client, [{"role": "user", "content": "hi"}], n=2, headers={"X-Trajectory-Id": "ep-6"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_completions_with_token_ids_and_text(local, pool, engine_and_tokenizer):
    client, upstream = local
    _, tokenizer = engine_and_tokenizer
    prompt = tokenizer("You are in the kitchen", add_special_tokens=False)["input_ids"]
    body = client.post("/v1/completions", headers=AUTH, json={
        "prompt": prompt, "max_tokens": 5, "logprobs": 1, "return_token_ids": True,
        "return_tokens_as_token_ids": True}).json()
    [choice] = body["choices"]
    sampled = upstream.results[-1]
    assert choice["token_ids"] == sampled.token_ids and choice["prompt_token_ids"] == prompt
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in sampled.token_ids]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(sampled.logprobs)
    step = pool.get_trajectory(body["trajectory_id"]).steps[0]
    assert step.prompt_ids == prompt and step.response_ids == sampled.token_ids
    text = client.post("/v1/completions", headers=AUTH, json={"prompt": "You are in", "max_tokens": 3}).json()
    assert text["object"] == "text_completion" and "token_ids" not in text["choices"][0]
    for bad in ({"prompt": ["a", "b"]}, {"prompt": [10**6]}, {"prompt": []}, {"prompt": ""}):
        assert client.post("/v1/completions", headers=AUTH, json=bad).status_code == 400, bad


def test_streaming_sends_the_committed_response(local, pool):
    client, _ = local
    response = chat(client, [{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True},
                    headers={"X-Trajectory-Id": "ep-7"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    step = pool.get_trajectory("ep-7").steps[0]
    assert content == step.response_text and ids == step.response_ids
    assert chunks[0]["prompt_token_ids"] == step.prompt_ids
    assert chunks[-1]["usage"]["completion_tokens"] == len(step.response_ids)


def test_rewards_and_completion(scripted, pool):
    client, _ = scripted
    for _ in range(2):
        chat(client, [{"role": "user", "content": "hi"}], path="/t/ep-8/v1/chat/completions")
    assert client.post("/v1/trajectories/ep-8/reward", headers=AUTH,
                       json={"reward": 0.5, "step_index": 0}).json()["episode_return"] == 0.5
    assert client.post("/v1/trajectories/ep-8/reward", headers=AUTH, json={"reward": 1.0}).json()[
        "episode_return"] == 1.5
    done = client.post("/v1/trajectories/ep-8/complete", headers=AUTH, json={"status": "complete", "won": True})
    assert done.json()["status"] == "complete" and done.json()["won"] is True
    record = client.get("/v1/trajectories/ep-8", headers=AUTH).json()
    assert [s["reward"] for s in record["steps"]] == [0.5, 1.0] and record["episode_return"] == 1.5
    late = chat(client, [{"role": "user", "content": "hi"}], path="/t/ep-8/v1/chat/completions")
    assert late.status_code == 409 and late.json()["error"]["code"] == "trajectory_finished"
    assert pool.get_trajectory("ep-8").num_steps == 2
    # a finished trajectory is final: completing again or rewarding it is a 409 and changes nothing
    again = client.post("/v1/trajectories/ep-8/complete", headers=AUTH, json={"status": "failed", "won": False})
    assert _error(again, 409)["code"] == "trajectory_finished"
    reward = client.post("/v1/trajectories/ep-8/reward", headers=AUTH, json={"reward": 4.0})
    assert "already complete" in _error(reward, 409)["message"]
    final = pool.get_trajectory("ep-8")
    assert (final.status, final.won, final.episode_return) == ("complete", True, 1.5)


def test_path_and_header_ids_must_agree(scripted):
    client, _ = scripted
    response = chat(client, [{"role": "user", "content": "hi"}], path="/t/a/v1/chat/completions",
                    headers={"X-Trajectory-Id": "b"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "trajectory_id"


def test_health_models_and_ui_are_mounted(scripted):
    client, _ = scripted
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "arlflow-policy"
    assert client.get("/ui/").status_code == 200
    assert client.get("/ui/api/trajectories").status_code == 401


# ------------------------------------------------------------------------------------- rejected requests


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_get_openai_errors_and_write_nothing(scripted, pool):
    client, upstream = scripted
    url = "/v1/chat/completions"
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    assert _error(client.post(url, json=ok), 401)["code"] == "invalid_api_key"
    assert _error(client.post(url, json=ok, headers={"Authorization": "Bearer wrong"}), 401)
    assert _error(client.post(url, json=ok, headers={"Authorization": KEY}), 401)
    assert _error(client.post(url, content=b"{not json", headers={**AUTH, "Content-Type": "application/json"}),
                  400)["code"] == "invalid_json"
    assert _error(client.post(url, json=[1, 2], headers=AUTH), 400)
    assert _error(client.post(url, json={}, headers=AUTH), 400)["param"] == "messages"
    assert _error(client.post(url, json={**ok, "temperature": "hot"}, headers=AUTH), 400)["param"] == "temperature"
    assert _error(client.post(url, json={**ok, "n": 99}, headers=AUTH), 400)["param"] == "n"
    assert _error(client.post(url, json={**ok, "max_tokens": 10**6}, headers=AUTH), 400)["param"] == "max_tokens"
    assert _error(client.post(url, json={"messages": [{"role": "robot", "content": "x"}]}, headers=AUTH),
                  400)["param"] == "messages[0].role"
    assert _error(client.post(url, json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                              headers=AUTH), 400)
    assert _error(client.post(url, json=ok, headers={**AUTH, "X-Trajectory-Id": "bad id!"}), 400)
    huge = {"messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    assert _error(client.post(url, json=huge, headers=AUTH), 413)["code"] == "request_too_large"
    assert _error(client.post("/v1/trajectories/nope/reward", json={"reward": 1.0}, headers=AUTH), 404)
    assert _error(client.post("/v1/trajectories/nope/complete", json={}, headers=AUTH), 404)
    assert _error(client.get("/v1/trajectories/nope", headers=AUTH), 404)
    assert _error(client.post("/v1/trajectories/x/reward", json={"reward": "lots"}, headers=AUTH), 400)
    assert _error(client.post("/v1/trajectories/x/complete", json={"status": "won"}, headers=AUTH), 400)
    assert _error(client.get("/v2/nothing", headers=AUTH), 404)
    assert upstream.calls == 0
    assert_nothing_written(pool)


def test_chunked_oversized_body_is_rejected(scripted, pool):
    client, _ = scripted

    def chunks():
        for _ in range(20):
            yield b"x" * 100_000

    assert _error(client.post("/v1/chat/completions", content=chunks(), headers=AUTH), 413)
    assert_nothing_written(pool)


def test_upstream_failures_write_nothing(pool, engine_and_tokenizer):
    _, tokenizer = engine_and_tokenizer
    client = make_client(pool, FailingUpstream(RuntimeError("connection refused")), tokenizer)
    assert _error(chat(client, [{"role": "user", "content": "hi"}]), 502)["code"] == "upstream_failed"
    assert client.get("/health").status_code == 503
    client = make_client(pool, FailingUpstream(ValueError("prompt too long")), tokenizer)
    assert "prompt too long" in _error(chat(client, [{"role": "user", "content": "hi"}]), 400)["message"]
    assert_nothing_written(pool)


class FaultyUpstream:
    """Answers with what a broken upstream sends: ids, log-probs and lengths no sampler can produce."""

    name = "faulty"

    def __init__(self, ids, logprobs) -> None:
        self.ids, self.logprobs = ids, logprobs

    def generate(self, prompt_ids, sampling, n=1):
        return [UpstreamResult(list(prompt_ids), list(self.ids), list(self.logprobs), "stop") for _ in range(n)]

    def health(self) -> bool:
        return True


@pytest.mark.parametrize("ids, logprobs, says", [
    ([5, 100_000], [-0.1, -0.2], "token id 100000 is outside the policy's vocabulary"),
    ([5, -3], [-0.1, -0.2], "token id -3 is outside"),
    ([5, 6], [-0.1, 7.5], "log-prob 7.5 is not a finite value <= 0"),
    ([5, 6], [-0.1, float("nan")], "log-prob nan"),
    ([5] * 3000, [-0.1] * 3000, "3000 tokens for max_tokens 4"),
    ([5, 6], [-0.1], "1 log-probs for 2 token ids"),
])
def test_invalid_upstream_output_is_a_502_and_nothing_is_recorded(pool, engine_and_tokenizer, ids, logprobs, says):
    _, tokenizer = engine_and_tokenizer
    client = make_client(pool, FaultyUpstream(ids, logprobs), tokenizer)
    error = _error(chat(client, [{"role": "user", "content": "hi"}], max_tokens=4), 502)
    assert error["code"] == "upstream_invalid_output" and says in error["message"] and "faulty" in error["message"]
    assert_nothing_written(pool)


def test_prompt_longer_than_the_model_is_a_400(local, pool):
    client, _ = local
    response = chat(client, [{"role": "user", "content": "north " * 400}])
    assert "max_position_embeddings" in _error(response, 400)["message"]
    assert_nothing_written(pool)


def test_no_auth_mode_and_config_validation(pool, engine_and_tokenizer):
    _, tokenizer = engine_and_tokenizer
    client = make_client(pool, ScriptedUpstream(tokenizer), tokenizer, api_keys=(), allow_no_auth=True)
    assert chat(client, [{"role": "user", "content": "hi"}]).status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        GatewayConfig()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
          "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}"
          "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_prefix_consistency_with_a_jinja_chat_template(pool, engine_and_tokenizer):
    """The end-of-turn text the template writes after a reply (``<|endoftext|>\\n``) is added after the sampled ids,
    without a second eos when the model sampled it."""
    _, tokenizer = engine_and_tokenizer
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = CHATML
    upstream = ScriptedUpstream(templated, " east")
    client = make_client(pool, upstream, templated)
    messages = [{"role": "user", "content": "look"}]
    first = chat(client, messages, headers={"X-Trajectory-Id": "jinja"}).json()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "and now?"}]
    second = chat(client, messages, headers={"X-Trajectory-Id": "jinja"}).json()
    prefix = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"][: len(prefix)] == prefix
    suffix = templated.decode(second["prompt_token_ids"][len(prefix):])
    assert suffix == "\n<|im_start|>user\nand now?<|endoftext|>\n<|im_start|>assistant\n"


def test_the_gateway_refuses_a_policy_folder_it_cannot_tokenize_with(tiny_policy_dir, tmp_path):
    """Without tokenizer.json the folder loads a one-token tokenizer that maps every text to no ids: the gateway
    must not start on it (before: /health ok, chat 200, prompt_ids [0] stored)."""
    import shutil

    from typer.testing import CliRunner

    from datapool.gateway.server import build_gateway
    from flows.gateway_cli import gateway_app

    broken = tmp_path / "policy"
    shutil.copytree(tiny_policy_dir, broken)
    (broken / "tokenizer.json").unlink()
    config = GatewayConfig(api_keys=(KEY,))
    for upstreams in ([], ["http://127.0.0.1:9/v1"]):
        with pytest.raises(ValueError, match="cannot tokenize text.*tokenizer.json"):
            build_gateway(config, policy=broken, pool_url=str(tmp_path / "pool.db"), upstream_urls=upstreams)
    result = CliRunner().invoke(gateway_app, ["serve", "--policy", str(broken), "--pool-url", str(tmp_path / "p.db"),
                                              "--api-key", KEY])
    assert result.exit_code == 2 and "cannot tokenize text" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "p.db").exists()


@pytest.mark.parametrize("path, body, field", [
    ("/v1/trajectories/t/reward", {"reward": "0.5"}, "reward"),
    ("/v1/trajectories/t/reward", {"reward": True}, "reward"),
    ("/v1/trajectories/t/reward", {"reward": 1.0, "step_index": 2 ** 63}, "step_index"),
    ("/v1/trajectories/t/complete", {"won": "yes"}, "won"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 70}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}]}, "content"),
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 2}, "prompt"),
])
def test_loose_values_are_refused_with_a_400_not_coerced(scripted, pool, path, body, field):
    """Before: "0.5", true, "yes", "4" and [true, false] were coerced; 2**63 and a lone surrogate were 500s."""
    client, upstream = scripted
    chat(client, [{"role": "user", "content": "hi"}], headers={"X-Trajectory-Id": "t"})
    before = pool.get_trajectory("t")
    response = client.post(path, headers={**AUTH, "content-type": "application/json"},
                           content=json.dumps(body))                     # ASCII-escaped: a lone surrogate survives
    assert response.status_code in (400, 422), response.text
    assert field in response.text
    after = pool.get_trajectory("t")
    assert (after.status, after.episode_return, after.num_steps) == (before.status, before.episode_return, 1)
    assert upstream.calls == 1


def test_round_header_and_returns_stay_in_range(scripted, pool):
    client, _ = scripted
    for bad in ("²".encode("latin-1"), b"99999999999999999999"):          # headers are latin-1: "²" isdigit()
        refused = chat(client, [{"role": "user", "content": "hi"}], headers={"X-Round": bad})
        assert "X-Round" in _error(refused, 400)["message"]
    chat(client, [{"role": "user", "content": "hi"}], headers={"X-Trajectory-Id": "r"})
    chat(client, [{"role": "user", "content": "hi"}], headers={"X-Trajectory-Id": "r"})
    assert client.post("/v1/trajectories/r/reward", headers=AUTH, json={"reward": 1e308, "step_index": 0}).status_code == 200
    overflow = client.post("/v1/trajectories/r/reward", headers=AUTH, json={"reward": 1e308, "step_index": 1})
    assert "not a finite number" in _error(overflow, 400)["message"]
    record = client.get("/v1/trajectories/r", headers=AUTH)
    assert record.json()["episode_return"] == 1e308 and "Infinity" not in record.text


def test_two_authorization_headers_are_refused_by_the_api_and_the_ui_alike(scripted, pool):
    """Before: the API took the last header and the UI the first, so one request was judged two ways."""
    client, upstream = scripted
    twice = [("authorization", "Bearer wrong"), ("authorization", f"Bearer {KEY}")]
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/ui/api/trajectories")):
        response = client.request(method, path, headers=twice,
                                  json={"messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None)
        assert _error(response, 400)["code"] == "duplicate_authorization"
    assert upstream.calls == 0
    assert_nothing_written(pool)


def test_the_gateway_cli_says_in_one_line_why_a_pool_cannot_be_opened(tiny_policy_dir, tmp_path):
    """Before: a Python traceback for a pool path that is a folder or not a database, a PostgreSQL server that is
    down, or an unsupported URL."""
    from typer.testing import CliRunner

    from flows.gateway_cli import gateway_app

    (tmp_path / "garbage.db").write_bytes(b"not a database at all" * 50)
    (tmp_path / "folder").mkdir()
    cases = {str(tmp_path / "folder"): "unable to open database file",
             f"sqlite:///{tmp_path / 'garbage.db'}": "file is not a database",
             "postgresql+psycopg://user:hunter2@127.0.0.1:9/pool": "Connection refused",
             "mongodb://x/y": "Can't load plugin"}
    for url, says in cases.items():
        result = CliRunner().invoke(gateway_app, ["serve", "--policy", str(tiny_policy_dir), "--pool-url", url,
                                                  "--api-key", KEY])
        assert result.exit_code == 2, (url, result.output)
        assert "cannot open the data pool" in result.output and says in result.output, result.output
        assert "Traceback" not in result.output and "hunter2" not in result.output
    assert (tmp_path / "garbage.db").read_bytes() == b"not a database at all" * 50      # left as it was
