"""dflash serve: OpenAI's HTTP API (chat and text completions, SSE streaming) on one model.

    dflash serve [--model DIR|default] [--draft dflash+lookup|DIR|prompt-lookup|none]
                 [--host 127.0.0.1] [--port 8000] [--chat-template FILE] ...

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). One generation decodes at a time; others wait in a
bounded queue (--queue-size; one more is answered 429 with Retry-After). SIGTERM or Ctrl-C
stops accepting connections and finishes the requests in flight.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="default",
                   help="a checkpoint directory or a built-in name (default: the embedded pair)")
    p.add_argument("--draft", default="dflash+lookup",
                   help="the drafter (as dflash generate --draft), or 'none' for plain decoding")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: the --model value's last part)")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a jinja chat template file instead of the checkpoint's")
    p.add_argument("--devices", default=None, help="comma-separated devices, one per shard")
    p.add_argument("--layer-split", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--rollback", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens per prefill forward, and the prefix cache's grain: a "
                   "prompt reuses a cached prefix up to a multiple of it (default 512)")
    p.add_argument("--prefix-cache-mb", type=int, default=512,
                   help="MB of prefilled prefixes kept (least recently used out; 0: none; "
                   "default 512)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--draft-window", type=int, default=None)
    p.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait while one decodes (default 16)")
    p.add_argument("--queue-timeout", type=float, default=600.0,
                   help="seconds a request waits for its turn before a 503 (default 600)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a generation may decode once admitted; past them it is "
                   "stopped and answered with a 504 (default 600)")
    p.add_argument("--default-max-tokens", type=int, default=512,
                   help="a request's budget when it names none (default 512)")
    p.add_argument("--max-body-mb", type=int, default=16,
                   help="the largest request body in MiB; a larger one is answered with a "
                   "413 before it is read (default 16)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import importlib.util

    import dflash
    from dflash.errors import UsageError

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"dflash serve needs {' and '.join(missing)}: pip install 'dflash[serve]'"
        )
    from dflash.serve import ServeConfig, listen, run_server

    for flag, value, low in (("--queue-size", args.queue_size, 0),
                             ("--default-max-tokens", args.default_max_tokens, 1),
                             ("--max-body-mb", args.max_body_mb, 1)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low} (got {value})")
    for flag, seconds in (("--queue-timeout", args.queue_timeout),
                          ("--request-timeout", args.request_timeout)):
        if not seconds > 0 or seconds == float("inf"):
            raise UsageError(f"{flag} must be a number of seconds > 0 (got {seconds})")
    sock = listen(args.host, args.port)  # before the model loads: a taken port fails at once
    devices = args.devices or ("cuda:0" if _cuda() else "cpu")
    llm = dflash.load(
        model=args.model, draft=None if args.draft == "none" else args.draft, device=devices,
        dtype=args.dtype, rollback=args.rollback, block_size=args.block_size,
        layer_split=args.layer_split, prefill_chunk=args.prefill_chunk or None,
        max_context=args.max_context, draft_window=args.draft_window,
        prefix_cache_mb=args.prefix_cache_mb,
    )
    if args.chat_template is not None:
        llm.use_chat_template(args.chat_template)
    name = args.served_model_name or Path(args.model.rstrip("/")).name or args.model
    config = ServeConfig(model_name=name, queue_size=args.queue_size,
                         queue_timeout_s=args.queue_timeout,
                         request_timeout_s=args.request_timeout,
                         default_max_tokens=args.default_max_tokens,
                         max_body_bytes=args.max_body_mb * 2**20)

    def ready(url: str) -> None:
        print(f"dflash serve: {name!r} at {url}/v1 (drafter {args.draft}, {devices})",
              file=sys.stderr, flush=True)

    run_server(llm, config, sock, on_ready=ready)
    return 0


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
