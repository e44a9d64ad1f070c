"""N concurrent clients against one gateway on loopback (uvicorn, the local engine), on SQLite and PostgreSQL:
afterwards the pool holds exactly the records the clients were answered, each once."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi.testclient import TestClient
from gateway_helpers import AUTH, KEY, RecordingUpstream, ScriptedUpstream, ThreadedServer

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import LocalEngineUpstream
from datapool.store import DataPool

CLIENTS, TURNS, ONE_OFF, KEYLESS = 12, 3, 10, 10


def conversation(url: str, index: int, barrier: threading.Barrier) -> tuple[str, list[list[int]]]:
    """One client: TURNS turns on its own trajectory; returns (trajectory id, the response ids it was given)."""
    tid = f"conc-{index}"
    messages = [{"role": "user", "content": f"room {index}"}]
    got = []
    with httpx.Client(base_url=f"{url}/t/{tid}/v1", headers=AUTH, timeout=60) as client:
        barrier.wait()
        for turn in range(TURNS):
            response = client.post("/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                               "seed": 100 * index + turn, "return_token_ids": True})
            response.raise_for_status()
            choice = response.json()["choices"][0]
            got.append(choice["token_ids"])
            messages += [choice["message"], {"role": "user", "content": f"turn {turn}"}]
    return tid, got


def one_off(url: str, index: int, barrier: threading.Barrier) -> dict:
    """A single request without a trajectory id, under an idempotency key another thread sends too."""
    with httpx.Client(base_url=f"{url}/v1", headers={**AUTH, "Idempotency-Key": f"once-{index // 2}"},
                      timeout=60) as client:
        barrier.wait()
        response = client.post("/completions", json={"prompt": [3, 4, 5, index // 2 + 1], "max_tokens": 3,
                                                      "seed": index // 2, "return_token_ids": True})
        response.raise_for_status()  # both sends of a key carry the same body: a retry, not a reuse
        return response.json()


def keyless(url: str, index: int, barrier: threading.Barrier) -> dict:
    """A single chat request with no trajectory id and no key (the group-commit path)."""
    with httpx.Client(base_url=f"{url}/v1", headers=AUTH, timeout=60) as client:
        barrier.wait()
        response = client.post("/chat/completions", json={"messages": [{"role": "user", "content": f"hi {index}"}],
                                                           "max_tokens": 3, "seed": index, "return_token_ids": True})
        response.raise_for_status()
        return response.json()


def test_concurrent_clients_get_exact_record_counts(pool_url, engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    upstream = RecordingUpstream(LocalEngineUpstream(engine))
    with DataPool(pool_url) as pool:
        app = create_app(GatewayConfig(api_keys=(KEY,)), upstream, pool, tokenizer)
        with ThreadedServer(app) as server:
            barrier = threading.Barrier(CLIENTS + 2 * ONE_OFF + KEYLESS)
            with ThreadPoolExecutor(CLIENTS + 2 * ONE_OFF + KEYLESS) as workers:
                talks = [workers.submit(conversation, server.url, i, barrier) for i in range(CLIENTS)]
                singles = [workers.submit(one_off, server.url, i, barrier) for i in range(2 * ONE_OFF)]
                plain = [workers.submit(keyless, server.url, i, barrier) for i in range(KEYLESS)]
                conversations = [f.result() for f in talks]
                answers = [f.result() for f in singles]
                unkeyed = [f.result() for f in plain]

        counts = pool.counts()
        assert counts == {"trajectories": CLIENTS + ONE_OFF + KEYLESS,
                          "steps": CLIENTS * TURNS + ONE_OFF + KEYLESS}, counts
        for tid, got in conversations:
            traj = pool.get_trajectory(tid)
            assert [s.step_index for s in traj.steps] == list(range(TURNS))
            assert [s.response_ids for s in traj.steps] == got
            assert traj.num_steps == TURNS and traj.response_tokens == sum(map(len, got))
        for first, second in zip(answers[::2], answers[1::2]):  # the two sends of one key: one answer, one step
            assert first == second
            [step] = pool.get_trajectory(first["trajectory_id"]).steps
            assert step.response_ids == first["choices"][0]["token_ids"]
        assert len({a["trajectory_id"] for a in unkeyed}) == KEYLESS
        for answer in unkeyed:
            traj = pool.get_trajectory(answer["trajectory_id"])
            assert traj.status == "open" and [s.response_ids for s in traj.steps] == [
                answer["choices"][0]["token_ids"]]
        # every generation that was recorded is one the engine produced; duplicates of a key may sample and lose
        sampled = {tuple(r.token_ids) for r in upstream.results}
        assert all(tuple(ids) in sampled for _, got in conversations for ids in got)


def test_any_generated_text_is_recorded(pool_url, engine_and_tokenizer):
    """An untrained policy samples any byte, NUL included (PostgreSQL text columns cannot hold NUL as is)."""
    _, tokenizer = engine_and_tokenizer
    with DataPool(pool_url) as pool:
        client = TestClient(create_app(GatewayConfig(api_keys=(KEY,)), ScriptedUpstream(tokenizer, "a\x00b"), pool,
                                       tokenizer))
        response = client.post("/t/nul/v1/chat/completions", headers=AUTH,
                               json={"messages": [{"role": "user", "content": "x\x00y"}], "return_token_ids": True})
        assert response.status_code == 200, response.text
        step = pool.get_trajectory("nul").steps[0]
        assert step.response_ids == response.json()["choices"][0]["token_ids"]
