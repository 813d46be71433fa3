"""OpenAI's request and response bodies as pydantic models (the subset ``dflash serve``
speaks), strict: an unknown field, a wrong type or a value out of range is a 400 naming
the field, never a silent default.

Fields OpenAI defines that change nothing here are accepted at their neutral values only
(``n`` = 1, ``frequency_penalty`` / ``presence_penalty`` = 0, ``logprobs`` off, no
``tools``): any other value is refused with the field named, rather than ignored. Extra
sampling fields beyond OpenAI's (``top_k``, ``min_p``) are dflash's seeded rule's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: OpenAI's default ``temperature`` (the rule is then sampled, with a fresh seed unless one
#: is given)
DEFAULT_TEMPERATURE = 1.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    """One part of a message's content given as a list (OpenAI's ``[{"type": "text",
    "text": ...}]`` form, as many clients send it); only text parts exist here."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (a list's text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _neutral(value: object, neutral: object, name: str) -> None:
    if value is not None and value != neutral:
        raise ValueError(f"'{name}' other than {neutral!r} is not supported (got {value!r})")


class _Sampling(_Strict):
    """What both endpoints share: the model, the budget, the sampling rule, stops, stream."""

    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None

    @field_validator("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     mode="before")
    @classmethod
    def _int_is_a_number(cls, value: object) -> object:
        # JSON has one number type: 1 and 1.0 are the same temperature
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("'stop' must be up to 4 non-empty strings")
        return value

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        _neutral(self.n, 1, "n")
        _neutral(self.frequency_penalty, 0.0, "frequency_penalty")
        _neutral(self.presence_penalty, 0.0, "presence_penalty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed with 'stream': true")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        _neutral(self.logprobs, False, "logprobs")
        if self.tools:
            raise ValueError("'tools' is not supported")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ValueError("'response_format' other than {'type': 'text'} is not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None and (
            self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("'max_tokens' and 'max_completion_tokens' differ")
        return self

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[Annotated[int, Field(ge=0)]]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list[int]) -> str | list[int]:
        if not value:
            raise ValueError("'prompt' must not be empty")
        return value

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        _neutral(self.echo, False, "echo")
        if self.logprobs is not None:
            raise ValueError("'logprobs' is not supported")
        if self.suffix:
            raise ValueError("'suffix' is not supported")
        return self

    def budget(self) -> int | None:
        return self.max_tokens


# -- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class DFlashFigures(BaseModel):
    """dflash's own figures of one completion (under the ``dflash`` key)."""

    acceptance_rate: float
    avg_commit: float
    steps: int
    rollback_status: str
    drafter: str
    tokens_per_s: float | None
    prefill_s: float


FinishReason = Literal["stop", "length"]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    dflash: DFlashFigures


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    dflash: DFlashFigures | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    dflash: DFlashFigures | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


__all__ = [
    "DEFAULT_TEMPERATURE",
    "ChatChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "CompletionRequest",
    "DFlashFigures",
    "Delta",
    "ErrorBody",
    "ErrorDetail",
    "Message",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "StreamOptions",
    "TextPart",
    "Usage",
]
