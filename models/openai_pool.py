"""Token-in-token-out client of OpenAI-compatible servers: the one path every served generation takes.

`OpenAIUpstreamPool` sends each request to one of several OpenAI-compatible servers (vLLM, managed by arlflow or run
by the user, or other arlflow gateways) and returns the exact ids they sampled with their log-probs. The gateway uses
it as its upstream (datapool/gateway/upstreams.py) and the stages use it as an engine (models/served_engine.py), so
both record the same data as the local engine would.

The request (`completion_request_body`) is `POST {base_url}/completions` with `prompt` = the prompt token ids (a
token prompt skips server-side tokenization; `add_special_tokens` only applies to text prompts), `max_tokens`,
`temperature`, `top_p`, `seed`, `n`, `logprobs: 1`, plus two vLLM extras, taken from vLLM's
`vllm/entrypoints/openai/protocol.py` (`CompletionRequest`, `CompletionResponseChoice`):
- `return_token_ids: true`: "the result will include token IDs alongside the generated text". Each choice then has
  `token_ids` (the sampled ids) and `prompt_token_ids` (vLLM puts them in the choice for /v1/completions; the chat
  response has them at the top level, so both places are read).
- `return_tokens_as_token_ids: true`: "if specified with 'logprobs', tokens are represented as strings of the form
  'token_id:{token_id}'", i.e. `choices[i].logprobs.tokens` carry the ids on vLLM versions without
  `return_token_ids` (an unknown field is ignored by vLLM's `OpenAIBaseModel(extra="allow")`, with a warning).
Log-probs are `choices[i].logprobs.token_logprobs` (OpenAI completions shape; NaN where an upstream omits them).
vLLM V1's sampler defaults to `logprobs_mode="raw_logprobs"` (`vllm/v1/sample/sampler.py`): log-probs of the raw
model logits, before temperature and top-p, which is the local engine's convention (temperature 1); a server started
with a `processed_*` logprobs mode returns other numbers, which this client cannot detect.
If an upstream returns neither ids form (a text-only server), the text is re-tokenized with the gateway's tokenizer,
the result is flagged `retokenized=True` (the pool's validation rejects such steps by default) and its log-probs are
NaN. This parsing was written from vLLM's protocol source, is tested against arlflow gateways and fake servers in
tests/datapool/gateway/test_upstreams.py, and live against vLLM's CPU build (0.32) in tests/models/test_vllm_live.py.

Connections: vLLM closes idle HTTP connections after 5 s (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`); a client that keeps them
as long races the server and sees "Server disconnected without sending a response" on a reused one. The pool keeps
idle connections `keepalive_s` (2 s) and retries a request once, on the same upstream, when its connection dropped
before the answer came back (also with a single upstream: nothing was answered, so nothing is lost). A drop is either
a close (FIN: "Server disconnected without sending a response") or, when the server closed with the request still
unread in its buffer, a reset (RST: "Connection reset by peer").
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from models.engine import SamplingParams

TOKEN_ID_PREFIX = "token_id:"          # vLLM's `return_tokens_as_token_ids` token strings
STRATEGIES = ("round_robin", "least_loaded")


@dataclass(frozen=True)
class UpstreamResult:
    """One sampled completion with the exact ids: what the gateway records."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    retokenized: bool = False
    upstream: str = "local"


class Upstream(Protocol):
    name: str

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[UpstreamResult]: ...

    def health(self) -> bool: ...


class UpstreamError(RuntimeError):
    """Base class of the pool's errors."""


class UpstreamUnavailableError(UpstreamError):
    """Every upstream tried failed (connection refused/reset, timeout, 5xx): the gateway answers 502/503."""


class UpstreamResponseError(UpstreamError):
    """An upstream refused the request (401, 403, other 4xx but 429) or answered ids that contradict the request."""


class UpstreamRejectedError(UpstreamResponseError, ValueError):
    """The upstream found the request itself invalid (400, 413, 422: e.g. prompt + max_tokens over the model's
    context): the caller's error, so a ValueError like the local engine's refusals (the gateway answers 400)."""


_CALLER_ERRORS = (400, 413, 422)


# --------------------------------------------------------------------------------------------- request / response


