"""The gateway's configuration: who may call it, how big a request may be, and the default sampling."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted in ``Authorization: Bearer <key>``; required unless ``allow_no_auth``."""
    allow_no_auth: bool = False
    """Local development only: serve without any API key."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (bytes); larger ones get 413 before anything is parsed or written."""
    model_name: str = "arlflow-policy"
    """The one model id listed by ``/v1/models``; requests may name any model (it is recorded, not routed)."""
    policy_version: str = "unknown"
    """Recorded on every trajectory and step (the version of the policy behind the upstream)."""
    default_max_tokens: int = 64
    """New tokens per response when a request sets neither max_tokens nor max_completion_tokens."""
    max_tokens_limit: int = 4096
    """Requests asking for more new tokens than this are rejected (400)."""
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    max_n: int = 16
    """Most choices (``n``) one request may ask for."""
    min_free_bytes: int = 1 << 20
    """A SQLite pool whose disk has less free space than this is reported unwritable by /health (503) and the
    gateway does not start on it; 0 turns the check off (writes that fail for lack of space are 503s anyway)."""
    max_prompt_chars: int = 131_072
    """Most characters in a request's text (all message and tool strings, or a completion's text prompt); a longer
    request is a 400 before any of it is tokenized (~32k tokens of English: more than the context of the models we
    serve; raise it for long-context models). Bounds the CPU a request costs within the body limit."""

    def __post_init__(self) -> None:
        if not self.allow_no_auth and not self.api_keys:
            raise ValueError("GatewayConfig needs at least one api_key (or allow_no_auth=True for local development)")
        if any(not isinstance(key, str) or not key for key in self.api_keys):
            raise ValueError("every api_key must be a non-empty string")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(f"default_max_tokens must be in [1, max_tokens_limit={self.max_tokens_limit}], got "
                             f"{self.default_max_tokens}")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError(f"default_temperature must be in [0, 2], got {self.default_temperature}")
        if not 0.0 < self.default_top_p <= 1.0:
            raise ValueError(f"default_top_p must be in (0, 1], got {self.default_top_p}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {self.min_free_bytes}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
