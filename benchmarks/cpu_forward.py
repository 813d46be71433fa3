"""Wall time of one decode forward and one verify forward of the default target on CPU.

The speculative step's target cost on a CPU: a ``T``-token verify against the one-token
decode that plain greedy decoding repeats. Median of ``--reps`` forwards after a prompt of
``--prompt-len`` seeded tokens; each verify is undone (snapshot restore) so every
measured verify starts from the same position.

    python3 benchmarks/cpu_forward.py [--threads 2] [--reps 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash.data import require_default
from dflash.geometry import require_chain
from dflash.model import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = TargetModel.from_pretrained(require_default("target"))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab - 1, (1, args.prompt_len), generator=gen)
    rows: dict[str, float] = {}
    with torch.inference_mode():
        for t in (1, 4, 8, 16):
            caches = model.new_caches(max_len=args.prompt_len + args.reps + 32, max_draft=16)
            model(prompt, caches, "prefill")
            ids = torch.randint(1, vocab - 1, (1, t), generator=gen)
            chain = require_chain(list(range(-1, t - 1)))
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                if t == 1:
                    model(ids, caches, "decode")
                else:
                    model(ids, caches, "verify", geometry=chain)
                times.append(time.perf_counter() - t0)
                if t > 1:  # undo the verify: the next one starts at the same position
                    caches.pool.restore_pre_verify()
                    caches.kv.truncate(caches.pool.length)
            name = "decode (T=1)" if t == 1 else f"verify (T={t})"
            rows[name] = statistics.median(times) * 1e3
            print(f"{name:<14} {rows[name]:7.2f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "ms": rows}, indent=2))


if __name__ == "__main__":
    main()
