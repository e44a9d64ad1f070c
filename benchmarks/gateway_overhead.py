"""Gateway overhead: latency the gateway adds over calling the same upstream directly, and recorded requests/s.

    .venv/bin/python benchmarks/gateway_overhead.py [--requests 2000] [--seconds 10] [--concurrency 16]

The upstream is trivial (fixed ids, instantly), so everything measured is the gateway's own cost: HTTP on loopback,
auth, JSON + pydantic, chat template rendering + tokenization, the worker-thread hop, building the response and the
durable commit of the step (SQLite in WAL mode with the default synchronous=FULL, a file under a temp folder)
before the response is sent.

- direct: ``upstream.generate(prompt_ids)`` in this process (what a caller pays without the gateway).
- gateway: the same request as ``POST /v1/chat/completions`` (and ``/v1/completions`` with token ids) from one
  keep-alive connection, one at a time, to a gateway in its own process (uvicorn, one worker). Added latency =
  gateway round trip - direct call; p50 and p99 over ``--requests`` requests after a warm-up.
- throughput: ``--concurrency`` keep-alive connections (an asyncio client in this process) send chat requests for
  ``--seconds``; recorded req/s = 200s received / wall time (the pool's step count is checked equal to every 200
  of the run). Without a key the one-step trajectories go through the group commit (``gateway/committer.py``);
  ``throughput_keyed`` repeats it with an Idempotency-Key per request (``append_step``, one request per commit).
- store: ``open_trajectory`` + ``append_step`` in a loop in this process, no HTTP (the keyed path's commit cost).

Goals (issue 5): p50 added <= 2 ms, >= 500 recorded req/s on 2 cores. Writes
benchmarks/results/gateway_overhead.json.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datapool.gateway.app import create_app  # noqa: E402
from datapool.gateway.config import GatewayConfig  # noqa: E402
from datapool.gateway.upstreams import UpstreamResult  # noqa: E402
from datapool.records import StepRecord  # noqa: E402
from datapool.store import DataPool  # noqa: E402
from models.build import train_tokenizer  # noqa: E402
from models.engine import SamplingParams  # noqa: E402

RESULTS_PATH = ROOT / "benchmarks" / "results" / "gateway_overhead.json"
KEY = "bench-key"
MESSAGES = [{"role": "system", "content": "You are in a text game."},
            {"role": "user", "content": "You are in the kitchen. Exits: north, east. What do you do?"}]
TEXTS = [f"You are in the kitchen (room {i}). Exits: north, east.\n> take key {i}\nYou take the key.\n"
         for i in range(200)]


class TrivialUpstream:
    """Fixed ids, instantly: the gateway's own cost is all that is left to measure."""

    name = "trivial"

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.logprobs = [-0.5] * len(token_ids)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[UpstreamResult]:
        return [UpstreamResult(prompt_ids, self.token_ids, self.logprobs, "stop", upstream=self.name)
                for _ in range(n)]

    def health(self) -> bool:
        return True


def tokenizer_and_upstream():
    tokenizer = train_tokenizer(TEXTS, vocab_size=320)
    ids = tokenizer(" go north", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return tokenizer, TrivialUpstream(ids)


def serve(port: int, pool_url: str) -> None:
    """The gateway process (``--serve``)."""
    import uvicorn  # noqa: PLC0415 - only the server process needs it

    tokenizer, upstream = tokenizer_and_upstream()
    pool = DataPool(pool_url)
    app = create_app(GatewayConfig(api_keys=(KEY,), policy_version="bench"), upstream, pool, tokenizer)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 4), "p99_ms": round(float(np.percentile(ms, 99)), 4),
            "mean_ms": round(float(ms.mean()), 4)}


