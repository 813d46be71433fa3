"""The FP8 and bf16 linears at the 9B shape's projections, one launch each, against the
byte floor: every member of a projection group alone (the unfused launches) and every
group as one weight (the fused launches), M = 1 and 16.

For each shape: the bf16 linear (:func:`dflash.kernels.linear`) and the FP8 linear's
default launch (:func:`dflash.kernels.fp8_linear_triton.launch_fp8_linear`), timed as
CUDA-graph medians (``triton.testing.do_bench_cudagraph``), with the floor of its weight
bytes at the measured copy bandwidth. ``--sweep`` adds, for the fused shapes at M = 1, the
best of N tiles, split-K counts and warps (each configuration checked against the
default's output: another split is another reduction order, so they agree closely, not
bitwise). ``--ncu`` instead runs each FP8 and bf16 launch of the fused shapes three times
eagerly (no graphs, no timing), for ``ncu --kernel-name regex:linear`` to read. GPU only.

    python benchmarks/fp8_shapes.py [--sweep] [--json out.json]
    ncu --clock-control none --kernel-name regex:linear --section SpeedOfLight \
        python benchmarks/fp8_shapes.py --ncu
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from hot_kernels import copy_bandwidth, timed

from dflash.kernels.fp8_linear import quantize_fp8
from dflash.kernels.fp8_linear_triton import (
    Fp8LinearConfig,
    fp8_linear_config,
    launch_fp8_linear,
)
from dflash.kernels.linear import linear
from dflash.model import HybridConfig

DEVICE = "cuda"
BLOCK = (128, 128)


def shapes(config: HybridConfig) -> list[tuple[str, int, int, bool]]:
    """``(name, N, K, fused)`` of every projection launch of ``config``'s decoder layers:
    each group's members and the group as one weight (every member padded to whole
    128-row scale blocks, as an FP8 group is fused)."""
    h, i = config.hidden_size, config.intermediate_size
    d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    kd = config.linear_num_key_heads * config.linear_key_head_dim
    vd = config.linear_num_value_heads * config.linear_value_head_dim
    hv = config.linear_num_value_heads

    def padded(*ns: int) -> int:
        return sum(-(-n // BLOCK[0]) * BLOCK[0] for n in ns)

    return [
        ("gdn in_proj (qkv, z, b, a)", padded(2 * kd + vd, vd, hv, hv), h, True),
        ("attention qkv (q+gate, k, v)", padded(2 * hq * d, hkv * d, hkv * d), h, True),
        ("mlp gate_up", 2 * i, h, True),
        ("gdn out_proj", h, vd, True),
        ("attention o_proj", h, hq * d, True),
        ("mlp down_proj", h, i, True),
        ("gdn in_proj_qkv", 2 * kd + vd, h, False),
        ("gdn in_proj_z", vd, h, False),
        ("gdn in_proj_b / a", hv, h, False),
        ("attention q_proj", 2 * hq * d, h, False),
        ("attention k_proj / v_proj", hkv * d, h, False),
        ("mlp gate_proj / up_proj", i, h, False),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    bw = 0.0 if args.ncu else copy_bandwidth()
    for name, N, K, fused in shapes(HybridConfig.nine_b_shape()):
        if args.ncu and not fused:
            continue
        w = torch.randn(N, K, device=DEVICE) / K**0.5
        wq, s = quantize_fp8(w, BLOCK)
        wb = w.bfloat16()
        del w
        for M in (1, 16):
            x = torch.randn(M, K, device=DEVICE).bfloat16()
            y = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
            if args.ncu:
                for _ in range(3):
                    linear(x, wb, None)
                    launch_fp8_linear(x, wq, s, None, BLOCK, y)
                torch.cuda.synchronize()
                continue
            cfg = fp8_linear_config(N, K, torch.bfloat16, BLOCK)
            bf16_us = timed(partial(linear, x, wb, None))
            fp8_us = timed(partial(launch_fp8_linear, x, wq, s, None, BLOCK, y))
            fp8_floor = (wq.numel() + s.numel() * 4) / bw * 1e6
            bf16_floor = wb.numel() * 2 / bw * 1e6
            row: dict[str, Any] = {
                "shape": name, "N": N, "K": K, "fused": fused, "M": M,
                "bf16_us": round(bf16_us, 2), "bf16_floor_us": round(bf16_floor, 2),
                "fp8_us": round(fp8_us, 2), "fp8_floor_us": round(fp8_floor, 2),
                "fp8_config": [cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages],
            }
            if args.sweep and fused and M == 1:
                want = launch_fp8_linear(x, wq, s, None, BLOCK, None).float()
                best: tuple[float, Fp8LinearConfig] | None = None
                for bn, split, warps in itertools.product((64, 128, 256), (1, 2, 4, 8, 16),
                                                          (4, 8)):
                    c = replace(cfg, block_n=bn, split_k=split, num_warps=warps,
                                num_stages=3 if bn == 256 else cfg.num_stages)
                    try:
                        got = launch_fp8_linear(x, wq, s, None, BLOCK, None, c).float()
                        us = timed(partial(launch_fp8_linear, x, wq, s, None, BLOCK, y, c))
                    except Exception as exc:  # a config the compiler refuses is skipped
                        print(f"  skip {c}: {type(exc).__name__}", file=sys.stderr)
                        continue
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                        raise AssertionError(f"{name}: config {c} disagrees with the default")
                    if best is None or us < best[0]:
                        best = (us, c)
                if best is not None:
                    b = best[1]
                    row["fp8_best_us"] = round(best[0], 2)
                    row["fp8_best"] = [b.block_n, b.split_k, b.num_warps, b.num_stages]
            rows.append(row)
            best_txt = (f", best {row['fp8_best_us']:6.1f} {row['fp8_best']}"
                        if "fp8_best_us" in row else "")
            print(f"{name:30s} {N:>6}x{K:<6} M={M:<2} bf16 {bf16_us:6.1f} us "
                  f"({bf16_floor:5.1f} floor)  fp8 {fp8_us:6.1f} us ({fp8_floor:5.1f} floor) "
                  f"{row['fp8_config']}{best_txt}", flush=True)
    if args.json and rows:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_GBps": round(bw / 1e9, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
