"""``dflash serve`` as a real server on 127.0.0.1 (a subprocess, the default pair) and the
official ``openai`` client: chat and completions, streamed and not, equal to the library
on the same rendered prompt; a bounded load test (8 clients x 20 requests, every answer
checked, latency printed); a client that leaves mid-stream frees the engine, and ten
leave no thread, queue entry or memory behind; a full queue
answers 429 with Retry-After; SIGTERM finishes the request in flight, then exits 0."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

import dflash

ROOT = Path(__file__).resolve().parents[3]
ASK = "def add(a, b):"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASK}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash.cli", "serve", "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]  # piped
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the server did not come up within 120 s")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--queue-size", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm() -> dflash.LLM:
    return dflash.load()


def test_the_openai_client_gets_the_librarys_text(server: Server, llm: dflash.LLM) -> None:
    client = server.client()
    prompt = llm.render_chat([{"role": "user", "content": ASK}])
    want = llm.generate(prompt, max_new_tokens=16).text
    chat = client.chat.completions.create(model="default", messages=MESSAGES,
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == want
    assert chat.usage is not None and chat.usage.completion_tokens == 16
    streamed = client.chat.completions.create(model="default", messages=MESSAGES,
                                              max_tokens=16, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in streamed:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == want and usage is not None and usage.prompt_tokens > 0
    text = client.completions.create(model="default", prompt=prompt, max_tokens=16,
                                     temperature=0)
    assert text.choices[0].text == want
    pieces = [c.choices[0].text for c in client.completions.create(
        model="default", prompt=prompt, max_tokens=16, temperature=0, stream=True)]
    assert "".join(pieces) == want
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=0)


def test_a_second_turn_reports_cached_tokens_and_equals_a_cold_run() -> None:
    """Through the official client: a conversation's second turn is served from the
    prefix cache (``cached_tokens`` > 0) and answers what the library answers cold, with
    the server's prefill chunks (greedy and seeded sampling)."""
    cold = dflash.load(prefill_chunk=16)
    s = Server("--prefill-chunk", "16")
    try:
        client = s.client()
        first = [{"role": "system", "content": "You write short Python functions."},
                 {"role": "user", "content": "a function that adds two numbers, with a docstring"}]
        for temperature, seed in ((0.0, 0), (0.7, 11)):
            def ask(messages: list[dict[str, str]],
                    temperature: float = temperature, seed: int = seed) -> Any:
                return client.chat.completions.create(
                    model="default", messages=cast(list[ChatCompletionMessageParam], messages),
                    max_tokens=16, temperature=temperature, seed=seed)

            reply = ask(first).choices[0].message.content or ""
            second = [*first, {"role": "assistant", "content": reply},
                      {"role": "user", "content": "now one that multiplies"}]
            b = ask(second)
            assert b.usage is not None and b.usage.prompt_tokens_details is not None
            assert (b.usage.prompt_tokens_details.cached_tokens or 0) >= 16
            want = cold.generate(cold.render_chat(second), max_new_tokens=16,
                                 temperature=temperature, seed=seed)
            assert want.cached_tokens == 0 and b.choices[0].message.content == want.text
    finally:
        s.stop()


def test_eight_clients_twenty_requests_each(server: Server, llm: dflash.LLM) -> None:
    prompts = [f"def f{i}(x):\n    return" for i in range(8)]
    want = {p: llm.generate(p, max_new_tokens=6).text for p in prompts}
    latencies: list[float] = []
    failures: list[str] = []

    def one_client(prompt: str) -> None:
        client = server.client()
        for _ in range(20):
            start = time.perf_counter()
            try:
                r = client.completions.create(model="default", prompt=prompt, max_tokens=6,
                                              temperature=0)
                if r.choices[0].text != want[prompt]:
                    failures.append(f"{prompt!r}: {r.choices[0].text!r}")
            except openai.OpenAIError as exc:
                failures.append(f"{prompt!r}: {exc}")
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one_client, prompts))
    wall = time.perf_counter() - start
    assert failures == []
    assert len(latencies) == 160
    qs = statistics.quantiles(latencies, n=100)
    print(f"load: 160 requests in {wall:.1f} s ({160 / wall:.1f} req/s); latency p50 "
          f"{statistics.median(latencies):.2f} s, p99 {qs[98]:.2f} s")
    assert server.metric("dflash_queue_depth") == 0 and server.metric("dflash_busy") == 0


def _leave_mid_stream(server: Server, lines: int) -> None:
    """A streamed chat of 2,000 tokens left after ``lines`` lines; returns once the engine
    is free again (at most 30 s later)."""
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 2000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        events = r.iter_lines()
        for _ in range(lines):
            next(events)
    deadline = time.monotonic() + 30
    while server.metric("dflash_busy") and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_client_that_leaves_mid_stream_frees_the_engine(server: Server) -> None:
    before = server.metric("dflash_cancelled_requests_total")
    # the decode stops at its next step: the engine is free, the next request runs at once
    _leave_mid_stream(server, 6)
    assert server.metric("dflash_busy") == 0
    assert server.metric("dflash_cancelled_requests_total") == before + 1
    ok = server.client().chat.completions.create(model="default", messages=MESSAGES,
                                                 max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_clients_leaving_mid_stream_leave_nothing_behind(server: Server) -> None:
    """Ten clients in a row leave a stream after its first pieces: each time the engine,
    the queue and the decode threads return to idle, and the server's resident memory
    does not grow with them (printed; bounded by 64 MB over the ten, a guard against gross
    leaks only: the decode-thread gauge is the sharp check)."""

    def leave_and_wait_idle() -> None:
        _leave_mid_stream(server, 4)
        assert server.metric("dflash_busy") == 0
        # the turn ends only once its decode thread has stopped
        assert server.metric("dflash_decode_threads") == 0
        assert server.metric("dflash_queue_depth") == 0

    leave_and_wait_idle()  # the first one warms whatever is made once
    before = _rss_bytes(server.proc.pid)
    for _ in range(10):
        leave_and_wait_idle()
    after = _rss_bytes(server.proc.pid)
    print(f"server RSS {before / 2**20:.1f} MB -> {after / 2**20:.1f} MB over ten clients "
          "leaving mid-stream")
    assert after - before < 64 * 2**20


def test_a_full_queue_answers_429_and_sigterm_finishes_the_request_in_flight() -> None:
    s = Server("--queue-size", "1")
    try:
        body = {"model": "default", "prompt": "import os\n", "max_tokens": 200,
                "temperature": 0, "stream": True}
        events: list[str] = []

        def long_stream() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=300) as r:
                events.extend(r.iter_lines())

        first = threading.Thread(target=long_stream)
        first.start()
        while not s.metric("dflash_busy"):
            time.sleep(0.05)
        waiting = threading.Thread(target=lambda: httpx.post(
            s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2},
            timeout=300))
        waiting.start()
        while s.metric("dflash_queue_depth") < 1:
            time.sleep(0.05)
        busy = httpx.post(s.url + "/v1/completions", json={**body, "stream": False},
                          timeout=60)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["code"] == "queue_full"
        code = s.stop()  # SIGTERM while the stream decodes
        first.join(timeout=120)
        waiting.join(timeout=120)
        assert code == 0
        data = [e for e in events if e]
        assert data and data[-1] == "data: [DONE]"  # the request in flight finished
    finally:
        s.stop()
