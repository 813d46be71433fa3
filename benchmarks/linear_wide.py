"""The M-invariant linear at verify widths: µs per call for M = 1 … 128 rows at the
Qwen3.5-9B projection shapes (one GPU), and the ratio to the 1-row call.

One program of :func:`dflash.kernels.linear` multiplies each weight tile it loads by every
16-row tile of the call (up to 128 rows), so a wide call should cost about what a 1-row
call costs while the weight read dominates. The table shows, per shape and M, the kernel's
µs, its ratio to M = 1, cuBLAS (``torch.nn.functional.linear``) for scale, and the
weight-read floor (weight bytes / 4.2e12 B/s). Before any timing, every shape checks that
rows of a 1-, 17- and 64-row call are bitwise the same rows inside a 128-row call; a
shape that fails is reported and its times are not.

Timing: ``--calls`` calls that walk several copies of the weight (so no call finds its
weight in the 60 MB L2 left by the previous one) are captured in one CUDA graph (the
host's launch cost is not timed); CUDA events around each replay, after ``--warmup``
replays; the median of ``--repeats`` replays, divided by the calls. bfloat16.

    python benchmarks/linear_wide.py [--out benchmarks/results/linear_wide.json]
        [--rows 1 16 32 64 128] [--repeats 30] [--stages]

``--stages`` also times the calls of 32 rows and more at every pipeline depth 1 … 4 (the
default depth comes from ``dflash.kernels.linear_triton.linear_config``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash.kernels import linear
from dflash.kernels.linear_triton import launch_linear, linear_config, linear_launch

HBM_BYTES_PER_S = 4.2e12
HIDDEN = 4096
#: (name, N, K): every distinct projection shape of the 9B model
SHAPES: list[tuple[str, int, int]] = [
    ("gdn.in_proj_qkv / attn.q_proj", 8192, HIDDEN),
    ("gdn.in_proj_z / out_proj / o_proj", 4096, HIDDEN),
    ("gdn.in_proj_a/b", 32, HIDDEN),
    ("attn.k_proj/v_proj", 1024, HIDDEN),
    ("mlp.gate/up", 12288, HIDDEN),
    ("mlp.down", HIDDEN, 12288),
    ("lm_head", 248320, HIDDEN),
]
ROWS = (1, 16, 32, 64, 128)
ROTATE_BYTES = 256 * 2**20   # weight bytes walked per timed loop (> L2)
MAX_COPIES = 16


def time_us(fn: Callable[[], object], calls: int, warmup: int, repeats: int) -> float:
    """Median µs of one call: ``fn`` (which makes ``calls`` calls) captured once in a CUDA
    graph, so the host's launch cost is not timed; CUDA events around each replay."""
    fn()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves Event untyped
        stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as above
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / calls)
    return float(statistics.median(samples))


