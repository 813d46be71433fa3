"""τ of the default pair's DFlash drafter against the context length, with and without a
draft window (``--draft-window``), and prompt lookup's beside it.

Long inputs are windows of the held-out standard-library files (``drafter_tau.py``'s rule)
concatenated in a seeded order and tokenized with the default target's tokenizer: for each
length ``L`` (at most the target's 8,192 positions less the budget), ``--prompts`` windows
of ``L`` tokens at seeded offsets; each is decoded speculatively for ``--tokens`` tokens
(every draft verified whole, block 16) and τ is the mean accepted length per step over all
of them (bonus included). The target's prefill runs in chunks (``prefill_chunk``).

    python benchmarks/context_tau.py [--lengths 256,1024,2048,4096,7680] [--windows 0,512]
        [--prompts 4] [--tokens 64] [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from drafter_tau import BLOCK, heldout_files

from dflash.data import require_default
from dflash.execution import generate, plan_shards
from dflash.execution.shards import ShardedTarget
from dflash.model import TargetModel
from dflash.model.drafters import DFlashDrafter, Drafter, PromptLookupDrafter, make_drafter
from dflash.model.tokenizer import load_tokenizer


def long_stream(seed: int, need: int) -> list[int]:
    """Held-out files, shuffled by ``seed`` and concatenated, until ``need`` tokens."""
    tokenizer = load_tokenizer(require_default("target"))
    assert tokenizer is not None  # the default target ships one
    held = heldout_files(Path(sysconfig.get_paths()["stdlib"]))
    random.Random(seed).shuffle(held)
    ids: list[int] = []
    for path in held:
        ids += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace") + "\n\n")
        if len(ids) >= need:
            break
    return ids


def tau(model: TargetModel, make: Any, prompts: list[list[int]], tokens: int,
        device: str) -> dict[str, float]:
    plan = plan_shards(model.config.num_hidden_layers, device)
    target = ShardedTarget(model, plan, max_len=max(map(len, prompts)) + tokens + BLOCK + 1,
                           max_draft=BLOCK)
    steps = accepted = 0
    start = time.perf_counter()
    for prompt in prompts:
        drafter: Drafter = make()
        r = generate(model, drafter, prompt, plan=plan, max_new_tokens=tokens, block_size=BLOCK,
                     target=target, verify_window="full")
        steps += r.steps
        accepted += r.accepted_tokens
    return {"tau": (accepted + steps) / steps if steps else 0.0, "steps": float(steps),
            "seconds": time.perf_counter() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048,4096,7680")
    ap.add_argument("--windows", default="0,512", help="draft windows (0: none)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    windows = [int(x) or None for x in args.windows.split(",")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = TargetModel.from_pretrained(require_default("target"), dtype=dtype,
                                        device=args.device)
    limit = model.config.max_position_embeddings - args.tokens - BLOCK
    if max(lengths) > limit:
        raise SystemExit(f"--lengths: at most {limit} with --tokens {args.tokens}")
    stream = long_stream(args.seed, max(lengths) * args.prompts + max(lengths))
    rng = random.Random(args.seed)
    rows = []
    for length in lengths:
        prompts = []
        for _ in range(args.prompts):
            at = rng.randrange(0, len(stream) - length)
            prompts.append(stream[at : at + length])
        row: dict[str, Any] = {"length": length}
        row["prompt-lookup"] = tau(model, PromptLookupDrafter, prompts, args.tokens,
                                   args.device)
        for window in windows:
            def make(window: int | None = window) -> DFlashDrafter:
                drafter = make_drafter(str(require_default("drafter")), model)
                assert isinstance(drafter, DFlashDrafter)
                drafter.context_window = window
                return drafter

            row[f"dflash window {window or 'none'}"] = tau(model, make, prompts, args.tokens,
                                                          args.device)
        rows.append(row)
        print(f"{length:>6} tokens: " + "  ".join(
            f"{k} τ {v['tau']:.2f} ({v['seconds']:.1f} s)" for k, v in row.items()
            if k != "length"), file=sys.stderr, flush=True)
    report = {"python": platform.python_version(), "device": args.device,
              "torch": torch.__version__, "prompts": args.prompts, "tokens": args.tokens,
              "block_size": BLOCK, "seed": args.seed, "rows": rows}
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
