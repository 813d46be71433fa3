"""A load test of ``dflash serve``: a real server (a subprocess) and concurrent clients.

``--clients`` threads each send ``--requests`` streamed chat completions of
``--max-tokens`` tokens (temperature 0, each client its own prompt) with the official
``openai`` client; every answer is checked against the first answer to its prompt. Prints
and writes (``--json``) throughput, the latency and time-to-first-token percentiles
(inclusive: never past the slowest request), and the server's tokens/s; one request
before the load (kernels compiled, CUDA graphs captured) is timed apart.

    python benchmarks/serve_load.py [--model default] [--devices cpu] [--clients 8]
        [--requests 20] [--max-tokens 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="dflash+lookup")
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port = _port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "dflash.cli", "serve", "--model", args.model, "--draft",
         args.draft, "--devices", args.devices, "--port", str(port), "--queue-size",
         str(args.clients)], cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not come up") from None
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        latencies: list[float] = []
        firsts: list[float] = []
        answers: dict[str, str] = {}
        failures: list[str] = []
        tokens = 0
        lock = threading.Lock()

        def one(k: int) -> None:
            nonlocal tokens
            prompt = f"def function_{k}(values):\n    "
            for _ in range(args.requests):
                start = time.perf_counter()
                first = None
                pieces = []
                used = 0
                for chunk in client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter() - start
                        pieces.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
                text = "".join(pieces)
                with lock:
                    latencies.append(time.perf_counter() - start)
                    if first is not None:
                        firsts.append(first)
                    tokens += used
                    if answers.setdefault(prompt, text) != text:
                        failures.append(prompt)

        # one request before the clock starts: the first compiles the kernels and captures
        # the CUDA graphs (reported apart, not a percentile of the load)
        warm = time.perf_counter()
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=args.max_tokens, temperature=0)
        warmup_s = time.perf_counter() - warm
        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        # inclusive: a percentile between the samples, never past the largest
        q = statistics.quantiles(latencies, n=100, method="inclusive")
        qf = statistics.quantiles(firsts, n=100, method="inclusive")
        report: dict[str, Any] = {
            "model": args.model, "draft": args.draft, "devices": args.devices,
            "clients": args.clients, "requests_per_client": args.requests,
            "max_tokens": args.max_tokens, "python": platform.python_version(),
            "warmup_request_s": warmup_s,
            "requests": len(latencies), "failures": len(failures), "wall_s": wall,
            "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens / wall,
            "latency_p50_s": statistics.median(latencies), "latency_p99_s": q[98],
            "first_token_p50_s": statistics.median(firsts), "first_token_p99_s": qf[98],
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 1 if failures else 0
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
