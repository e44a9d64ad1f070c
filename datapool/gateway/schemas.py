"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown extra fields are accepted and ignored, as
OpenAI-compatible servers do, so SDKs that send newer fields keep working; known fields are type-checked strictly:
counts, ids and flags must be JSON numbers / booleans of the right kind (no ``"4"``, no ``true`` for a reward, no
``"yes"`` for a flag), and integers stay within what the pool stores (int32 ids and counts, int64 seeds)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

INT32_MAX = 2 ** 31 - 1
INT64_MAX = 2 ** 63 - 1
Count = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


def _encodable(text: str) -> str:
    """JSON may carry a lone surrogate (``"\\ud800"``); it is not text and cannot be tokenized or stored."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text holds a lone surrogate at position {err.start}: send valid Unicode") from err
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCallIn(_Lenient):
    name: Text
    arguments: Text | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Lenient):
    type: str
    text: Text | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
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
    max_tokens: Count | None = None
    n: Count = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[StrictInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)] | None = None
    return_token_ids: StrictBool = False
    """vLLM's extra field: return the prompt ids and each choice's sampled ids."""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSchema] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    """vLLM's extra field: logprob tokens are written ``token_id:<id>``."""


class RewardRequest(_Lenient):
    reward: Annotated[StrictFloat | StrictInt, Field(allow_inf_nan=False)]
    step_index: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None


class CompleteRequest(_Lenient):
    status: Literal["complete", "truncated", "failed"] = "complete"
    won: StrictBool | None = None