def completion_request_body(prompt_ids: list[int], sampling: SamplingParams, n: int = 1,
                            model: str | None = None) -> dict[str, Any]:
    """The JSON body of `POST /completions` for a token prompt, asking for the sampled ids and log-probs."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "n": n,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if model is not None:
        body["model"] = model
    return body


def _ids_from_logprob_tokens(logprobs: Any) -> list[int] | None:
    """Ids from `logprobs.tokens` when every token is a "token_id:<id>" string (return_tokens_as_token_ids)."""
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list) or not tokens:
        return None
    if not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        return None
    try:
        return [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
    except ValueError:
        return None


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_completion_choice(choice: dict[str, Any], prompt_ids: list[int], *, tokenizer, upstream: str,
                            top_prompt_ids: Any = None) -> UpstreamResult:
    """One `choices[i]` of a completions response -> UpstreamResult (ids from `token_ids`, else from
    "token_id:<id>" logprob tokens, else re-tokenized text with `retokenized=True`)."""
    if not isinstance(choice, dict):
        raise UpstreamResponseError(f"upstream {upstream}: a choice is not an object: {choice!r:.200}")
    echoed = choice.get("prompt_token_ids")
    echoed = top_prompt_ids if echoed is None else echoed
    if echoed is not None and (not _is_id_list(echoed) or list(echoed) != list(prompt_ids)):
        raise UpstreamResponseError(
            f"upstream {upstream} sampled from other prompt ids than sent ({echoed!r:.80} vs {len(prompt_ids)} ids): "
            "it truncated or re-tokenized the prompt; check its max_model_len / truncate_prompt_tokens")
    finish_reason = choice.get("finish_reason") or "length"
    logprobs_obj = choice.get("logprobs")
    retokenized = False
    if _is_id_list(choice.get("token_ids")):
        token_ids = list(choice["token_ids"])
    elif (from_logprobs := _ids_from_logprob_tokens(logprobs_obj)) is not None:
        token_ids = from_logprobs
    else:
        text = choice.get("text")
        if not isinstance(text, str):
            raise UpstreamResponseError(f"upstream {upstream}: a choice has neither token ids nor text")
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
        # The text of a completion that stopped on eos (vLLM: finish "stop", stop_reason None) omits the eos token.
        if finish_reason == "stop" and choice.get("stop_reason") is None and tokenizer.eos_token_id is not None:
            token_ids.append(int(tokenizer.eos_token_id))
        retokenized = True
    logprobs = [math.nan] * len(token_ids)
    raw = logprobs_obj.get("token_logprobs") if isinstance(logprobs_obj, dict) else None
    if not retokenized and isinstance(raw, list) and len(raw) == len(token_ids):
        logprobs = [math.nan if v is None else float(v) for v in raw]
    return UpstreamResult(list(prompt_ids), token_ids, logprobs, finish_reason, retokenized=retokenized,
                          upstream=upstream)


LOGPROB_SLACK = 1e-4
"""A served log-prob may exceed 0 by float rounding; more than this is not a log-probability."""


def upstream_output_problem(result: UpstreamResult, *, vocab_size: int | None, max_tokens: int) -> str | None:
    """What is wrong with an upstream's sampled output, or None: ids outside ``[0, vocab_size)``, more ids than
    ``max_tokens``, not one log-prob per id, a log-prob that is not finite or is above 0 (retokenized output has
    no log-probs to check). Such output is never stored: the gateway answers 502, a stage fails."""
    ids = list(result.token_ids)
    limit = vocab_size if vocab_size is not None else 2 ** 31
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limit), None)
    if bad is not None:
        return f"token id {bad!r} is outside the policy's vocabulary [0, {limit})"
    if len(ids) > max_tokens:
        return f"{len(ids)} tokens for max_tokens {max_tokens}"
    if len(result.logprobs) != len(ids):
        return f"{len(result.logprobs)} log-probs for {len(ids)} token ids"
    if not result.retokenized:
        odd = next((v for v in result.logprobs if not math.isfinite(v) or v > LOGPROB_SLACK), None)
        if odd is not None:
            return f"log-prob {odd!r} is not a finite value <= 0"
    return None


def parse_completion_response(payload: Any, prompt_ids: list[int], n: int, *, tokenizer,
                              upstream: str) -> list[UpstreamResult]:
    """A whole completions response -> `n` results, in choice-index order."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise UpstreamResponseError(f"upstream {upstream} answered {got} choices, expected {n}")
    choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    return [parse_completion_choice(c, prompt_ids, tokenizer=tokenizer, upstream=upstream,
                                    top_prompt_ids=payload.get("prompt_token_ids")) for c in choices]


def parse_batch_response(payload: Any, prompts: list[list[int]], n: int, *, tokenizer,
                         upstream: str) -> list[list[UpstreamResult]]:
    """A response to a list of token prompts -> per prompt, its ``n`` results. Choice ``index`` is
    prompt * n + sample (the OpenAI completions convention for a list prompt)."""
    if len(prompts) == 1:
        return [parse_completion_response(payload, prompts[0], n, tokenizer=tokenizer, upstream=upstream)]
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or len(choices) != n * len(prompts):
        got = len(choices) if isinstance(choices, list) else "no"
        raise UpstreamResponseError(f"upstream {upstream} answered {got} choices, expected {n * len(prompts)} "
                                    f"({len(prompts)} prompts x n={n})")
    choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    return [[parse_completion_choice(c, prompt, tokenizer=tokenizer, upstream=upstream)
             for c in choices[i * n:(i + 1) * n]] for i, prompt in enumerate(prompts)]


