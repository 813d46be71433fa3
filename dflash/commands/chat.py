"""dflash chat: a conversation on the terminal, through the same chat template and decode as
dflash serve's /v1/chat/completions.

Each line read from stdin is a user message; the reply streams to stdout as it is
committed, then a one-line summary (tokens, tokens/s, acceptance) goes to stderr. The
whole conversation is the next prompt. ``/reset`` forgets it, ``/exit`` (or end of input)
ends the session. The flags are checked before the model loads (exit 2). A turn the model
cannot take (the conversation grown past the context, a template that fails on it) is
reported on stderr and dropped: the conversation before it goes on, and the session ends
with exit 1 instead of 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat", help="chat on the terminal",
        description=" ".join(__doc__.split("\n\n")[0].split()).removeprefix("dflash chat: "),
    )
    p.add_argument("--model", default="default")
    p.add_argument("--draft", default="dflash+lookup",
                   help="the drafter (as dflash generate --draft), or 'none'")
    p.add_argument("--devices", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--system", default=None, help="a system message to begin with")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a jinja chat template file instead of the checkpoint's")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per reply (256)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None,
                   help="a stop string (repeatable)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dflash
    from dflash.commands.generate import sampling_params
    from dflash.errors import DFlashError, UsageError

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    sampling_params(args)  # --temperature, --top-k, --top-p, --min-p, --seed, named
    if args.stop is not None and not all(args.stop):
        raise UsageError(f"--stop must not be empty (got {args.stop!r})")
    devices = args.devices or _default_device()
    llm = dflash.load(model=args.model, draft=None if args.draft == "none" else args.draft,
                      device=devices, dtype=args.dtype)
    if args.chat_template is not None:
        llm.use_chat_template(args.chat_template)
    start = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages: list[dict[str, str]] = list(start)
    tty = sys.stdin.isatty()
    failed = 0
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 1 if failed else 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(start)
            print("(conversation reset)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            stream = llm.stream(llm.render_chat(messages), max_new_tokens=args.max_tokens,
                                temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                stop=args.stop)
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except DFlashError as exc:  # this turn only: the conversation before it goes on
            messages.pop()
            failed += 1
            print(f"dflash chat: {str(exc).replace('max_new_tokens', '--max-tokens')} "
                  "(the message is dropped; /reset starts over)", file=sys.stderr)
            continue
        r = stream.result
        sys.stdout.write("\n")
        sys.stdout.flush()
        rate = "-" if r.timings.tokens_per_s is None else f"{r.timings.tokens_per_s:.1f}"
        print(f"({len(r.tokens)} tokens, {rate} tokens/s, acceptance {r.acceptance_rate:.2f}, "
              f"stop: {r.stop_reason})", file=sys.stderr)
        messages.append({"role": "assistant", "content": r.text or ""})


def _default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"
