"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown extra fields are accepted and ignored, as
OpenAI-compatible servers do, so SDKs that send newer fields keep working; known fields are type-checked."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionSchema(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSchema(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSchema


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    return_token_ids: bool = False
    """vLLM's extra field: return the prompt ids and each choice's sampled ids."""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSchema] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    return_tokens_as_token_ids: bool = False
    """vLLM's extra field: logprob tokens are written ``token_id:<id>``."""


class RewardRequest(_Lenient):
    reward: float = Field(allow_inf_nan=False)
    step_index: int | None = Field(default=None, ge=0)


class CompleteRequest(_Lenient):
    status: Literal["complete", "truncated", "failed"] = "complete"
    won: bool | None = None
