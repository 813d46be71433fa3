"""``dflash serve``: OpenAI's HTTP API over one :class:`dflash.api.LLM` (FastAPI on uvicorn).

Why FastAPI: the request bodies are pydantic models already (:mod:`dflash.serve.schema`),
FastAPI validates them and hands every failure to one handler (so every bad request is an
OpenAI error, never a traceback), streams SSE with a plain async generator, and serves an
OpenAPI description of the endpoints at ``/docs``; uvicorn is the ASGI server it is made
for, and stops on SIGTERM by refusing new connections and finishing the requests in flight.

One generation runs at a time (the engine's regime: batch 1). A request waits in a bounded
queue (:attr:`ServeConfig.queue_size` waiting; one more is a 429 with ``Retry-After``) for
at most :attr:`ServeConfig.queue_timeout_s`, then decodes through :meth:`LLM.stream`; its
pieces go to the client as they are committed. A client that disconnects stops its
decode at the next step and frees the engine for the next request; so does a generation
that runs past :attr:`ServeConfig.request_timeout_s` (a 504, or an error event in a
stream already under way).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: a body that is
not JSON, an unknown field, a wrong type, a value out of range, an empty ``messages``,
a prompt past the context → 400; an unknown model → 404; a full queue → 429; no turn
within the queue timeout → 503; a generation past the request timeout → 504; a decode
that fails → 500 with its one-line reason. The process keeps serving after every one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
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
    queue_size: int = 16  # requests that may wait while one decodes
    queue_timeout_s: float = 600.0  # the longest a request waits for the engine
    request_timeout_s: float = 600.0  # the longest a generation decodes once admitted
    default_max_tokens: int = 512  # a request's budget when it names none


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
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        """Wait for the engine's turn (refused at once when the queue is full, or after the
        queue timeout); :meth:`release` ends it."""
        if self.waiting >= self.config.queue_size:
            raise ServeError(429, f"the queue is full ({self.waiting} requests waiting); "
                             "retry later", "rate_limit_exceeded", code="queue_full",
                             headers={"Retry-After": "1"})
        self.waiting += 1
        try:
            await asyncio.wait_for(self._lock.acquire(), self.config.queue_timeout_s)
        except TimeoutError:
            raise ServeError(503, f"no turn within {self.config.queue_timeout_s:g} s",
                             "server_error", code="queue_timeout",
                             headers={"Retry-After": "5"}) from None
        finally:
            self.waiting -= 1
        self.busy = True

    def release(self) -> None:
        self.busy = False
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


@dataclass(frozen=True)
class _Job:
    prompt: str | list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: list[str]
    chat: bool = True


def _job(body: ChatCompletionRequest | CompletionRequest, prompt: str | list[int],
         llm: LLM, config: ServeConfig) -> _Job:
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    # OpenAI's rule: without a seed a sampled completion is not reproducible
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    budget = body.budget()
    if budget is None:  # the default, within what the context leaves after the prompt
        budget = max(1, min(config.default_max_tokens, _room(llm, prompt)))
    return _Job(prompt, budget, temperature, body.top_k or 0,
                1.0 if body.top_p is None else body.top_p, body.min_p or 0.0, seed,
                body.stops())


def _room(llm: LLM, prompt: str | list[int]) -> int:
    """Tokens the context leaves after ``prompt`` (the last verify's block included)."""
    assert llm.tokenizer is not None  # create_app refuses a model without one
    n = len(prompt) if isinstance(prompt, list) else len(llm.tokenizer.encode(prompt))
    limit = llm.max_context or llm.model.config.max_position_embeddings
    return limit - n - llm.block_size + 2


def _open_stream(llm: LLM, job: _Job) -> TextStream:
    """:meth:`LLM.stream` of ``job``; a refused argument becomes a 400 naming it."""
    try:
        return llm.stream(job.prompt, max_new_tokens=job.max_tokens,
                          temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
                          min_p=job.min_p, seed=job.seed, stop=job.stop or None)
    except ContextLengthError as exc:
        where = "messages" if job.chat else "prompt"
        raise ServeError(400, str(exc).replace("max_new_tokens", "max_tokens"),
                         "invalid_request_error", where, "context_length_exceeded") from None
    except UsageError as exc:
        raise ServeError(400, str(exc), "invalid_request_error") from None


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


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


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

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(engine.waiting, engine.busy),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        body = await _parse(request, ChatCompletionRequest)
        _check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = llm.render_chat(messages)
        except DFlashError as exc:
            raise ServeError(400, str(exc), "invalid_request_error", "messages") from None
        job = _job(body, prompt, llm, config)
        return await _answer(request, engine, job, body, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await _parse(request, CompletionRequest)
        _check_model(body.model)
        job = dataclasses.replace(_job(body, body.prompt, llm, config), chat=False)
        return await _answer(request, engine, job, body, chat=False)

    return app


async def _parse(request: Request, model: type[Any]) -> Any:
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _validation_error(errors: Any) -> ServeError:
    """The first validation error as a 400 naming its field (malformed JSON included)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        message = f"the body is not valid JSON: {first.get('msg', '')}"
    elif kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
    return ServeError(400, message, "invalid_request_error", param, kind or None)


async def _answer(request: Request, engine: Engine, job: _Job,
                  body: ChatCompletionRequest | CompletionRequest, *, chat: bool
                  ) -> JSONResponse | StreamingResponse:
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    name = engine.config.model_name
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if body.stream:
        # admitted (or refused with a 429) before the response starts
        await engine.acquire()
        finish = _Once(engine.release)
        try:
            stream = _open_stream(engine.llm, job)
        except BaseException:
            finish()
            raise
        engine.metrics.request(path, 200)
        events = _events(engine, finish, stream, ident, created, name, chat,
                         body.include_usage())
        return StreamingResponse(
            _StreamBody(events, finish, stream), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    async with engine.turn():
        start = time.perf_counter()
        stream = _open_stream(engine.llm, job)
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
    return JSONResponse(answer.model_dump(exclude_none=True))


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
        except DFlashError as exc:  # the status is sent: the error goes in the stream
            finished = True
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


def run_server(llm: LLM, config: ServeConfig, host: str, port: int,
               on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM / Ctrl-C (uvicorn: new connections refused, requests in flight
    finished within 30 s, then cancelled). After a SIGTERM the function returns (the
    process exits 0); after Ctrl-C uvicorn raises KeyboardInterrupt once it has stopped."""
    import signal

    import uvicorn

    app = create_app(llm, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=30))
    if on_ready is not None:
        on_ready(f"http://{host}:{port}")
    # uvicorn handles SIGTERM itself, then raises it again under the handler it found: a
    # handler that does nothing makes that a clean return, not death by the signal
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["Engine", "Metrics", "ServeConfig", "ServeError", "create_app", "run_server"]
