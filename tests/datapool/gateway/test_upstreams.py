"""OpenAIUpstreamPool against real server processes: exact ids, balancing, retries, SIGKILL mid-load, health checks.

Upstreams that sample are real arlflow gateway processes (`python -m flows.gateway_cli serve`: the local engine and a
SQLite pool) serving the tiny policy; the failure modes (text-only, 5xx, slow, old-vLLM "token_id:"
logprob tokens) come from one light fake-server process (`FAKE_SERVER`) with one route prefix per mode.
"""
from __future__ import annotations

import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import (
    OpenAIUpstreamPool,
    UpstreamRejectedError,
    UpstreamResponseError,
    UpstreamUnavailableError,
    completion_request_body,
    parse_completion_response,
)
from datapool.store import DataPool
from models.build import load_policy
from models.engine import SamplingParams
from models.hf_engine import TransformersEngine

REPO_ROOT = Path(__file__).resolve().parents[3]
API_KEY = "sk-upstream-test"

FAKE_SERVER = r'''
"""Fake OpenAI servers, one per route prefix: text-only, 5xx, slow, old-vLLM "token_id:" logprob tokens."""
import sys, time
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

app = FastAPI()

@app.get("/{mode}/health")
def health(mode: str):
    return {"status": "ok"}

@app.post("/{mode}/v1/completions")
def completions(mode: str, body: dict):
    n = body.get("n", 1)
    if mode == "error500":
        return JSONResponse({"error": {"message": "engine died", "type": "server_error", "param": None,
                                       "code": 500}}, 500)
    if mode == "text":          # what a server that cannot return ids answers
        choices = [{"index": i, "text": "You take the key.", "finish_reason": "stop", "logprobs": None}
                   for i in range(n)]
    elif mode == "logprob_tokens":   # vLLM without return_token_ids, with return_tokens_as_token_ids
        choices = [{"index": i, "text": "xyz", "finish_reason": "length",
                    "logprobs": {"tokens": ["token_id:5", "token_id:17", "token_id:2"],
                                 "token_logprobs": [-0.5, -1.25, -2.0], "top_logprobs": None}}
                   for i in range(n)]
    else:                        # slow: a correct answer after a delay
        time.sleep(float(mode.removeprefix("slow")))
        choices = [{"index": i, "text": "ab", "finish_reason": "length", "token_ids": [7, 8],
                    "prompt_token_ids": body["prompt"], "logprobs": {"token_logprobs": [-1.0, -2.0]}}
                   for i in range(n)]
    return {"id": "cmpl-fake", "object": "text_completion", "model": "fake", "choices": choices}

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One server subprocess (its args have "PORT" where the port goes) that can be SIGKILLed and restarted on the
    same port."""

    def __init__(self, args: list[str], port: int, ready_path: str = "/health") -> None:
        self.args, self.port, self.ready_path = args, port, ready_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        command = [sys.executable, *(str(self.port) if a == "PORT" else a for a in self.args)]
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        return self

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.args} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server on port {self.port} not ready after {timeout_s}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    model, tokenizer = load_policy(tiny_policy_dir)
    return TransformersEngine(model, tokenizer, policy_version="v0"), tokenizer


@pytest.fixture(scope="module")
def fake_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("servers") / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def gateway_command(policy_dir: Path, pool_path: Path, *extra: str) -> list[str]:
    """`arlflow gateway serve` (flows.gateway_cli) on PORT, serving the policy in-process unless --upstream."""
    return ["-m", "flows.gateway_cli", "serve", "--policy", str(policy_dir), "--port", "PORT", "--pool-url",
            f"sqlite:///{pool_path}", "--api-key", API_KEY, *extra]


@pytest.fixture(scope="module")
def engine_servers(tiny_policy_dir, tmp_path_factory):
    """Three arlflow gateway processes serving the tiny policy; a test that kills one restarts it (`restarted`)."""
    folder = tmp_path_factory.mktemp("pools")
    commands = [gateway_command(tiny_policy_dir, folder / f"pool{i}.db") for i in range(3)]
    servers = [ServerProcess(command, free_port()).start() for command in commands]
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture()
def restarted(engine_servers):
    """Yields the servers and restarts any a test killed, so later tests see three live upstreams."""
    yield engine_servers
    for server in engine_servers:
        if not server.alive():
            server.start().wait_ready()


@pytest.fixture(scope="module")
def fake_server(fake_script):
    server = ServerProcess([str(fake_script), "PORT"], free_port(), ready_path="/text/health").start()
    try:
        server.wait_ready()
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.kill()


def make_pool(urls, tokenizer, **kwargs) -> OpenAIUpstreamPool:
    kwargs.setdefault("health_interval_s", 0)
    kwargs.setdefault("api_key", API_KEY)
    return OpenAIUpstreamPool(list(urls), tokenizer=tokenizer, **kwargs)


def prompts_of(tokenizer) -> list[list[int]]:
    texts = ["You are in the kitchen.\n> ", "Exits: north", "> take key 14\nYou take", "Inventory: 3 coins"]
    return [tokenizer.encode(t) for t in texts]


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
# ------------------------------------------------------------------------------------------------ pure functions


def test_request_body_asks_for_ids_and_logprobs():
    body = completion_request_body([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, seed=4), 2)
    assert body == {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "n": 2, "logprobs": 1,
                    "return_token_ids": True, "return_tokens_as_token_ids": True, "seed": 4}
    assert "seed" not in completion_request_body([1], SamplingParams(seed=None))


def test_parse_rejects_other_prompt_ids_and_wrong_choice_count(policy):
    _, tokenizer = policy
    choice = {"index": 0, "text": "a", "token_ids": [4], "prompt_token_ids": [1, 2], "finish_reason": "length"}
    with pytest.raises(UpstreamResponseError, match="other prompt ids"):
        parse_completion_response({"choices": [choice]}, [1, 2, 3], 1, tokenizer=tokenizer, upstream="u")
    with pytest.raises(UpstreamResponseError, match="answered 1 choices, expected 2"):
        parse_completion_response({"choices": [choice]}, [1, 2], 2, tokenizer=tokenizer, upstream="u")
    # chat-style top-level prompt_token_ids are checked too
    top = {"choices": [{**choice, "prompt_token_ids": None}], "prompt_token_ids": [9]}
    with pytest.raises(UpstreamResponseError, match="other prompt ids"):
        parse_completion_response(top, [1, 2], 1, tokenizer=tokenizer, upstream="u")


# ---------------------------------------------------------------------------------------------- real processes


def test_ids_and_logprobs_equal_what_the_engine_samples(policy, engine_servers):
    engine, tokenizer = policy
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=11)
    with make_pool([s.base_url for s in engine_servers], tokenizer) as pool:
        for prompt in prompts_of(tokenizer):
            for sampling, n in ((GREEDY, 1), (sampled, 3)):
                results = pool.generate(prompt, sampling, n=n)
                expected = engine.generate([prompt] * n, sampling)
                assert [r.token_ids for r in results] == [g.token_ids for g in expected]
                assert [r.finish_reason for r in results] == [g.finish_reason for g in expected]
                for result, gen in zip(results, expected):
                    assert result.prompt_ids == prompt and not result.retokenized
                    assert result.logprobs == pytest.approx(gen.logprobs, abs=1e-5)


def test_round_robin_cycles_through_upstreams(policy, engine_servers):
    _, tokenizer = policy
    urls = [s.base_url for s in engine_servers]
    with make_pool(urls, tokenizer, strategy="round_robin") as pool:
        served = [pool.generate(prompts_of(tokenizer)[0], GREEDY)[0].upstream for _ in range(9)]
        assert served == urls * 3
        assert [s.requests for s in pool.states()] == [3, 3, 3]


def test_least_loaded_avoids_the_busy_upstream(policy, fake_server, engine_servers):
    """While a 3 s request is in flight on the slow upstream, least-loaded sends everything else to the idle one;
    round-robin would alternate between them."""
    _, tokenizer = policy
    slow, fast = f"{fake_server}/slow3/v1", engine_servers[0].base_url
    prompt = prompts_of(tokenizer)[1]
    with make_pool([slow, fast], tokenizer, strategy="least_loaded") as pool:
        with ThreadPoolExecutor(1) as executor:
            slow_call = executor.submit(pool.generate, prompt, GREEDY)
            while pool.states()[0].in_flight == 0:
                time.sleep(0.01)
            served = [pool.generate(prompt, GREEDY)[0].upstream for _ in range(6)]
            assert not slow_call.done(), "the slow request finished early: the test did not measure anything"
            assert served == [fast] * 6
            assert slow_call.result()[0].upstream == slow
    with make_pool([slow, fast], tokenizer, strategy="round_robin") as pool:
        assert [pool.generate(prompt, GREEDY)[0].upstream for _ in range(2)] == [slow, fast]


def test_5xx_is_retried_on_another_upstream_and_marks_it_down(policy, fake_server, engine_servers):
    _, tokenizer = policy
    broken, good = f"{fake_server}/error500/v1", engine_servers[1].base_url
    with make_pool([broken, good], tokenizer) as pool:
        results = [pool.generate(p, GREEDY)[0] for p in prompts_of(tokenizer)]
        assert all(r.upstream == good and not r.retokenized for r in results)
        states = pool.states()
        assert (states[0].healthy, states[0].requests, states[0].failures) == (False, 1, 1)
        assert (states[1].healthy, states[1].requests, states[1].failures) == (True, 4, 0)
        # the health check (here on demand) sees /health answer 200 and marks it back up
        assert pool.check_health() == {broken: True, good: True}


def test_refused_connection_is_retried_and_all_down_raises(policy, engine_servers):
    _, tokenizer = policy
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    with make_pool([nobody, engine_servers[2].base_url], tokenizer) as pool:
        result = pool.generate(prompts_of(tokenizer)[2], GREEDY)[0]
        assert result.upstream == engine_servers[2].base_url
        assert [s.healthy for s in pool.states()] == [False, True] and pool.health()
    with make_pool([nobody, f"http://127.0.0.1:{free_port()}/v1"], tokenizer, max_retries=5) as pool:
        with pytest.raises(UpstreamUnavailableError, match="no upstream answered after 2 attempt"):
            pool.generate([1, 2], GREEDY)
        assert not pool.health()


def test_client_errors_are_not_retried(policy, engine_servers):
    _, tokenizer = policy
    urls = [s.base_url for s in engine_servers]
    with make_pool(urls, tokenizer, api_key="wrong") as pool:
        with pytest.raises(UpstreamResponseError, match="HTTP 401") as refused:
            pool.generate([1, 2], GREEDY)
        assert not isinstance(refused.value, ValueError)          # the pool's misconfiguration, not the caller's
        assert sum(s.requests for s in pool.states()) == 1
    with make_pool(urls, tokenizer) as pool:        # prompt + max_new_tokens > max_position_embeddings -> 400
        with pytest.raises(UpstreamRejectedError, match="HTTP 400") as rejected:
            pool.generate([1, 2], SamplingParams(max_new_tokens=1000))
        assert isinstance(rejected.value, ValueError)             # what the gateway maps to 400
        assert all(s.healthy for s in pool.states()) and sum(s.requests for s in pool.states()) == 1


def test_sigkill_mid_load_every_request_answered(policy, restarted):
    """One of three upstream processes is SIGKILLed while 8 client threads keep 120 requests going: every request
    is answered (in-flight ones on the dead process are retried elsewhere) with well-formed ids."""
    engine, tokenizer = policy
    servers = restarted
    victim = servers[1]
    prompts = prompts_of(tokenizer)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=None)
    done = []
    done_lock = threading.Lock()

    with make_pool([s.base_url for s in servers], tokenizer, strategy="least_loaded", health_interval_s=0.5,
                   timeout_s=20) as pool:
        def call(i: int):
            result = pool.generate(prompts[i % len(prompts)], sampling)[0]
            with done_lock:
                done.append(result)
            return result

        with ThreadPoolExecutor(8) as executor:
            futures = [executor.submit(call, i) for i in range(120)]
            deadline = time.monotonic() + 120
            while (len(done) < 30 or pool.states()[1].in_flight == 0) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert pool.states()[1].in_flight >= 1, "no request was in flight on the victim: nothing was tested"
            victim.kill()
            results = [f.result(timeout=120) for f in futures]      # raises if any request was lost

        states = pool.states()
    assert len(results) == 120
    for i, result in enumerate(results):
        assert result.prompt_ids == prompts[i % len(prompts)] and not result.retokenized
        assert 1 <= len(result.token_ids) <= 24 and len(result.logprobs) == len(result.token_ids)
        assert all(math.isfinite(v) and v <= 0 for v in result.logprobs)
    served_late = [r.upstream for r in results[60:]]          # submitted after >= 52 were done: after the kill
    assert victim.base_url in [r.upstream for r in done[:30]]
    assert states[1].failures >= 1 and not states[1].healthy    # its in-flight request(s) failed and were retried
    assert victim.base_url not in served_late
    assert {servers[0].base_url, servers[2].base_url} <= set(served_late)


def test_health_check_marks_down_and_back_up(policy, restarted):
    _, tokenizer = policy
    server = restarted[2]

    def wait_for(predicate, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "the health check did not update the mark in time"
            time.sleep(0.05)

    with make_pool([s.base_url for s in restarted], tokenizer, health_interval_s=0.2) as pool:
        assert all(s.healthy for s in pool.states())
        server.kill()
        wait_for(lambda: not pool.states()[2].healthy)               # no request needed: the probe saw it
        assert pool.states()[2].requests == 0
        served = {pool.generate([1, 2, 3], GREEDY)[0].upstream for _ in range(6)}
        assert server.base_url not in served
        server.start().wait_ready()
        wait_for(lambda: pool.states()[2].healthy)
        served = [pool.generate([1, 2, 3], GREEDY)[0].upstream for _ in range(6)]
        assert server.base_url in served


def test_text_only_upstream_is_retokenized_and_flagged(policy, fake_server):
    _, tokenizer = policy
    with make_pool([f"{fake_server}/text/v1"], tokenizer) as pool:
        results = pool.generate([1, 2, 3], GREEDY, n=2)
    for result in results:
        assert result.retokenized
        assert result.token_ids == tokenizer.encode("You take the key.", add_special_tokens=False) + [
            tokenizer.eos_token_id]                                   # finish "stop" without stop_reason: eos
        assert len(result.logprobs) == len(result.token_ids) and all(math.isnan(v) for v in result.logprobs)


def test_old_vllm_logprob_token_ids_are_exact(policy, fake_server):
    _, tokenizer = policy
    with make_pool([f"{fake_server}/logprob_tokens/v1"], tokenizer) as pool:
        result = pool.generate([1, 2, 3], GREEDY)[0]
    assert (result.token_ids, result.logprobs, result.retokenized) == ([5, 17, 2], [-0.5, -1.25, -2.0], False)


def test_constructor_rejects_bad_arguments(policy):
    _, tokenizer = policy
    with pytest.raises(ValueError, match="base_urls is empty"):
        OpenAIUpstreamPool([], tokenizer=tokenizer)
    with pytest.raises(ValueError, match="strategy must be one of"):
        OpenAIUpstreamPool(["http://x/v1"], tokenizer=tokenizer, strategy="random")
    with pytest.raises(ValueError, match="duplicates"):
        OpenAIUpstreamPool(["http://x/v1", "http://x/v1/"], tokenizer=tokenizer)


def test_gateway_over_a_pool_records_exact_or_flagged_ids(policy, engine_servers, fake_server, tmp_path):
    """The production shape: an arlflow gateway whose upstream is a pool of servers. Ids from an upstream that
    returns them are recorded as sampled; a text-only upstream's step is recorded with retokenized=True."""
    engine, tokenizer = policy
    prompt = prompts_of(tokenizer)[0]
    cases = [([s.base_url for s in engine_servers], False), ([f"{fake_server}/text/v1"], True)]
    for i, (urls, retokenized) in enumerate(cases):
        with make_pool(urls, tokenizer) as upstream, DataPool(f"sqlite:///{tmp_path / f'pool{i}.db'}") as pool:
            app = create_app(GatewayConfig(allow_no_auth=True, policy_version="v0"), upstream, pool,
                                        tokenizer)
            with TestClient(app) as client:
                response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                                "temperature": 0.0, "return_token_ids": True})
            assert response.status_code == 200, response.text
            step = pool.get_trajectory(response.json()["trajectory_id"]).steps[0]
            assert step.prompt_ids == prompt and step.retokenized is retokenized
            if not retokenized:
                assert step.response_ids == engine.generate([prompt], GREEDY)[0].token_ids
                assert response.json()["choices"][0]["token_ids"] == step.response_ids


def test_gateway_cli_with_upstreams_serves_their_exact_ids(policy, engine_servers, tiny_policy_dir, tmp_path):
    """`arlflow gateway serve --upstream A --upstream B --strategy least_loaded` in front of two gateways: what the
    front gateway answers and records are the ids the back ends sampled."""
    engine, tokenizer = policy
    urls = [s.base_url for s in engine_servers[:2]]
    front = ServerProcess(gateway_command(tiny_policy_dir, tmp_path / "front.db", "--upstream", urls[0], "--upstream",
                                          urls[1], "--upstream-api-key", API_KEY, "--strategy", "least_loaded"),
                          free_port()).start()
    try:
        front.wait_ready()
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for prompt in prompts_of(tokenizer)[:2]:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
            response = httpx.post(f"{front.base_url}/completions", json=body, headers=headers, timeout=30)
            assert response.status_code == 200, response.text
            expected = engine.generate([prompt], GREEDY)[0].token_ids
            assert response.json()["choices"][0]["token_ids"] == expected
            record = httpx.get(f"{front.base_url}/trajectories/{response.json()['trajectory_id']}", headers=headers,
                               timeout=30).json()
            assert record["steps"][0]["response_ids"] == expected and record["steps"][0]["retokenized"] is False
    finally:
        front.kill()


def _read_request(conn: socket.socket) -> None:
    """Read one whole HTTP request (headers, then content-length bytes of body) off `conn`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        rest += chunk


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("drops", [1, 2])
def test_a_connection_dropped_before_any_byte_is_retried_once(policy, drops, how):
    """A server that drops the connection without answering a byte gets one retry on the same, single upstream:
    one drop is answered, two are an error. `close` is vLLM closing an idle keep-alive connection as the request
    arrives (FIN: "Server disconnected without sending a response"); `reset` is the same close with the request
    still unread in the server's buffer, which the kernel turns into a RST ("Connection reset by peer"): CI saw
    this once from a server that read the headers but not yet the body."""
    hits = {"n": 0}
    body = (b'{"choices":[{"index":0,"token_ids":[5],"prompt_token_ids":[1],"finish_reason":"length",'
            b'"logprobs":{"token_logprobs":[-0.5]}}]}')
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                _read_request(conn)
                hits["n"] += 1
                if hits["n"] <= drops:
                    if how == "reset":                      # linger 0: close() sends RST, not FIN
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue                                # drop the request without a byte
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    _, tokenizer = policy
    pool = OpenAIUpstreamPool([f"http://127.0.0.1:{port}/v1"], tokenizer=tokenizer, health_interval_s=0)
    try:
        if drops == 1:
            assert pool.generate([1], SamplingParams(max_new_tokens=1))[0].token_ids == [5]
        else:
            expected = "without sending a response" if how == "close" else "reset by peer"
            with pytest.raises(UpstreamUnavailableError, match=expected):
                pool.generate([1], SamplingParams(max_new_tokens=1))
    finally:
        pool.close()
        listener.close()
    assert hits["n"] == 2
