"""The blocking half of a request: render, generate on the upstream, commit the step, build the response.

Runs in a worker thread (the engine and the store are synchronous). The response is built first and committed
with the step in one ``DataPool.append_step`` transaction, under the request's idempotency key when it has one,
so a client retry gets the stored response back instead of a second sample, and nothing reaches the client
before its step is durable. Responses are kept in their full form (with ``token_ids`` / ``prompt_token_ids``);
``app.py`` strips the ids when the request did not ask for them.

One turn at a time per trajectory and ``prefix_break`` on a step that does not extend its predecessor:
``datapool.gateway.turns``. A request whose text is longer than ``max_prompt_chars`` is refused before any of it is
tokenized.
"""
from __future__ import annotations

import hashlib
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Sequence

from datapool.gateway.chat import ChatInputError, ChatRenderer, assistant_reply
from datapool.gateway.committer import GroupCommitter
from datapool.gateway.config import GatewayConfig
from datapool.gateway.errors import GatewayError
from datapool.gateway.schemas import ChatCompletionRequest, CompletionRequest
from datapool.gateway.turns import TurnGuard, breaks_prefix, text_chars, turn_in_progress
from datapool.gateway.upstreams import Upstream, UpstreamResult
from models.openai_pool import upstream_output_problem
from datapool.records import StepRecord, TrajectoryRecord
from datapool.store import StepConflictError
from models.engine import SamplingParams


REQUEST_HASH = "arlflow_request_sha256"
"""Kept with an idempotent request's stored response (never sent to a client): the hash of the body it answered."""


def request_hash(req) -> str:
    """sha256 of a request body as parsed (field order and unset defaults do not matter)."""
    return hashlib.sha256(req.model_dump_json(exclude_none=True).encode()).hexdigest()


@dataclass(frozen=True)
class RequestContext:
    """Where a request's steps go, from the path prefix ``/t/{id}`` or the ``X-*`` headers."""

    trajectory_id: str | None = None
    group_id: str | None = None
    idempotency_key: str | None = None
    env: str = "gateway"
    round: int = 0


@dataclass
class Served:
    response: dict             # the full response (ids included)
    trajectory_ids: list[str]  # one per choice
    step_index: int | None     # of choice 0's step, when known (not on a replay of a stored response)
    replayed: bool = False


