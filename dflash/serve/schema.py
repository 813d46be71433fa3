"""OpenAI's request and response bodies as pydantic models (the subset ``dflash serve``
speaks), strict: an unknown field, a wrong type or a value out of range is a 400 naming
the field, never a silent default.

Fields OpenAI defines that change nothing here are accepted at their neutral values only
(``n`` = 1, ``frequency_penalty`` / ``presence_penalty`` = 0, ``logprobs`` off, no
``tools``, ``tool_choice`` ``"none"`` or ``"auto"``): any other value is refused with the
field named, rather than ignored. Extra sampling fields beyond OpenAI's (``top_k``,
``min_p``) are dflash's seeded rule's. Every check that concerns one field raises on that
field (pydantic's ``loc``), with a message that names the field and the value; a field
that takes one of several shapes (a prompt as text or token ids, content as text or
parts, stops as one string or a list) is checked by hand first, so its error says what
is wrong instead of which shape did not fit. NaN and infinities are not numbers here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: OpenAI's default ``temperature`` (the rule is then sampled, with a fresh seed unless one
#: is given)
DEFAULT_TEMPERATURE = 1.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _shape(name: str, value: object, what: str) -> ValueError:
    return ValueError(f"'{name}' must be {what} (got {_show(value)})")


def _show(value: object) -> str:
    """A value as an error message quotes it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: object) -> object:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _shape("content", value, "a string or a list of text parts")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"'content' part {i} must be a text part {{'type': 'text', 'text': ...}}; "
                    f"only text is supported (got {_show(kind if kind else part)})"
                )
        return value

    def text(self) -> str:
        """The content as one string (a list's text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _neutral(value: object, neutral: object, name: str) -> None:
    if value is not None and value != neutral:
        raise ValueError(
            f"'{name}' other than {neutral!r} is not supported (got {_show(value)})"
        )


class _Sampling(_Strict):
    """What both endpoints share: the model, the budget, the sampling rule, stops, stream."""

    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    # OpenAI's ranges: top_p 0 keeps the most probable token alone, a seed is any int64
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
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

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: object) -> object:
        stops = [value] if isinstance(value, str) else value
        if value is not None and (
            not isinstance(stops, list) or len(stops) > 4
            or any(not isinstance(s, str) or not s for s in stops)
        ):
            raise _shape("stop", value, "a non-empty string or a list of up to 4 of them")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        _neutral(value, 1, "n")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        _neutral(value, 0.0, str(info.field_name))
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_with_stream(cls, value: StreamOptions | None, info: ValidationInfo
                             ) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is not True:
            raise ValueError("'stream_options' is only allowed with 'stream': true")
        return value


    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def budget(self) -> int | None:
        """The token budget the request names, None when it names none."""
        return self.max_tokens


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_budget(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(
                f"'max_tokens' ({other}) and 'max_completion_tokens' ({value}) differ"
            )
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        _neutral(value, False, "logprobs")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError("'tools' is not supported (this server does not call tools)")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: str | dict[str, Any] | None
                        ) -> str | dict[str, Any] | None:
        if value not in (None, "none", "auto"):
            raise ValueError(
                f"'tool_choice' other than 'none' or 'auto' is not supported (this server "
                f"does not call tools; got {_show(value)})"
            )
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise ValueError(
                f"'response_format' other than {{'type': 'text'}} is not supported "
                f"(got {_show(value)})"
            )
        return value

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[Annotated[int, Field(ge=0)]]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: object) -> object:
        if isinstance(value, str):
            if not value:
                raise ValueError("'prompt' must not be empty")
            return value
        if not isinstance(value, list):
            raise _shape("prompt", value, "a string or a list of token ids")
        if not value:
            raise ValueError("'prompt' must not be empty")
        if all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value):
            raise ValueError(
                f"'prompt' as a list of prompts is not supported (got {len(value)}): send "
                "one prompt, a string or a list of token ids, per request"
            )
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"'prompt' entry {i} must be a token id, an int >= 0 (got {_show(t)})"
                )
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        _neutral(value, False, "echo")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError(f"'logprobs' is not supported (got {_show(value)})")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(f"'suffix' is not supported (got {_show(value)})")
        return value


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
