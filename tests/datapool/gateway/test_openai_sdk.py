"""The real ``openai`` SDK against a gateway served by uvicorn on loopback: multi-turn chat, tools, streaming,
completions, rewards and errors; the recorded ids are the ids the engine sampled, and turn t+1's prompt ids extend
turn t's prompt + response ids."""
from __future__ import annotations

import httpx
import openai
import pytest
from gateway_helpers import KEY, RecordingUpstream, ScriptedUpstream, ThreadedServer

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import LocalEngineUpstream
from datapool.store import DataPool

TOOLS = [{"type": "function", "function": {"name": "move", "description": "walk one room",
                                           "parameters": {"type": "object",
                                                          "properties": {"direction": {"type": "string"}}}}}]
IDS = {"return_token_ids": True}


@pytest.fixture
def served(tmp_path, engine_and_tokenizer):
    """(base url, pool, recording upstream over the local engine, scripted upstream switch)."""
    engine, tokenizer = engine_and_tokenizer
    local = RecordingUpstream(LocalEngineUpstream(engine))
    scripted = ScriptedUpstream(tokenizer)

    class Switch:  # the local engine by default; the scripted one when a test needs a known answer (tools)
        name = "switch"
        target = local

        def generate(self, prompt_ids, sampling, n=1):
            return self.target.generate(prompt_ids, sampling, n)

        def health(self):
            return True

    switch = Switch()
    with DataPool(f"sqlite:///{tmp_path / 'pool.db'}") as pool:
        app = create_app(GatewayConfig(api_keys=(KEY,), policy_version="tiny-v0"), switch, pool, tokenizer)
        with ThreadedServer(app) as server:
            yield server.url, pool, local, scripted, switch


def client_for(url: str, trajectory_id: str | None = None, key: str = KEY) -> openai.OpenAI:
    base = f"{url}/t/{trajectory_id}/v1" if trajectory_id else f"{url}/v1"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)


def test_multi_turn_chat_records_the_sampled_ids_prefix_consistently(served):
    url, pool, local, _, _ = served
    client = client_for(url, "sdk-ep-1")
    messages = [{"role": "system", "content": "You are in a maze."}, {"role": "user", "content": "look"}]
    returned = []
    for turn in range(3):
        completion = client.chat.completions.create(model="arlflow-policy", messages=messages, max_tokens=6,
                                                    temperature=1.0, seed=turn, extra_body=IDS)
        choice = completion.choices[0]
        returned.append((completion.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]))
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": f"go east {turn}"}]
    steps = pool.get_trajectory("sdk-ep-1").steps
    sampled = local.results[-3:]
    assert [s.response_ids for s in steps] == [r.token_ids for r in sampled] == [ids for _, ids in returned]
    assert [s.prompt_ids for s in steps] == [r.prompt_ids for r in sampled] == [p for p, _ in returned]
    for before, after in zip(steps, steps[1:]):
        prefix = before.prompt_ids + before.response_ids
        assert after.prompt_ids[: len(prefix)] == prefix, "turn t+1 must extend turn t's prompt + response ids"


def test_tools_round_trip_through_the_sdk(served):
    url, pool, _, scripted, switch = served
    switch.target = scripted
    scripted.set_text('<tool_call>{"name": "move", "arguments": {"direction": "north"}}</tool_call>')
    client = client_for(url, "sdk-ep-2")
    messages = [{"role": "user", "content": "find the exit"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "move" and call.function.arguments == '{"direction": "north"}'
    scripted.set_text(" I see the exit.")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "a corridor"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=100)
    assert second.choices[0].message.content == " I see the exit."
    before, after = pool.get_trajectory("sdk-ep-2").steps
    assert before.tool_calls == 1
    assert after.prompt_ids[: len(before.prompt_ids) + len(before.response_ids)] == (
        before.prompt_ids + before.response_ids)


def test_streaming_through_the_sdk(served):
    url, pool, _, _, _ = served
    client = client_for(url, "sdk-ep-3")
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}, extra_body=IDS)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    step = pool.get_trajectory("sdk-ep-3").steps[0]
    assert content == step.response_text and ids == step.response_ids
    assert chunks[-1].usage.completion_tokens == len(step.response_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completions_rewards_and_errors_through_the_sdk(served):
    url, pool, local, _, _ = served
    client = client_for(url)
    completion = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=4, logprobs=1,
                                           extra_body=IDS)
    tid = completion.model_extra["trajectory_id"]
    assert pool.get_trajectory(tid).steps[0].response_ids == completion.choices[0].model_extra["token_ids"] == (
        local.results[-1].token_ids)
    rewarded = client.post(f"/trajectories/{tid}/reward", body={"reward": 2.0}, cast_to=httpx.Response).json()
    assert rewarded["episode_return"] == 2.0
    client.post(f"/trajectories/{tid}/complete", body={"status": "truncated"}, cast_to=httpx.Response)
    assert pool.get_trajectory(tid).status == "truncated"
    assert [m.id for m in client.models.list()] == ["arlflow-policy"]
    with pytest.raises(openai.AuthenticationError):
        client_for(url, key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        client.post("/trajectories/missing/reward", body={"reward": 1.0}, cast_to=httpx.Response)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.ConflictError):
        client_for(url, tid).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