# ------------------------------------------------------------------------------------------------------- the pool


@dataclass
class UpstreamState:
    """What the pool knows about one upstream (`OpenAIUpstreamPool.states()` returns copies)."""

    base_url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0          # attempts sent to it
    failures: int = 0          # of those, failed (connection, timeout, 5xx, 429, unparseable)


def _dropped_unanswered(exc: httpx.TransportError) -> bool:
    """Whether a POST failed because the server dropped the connection (closed or reset it) with no answer."""
    if isinstance(exc, httpx.RemoteProtocolError):
        return "without sending a response" in str(exc)
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionResetError):
            return True
        cause = cause.__cause__ or cause.__context__
    return "reset by peer" in str(exc)


class _RetryableFailure(Exception):
    """One attempt failed in a way another upstream may not: try the next one."""

    def __init__(self, message: str, *, mark_down: bool) -> None:
        super().__init__(message)
        self.mark_down = mark_down


class OpenAIUpstreamPool:
    """A pool of OpenAI-compatible servers with round-robin or least-loaded balancing, retries and health checks.

    `base_urls` are OpenAI base URLs (`http://host:8000/v1`). A request goes to one healthy upstream (round-robin, or
    the fewest requests in flight); on a connection error, timeout, 5xx or 429 it is retried on another upstream, at
    most `max_retries` times. Other 4xx are raised at once: 400/413/422 as `UpstreamRejectedError` (a ValueError,
    the caller's request is bad), the rest (401, 403, ...) as `UpstreamResponseError`. An
    upstream that failed a request is marked down; a background thread probes every upstream each
    `health_interval_s` (`GET <root>/health`, else `GET {base_url}/models`) and marks it back up (0 disables the
    thread: `check_health()` then probes on demand). When every untried upstream is down, the down ones are still
    tried as a last resort, since their state may be stale. Thread-safe: one shared httpx client.
    """

    def __init__(self, base_urls: list[str], *, tokenizer, api_key: str | None = None,
                 strategy: str = "round_robin", timeout_s: float = 30, health_interval_s: float = 5,
                 max_retries: int = 2, model: str | None = None, name: str = "openai-pool",
                 keepalive_s: float = 2.0) -> None:
        if not base_urls:
            raise ValueError("base_urls is empty: give at least one OpenAI base URL, e.g. http://host:8000/v1")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if timeout_s <= 0 or health_interval_s < 0 or max_retries < 0:
            raise ValueError(f"timeout_s must be > 0, health_interval_s >= 0 and max_retries >= 0, got "
                             f"{timeout_s}, {health_interval_s}, {max_retries}")
        urls = [u.rstrip("/") for u in base_urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"base_urls has duplicates: {urls}")
        self.name = name
        self.tokenizer = tokenizer
        self.strategy = strategy
        self.max_retries = max_retries
        self.model = model
        self.health_interval_s = health_interval_s
        self._states = [UpstreamState(u) for u in urls]
        self._lock = threading.Lock()
        self._cursor = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=keepalive_s))
        self._probe_timeout = httpx.Timeout(min(timeout_s, 2.0))
        self._stop = threading.Event()
        self._health_thread: threading.Thread | None = None
        if health_interval_s > 0:
            self._health_thread = threading.Thread(target=self._health_loop, name=f"{name}-health", daemon=True)
            self._health_thread.start()

    # --- Upstream protocol

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[UpstreamResult]:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a prompt needs at least one token")
        return self.generate_many([prompt_ids], sampling, n)[0]

    def generate_many(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1,
                      extra_body: dict[str, Any] | None = None) -> list[list[UpstreamResult]]:
        """``n`` completions of each prompt in ONE request (the completions API takes a list of token prompts;
        vLLM batches them in one scheduler pass, ~5-10x the throughput of one request per prompt on vLLM-CPU).
        vLLM seeds every prompt of a request alike: identical prompts then sample identically, so send a prompt
        once with ``n`` (its n samples get distinct streams) rather than twice. ``extra_body`` adds fields to the
        request (e.g. ``vllm_xargs``)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts or any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        body = completion_request_body(prompts[0], sampling, n, self.model)
        if len(prompts) > 1:
            body["prompt"] = [[int(t) for t in p] for p in prompts]
        body.update(extra_body or {})
        tried: set[int] = set()
        errors: list[str] = []
        for _ in range(self.max_retries + 1):
            index = self._acquire(tried)
            if index is None:
                break
            tried.add(index)
            state = self._states[index]
            try:
                payload = self._post(state.base_url, body)
                results = parse_batch_response(payload, prompts, n, tokenizer=self.tokenizer,
                                               upstream=state.base_url)
            except _RetryableFailure as failure:
                self._release(index, failed=True, mark_down=failure.mark_down)
                errors.append(f"{state.base_url}: {failure}")
                continue
            except BaseException:
                self._release(index, failed=True, mark_down=False)
                raise
            self._release(index, failed=False, mark_down=False)
            return results
        raise UpstreamUnavailableError(
            f"no upstream answered after {len(errors)} attempt(s) ({'; '.join(errors) or 'none reachable'}); "
            "check that the upstream servers are running and reachable")

    def health(self) -> bool:
        """True while at least one upstream is marked healthy."""
        with self._lock:
            return any(s.healthy for s in self._states)

    # --- inspection and lifecycle

    def states(self) -> list[UpstreamState]:
        with self._lock:
            return [UpstreamState(s.base_url, s.healthy, s.in_flight, s.requests, s.failures) for s in self._states]

    def check_health(self) -> dict[str, bool]:
        """Probes every upstream now and updates its mark; returns {base_url: healthy}."""
        marks = {state.base_url: self._probe(state.base_url) for state in self._states}
        with self._lock:
            for state in self._states:
                state.healthy = marks[state.base_url]
        return marks

    def close(self) -> None:
        self._stop.set()
        if self._health_thread is not None:
            self._health_thread.join(timeout=5)
        self._client.close()

    def __enter__(self) -> OpenAIUpstreamPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals

    def _acquire(self, tried: set[int]) -> int | None:
        """Picks an untried upstream (healthy first) by the strategy and counts it in flight."""
        with self._lock:
            count = len(self._states)
            order = [(self._cursor + k) % count for k in range(count)]       # rotation: ties go round-robin
            untried = [i for i in order if i not in tried]
            candidates = [i for i in untried if self._states[i].healthy] or untried
            if not candidates:
                return None
            if self.strategy == "least_loaded":
                index = min(candidates, key=lambda i: self._states[i].in_flight)
            else:
                index = candidates[0]
            self._cursor = (index + 1) % count
            state = self._states[index]
            state.in_flight += 1
            state.requests += 1
            return index

    def _release(self, index: int, *, failed: bool, mark_down: bool) -> None:
        with self._lock:
            state = self._states[index]
            state.in_flight -= 1
            if failed:
                state.failures += 1
            if mark_down:
                state.healthy = False
            elif not failed:
                state.healthy = True      # it just answered: whatever a stale probe said, it is up

    def served_models(self) -> dict[str, list[str]]:
        """{base_url: the model ids it serves (`GET {base_url}/models`)}; an unreachable upstream maps to []."""
        served: dict[str, list[str]] = {}
        for state in self._states:
            try:
                response = self._client.get(f"{state.base_url}/models", timeout=self._probe_timeout)
                data = response.json().get("data", []) if response.status_code < 300 else []
            except (httpx.TransportError, ValueError, AttributeError):
                data = []
            served[state.base_url] = [m.get("id") for m in data if isinstance(m, dict)]
        return served

    def _post(self, base_url: str, body: dict[str, Any]) -> Any:
        for attempt in range(2):
            try:
                response = self._client.post(f"{base_url}/completions", json=body)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if attempt == 0 and _dropped_unanswered(exc):
                    continue
                raise _RetryableFailure(f"{type(exc).__name__}: {exc}", mark_down=True) from exc
            except httpx.TransportError as exc:        # refused, timeout, other protocol errors
                raise _RetryableFailure(f"{type(exc).__name__}: {exc}", mark_down=True) from exc
        if response.status_code >= 500:
            raise _RetryableFailure(f"HTTP {response.status_code}: {response.text[:200]}", mark_down=True)
        if response.status_code == 429:
            raise _RetryableFailure("HTTP 429 (overloaded)", mark_down=False)
        if response.status_code >= 400:
            error = UpstreamRejectedError if response.status_code in _CALLER_ERRORS else UpstreamResponseError
            raise error(
                f"upstream {base_url} rejected the request: HTTP {response.status_code}: {response.text[:500]}")
        try:
            return response.json()
        except ValueError as exc:
            raise _RetryableFailure(f"unparseable JSON body: {response.text[:200]!r}", mark_down=False) from exc

    def _probe(self, base_url: str) -> bool:
        """`GET <root>/health` (vLLM and arlflow serve it outside /v1), else `GET {base_url}/models`."""
        root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
        for url in (f"{root}/health", f"{base_url}/models"):
            try:
                response = self._client.get(url, timeout=self._probe_timeout)
            except httpx.TransportError:
                return False
            if response.status_code < 300:
                return True
            if response.status_code not in (404, 405):
                return False
        return False

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check_health()
            except Exception:        # noqa: BLE001 a probe bug must not kill the thread; requests still mark down
                continue