def rows_invariant(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Rows of 1-, 17- and 64-row calls (at the front, the back and an odd offset of the
    128 rows) bitwise equal to the same rows of the 128-row call."""
    full = linear(x, w)
    n = x.shape[0]
    return all(
        torch.equal(linear(x[a : a + M], w), full[a : a + M])
        for M in (1, 17, 64) for a in (0, 7, n - M)
    )


def bench_shape(name: str, N: int, K: int, rows: tuple[int, ...], args: argparse.Namespace,
                ) -> dict[str, Any]:
    copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // (N * K * 2))))
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    ws = [(torch.randn(N, K, generator=gen, device="cuda") / K**0.5).bfloat16()
          for _ in range(copies)]
    x_all = torch.randn(max(128, *rows), K, generator=gen, device="cuda").bfloat16()
    floor_us = N * K * 2 / HBM_BYTES_PER_S * 1e6
    result: dict[str, Any] = {
        "name": name, "N": N, "K": K, "weight_copies": copies, "floor_us": round(floor_us, 2),
        "m_invariant": rows_invariant(x_all[:128], ws[0]), "rows": [],
    }
    if not result["m_invariant"]:
        print(f"  {name}: ROWS DEPEND ON M — times not reported", flush=True)
        return result
    base = None   # the 1-row call's µs (rows[0] is 1)
    for M in rows:
        x = x_all[:M].contiguous()
        y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        plan = linear_launch(M, N, K, torch.bfloat16)

        def run(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            for _ in range(args.calls // copies):
                for w in ws:
                    linear(x, w, out=y)

        def run_cublas(x: torch.Tensor = x) -> None:
            for _ in range(args.calls // copies):
                for w in ws:
                    F.linear(x, w)

        calls = args.calls // copies * copies
        us = time_us(run, calls, args.warmup, args.repeats)
        cublas_us = time_us(run_cublas, calls, args.warmup, args.repeats)
        base = us if base is None else base
        row: dict[str, Any] = {
            "M": M, "us": round(us, 2), "ratio_to_M1": round(us / base, 3),
            "cublas_us": round(cublas_us, 2), "frac_floor": round(floor_us / us, 3),
            "m_tiles": plan.m_tiles, "grid": list(plan.grid),
            "config": asdict(plan.config),
        }
        if args.stages and M >= 32:
            stage_us: dict[int, float | str] = {}
            for stages in (1, 2, 3, 4):
                cfg = replace(plan.config, num_stages=stages)

                def run_cfg(x: torch.Tensor = x, y: torch.Tensor = y,
                            cfg: Any = cfg) -> None:
                    for _ in range(args.calls // copies):
                        for w in ws:
                            launch_linear(x, w, None, y, cfg)

                try:
                    stage_us[stages] = round(time_us(run_cfg, calls, args.warmup,
                                                     args.repeats), 2)
                except Exception as exc:   # a depth may not fit the SM's shared memory
                    stage_us[stages] = type(exc).__name__
            row["us_by_stages"] = stage_us
        result["rows"].append(row)
        print(f"  {name:34s} M={M:3d}  {us:9.2f} us  x{us / base:5.2f}  "
              f"cublas {cublas_us:9.2f} us  floor {floor_us:8.2f} us  "
              f"tiles {plan.m_tiles} stages {plan.config.num_stages}"
              + (f"  by stages {row['us_by_stages']}" if "us_by_stages" in row else ""),
              flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                    help="row counts M to time (M = 1, the ratio's base, is always added)")
    ap.add_argument("--repeats", type=int, default=30, help="timed replays (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed replays first")
    ap.add_argument("--calls", type=int, default=32, help="calls per timed loop")
    ap.add_argument("--stages", action="store_true",
                    help="also time M >= 32 at pipeline depths 1 … 4")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_wide.py times the Triton kernel on a GPU: no CUDA device is "
              "available here, nothing was measured.", file=sys.stderr)
        return 2
    bad = [m for m in args.rows if not 1 <= m <= 4096]
    if bad or args.repeats < 1 or args.warmup < 0 or args.calls < 1:
        ap.error(f"--rows must be in 1 … 4096 (got {bad}); --repeats >= 1, --warmup >= 0, "
                 f"--calls >= 1 (got {args.repeats}, {args.warmup}, {args.calls})")
    rows = tuple(sorted({1, *args.rows}))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = [bench_shape(name, N, K, rows, args) for name, N, K in SHAPES]
    # one call of each distinct shape, summed: a rough per-M picture of a forward's linears
    total = {}
    if all(r["m_invariant"] for r in results):
        for i, M in enumerate(rows):
            total[M] = round(sum(r["rows"][i]["us"] for r in results), 2)
        print("\n  one call of each shape, summed:")
        for M, us in total.items():
            print(f"    M={M:3d}  {us:9.2f} us  x{us / total[rows[0]]:5.2f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "dtype": "bfloat16", "rows": list(rows), "repeats": args.repeats,
            "calls": args.calls, "shapes": results, "sum_of_shapes_us": total,
            "base_config": {n: asdict(linear_config(N, K, torch.bfloat16))
                            for n, N, K in SHAPES},
        }, indent=1))
        print(f"wrote {args.out}")
    return 0 if all(r["m_invariant"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
