"""The CPU recurrent and attention kernels' wall time per verified token (default target).

A CPU verify of ``T`` tokens runs each recurrent layer's gated delta rule, causal conv and
each attention layer's rows token by token (the torch references: that is what keeps a
token's bits independent of ``T``), so these are the part of a verify that grows with
its window. For ``T`` in 1, 2, 4, 8, 16 this times, at the shapes of the built-in default
target (read from its config) and a context of ``--context`` positions:

- ``gdn_verify`` (capture mode: every token's state into its checkpoint slot), and the
  decode form (``T = 1``, the state advanced in place);
- ``causal_conv1d_capture``;
- ``decode_attention`` over ``context + T`` keys;

each the fastest of ``--reps`` calls, and the slope per further token (a least-squares
fit over the five windows). ``--json`` writes the rows.

    python3 benchmarks/cpu_kernels.py [--reps 200] [--threads 2] [--context 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.data import require_default
from dflash.geometry import require_chain
from dflash.kernels import causal_conv1d_capture, decode_attention, gdn_verify
from dflash.model.config import HybridConfig

WINDOWS = (1, 2, 4, 8, 16)


def fastest(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` calls after five warm-ups, in microseconds."""
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def slope(times: list[float]) -> float:
    """Least-squares microseconds per further token over :data:`WINDOWS`."""
    n = len(WINDOWS)
    mx, my = sum(WINDOWS) / n, sum(times) / n
    num = sum((x - mx) * (y - my) for x, y in zip(WINDOWS, times, strict=True))
    return num / sum((x - mx) ** 2 for x in WINDOWS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = HybridConfig.from_hf_config(require_default("target") / "config.json")
    gen = torch.Generator().manual_seed(0)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kc, conv_dim = cfg.linear_conv_kernel_dim, cfg.conv_dim
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows: dict[str, list[float]] = {}
    with torch.inference_mode():
        state = torch.randn(1, hv, k_dim, v_dim, generator=gen) * 0.1
        checkpoints = torch.empty(1, 16, hv, k_dim, v_dim)
        snapshot = torch.empty_like(state)
        weight = torch.randn(conv_dim, kc, generator=gen) * 0.3
        conv_rows = torch.randn(1, kc - 1, conv_dim, generator=gen)
        captured = torch.empty(1, kc - 1 + 16, conv_dim)
        s_max = args.context + 16
        k_cache = torch.randn(1, kv_heads, s_max, d, generator=gen)
        v_cache = torch.randn(1, kv_heads, s_max, d, generator=gen)
        start = torch.tensor([args.context])
        for t in WINDOWS:
            q = torch.randn(1, t, hk, k_dim, generator=gen)
            k = torch.randn(1, t, hk, k_dim, generator=gen)
            v = torch.randn(1, t, hv, v_dim, generator=gen)
            g = -torch.rand(1, t, hv, generator=gen)
            beta = torch.rand(1, t, hv, generator=gen)
            chain = require_chain(list(range(-1, t - 1)))
            x = torch.randn(1, t, conv_dim, generator=gen)
            qa = torch.randn(1, t, heads, d, generator=gen)
            calls: dict[str, Callable[[], object]] = {
                "gdn_verify (capture)": functools.partial(
                    gdn_verify, q, k, v, g, beta, state, checkpoints, chain, snapshot=snapshot
                ),
                "causal_conv1d_capture": functools.partial(
                    causal_conv1d_capture, x, conv_rows, weight, None, captured
                ),
                "decode_attention": functools.partial(
                    decode_attention, qa, k_cache, v_cache, start
                ),
            }
            for name, call in calls.items():
                rows.setdefault(name, []).append(fastest(call, args.reps))
        live = state.clone()
        decode = fastest(functools.partial(
            gdn_verify, q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], live,
            live.unsqueeze(1), None, final_state_only=True), args.reps)  # fmt: skip
    print(f"{'kernel (µs a call)':<24}" + "".join(f"{f'T={t}':>9}" for t in WINDOWS)
          + f"{'per token':>11}")  # fmt: skip
    for name, times in rows.items():
        print(f"{name:<24}" + "".join(f"{x:9.1f}" for x in times) + f"{slope(times):11.1f}")
    print(f"{'gdn_verify (decode)':<24}{decode:9.1f}")
    if args.json:
        meta = {"python": platform.python_version(), "torch": torch.__version__,
                "threads": args.threads, "context": args.context, "reps": args.reps}  # fmt: skip
        out = {"windows": list(WINDOWS), "us": rows, "per_token_us":
               {n: slope(t) for n, t in rows.items()}, "gdn_decode_us": decode}  # fmt: skip
        Path(args.json).write_text(json.dumps({**meta, **out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
