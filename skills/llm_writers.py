"""Skill writers for the LLM miner: the SkillWriter protocol (prompt -> text) and the writers that talk to a model.

``ChatEndpointWriter`` asks a model behind an OpenAI-compatible endpoint over httpx (a hosted teacher, vLLM, or our
gateway, so the policy served there works too); ``EngineWriter`` has the policy itself answer in-process on a local
engine. A writer that cannot get an answer at all (HTTP error, timeout, a body that is not an OpenAI response, a
prompt longer than the policy's context) raises ``SkillWriterError`` saying what to fix: a configuration problem for
the caller, unlike an answer that is not a skill (skills/llm_miner.py parses and reports those).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, Protocol

import httpx

from models.engine import SamplingParams


class SkillWriterError(RuntimeError):
    """The writer could not get an answer at all (endpoint down, HTTP error, malformed response, prompt too long)."""


class SkillWriter(Protocol):
    """Anything that answers a prompt with text; raises SkillWriterError when it cannot answer at all."""

    def complete(self, prompt: str) -> str: ...


class ChatEndpointWriter:
    """A model behind an OpenAI-compatible ``{base_url}/chat/completions`` (our gateway, vLLM, a hosted teacher).

    The API key is read from the environment variable ``api_key_env`` at every call and never stored ("" = no key).
    ``headers`` are sent with every request, e.g. ``{"X-Env": "skill-miner", "X-Round": "3"}`` so the gateway
    records the miner's calls apart from rollouts.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str = "", timeout_s: float = 60,
                 max_tokens: int = 512, temperature: float = 0.0, headers: Mapping[str, str] | None = None) -> None:
        if not re.match(r"^https?://[^/\s]+", base_url or ""):
            raise ValueError(f"base_url {base_url!r} must be an http(s) URL of an OpenAI-compatible API, e.g. "
                             "http://127.0.0.1:8000/v1")
        if timeout_s <= 0 or max_tokens < 1 or not 0.0 <= temperature <= 2.0:
            raise ValueError(f"need timeout_s > 0, max_tokens >= 1 and temperature in [0, 2], got {timeout_s}, "
                             f"{max_tokens}, {temperature}")
        if any(key.lower() == "authorization" for key in (headers or {})):
            raise ValueError("do not pass Authorization in headers: name the environment variable holding the key "
                             "in api_key_env")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.headers = dict(headers or {})
        self._api_key()  # fail at construction, not mid-round, when the variable is missing

    def _api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise SkillWriterError(f"environment variable {self.api_key_env} (api_key_env) is not set: export the "
                                   f"key of {self.url} in it, or set api_key_env='' for an endpoint without a key")
        return key

    def complete(self, prompt: str) -> str:
        """The text of the first choice for a one-message user conversation ``prompt``."""
        headers = dict(self.headers)
        key = self._api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        try:
            response = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
        except httpx.TimeoutException:
            raise SkillWriterError(f"no answer from {self.url} within {self.timeout_s} s: check that the server is "
                                   "up and not overloaded, or raise timeout_s") from None
        except httpx.HTTPError as exc:
            raise SkillWriterError(f"could not reach {self.url} ({type(exc).__name__}: {exc}): start the server or "
                                   "fix base_url") from None
        if response.status_code >= 400:
            hint = (f"check the key in ${self.api_key_env or '<api_key_env unset>'}"
                    if response.status_code in (401, 403) else
                    "check the model name and request size" if response.status_code < 500 else
                    "see the server's log")
            raise SkillWriterError(f"{self.url} answered HTTP {response.status_code}: "
                                   f"{_error_message(response)}: {hint}")
        try:
            payload = response.json()
        except ValueError:
            raise SkillWriterError(f"{self.url} answered HTTP {response.status_code} with a body that is not JSON "
                                   f"({response.text[:120]!r}): is base_url an OpenAI-compatible API (ending in "
                                   "/v1)?") from None
        return _first_choice_text(payload, self.url)


def _error_message(response: httpx.Response) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, else the start of the body."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:300]
        if isinstance(error, str):
            return error[:300]
    except (ValueError, AttributeError):
        pass
    return repr(response.text[:200]) if response.text else "(empty body)"


def _first_choice_text(payload: Any, url: str) -> str:
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise SkillWriterError(f"{url} answered JSON without choices[0].message.content ({str(payload)[:160]}): is "
                               "base_url an OpenAI-compatible chat-completions API?") from None
    if not isinstance(content, str):
        raise SkillWriterError(f"{url} answered choices[0].message.content={content!r}, not text: the model must "
                               "answer in text (no tool calls)")
    return content


class EngineWriter:
    """The policy itself writes the skill: greedy decoding on a local engine (``models.engine.Engine``).

    The prompt is one user message in the tokenizer's chat template; a tokenizer without one gets the gateway's
    built-in layout (``user: <prompt><eos>\\nassistant:``), so the policy sees the same text either way.
    """

    def __init__(self, engine: Any, tokenizer: Any, max_new_tokens: int = 128, seed: int = 0) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.seed = seed

    def prompt_ids(self, prompt: str) -> list[int]:
        message = [{"role": "user", "content": prompt}]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        else:
            text = f"user: {prompt}{self.tokenizer.eos_token or ''}\nassistant:"
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def complete(self, prompt: str) -> str:
        ids = self.prompt_ids(prompt)
        limit = getattr(self.engine, "max_positions", None)
        if limit is not None and len(ids) + self.max_new_tokens > limit:
            raise SkillWriterError(f"the miner's prompt has {len(ids)} tokens + max_new_tokens {self.max_new_tokens} "
                                   f"> the policy's context of {limit} tokens: lower max_chars or "
                                   "trajectories_per_prompt, or use a teacher endpoint (ChatEndpointWriter)")
        sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, seed=self.seed)
        generation = self.engine.generate([ids], sampling)[0]
        return self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