def sequential(port: int, path: str, body: dict, count: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    times = []
    for _ in range(count):
        start = time.perf_counter()
        conn.request("POST", path, payload, headers)
        response = conn.getresponse()
        data = response.read()
        times.append(time.perf_counter() - start)
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {data[:300]!r}")
    conn.close()
    return times


async def _worker(port: int, payload: bytes, stop_at: float, counts: dict, keyed: str | None) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n").encode()
    sent = 0
    while time.perf_counter() < stop_at:
        key = f"Idempotency-Key: {keyed}-{sent}\r\n".encode() if keyed else b""
        writer.write(head + key + b"\r\n" + payload)
        sent += 1
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        counts["ok" if b" 200 " in status_line else "failed"] += 1
    writer.close()


async def _load(port: int, body: dict, seconds: float, concurrency: int,
                keyed: bool = False) -> tuple[dict, float]:
    """``concurrency`` connections sending ``body`` for ``seconds``; with ``keyed``, each request carries its own
    Idempotency-Key (the append_step path: its own transactions, no group commit)."""
    counts = {"ok": 0, "failed": 0}
    start = time.perf_counter()
    await asyncio.gather(*(_worker(port, json.dumps(body).encode(), start + seconds, counts,
                                   f"k{i}" if keyed else None) for i in range(concurrency)))
    return counts, time.perf_counter() - start


def store_only(pool_url: str, count: int) -> list[float]:
    """open_trajectory + append_step per request, in process: the durable-commit part of a gateway request."""
    times = []
    with DataPool(pool_url) as pool:
        for i in range(count):
            step = StepRecord(trajectory_id=f"s{i}", group_id=f"s{i}", step_index=0, prompt_ids=list(range(40)),
                              response_ids=[5, 6, 7, 0], logprobs=[-0.5] * 4, prompt_text="p" * 120,
                              observation="o" * 60, action=" go north", response_text=" go north", reward=0.0,
                              anchor="a", policy_version="bench")
            start = time.perf_counter()
            pool.open_trajectory(f"s{i}", group_id=f"s{i}", policy_version="bench")
            pool.append_step(step, idempotency_key=None)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pool-url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.pool_url)
        return

    tokenizer, upstream = tokenizer_and_upstream()
    prompt_ids = tokenizer("You are in the kitchen", add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(max_new_tokens=8)
    direct = []
    for _ in range(args.requests):
        start = time.perf_counter()
        upstream.generate(prompt_ids, sampling)
        direct.append(time.perf_counter() - start)

    workdir = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    pool_url = f"sqlite:///{workdir / 'pool.db'}"
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), "--pool-url", pool_url],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the gateway process did not start")
                time.sleep(0.1)
        chat_body = {"model": "m", "messages": MESSAGES, "max_tokens": 8}
        completion_body = {"model": "m", "prompt": prompt_ids, "max_tokens": 8, "return_token_ids": True}
        sequential(port, "/v1/chat/completions", chat_body, args.warmup)
        chat = sequential(port, "/v1/chat/completions", chat_body, args.requests)
        completions = sequential(port, "/v1/completions", completion_body, args.requests)
        counts, wall = asyncio.run(_load(port, chat_body, args.seconds, args.concurrency))
        keyed_counts, keyed_wall = asyncio.run(_load(port, chat_body, args.seconds, args.concurrency, keyed=True))
    finally:
        server.terminate()
        server.wait(timeout=30)

    with DataPool(pool_url) as pool:
        steps = pool.counts()["steps"]
    sent_ok = args.warmup + 2 * args.requests + counts["ok"] + keyed_counts["ok"]
    if steps != sent_ok:
        raise RuntimeError(f"the pool holds {steps} steps for {sent_ok} answered requests")
    store = store_only(f"sqlite:///{workdir / 'store.db'}", min(args.requests, 1000))

    direct_p = percentiles(direct)
    chat_p, completion_p = percentiles(chat), percentiles(completions)
    result = {
        "platform": {"python": platform.python_version(), "machine": platform.machine(),
                     "cpus": os.cpu_count()},
        "setup": {"requests": args.requests, "seconds": args.seconds, "concurrency": args.concurrency,
                  "pool": "sqlite WAL, synchronous=FULL (default), file in a temp folder",
                  "server": "uvicorn, 1 worker process", "client": "same machine (shares the cores)"},
        "direct_call": direct_p,
        "chat": {**chat_p, "added_p50_ms": round(chat_p["p50_ms"] - direct_p["p50_ms"], 4),
                 "added_p99_ms": round(chat_p["p99_ms"] - direct_p["p99_ms"], 4)},
        "completions_token_ids": {**completion_p,
                                  "added_p50_ms": round(completion_p["p50_ms"] - direct_p["p50_ms"], 4),
                                  "added_p99_ms": round(completion_p["p99_ms"] - direct_p["p99_ms"], 4)},
        "throughput": {"recorded_requests_per_s": round(counts["ok"] / wall, 1), "answered": counts["ok"],
                       "failed": counts["failed"], "wall_s": round(wall, 3),
                       "path": "no trajectory id, no key: one-step trajectories, group commit"},
        "throughput_keyed": {"recorded_requests_per_s": round(keyed_counts["ok"] / keyed_wall, 1),
                             "answered": keyed_counts["ok"], "failed": keyed_counts["failed"],
                             "wall_s": round(keyed_wall, 3),
                             "path": "Idempotency-Key on every request: open_trajectory + append_step (with the "
                                     "stored response), committed one request at a time"},
        "store_commit_only": percentiles(store),
        "goals": {"p50_added_ms_max": 2.0, "recorded_requests_per_s_min": 500},
    }
    result["goals"]["p50_met"] = result["chat"]["added_p50_ms"] <= 2.0
    result["goals"]["throughput_met"] = result["throughput"]["recorded_requests_per_s"] >= 500
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