class Recorder:
    def __init__(self, config: GatewayConfig, upstream: Upstream, pool, renderer: ChatRenderer,
                 committer: GroupCommitter | None = None) -> None:
        self.config = config
        self.upstream = upstream
        self.pool = pool
        self.renderer = renderer
        self.committer = committer
        self.turns = TurnGuard()

    # -- the two generation routes

    def chat(self, ctx: RequestContext, req: ChatCompletionRequest) -> Served:
        replay = self._replay(ctx, req)
        if replay is not None:
            return replay
        self._check_n(ctx, req.n)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        self._check_chars(text_chars(messages) + text_chars(tools), "messages")
        with self.turns.turn(ctx.trajectory_id):
            return self._chat(ctx, req, messages, tools)

    def _chat(self, ctx: RequestContext, req: ChatCompletionRequest, messages: list[dict],
              tools: list[dict] | None) -> Served:
        parse_tools = bool(tools) and req.tool_choice != "none"
        previous, existing_group = self._open_steps(ctx)
        try:
            prompt = self.renderer.build_prompt(messages, tools, previous, parse_tools=parse_tools)
        except ChatInputError as exc:
            raise GatewayError(400, str(exc), param="messages") from exc
        results = self._generate(prompt.prompt_ids, req, req.max_completion_tokens or req.max_tokens)
        choices, steps = [], []
        for i, result in enumerate(results):
            text = self.renderer.decode(result.token_ids)
            content, calls = assistant_reply(text, prompt.anchor, parse_tools=parse_tools)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            choices.append({"index": i, "message": message,
                            "logprobs": self._chat_logprobs(result, req.top_logprobs) if req.logprobs else None,
                            "finish_reason": "tool_calls" if calls else result.finish_reason,
                            "token_ids": list(result.token_ids)})
            action = "\n".join(f'{c["function"]["name"]}({c["function"]["arguments"]})' for c in calls) or text
            steps.append(self._step(result, prompt.prompt_text, observation=prompt.observation, action=action,
                                    response_text=text, anchor=prompt.anchor, tool_calls=len(calls),
                                    previous=previous))
        response = self._envelope("chatcmpl", "chat.completion", req.model, choices, results)
        return self._commit(ctx, steps, response, existing_group, req, previous)

    def completion(self, ctx: RequestContext, req: CompletionRequest) -> Served:
        replay = self._replay(ctx, req)
        if replay is not None:
            return replay
        self._check_n(ctx, req.n)
        if isinstance(req.prompt, str) or (isinstance(req.prompt, list) and req.prompt
                                           and isinstance(req.prompt[0], str)):
            self._check_chars(text_chars(req.prompt), "prompt")
        with self.turns.turn(ctx.trajectory_id):
            return self._completion(ctx, req)

    def _completion(self, ctx: RequestContext, req: CompletionRequest) -> Served:
        prompt_ids, prompt_text = self._completion_prompt(req.prompt)
        previous, existing_group = self._open_steps(ctx)
        results = self._generate(prompt_ids, req, req.max_tokens)
        anchor = hashlib.sha256(str(prompt_ids).encode()).hexdigest()[:32]
        choices, steps = [], []
        for i, result in enumerate(results):
            text = self.renderer.decode(result.token_ids)
            choices.append({"index": i, "text": prompt_text + text if req.echo else text,
                            "logprobs": self._completion_logprobs(result, req) if req.logprobs is not None else None,
                            "finish_reason": result.finish_reason, "token_ids": list(result.token_ids),
                            "prompt_token_ids": list(result.prompt_ids)})
            steps.append(self._step(result, prompt_text, observation=prompt_text[-2000:], action=text,
                                    response_text=text, anchor=anchor, tool_calls=0, previous=previous))
        response = self._envelope("cmpl", "text_completion", req.model, choices, results)
        return self._commit(ctx, steps, response, existing_group, req, previous)

    # -- pieces

    def _replay(self, ctx: RequestContext, req) -> Served | None:
        """The stored response of a retried request. The key is bound to what it first recorded: the same
        trajectory and the same body (a hash kept with the response), else 422 and nothing is replayed."""
        if ctx.idempotency_key is None:
            return None
        stored = self.pool.lookup_request(ctx.idempotency_key)
        if stored is None:
            return None
        stored, ids = self._bound(ctx, req, stored)
        return Served(stored, ids, None, replayed=True)

    def _bound(self, ctx: RequestContext, req, stored: dict) -> tuple[dict, list[str]]:
        """(the stored response without its hash, its trajectory ids) if it answered this very request (same
        trajectory, same body); else 422 ``idempotency_key_reused``."""
        stored = dict(stored)
        digest = stored.pop(REQUEST_HASH, None)
        ids = [c.get("trajectory_id", stored.get("trajectory_id")) for c in stored["choices"]]
        if ctx.trajectory_id is not None and ctx.trajectory_id not in ids:
            raise GatewayError(422, f"Idempotency-Key {ctx.idempotency_key!r} was used for trajectory {ids[0]!r}, "
                                    f"not {ctx.trajectory_id!r}: use a new key per request", param="idempotency_key",
                               code="idempotency_key_reused")
        if digest is not None and req is not None and digest != request_hash(req):
            raise GatewayError(422, f"Idempotency-Key {ctx.idempotency_key!r} was used with another request body: "
                                    "a retry must resend the same body; use a new key for a new request",
                               param="idempotency_key", code="idempotency_key_reused")
        return stored, ids

    def _check_n(self, ctx: RequestContext, n: int) -> None:
        if n > self.config.max_n:
            raise GatewayError(400, f"n={n} is more than this gateway's max_n={self.config.max_n}", param="n")
        if n > 1 and ctx.trajectory_id is not None:
            raise GatewayError(400, "n > 1 within one trajectory is ambiguous: send n > 1 without a trajectory id "
                                    "(each choice becomes its own trajectory, grouped by X-Group-Id), or one "
                                    "request per trajectory", param="n")

    def _check_chars(self, chars: int, param: str) -> None:
        limit = self.config.max_prompt_chars
        if chars > limit:
            raise GatewayError(400, f"the request's {param} hold {chars} characters, more than this gateway's "
                                    f"max_prompt_chars={limit} (checked before tokenizing): shorten the "
                                    f"{param}, or raise the limit (arlflow gateway serve --max-prompt-chars N, "
                                    "GatewayConfig.max_prompt_chars)", param=param, code="prompt_too_long")

    def _open_steps(self, ctx: RequestContext) -> tuple[list[StepRecord], str | None]:
        """(steps so far, group id) of the request's trajectory, ([], None) for a new one; 409 if it is finished
        or if X-Group-Id names another group than the trajectory's."""
        if ctx.trajectory_id is None:
            return [], None
        try:
            traj = self.pool.get_trajectory(ctx.trajectory_id)
        except KeyError:
            return [], None
        if traj.status != "open":
            raise GatewayError(409, f"trajectory {ctx.trajectory_id!r} is already {traj.status}: use a new "
                                    "trajectory id for a new episode", param="trajectory_id",
                               code="trajectory_finished")
        self._check_group(ctx, traj.group_id)
        return traj.steps, traj.group_id

    @staticmethod
    def _check_group(ctx: RequestContext, group_id: str) -> None:
        if ctx.group_id is not None and ctx.group_id != group_id:
            raise GatewayError(409, f"trajectory {ctx.trajectory_id!r} is in group {group_id!r}, not "
                                    f"{ctx.group_id!r} (X-Group-Id): a trajectory stays in the group it started in; "
                                    "send its group id or none", param="group_id", code="group_mismatch")

    def _completion_prompt(self, prompt) -> tuple[list[int], str]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise GatewayError(400, f"got {len(prompt)} prompts: send one prompt per request (a string or a "
                                        "list of token ids)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise GatewayError(400, "prompt is empty", param="prompt")
            return self.renderer.encode(prompt), prompt
        if not prompt:
            raise GatewayError(400, "prompt is empty", param="prompt")
        vocab = len(self.renderer.tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise GatewayError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(prompt), self.renderer.decode(prompt, skip_special_tokens=False)

    def _generate(self, prompt_ids: list[int], req, max_tokens: int | None) -> list[UpstreamResult]:
        max_tokens = max_tokens or self.config.default_max_tokens
        if max_tokens > self.config.max_tokens_limit:
            raise GatewayError(400, f"max_tokens={max_tokens} is more than this gateway's limit of "
                                    f"{self.config.max_tokens_limit}", param="max_tokens")
        sampling = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.config.default_temperature if req.temperature is None else req.temperature,
            top_p=self.config.default_top_p if req.top_p is None else req.top_p, seed=req.seed)
        try:
            results = self.upstream.generate(prompt_ids, sampling, req.n)
        except ValueError as exc:  # the engine's refusals (prompt too long for the model, ...) are the client's
            raise GatewayError(400, f"the model cannot serve this request: {exc}") from exc
        except Exception as exc:
            raise GatewayError(502, f"upstream {getattr(self.upstream, 'name', '?')!r} failed: "
                                    f"{type(exc).__name__}: {exc}", code="upstream_failed") from exc
        if len(results) != req.n:
            raise GatewayError(502, f"upstream returned {len(results)} choices for n={req.n}")
        vocab = len(self.renderer.tokenizer)
        for result in results:
            problem = upstream_output_problem(result, vocab_size=vocab, max_tokens=max_tokens)
            if problem is not None:
                raise GatewayError(502, f"upstream {getattr(self.upstream, 'name', '?')!r} returned invalid output "
                                        f"({problem}); nothing was recorded", code="upstream_invalid_output")
        return results

    def _step(self, result: UpstreamResult, prompt_text: str, *, observation: str, action: str, response_text: str,
              anchor: str, tool_calls: int, previous: Sequence[StepRecord]) -> StepRecord:
        return StepRecord(
            trajectory_id="", group_id="", step_index=0, prompt_ids=list(result.prompt_ids),
            response_ids=list(result.token_ids), logprobs=list(result.logprobs), prompt_text=prompt_text,
            observation=observation, action=action, response_text=response_text, reward=0.0, anchor=anchor,
            policy_version=self.config.policy_version, truncated=result.finish_reason == "length",
            tool_calls=tool_calls, retokenized=result.retokenized,
            prefix_break=breaks_prefix(previous, result.prompt_ids))

    def _envelope(self, prefix: str, kind: str, model: str | None, choices: list[dict],
                  results: list[UpstreamResult]) -> dict:
        completion_tokens = sum(len(r.token_ids) for r in results)
        prompt_tokens = len(results[0].prompt_ids)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": model or self.config.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
                "prompt_token_ids": list(results[0].prompt_ids)}

    def _commit(self, ctx: RequestContext, steps: list[StepRecord], response: dict,
                existing_group: str | None, req=None, previous: Sequence[StepRecord] = ()) -> Served:
        """Open the trajectories (one per choice without a trajectory id) and append each step durably; a step of
        a named trajectory only if the trajectory still has exactly the ``previous`` steps it was built on."""
        n = len(steps)
        if ctx.trajectory_id is not None:
            ids = [ctx.trajectory_id]
        else:  # from the idempotency key when there is one, so a retry lands on the same trajectories
            base = "req-" + (hashlib.sha256(ctx.idempotency_key.encode()).hexdigest()[:24]
                             if ctx.idempotency_key is not None else uuid.uuid4().hex[:24])
            ids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
        group_id = existing_group or ctx.group_id or (ids[0] if n == 1 else ids[0].rsplit("-", 1)[0])
        for choice, tid in zip(response["choices"], ids):
            choice["trajectory_id"] = tid
        response["trajectory_id"], response["group_id"] = ids[0], group_id
        metadata = {"source": "gateway", "model": response["model"]}
        if ctx.trajectory_id is None and ctx.idempotency_key is None and self.committer is not None:
            self.committer.commit([self._one_step_trajectory(step, tid, group_id, ctx, metadata)
                                   for step, tid in zip(steps, ids)])
            return Served(response, ids, 0)
        first_index = None
        expected = None if ctx.trajectory_id is None else max((s.step_index for s in previous), default=-1) + 1
        for i, (step, tid) in enumerate(zip(steps, ids)):
            opening = None  # a new trajectory is opened by its first append, in one transaction: a failed append
            if existing_group is None:  # (pool unwritable) leaves no empty trajectory behind
                try:
                    found = self.pool.get_trajectory(tid).group_id
                except KeyError:
                    found = None
                    opening = {"policy_version": self.config.policy_version, "env": ctx.env, "round": ctx.round,
                               "metadata": metadata}
                if found is not None and ctx.trajectory_id is not None:  # another gateway process opened it
                    group_id = found
                    self._check_group(ctx, group_id)
                    response["group_id"] = group_id
            key = None if ctx.idempotency_key is None else (
                ctx.idempotency_key if n == 1 else f"{ctx.idempotency_key}#{i}")
            kept = response if key is None or req is None else {**response, REQUEST_HASH: request_hash(req)}
            try:
                index, stored = self.pool.append_step(replace(step, trajectory_id=tid, group_id=group_id),
                                                      idempotency_key=key, response=kept, expected_index=expected,
                                                      open_as=opening)
            except StepConflictError as exc:
                raise turn_in_progress(tid) from exc
            if stored is not None:  # another request under this key committed first: only a retry may share it
                stored, _ = self._bound(ctx, req, stored)
                if n == 1:  # a concurrent retry of the same request committed first: answer what it stored
                    return Served(stored, ids, index, replayed=True)
                response["choices"][i] = stored["choices"][i]
            if i == 0:
                first_index = index
        return Served(response, ids, first_index)

    def _one_step_trajectory(self, step: StepRecord, tid: str, group_id: str, ctx: RequestContext,
                             metadata: dict) -> TrajectoryRecord:
        """What open_trajectory + append_step would leave in the pool, as one record (for the group commit)."""
        step = replace(step, trajectory_id=tid, group_id=group_id, step_index=0)
        return TrajectoryRecord(trajectory_id=tid, group_id=group_id, scenario="{}", env=ctx.env, split="train",
                                round=ctx.round, policy_version=self.config.policy_version, status="open",
                                episode_return=float(step.reward), won=False, num_steps=1,
                                response_tokens=len(step.response_ids), metadata=metadata, steps=[step])

    def _chat_logprobs(self, result: UpstreamResult, top: int | None) -> dict:
        content = []
        for token_id, logprob in zip(result.token_ids, result.logprobs):
            token = self.renderer.decode([token_id], skip_special_tokens=False)
            entry = {"token": token, "logprob": _finite_or_none(logprob), "bytes": list(token.encode())}
            # only the sampled token's log-prob is known (upstreams return no alternatives)
            entry["top_logprobs"] = [dict(entry)] if top else []
            content.append(entry)
        return {"content": content}

    def _completion_logprobs(self, result: UpstreamResult, req: CompletionRequest) -> dict:
        tokens, offsets, offset = [], [], 0
        for token_id in result.token_ids:
            text = self.renderer.decode([token_id], skip_special_tokens=False)
            tokens.append(f"token_id:{token_id}" if req.return_tokens_as_token_ids else text)
            offsets.append(offset)
            offset += len(text)
        logprobs = [_finite_or_none(lp) for lp in result.logprobs]  # a retokenized upstream has none (NaN)
        return {"tokens": tokens, "token_logprobs": logprobs,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)] if req.logprobs else None,
                "text_offset": offsets}


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN: log-probs an upstream did not return (retokenized results) are null."""
    return value if math.isfinite(value) else None
