"""The server in process (Starlette's test client), on the default pair: answers equal the
library's on the same rendered prompt (streamed or not, chat and completions), every bad
request is a 4xx OpenAI error naming its field and the server keeps serving, the metrics
count what happened, and malformed bodies of every shape (hypothesis) never reach a 5xx."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dflash
from dflash.serve import ServeConfig, create_app

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def llm() -> dflash.LLM:
    return dflash.load()


@pytest.fixture(scope="module")
def client(llm: dflash.LLM) -> TestClient:
    return TestClient(create_app(llm, ServeConfig(model_name="default")))


def _chat(client: TestClient, **fields: Any) -> Any:
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            **fields}
    return client.post("/v1/chat/completions", json=body)


def _events(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    events = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_chat_completion_is_the_librarys_generation(
    client: TestClient, llm: dflash.LLM
) -> None:
    r = _chat(client)
    assert r.status_code == 200
    got = r.json()
    want = llm.generate(llm.render_chat(MESSAGES), max_new_tokens=12)
    assert got["object"] == "chat.completion" and got["model"] == "default"
    assert got["id"].startswith("chatcmpl-")
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"] == {
        "prompt_tokens": want.prompt_len, "completion_tokens": 12,
        "total_tokens": want.prompt_len + 12, "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert got["dflash"]["drafter"] == "dflash+lookup" and got["dflash"]["steps"] >= 1


def test_a_streamed_chat_is_the_same_text_in_pieces(client: TestClient) -> None:
    whole = _chat(client).json()["choices"][0]["message"]["content"]
    events = _events(client, "/v1/chat/completions", {
        "model": "default", "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    })
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert len({c["id"] for c in chunks}) == 1


def test_completions_streamed_or_not_and_stop_strings(
    client: TestClient, llm: dflash.LLM
) -> None:
    body = {"model": "default", "prompt": "import os\n", "max_tokens": 24, "temperature": 0}
    want = llm.generate("import os\n", max_new_tokens=24)
    assert want.text
    got = client.post("/v1/completions", json=body).json()
    assert got["object"] == "text_completion" and got["choices"][0]["text"] == want.text
    events = _events(client, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text
    stop = want.text[len(want.text) // 2 : len(want.text) // 2 + 2]
    cut = client.post("/v1/completions", json={**body, "stop": stop}).json()
    assert cut["choices"][0]["text"] == want.text[: want.text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_a_seed_makes_sampling_reproducible(client: TestClient) -> None:
    a = _chat(client, temperature=0.9, seed=5).json()["choices"][0]["message"]["content"]
    b = _chat(client, temperature=0.9, seed=5).json()["choices"][0]["message"]["content"]
    c = _chat(client, temperature=0.9, seed=6).json()["choices"][0]["message"]["content"]
    assert a == b and a != c


def test_a_message_s_name_reaches_the_chat_template(
        client: TestClient, llm: dflash.LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[dict[str, str]]] = []
    real = llm.render_chat

    def recording(messages: Any, add_generation_prompt: bool = True) -> str:
        seen.append([dict(m) for m in messages])
        return real(messages, add_generation_prompt)

    monkeypatch.setattr(llm, "render_chat", recording)
    named = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": "def add(a, b):", "name": "ada"}]
    assert _chat(client, messages=named).status_code == 200
    assert seen == [[{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "def add(a, b):", "name": "ada"}]]


def test_openai_s_ranges_of_seed_and_top_p_are_served(client: TestClient) -> None:
    """OpenAI takes any int64 seed (a negative one is read as seed + 2^63) and top_p 0
    (the most probable token alone: top_k 1's rule)."""
    def text(**body: Any) -> str:
        r = _chat(client, temperature=0.9, **body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert text(seed=-1) == text(seed=2**63 - 1) == text(seed=-1)
    assert text(seed=-(2**63)) == text(seed=0)
    assert text(seed=3, top_p=0) == text(seed=4, top_k=1) == text(seed=5, top_p=0.0)


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"model": "nope"}, 404, "model", "the model 'nope' does not exist"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"messages": [{"role": "user"}]}, 400, "messages.0.content", "Field required"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "Input should"),
    ({"temperature": "hot"}, 400, "temperature", "valid number"),
    ({"temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 100000}, 400, "messages", "exceed the model's max_position_embeddings"),
    ({"n": 2}, 400, "n", "'n' other than 1 is not supported (got 2)"),
    ({"tools": [{"type": "function"}]}, 400, "tools", "'tools' is not supported"),
    ({"tool_choice": "required"}, 400, "tool_choice", "not supported"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty", "(got 0.5)"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "'stream': true"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "max_completion_tokens",
     "'max_tokens' (3) and 'max_completion_tokens' (4) differ"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content", "only text is supported (got 'image_url')"),
    ({"temperature": 1e-300}, 400, "temperature", "must be 0 (greedy) or at least 1e-05"),
    ({"top_k": 10**12}, 400, "top_k", "'top_k' must be an int in [0, 2147483647]"),
    ({"top_p": 2}, 400, "top_p", "(got 2.0)"),
    ({"top_p": -0.1}, 400, "top_p", "(got -0.1)"),
    ({"seed": 2**63}, 400, "seed", "(got 9223372036854775808)"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    ({"frobnicate": 1}, 400, "frobnicate", "unknown field 'frobnicate'"),
    ({"stream": "yes"}, 400, "stream", "valid boolean"),
])
def test_bad_requests_are_openai_errors_naming_the_field(
    client: TestClient, body: dict[str, Any], status: int, param: str | None, words: str
) -> None:
    r = _chat(client, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["param"] == param
    assert _chat(client).status_code == 200  # still serving


@pytest.mark.parametrize(("prompt", "words"), [
    ([-1], "'prompt' entry 0 must be a token id, an int >= 0 (got -1)"),
    (["def f():"], "'prompt' as a list of prompts is not supported (got 1)"),
    ([[1, 2], [3]], "a list of prompts"),
    ([5, "x"], "'prompt' entry 1 must be a token id"),
    ([10**6], "'prompt' entry 0 must be a token id in [0, 4096) (got 1000000)"),
    ("", "'prompt' must not be empty"),
    ({"text": "x"}, "'prompt' must be a string or a list of token ids (got {'text': 'x'})"),
])
def test_a_bad_prompt_is_named(client: TestClient, prompt: object, words: str) -> None:
    r = client.post("/v1/completions", json={"model": "default", "prompt": prompt,
                                              "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_numbers(client: TestClient, number: str) -> None:
    raw = ('{"model": "default", "messages": [{"role": "user", "content": "x"}], '
           f'"temperature": {number}}}')
    r = client.post("/v1/chat/completions", content=raw,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "temperature"
    assert "finite number" in r.json()["error"]["message"]


def test_bodies_that_are_not_json_objects(client: TestClient) -> None:
    for raw in (b"{bad", b"[]", b"", b"null", "{\"model\": \"\u00ff\"".encode("latin-1")):
        r = client.post("/v1/chat/completions", content=raw,
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_models_health_and_metrics(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["default"]
    assert client.get("/v1/models/default").json()["id"] == "default"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    _chat(client)
    text = client.get("/metrics").text
    assert 'dflash_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "dflash_queue_depth 0" in text and "dflash_busy 0" in text
    assert 'dflash_request_seconds_bucket{le="+Inf"}' in text
    assert "dflash_completion_tokens_total" in text


def test_unknown_paths_and_methods_are_openai_errors(client: TestClient) -> None:
    """Starlette's own 404 and 405 in OpenAI's error shape, counted in the metrics."""
    for method, path, status, code in (("GET", "/v1/chat/completions", 405,
                                        "method_not_allowed"),
                                       ("POST", "/v1/embeddings", 404, "not_found")):
        r = client.request(method, path)
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code and path in r.json()["error"]["message"]
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert f'endpoint="{path}",status="{status}"' in client.get("/metrics").text


def test_choices_carry_a_null_finish_reason_and_logprobs(client: TestClient) -> None:
    """As OpenAI sends them: every choice has ``finish_reason`` (null until the last
    chunk) and ``logprobs`` (null)."""
    events = _events(client, "/v1/chat/completions", {
        "model": "default", "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
        "stream": True})
    for e in events[:-2]:
        assert e["choices"][0]["finish_reason"] is None and e["choices"][0]["logprobs"] is None
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert _chat(client).json()["choices"][0]["logprobs"] is None


def test_a_bad_request_is_refused_before_it_queues(llm: dflash.LLM) -> None:
    """While a stream holds the engine, a request the library refuses (its prompt past the
    context) is a 400 at once, not a 503 after the queue timeout; with ``queue_size=0`` a
    good one is a 429 while the engine is busy, and served once it is idle."""
    client = TestClient(create_app(llm, ServeConfig(model_name="default", queue_size=0,
                                                    queue_timeout_s=30.0)))
    held = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
            "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=held) as r:
        assert r.status_code == 200  # admitted: the engine is busy until the body is read
        bad = client.post("/v1/completions", json={"model": "default", "prompt": [1] * 9000,
                                                    "max_tokens": 4})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["code"] == "context_length_exceeded"
        full = _chat(client)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        r.read()
    assert _chat(client).status_code == 200


def test_a_decode_that_fails_mid_stream_ends_with_an_error_event(
    llm: dflash.LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception from the decode (here a RuntimeError, as a CUDA failure would be)
    after the status went out: an error event with its one-line reason, no ``[DONE]``,
    and the next request is served."""
    client = TestClient(create_app(llm, ServeConfig(model_name="default")))

    def failing(*args: object) -> None:
        raise RuntimeError("the device fell off the bus\nsecond line")

    with monkeypatch.context() as m:
        m.setattr(llm, "_run", failing)
        events = _events(client, "/v1/chat/completions", {
            "model": "default", "messages": MESSAGES, "max_tokens": 4, "stream": True})
    assert events[-1]["error"]["message"] == "RuntimeError: the device fell off the bus"
    assert events[-1]["error"]["type"] == "server_error" and "[DONE]" not in events
    assert _chat(client).status_code == 200


def test_a_prompt_that_leaves_no_room_names_the_context(client: TestClient) -> None:
    """Without ``max_tokens`` the budget is what the context leaves; a prompt that leaves
    nothing is a 400 saying so (not a budget the client never sent)."""
    r = client.post("/v1/completions", json={"model": "default", "prompt": [1] * 8190})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "8190 tokens leave no room" in error["message"]


def test_a_body_over_the_limit_is_a_413_before_it_is_read(llm: dflash.LLM) -> None:
    """A declared length over :attr:`ServeConfig.max_body_bytes` and a chunked body that
    passes it are both a 413 in OpenAI's shape, counted, and the server keeps serving; a
    body at the limit is read."""
    body = json.dumps({"model": "default", "prompt": "def add(a, b):", "max_tokens": 2,
                       "temperature": 0}).encode()
    client = TestClient(create_app(llm, ServeConfig(model_name="default",
                                                    max_body_bytes=len(body))))
    headers = {"content-type": "application/json"}
    assert client.post("/v1/completions", content=body, headers=headers).status_code == 200
    over = body[:-1] + b" }"
    streamed_parts: list[int] = []

    def chunks() -> Any:
        for i in range(0, len(over), 7):
            streamed_parts.append(i)
            yield over[i:i + 7]

    for path in ("/v1/completions", "/v1/chat/completions"):
        for content, size in ((over, f"{len(over)} bytes"), (chunks(), "more than")):
            r = client.post(path, content=content, headers=headers)
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert error["code"] == "request_too_large"
            assert set(error) == {"message", "type", "param", "code"}
            assert size in error["message"] and f"limit of {len(body)} bytes" in error["message"]
        assert f'endpoint="{path}",status="413"' in client.get("/metrics").text
    assert streamed_parts  # the chunked body really was sent in pieces
    assert client.post("/v1/completions", content=body, headers=headers).status_code == 200


def test_max_body_mb_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    assert main(["serve", "--max-body-mb", "0"]) == 2
    assert "--max-body-mb must be >= 1 (got 0)" in capsys.readouterr().err


def test_listen_names_a_bad_or_taken_port() -> None:
    from dflash.errors import UsageError
    from dflash.serve import listen

    with pytest.raises(UsageError, match=r"--port must be in \[0, 65535\] \(got 70000\)"):
        listen("127.0.0.1", 70000)
    taken = listen("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port)
    finally:
        taken.close()
    with pytest.raises(UsageError, match=r"cannot listen on no-such-host\.invalid:80"):
        listen("no-such-host.invalid", 80)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8,
)
FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "stream", "stream_options", "n", "user", "max_completion_tokens", "tools"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON,
                               max_size=4),
       drop=st.lists(st.sampled_from(["model", "messages"]), max_size=2))
def test_malformed_bodies_never_reach_a_server_error(
    client: TestClient, changes: dict[str, Any], drop: list[str]
) -> None:
    body: dict[str, Any] = {"model": "default", "messages": MESSAGES, "max_tokens": 2,
                            **changes}
    for key in drop:
        body.pop(key, None)
    if body.get("stream") is True:  # a valid streamed body: read it to its end
        body["stream"] = False
    for budget in ("max_tokens", "max_completion_tokens"):  # a valid body decodes briefly
        value = body.get(budget)
        if isinstance(value, int) and not isinstance(value, bool) and 2 < value < 10**5:
            body[budget] = 2
    r = client.post("/v1/chat/completions", content=json.dumps(body, allow_nan=True),
                    headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_second_turn_is_served_from_the_prefix_cache(llm: dflash.LLM) -> None:
    """The second turn of a conversation reports cached tokens and answers what a server
    without the cache answers (greedy and seeded sampling)."""
    warm = TestClient(create_app(dflash.load(prefill_chunk=16, prefix_cache_mb=64),
                                 ServeConfig(model_name="default")))
    cold = TestClient(create_app(dflash.load(prefill_chunk=16),
                                 ServeConfig(model_name="default")))
    first = [{"role": "system", "content": "You write short Python functions."},
             {"role": "user", "content": "a function that adds two numbers, with a docstring"}]
    for rule in ({"temperature": 0}, {"temperature": 0.7, "seed": 11}):
        body = {"model": "default", "max_tokens": 16, **rule}
        a = warm.post("/v1/chat/completions", json={**body, "messages": first}).json()
        b = cold.post("/v1/chat/completions", json={**body, "messages": first}).json()
        assert a["choices"] == b["choices"]
        reply = a["choices"][0]["message"]
        second = [*first, reply, {"role": "user", "content": "now one that multiplies"}]
        c = warm.post("/v1/chat/completions", json={**body, "messages": second}).json()
        d = cold.post("/v1/chat/completions", json={**body, "messages": second}).json()
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert c["choices"] == d["choices"]
    assert "dflash_cached_tokens_total 0" not in warm.get("/metrics").text


def test_content_as_text_parts_and_a_stop_string_in_a_stream(client: TestClient) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add("},
                                          {"type": "text", "text": "a, b):"}]}]
    whole = _chat(client).json()["choices"][0]["message"]["content"]
    assert _chat(client, messages=parts).json()["choices"][0]["message"]["content"] == whole
    bad = _chat(client, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert bad.status_code == 400
    stop = whole[3:5]
    events = _events(client, "/v1/chat/completions", {
        "model": "default", "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
        "stream": True, "stop": stop,
    })
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == whole[: whole.index(stop)]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_stream_dropped_before_its_first_byte_frees_the_engine(llm: dflash.LLM) -> None:
    """Should the server drop a streamed response before iterating its body (the client
    left at once), the engine's turn is still released: the next request is served."""
    import asyncio
    import gc

    from dflash.serve.app import Engine, _events, _Once, _StreamBody

    async def run() -> None:
        engine = Engine(llm, ServeConfig(model_name="default", queue_size=1))
        await engine.acquire()
        finish = _Once(engine.release)
        stream = llm.stream("import os\n", max_new_tokens=4)
        body = _StreamBody(_events(engine, finish, stream, "x", 0, "default", True, False),
                           finish, stream)
        assert engine.busy
        del body
        gc.collect()
        assert not engine.busy
        await asyncio.wait_for(engine.acquire(), 5)  # the lock is free again
        engine.release()

    asyncio.run(run())


def test_a_generation_past_the_request_timeout_is_stopped(llm: dflash.LLM) -> None:
    """A generation still decoding at the request timeout is stopped at its next step: a
    504 naming the timeout (an error event when the stream is under way), counted in the
    metrics, and the engine serves the next request."""
    app = create_app(llm, ServeConfig(model_name="default", request_timeout_s=0.2))
    client = TestClient(app)
    long = {"max_tokens": 2000}
    r = _chat(client, **long)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "generation_timeout" and error["type"] == "server_error"
    assert "0.2 s" in error["message"]
    events = _events(client, "/v1/chat/completions", {
        "model": "default", "messages": MESSAGES, "temperature": 0, "stream": True, **long})
    assert events[-1]["error"]["code"] == "generation_timeout"
    assert "[DONE]" not in events
    metrics = client.get("/metrics").text
    assert "dflash_timed_out_requests_total 2" in metrics
    assert "dflash_busy 0" in metrics
    # the same engine serves the next request (with room for it on a loaded machine)
    app.state.engine.config = ServeConfig(model_name="default", request_timeout_s=120.0)
    ok = _chat(client, max_tokens=3)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("flag", ["--queue-timeout", "--request-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_serve_timeouts_must_be_positive_seconds(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused with one line naming the flag and the value, before any model is loaded."""
    from dflash.cli import main

    assert main(["serve", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} must be a number of seconds > 0 (got {float(value)})" in err
