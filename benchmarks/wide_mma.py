"""Are wider row tiles bit-for-bit the 16-row tiles? The M-invariant linear at 16, 32, 64
and 128 rows per MMA, compared bitwise and timed (one GPU).

:func:`dflash.kernels.linear_triton.linear_kernel` multiplies each weight tile by
``BLOCK_M``-row tiles of x (``[BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]`` products,
float32 accumulators, K ascending). Production uses ``BLOCK_M = 16`` for every call, so a
row's bits never depend on the call's width, and a 64-row call runs four 16-wide MMAs
per weight tile. A 64-wide MMA is one instruction of the same K order: if the tensor
cores reduce each output element the same way whatever the MMA's width, its rows are the
16-wide rows bit for bit, and a wide verify costs fewer MMA issues. This script measures
exactly that, on data built to expose a different summation order (magnitudes spread over
2^-20 … 2^20, 2^-6 … 2^6 in fp16, cancellation), at every 9B projection shape, for bf16,
fp16 and float32:

- ``equal``: every output of every ``BLOCK_M`` run equals the 16-wide run's, bitwise;
- ``us``: µs of one call at M = 64 and 128 for each ``BLOCK_M`` (CUDA graph replays over
  rotating weights, as ``linear_wide.py``).

    python benchmarks/wide_mma.py [--out wide_mma.json] [--trials 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import triton
from linear_wide import time_us  # the same CUDA-graph timing (run from benchmarks/)

from dflash.kernels.linear_triton import (
    BLOCK_REDUCE,
    linear_config,
    linear_kernel,
    linear_reduce_kernel,
)

SHAPES = [(8192, 4096), (4096, 4096), (32, 4096), (1024, 4096), (12288, 4096),
          (4096, 12288), (248320, 4096)]
WIDTHS = (16, 32, 64, 128)


def run_linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_m: int) -> None:
    """``y = x @ w.T`` by the production kernel with ``BLOCK_M = block_m`` row tiles (one
    program per weight tile holds up to 128 rows: ``128 / block_m`` tiles)."""
    M, K = x.shape
    N = w.shape[0]
    tiles = min(128 // block_m, int(triton.next_power_of_2(triton.cdiv(M, block_m))))
    cfg = linear_config(N, K, x.dtype, max(1, tiles * block_m // 16))
    k_per = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per)
    groups = triton.cdiv(triton.cdiv(M, block_m), tiles)
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    linear_kernel[(groups, triton.cdiv(N, cfg.block_n), split)](
        x, w, w, y, ws, ws, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        K_PER_SPLIT=k_per, SPLIT_K=split, HAS_BIAS=False, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, BLOCK_M=block_m, M_TILES=tiles,
        F32_DOT=x.dtype == torch.float32, EMULATE=False, FIXUP=False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        linear_reduce_kernel[(triton.cdiv(N, BLOCK_REDUCE), M)](
            ws, w, y, M, N, y.stride(0), SPLIT_K=split, HAS_BIAS=False, BLOCK=BLOCK_REDUCE,
            num_warps=4,
        )


def hostile(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values whose magnitudes span 2^-20 … 2^20 with random signs: sums of them
    round differently under any other order."""
    mant = torch.rand(shape, generator=gen, device="cuda") + 1.0
    top = 6 if dtype == torch.float16 else 20
    exp = torch.randint(-top, top + 1, shape, generator=gen, device="cuda").float()
    sign = torch.randint(0, 2, shape, generator=gen, device="cuda").float() * 2 - 1
    lim = 2.0**6 if dtype == torch.float16 else 2.0**20
    return (sign * mant * torch.exp2(exp)).clamp(-lim, lim).to(dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "shapes": [],
    }
    all_equal = True
    for N, K in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if N > 100_000 and dtype != torch.bfloat16:
                continue
            trials = 2 if N > 100_000 else args.trials
            equal = {bm: 0 for bm in WIDTHS[1:]}
            for _ in range(trials):
                w = hostile((N, K), dtype, gen)
                x = hostile((128, K), dtype, gen)
                ref = torch.empty(128, N, dtype=dtype, device="cuda")
                run_linear(x, w, ref, 16)
                for bm in WIDTHS[1:]:
                    y = torch.full_like(ref, float("nan"))
                    run_linear(x, w, y, bm)
                    itype = torch.int32 if dtype == torch.float32 else torch.int16
                    equal[bm] += int(torch.equal(y.view(itype), ref.view(itype)))
            ok = {bm: equal[bm] == trials for bm in equal}
            all_equal &= all(ok.values())
            row: dict[str, Any] = {"N": N, "K": K, "dtype": str(dtype).split(".")[-1],
                                   "trials": trials, "equal": ok}
            if dtype == torch.bfloat16:
                copies = max(1, min(16, (256 << 20) // (N * K * 2)))
                ws = [torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
                      for _ in range(copies)]
                times: dict[str, float] = {}
                for M in (1, 16, 64, 128):
                    xm = torch.randn(M, K, device="cuda", dtype=dtype)
                    ym = torch.empty(M, N, device="cuda", dtype=dtype)
                    for bm in WIDTHS:
                        if bm > 16 and M <= 16:
                            continue

                        def fn(xm: torch.Tensor = xm, ym: torch.Tensor = ym,
                               ws: list[torch.Tensor] = ws,
                               bm: int = bm) -> None:
                            for w_ in ws:
                                run_linear(xm, w_, ym, bm)
                        times[f"M{M}_bm{bm}"] = round(time_us(fn, copies, 3, 15), 2)
                row["us"] = times
                del ws
            report["shapes"].append(row)
            print(json.dumps(row), flush=True)
    report["all_equal"] = all_equal
    print("all_equal", all_equal)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
