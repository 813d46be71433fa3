"""``dflash serve``: OpenAI's HTTP API over one :class:`dflash.api.LLM` (FastAPI on uvicorn).

Why FastAPI: the request bodies are pydantic models already (:mod:`dflash.serve.schema`),
FastAPI validates them and hands every failure to one handler (so every bad request is an
OpenAI error, never a traceback), streams SSE with a plain async generator, and serves an
OpenAPI description of the endpoints at ``/docs``; uvicorn is the ASGI server it is made
for, and stops on SIGTERM by refusing new connections and finishing the requests in flight.

One generation runs at a time (the engine's regime: batch 1). A request is checked first —
its prompt rendered and tokenized once, off the event loop, and every argument checked by
:meth:`LLM.stream` — so a bad request is a 400 at once, never after a wait in the queue.
It then waits in a bounded queue (:attr:`ServeConfig.queue_size` waiting behind the one
decoding; one more is a 429 with ``Retry-After``) for at most
:attr:`ServeConfig.queue_timeout_s`, then decodes; its pieces go to the client as they
are committed. A client that disconnects stops its
decode at the next step and frees the engine for the next request; so does a generation
that runs past :attr:`ServeConfig.request_timeout_s` (a 504, or an error event in a
stream already under way).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: a body that is
not JSON, an unknown field, a wrong type, a value out of range, an empty ``messages``,
a prompt past the context → 400; an unknown model or path → 404; a wrong method → 405; a
body over :attr:`ServeConfig.max_body_bytes` → 413 (refused from its declared length, or
as soon as a chunked body passes it, never read whole); a full queue → 429; no turn
within the queue timeout → 503; a generation past the request timeout → 504; a decode
that fails → 500 with its one-line reason (in a stream already under way: an error
event, then the stream ends). The process keeps serving after every one."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from dflash.api import LLM, STREAM_THREAD, TextStream
from dflash.errors import DFlashError, UsageError
from dflash.execution.errors import ContextLengthError
from dflash.execution.results import GenerationResult
from dflash.serve.schema import (
    DEFAULT_TEMPERATURE,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    DFlashFigures,
    ErrorBody,
    ErrorDetail,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)


@dataclass(frozen=True)
class ServeConfig:
    """How the server admits and sizes requests."""

    model_name: str
    queue_size: int = 16  # requests that may wait while one decodes (0: none wait)
    queue_timeout_s: float = 600.0  # the longest a request waits for the engine
    request_timeout_s: float = 600.0  # the longest a generation decodes once admitted
    default_max_tokens: int = 512  # a request's budget when it names none
    #: the largest request body read (bytes): a larger one is a 413 before it is held in
    #: memory (default 16 MiB; a prompt of 262,144 tokens is about 1 MB of text)
    max_body_bytes: int = 16 * 2**20


class ServeError(UsageError):
    """A request the server refuses, answered as an OpenAI error body with ``status`` (a
    usage error: the request, or its timing, cannot be served as sent)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = ErrorBody(error=ErrorDetail(message=str(self), type=self.kind, param=self.param,
                                           code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


# -- metrics ---------------------------------------------------------------------------------

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf)


@dataclass
class Metrics:
    """The counters ``/metrics`` exposes (Prometheus text format)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    rollbacks: dict[str, int] = field(default_factory=dict)
    cancelled: int = 0
    timed_out: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    latency_sum: float = 0.0
    first_token: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    first_token_sum: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def generation(self, r: GenerationResult) -> None:
        with self.lock:
            self.prompt_tokens += r.prompt_len
            self.cached_tokens += r.cached_tokens
            self.completion_tokens += len(r.tokens)
            self.drafted_tokens += r.drafted_tokens
            self.accepted_tokens += r.accepted_tokens
            self.steps += r.steps
            for path, n in (("fast", r.rollback.fast), ("replay", r.rollback.replay),
                            ("replay_after_failure", r.rollback.replay_after_failure)):
                self.rollbacks[path] = self.rollbacks.get(path, 0) + n

    @staticmethod
    def _observe(buckets: list[int], seconds: float) -> None:
        for i, edge in enumerate(LATENCY_BUCKETS):
            if seconds <= edge:
                buckets[i] += 1

    def latency_of(self, seconds: float, first_token: float | None) -> None:
        with self.lock:
            self._observe(self.latency, seconds)
            self.latency_sum += seconds
            if first_token is not None:
                self._observe(self.first_token, first_token)
                self.first_token_sum += first_token

    def render(self, queue_depth: int, busy: bool) -> str:
        with self.lock:
            out = [
                "# HELP dflash_requests_total Requests answered, by endpoint and status.",
                "# TYPE dflash_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f'dflash_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            for name, value, text in (
                ("prompt_tokens", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("cached_tokens", self.cached_tokens,
                 "Prompt tokens served from the prefix cache."),
                ("completion_tokens", self.completion_tokens, "Tokens generated."),
                ("drafted_tokens", self.drafted_tokens, "Drafted tokens verified."),
                ("accepted_tokens", self.accepted_tokens, "Drafted tokens accepted."),
                ("steps", self.steps, "Speculative steps."),
                ("cancelled_requests", self.cancelled, "Requests whose client went away."),
                ("timed_out_requests", self.timed_out,
                 "Generations stopped at the request timeout."),
            ):
                out += [f"# HELP dflash_{name}_total {text}", f"# TYPE dflash_{name}_total counter",
                        f"dflash_{name}_total {value}"]
            out += ["# HELP dflash_rollbacks_total Speculative steps by rollback path.",
                    "# TYPE dflash_rollbacks_total counter"]
            for path, n in sorted(self.rollbacks.items()):
                out.append(f'dflash_rollbacks_total{{path="{path}"}} {n}')
            rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
            out += ["# HELP dflash_acceptance_rate Accepted over drafted tokens, all requests.",
                    "# TYPE dflash_acceptance_rate gauge", f"dflash_acceptance_rate {rate}",
                    "# HELP dflash_queue_depth Requests waiting for the engine.",
                    "# TYPE dflash_queue_depth gauge", f"dflash_queue_depth {queue_depth}",
                    "# HELP dflash_busy 1 while a request decodes.",
                    "# TYPE dflash_busy gauge", f"dflash_busy {int(busy)}",
                    "# HELP dflash_decode_threads Decode threads alive (0 when idle).",
                    "# TYPE dflash_decode_threads gauge",
                    f"dflash_decode_threads {decode_threads()}"]
            for name, buckets, total, text in (
                ("request_seconds", self.latency, self.latency_sum,
                 "Time from admission to the last token."),
                ("first_token_seconds", self.first_token, self.first_token_sum,
                 "Time from admission to the first piece of text."),
            ):
                out += [f"# HELP dflash_{name} {text}", f"# TYPE dflash_{name} histogram"]
                for edge, n in zip(LATENCY_BUCKETS, buckets, strict=True):
                    le = "+Inf" if math.isinf(edge) else repr(edge)
                    out.append(f'dflash_{name}_bucket{{le="{le}"}} {n}')
                out += [f"dflash_{name}_sum {total}", f"dflash_{name}_count {buckets[-1]}"]
            return "\n".join(out) + "\n"


def decode_threads() -> int:
    """Threads decoding a :class:`TextStream` now (each stream's worker is named so)."""
    return sum(t.name == STREAM_THREAD and t.is_alive() for t in threading.enumerate())


# -- the engine's queue ------------------------------------------------------------------------


class Engine:
    """The one :class:`LLM` and the queue in front of it."""

    def __init__(self, llm: LLM, config: ServeConfig) -> None:
        self.llm, self.config = llm, config
        self.metrics = Metrics()
        self.waiting = 0
        self.busy = False
        self._admitted = 0  # the request decoding (if any) and those waiting for it
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        """Wait for the engine's turn (refused at once when ``queue_size`` requests wait
        behind the one decoding, or after the queue timeout); :meth:`release` ends it.
        The count is taken before the first ``await``: admission is exact."""
        if self._admitted > self.config.queue_size:
            raise ServeError(429, f"the queue is full ({self.waiting} requests waiting); "
                             "retry later", "rate_limit_exceeded", code="queue_full",
                             headers={"Retry-After": "1"})
        self._admitted += 1
        self.waiting += 1
        try:
            await asyncio.wait_for(self._lock.acquire(), self.config.queue_timeout_s)
        except BaseException as exc:
            self._admitted -= 1
            if isinstance(exc, TimeoutError):
                raise ServeError(503, f"no turn within {self.config.queue_timeout_s:g} s",
                                 "server_error", code="queue_timeout",
                                 headers={"Retry-After": "5"}) from None
            raise
        finally:
            self.waiting -= 1
        self.busy = True

    def release(self) -> None:
        self.busy = False
        self._admitted -= 1
        self._lock.release()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """:meth:`acquire` for the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class _Once:
    """A callable that runs ``fn`` the first time it is called, and never again."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _StreamBody:
    """A streamed response's body: :func:`_events`, and the turn it holds released when
    the events end — or, should the server drop the response before the body was ever
    iterated (a client gone before the first byte), when this object is collected (the
    decode never started then: nothing else to stop)."""

    def __init__(self, events: AsyncIterator[str], finish: _Once, stream: TextStream) -> None:
        self._events, self._finish, self._stream = events, finish, stream

    def __aiter__(self) -> _StreamBody:
        return self

    async def __anext__(self) -> str:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()

    def __del__(self) -> None:
        self._stream.close()  # a no-op unless a decode is still running
        self._finish()


def _prepare(llm: LLM, config: ServeConfig, body: ChatCompletionRequest | CompletionRequest,
             prompt: str | list[int], where: str) -> TextStream:
    """The request's checked stream (the decode starts when it is first read): ``prompt``
    tokenized once, the default budget fitted to what the context leaves, and every
    argument checked by :meth:`LLM.stream`; a refused one is a 400 naming it (``where``:
    the field that holds the prompt). Runs in a worker thread: tokenizing a long prompt
    must not stall the event loop."""
    try:
        ids = llm.encode(prompt)
    except UsageError as exc:
        raise ServeError(400, str(exc), "invalid_request_error", where) from None
    budget = body.budget()
    if budget is None:  # the default, within what the context leaves after the prompt
        room = llm.room(len(ids))
        if room < 1:
            limit = llm.max_context or llm.model.config.max_position_embeddings
            raise ServeError(
                400, f"the prompt's {len(ids)} tokens leave no room to generate in the "
                f"context of {limit} positions", "invalid_request_error", where,
                "context_length_exceeded")
        budget = min(config.default_max_tokens, room)
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    # OpenAI's rule: without a seed a sampled completion is not reproducible; OpenAI's
    # seeds are int64, dflash's in [0, 2^63): a negative seed s is read as s + 2^63
    seed = secrets.randbits(62) if body.seed is None else body.seed % 2**63
    # top_p 0: the smallest nucleus, the most probable token alone (as top_k 1 keeps it)
    top_k, top_p = body.top_k or 0, 1.0 if body.top_p is None else body.top_p
    if top_p == 0.0:
        top_k, top_p = 1, 1.0
    try:
        return llm.stream(ids, max_new_tokens=budget, temperature=temperature,
                          top_k=top_k, top_p=top_p, min_p=body.min_p or 0.0, seed=seed,
                          stop=body.stops() or None)
    except ContextLengthError as exc:
        raise ServeError(400, str(exc).replace("max_new_tokens", "max_tokens"),
                         "invalid_request_error", where, "context_length_exceeded") from None
    except UsageError as exc:
        raise ServeError(400, str(exc), "invalid_request_error", _named(exc)) from None


#: the request fields a library error can name (its message quotes the argument)
_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "seed": "seed", "stop": "stop",
           "max_new_tokens": "max_tokens"}


def _named(exc: UsageError) -> str | None:
    """The request field a library error names first (``'top_k' must …``), if any."""
    text = str(exc)
    found = [(text.find(f"'{arg}'"), field) for arg, field in _FIELDS.items()
             if f"'{arg}'" in text]
    return min(found)[1] if found else None


_END = object()


async def _close(stream: TextStream) -> None:
    """Stop ``stream``'s decode (at its next step) and wait for it, off the event loop."""
    await asyncio.to_thread(stream.close)


def _next_piece(stream: TextStream) -> object:
    return next(stream, _END)


def _timed_out(engine: Engine) -> ServeError:
    engine.metrics.timed_out += 1
    return ServeError(504, f"the generation ran past the request timeout "
                      f"({engine.config.request_timeout_s:g} s) and was stopped",
                      "server_error", code="generation_timeout")


async def _pieces(stream: TextStream, engine: Engine) -> AsyncIterator[str]:
    """The stream's pieces, each read in a worker thread (the decode runs in its own),
    until :attr:`ServeConfig.request_timeout_s` after the first read: then a 504
    :class:`ServeError` (the caller's ``finally`` stops the decode at its next step)."""
    deadline = time.monotonic() + engine.config.request_timeout_s
    while True:
        try:
            piece = await asyncio.wait_for(asyncio.to_thread(_next_piece, stream),
                                           max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise _timed_out(engine) from None
        if piece is _END:
            return
        assert isinstance(piece, str)
        yield piece


def _usage(r: GenerationResult) -> Usage:
    return Usage(prompt_tokens=r.prompt_len, completion_tokens=len(r.tokens),
                 total_tokens=r.prompt_len + len(r.tokens),
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=r.cached_tokens))


def _figures(r: GenerationResult) -> DFlashFigures:
    return DFlashFigures(acceptance_rate=r.acceptance_rate, avg_commit=r.avg_commit,
                         steps=r.steps, rollback_status=r.rollback.status.value,
                         drafter=r.drafter, tokens_per_s=r.timings.tokens_per_s,
                         prefill_s=r.timings.prefill_s)


def _finish(r: GenerationResult) -> str:
    return "length" if r.stop_reason == "max_new_tokens" else "stop"


def _openai(model: BaseModel) -> dict[str, Any]:
    """``model`` as OpenAI writes it: fields that are None left out, except each choice's
    ``finish_reason`` and ``logprobs``, which OpenAI always sends (null until the end)."""
    data = model.model_dump(exclude_none=True)
    for choice in data.get("choices", ()):
        choice.setdefault("finish_reason", None)
        choice.setdefault("logprobs", None)
    return data


def _sse(model: BaseModel) -> str:
    return f"data: {json.dumps(_openai(model), ensure_ascii=False)}\n\n"


# -- the app ----------------------------------------------------------------------------------


def create_app(llm: LLM, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``config.model_name`` (see the module docstring)."""
    if llm.tokenizer is None:
        raise UsageError(
            "dflash serve needs a model with a tokenizer (tokenizer.json): OpenAI's API "
            "speaks text"
        )
    engine = Engine(llm, config)
    created = int(time.time())
    app = FastAPI(title="dflash", summary="OpenAI-compatible speculative decoding")
    app.state.engine = engine

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError) -> JSONResponse:
        engine.metrics.request(request.url.path, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _serve_error(request, _validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own answers (no such path, a method the path does not take) in
        # OpenAI's shape, counted like every other answer
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.url.path} does not take {request.method}"}
        return await _serve_error(request, ServeError(
            exc.status_code, message.get(exc.status_code, str(exc.detail)),
            "invalid_request_error", code=codes.get(exc.status_code),
            headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        first = (str(exc).splitlines() or [""])[0][:300]
        return await _serve_error(request, ServeError(
            500, f"{type(exc).__name__}: {first}", "server_error"))

    def _check_model(name: str) -> None:
        if name != config.model_name:
            raise ServeError(404, f"the model {name!r} does not exist; this server serves "
                             f"{config.model_name!r}", "invalid_request_error", "model",
                             "model_not_found")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        engine.metrics.request("/v1/models", 200)
        return ModelList(data=[ModelCard(id=config.model_name, created=created)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        _check_model(model_id)
        engine.metrics.request("/v1/models/{model}", 200)
        return ModelCard(id=config.model_name, created=created)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(engine.waiting, engine.busy),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        body = await _parse(request, ChatCompletionRequest, config.max_body_bytes)
        _check_model(body.model)
        # a message's ``name`` reaches the chat template too, as transformers passes it
        messages = [{"role": m.role, "content": m.text()}
                    | ({} if m.name is None else {"name": m.name}) for m in body.messages]

        def prepare() -> TextStream:
            try:
                prompt = llm.render_chat(messages)
            except DFlashError as exc:
                raise ServeError(400, str(exc), "invalid_request_error", "messages") from None
            return _prepare(llm, config, body, prompt, "messages")

        stream = await asyncio.to_thread(prepare)
        return await _answer(request, engine, stream, body, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await _parse(request, CompletionRequest, config.max_body_bytes)
        _check_model(body.model)
        stream = await asyncio.to_thread(_prepare, llm, config, body, body.prompt, "prompt")
        return await _answer(request, engine, stream, body, chat=False)

    return app


async def _parse(request: Request, model: type[Any], limit: int) -> Any:
    raw = await _body(request, limit)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, refused with a 413 when it is over ``limit`` bytes: at once when
    its ``Content-Length`` says so, else as soon as the bytes received pass it (a chunked
    body), so an oversized body is never held in memory whole."""
    def too_large(size: str) -> ServeError:
        return ServeError(413, f"the request body ({size}) is over this server's limit of "
                          f"{limit} bytes (dflash serve --max-body-mb)",
                          "invalid_request_error", code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared)} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(f"more than {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def _validation_error(errors: Any) -> ServeError:
    """The first validation error as a 400 naming its field and value (malformed JSON
    included). The schema's own checks (``value_error``) word their message in full."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = str(first.get("type", ""))
    msg = str(first.get("msg", "invalid"))
    if kind == "json_invalid":
        message = f"the body is not valid JSON: {msg}"
    elif kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "value_error":
        message = msg.removeprefix("Value error, ")
    elif kind == "missing" or "input" not in first:
        message = f"{param or 'body'}: {msg}"
    else:
        shown = repr(first["input"])
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        message = f"{param or 'body'}: {msg} (got {shown})"
    return ServeError(400, message, "invalid_request_error", param, kind or None)


async def _answer(request: Request, engine: Engine, stream: TextStream,
                  body: ChatCompletionRequest | CompletionRequest, *, chat: bool
                  ) -> JSONResponse | StreamingResponse:
    """Answer with ``stream`` (checked, not started) once the engine's turn comes."""
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    name = engine.config.model_name
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if body.stream:
        # admitted (or refused with a 429) before the response starts
        await engine.acquire()
        finish = _Once(engine.release)
        engine.metrics.request(path, 200)
        events = _events(engine, finish, stream, ident, created, name, chat,
                         body.include_usage())
        return StreamingResponse(
            _StreamBody(events, finish, stream), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    async with engine.turn():
        start = time.perf_counter()
        first: float | None = None
        try:
            async for _ in _pieces(stream, engine):
                first = first or time.perf_counter() - start
                if await request.is_disconnected():
                    engine.metrics.cancelled += 1
                    raise ServeError(499, "the client went away", "cancelled")
        finally:
            with anyio.CancelScope(shield=True):  # the decode stops before the turn ends
                await _close(stream)
        r = stream.result
    engine.metrics.generation(r)
    engine.metrics.latency_of(time.perf_counter() - start, first)
    engine.metrics.request(path, 200)
    text = r.text or ""
    usage = _usage(r)
    answer: BaseModel
    if chat:
        answer = ChatCompletion(id=ident, created=created, model=name, usage=usage,
                                choices=[ChatChoice(message=ChatMessage(content=text),
                                                    finish_reason=_finish(r))],  # type: ignore[arg-type]  # a FinishReason literal
                                dflash=_figures(r))
    else:
        answer = Completion(id=ident, created=created, model=name, usage=usage,
                            choices=[CompletionChoice(text=text, finish_reason=_finish(r))],  # type: ignore[arg-type]  # a FinishReason literal
                            dflash=_figures(r))
    return JSONResponse(_openai(answer))


async def _events(engine: Engine, finish: _Once, stream: TextStream, ident: str,
                  created: int, name: str, chat: bool, include_usage: bool
                  ) -> AsyncIterator[str]:
    """The SSE events of one streamed completion; the engine's turn ends with them (also
    when the client goes away: the decode stops at its next step)."""
    start = time.perf_counter()
    first: float | None = None
    finished = False
    try:
        if chat:
            yield _sse(ChatCompletionChunk(id=ident, created=created, model=name, choices=[
                ChunkChoice(delta=Delta(role="assistant", content=""))]))
        try:
            async for piece in _pieces(stream, engine):
                first = first or time.perf_counter() - start
                yield _sse(_chunk(ident, created, name, chat, piece, None))
        except ServeError as exc:  # the request timeout: the status is sent, so in-stream
            finished = True
            error = ErrorBody(error=ErrorDetail(message=str(exc), type=exc.kind,
                                                code=exc.code))
            yield f"data: {error.model_dump_json()}\n\n"
            return
        except Exception as exc:  # a failed decode: the status is sent, the error goes in
            finished = True  # the stream (a 500's one-line reason), and the stream ends
            error = ErrorBody(error=ErrorDetail(
                message=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}",
                type="server_error"))
            yield f"data: {error.model_dump_json()}\n\n"
            return
        r = stream.result
        finished = True
        engine.metrics.generation(r)
        engine.metrics.latency_of(time.perf_counter() - start, first)
        yield _sse(_chunk(ident, created, name, chat, None, _finish(r)))
        if include_usage:
            usage_chunk: BaseModel = (
                ChatCompletionChunk(id=ident, created=created, model=name, choices=[],
                                    usage=_usage(r), dflash=_figures(r)) if chat
                else Completion(id=ident, created=created, model=name, choices=[],
                                usage=_usage(r), dflash=_figures(r))
            )
            yield _sse(usage_chunk)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.metrics.cancelled += 1
        # a client that went away cancels this generator, and the cancellation would hit
        # every await after it: shielded, the decode stops before the turn ends
        with anyio.CancelScope(shield=True):
            await _close(stream)
        finish()


def _chunk(ident: str, created: int, name: str, chat: bool, piece: str | None,
           finish: str | None) -> BaseModel:
    if chat:
        return ChatCompletionChunk(id=ident, created=created, model=name, choices=[
            ChunkChoice(delta=Delta(content=piece), finish_reason=finish)])  # type: ignore[arg-type]  # a FinishReason literal or None
    return Completion(id=ident, created=created, model=name, choices=[
        CompletionChoice(text=piece or "", finish_reason=finish)])  # type: ignore[arg-type]  # as above


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (port 0: one the system picks), opened before
    any model is loaded, so an address in use or a host that does not resolve is a
    :class:`~dflash.errors.UsageError` naming it, at once; connections that arrive while
    the model loads wait in its backlog."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in [0, 65535] (got {port})")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_server(llm: LLM, config: ServeConfig, sock: socket.socket,
               on_ready: Callable[[str], None] | None = None) -> None:
    """Serve on ``sock`` (from :func:`listen`: already listening, so ``on_ready`` gets
    its URL first) until SIGTERM / Ctrl-C (uvicorn: new connections refused, requests in
    flight finished within 30 s, then cancelled). After a SIGTERM the function returns
    (the process exits 0); after Ctrl-C uvicorn raises KeyboardInterrupt once it has
    stopped."""
    import signal

    import uvicorn

    app = create_app(llm, config)
    host, port = sock.getsockname()[:2]
    if on_ready is not None:
        on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=30))
    # uvicorn handles SIGTERM itself, then raises it again under the handler it found: a
    # handler that does nothing makes that a clean return, not death by the signal
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


__all__ = ["Engine", "Metrics", "ServeConfig", "ServeError", "create_app", "listen",
           "run_server"]
