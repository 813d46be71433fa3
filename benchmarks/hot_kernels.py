"""Two decode kernels against their byte floors, with launch-config sweeps (one GPU).

- ``attention``: :func:`dflash.kernels.decode_attention` at the 9B shape's attention
  (16 query heads, 4 KV heads, head dim 256, bf16) for committed contexts up to 256k keys
  in a 262,144-row cache, T = 1 and 16 rows, over the key-split sizes (below and from
  key 16384) and warps;
  the floor is the K and V bytes the rows can see. The default config's time is split
  into its two passes with the torch profiler.
- ``tiles``: the same attention, T = 1 and 16, by the row tiles one program holds (1, 2,
  4: the K/V loaded once per program) and warps (4, 8), the default splits; and whether
  each call's rows equal 16 T = 1 calls at the default warps, bit for bit.
- ``fp8``: :func:`dflash.kernels.fp8_linear` at the 9B shape's projections (M = 1 and 16)
  over N tiles, split-K counts, warps, pipeline stages and the kernel's forms (x-major,
  the bit conversion), beside the bf16 M-invariant linear; the floor is the weight bytes
  (and scales).
- ``prefill``: the prefill attention (:func:`dflash.kernels.prefill_attention`) at the 9B
  shape's attention, a 4,096-token prefill chunk ending at each context, over query and
  key tiles, warps and stages; TFLOPS of the causal products (4 D H flops per visible
  query-key pair), and each configuration's largest difference from the default's output.
- ``gdn``: one 9B GDN layer's prefill of ``--gdn-tokens`` tokens (a prefill chunk): the
  token loop (:func:`dflash.kernels.gdn_verify`, final state only) against
  :func:`dflash.kernels.gdn_chunk_prefill` in chunks of 32 and 64, float32 and tf32
  products. (The state is updated in place by every call: a timing, not a check.)

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``); floors
use the copy bandwidth measured in the same run. Prints a table per part, writes JSON.

    python benchmarks/hot_kernels.py --part attention fp8 gdn --out results/hot_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing

from dflash.kernels.attention_triton import (
    SPLIT_KEYS,
    WIDE_FROM,
    WIDE_KEYS,
    launch_decode_attention,
)
from dflash.kernels.fp8_linear import quantize_fp8
from dflash.kernels.fp8_linear_triton import (
    Fp8LinearConfig,
    fp8_linear_config,
    launch_fp8_linear,
)
from dflash.kernels.gdn import gdn_verify
from dflash.kernels.gdn_chunk import gdn_chunk_prefill
from dflash.kernels.linear import linear
from dflash.kernels.prefill_attention_triton import (
    PrefillConfig,
    launch_prefill_attention,
    prefill_config,
)

DEVICE = "cuda"


def timed(fn: Callable[[], object]) -> float:
    """Median microseconds of one ``fn()`` replayed in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=100,
                                 return_mode="median")
    return 2 * src.numel() * 4 / (float(ms) * 1e-3)


def attention_part(bw: float, contexts: list[int]) -> list[dict[str, Any]]:
    H, HKV, D, S = 16, 4, 256, 262_144 + 64
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k = torch.randn(1, HKV, S, D, generator=gen, device=DEVICE).bfloat16()
    v = torch.randn(1, HKV, S, D, generator=gen, device=DEVICE).bfloat16()
    rows = []
    # (narrow split, wide split, warps); the narrow splits end at WIDE_FROM ({WIDE_FROM})
    configs = list(itertools.product((128, 256, 512), (1024, 2048, 4096), (4, 8)))
    for L, T in itertools.product(contexts, (1, 16)):
        q = torch.randn(1, T, H, D, generator=gen, device=DEVICE).bfloat16()
        start = torch.tensor([L - T], device=DEVICE)
        out = torch.empty_like(q)
        floor_us = 2 * L * HKV * D * 2 / bw * 1e6
        best: tuple[float, tuple[int, int, int]] | None = None
        default_us = 0.0
        for sk, wk, w in configs:
            fn = partial(launch_decode_attention, q, k, v, start, D**-0.5, out, num_warps=w,
                         split_keys=sk, wide_keys=wk)
            try:
                us = timed(fn)
            except Exception as exc:  # a config the compiler refuses is skipped
                print(f"  skip split {sk} wide {wk} warps {w}: {type(exc).__name__}",
                      file=sys.stderr)
                continue
            if (sk, wk, w) == (SPLIT_KEYS, WIDE_KEYS, 4):
                default_us = us
            if best is None or us < best[0]:
                best = (us, (sk, wk, w))
        assert best is not None
        row = {"context": L, "T": T, "default_us": round(default_us, 1),
               "best_us": round(best[0], 1), "best": best[1], "floor_us": round(floor_us, 1)}
        rows.append(row)
        print(f"attention (wide from {WIDE_FROM}) L={L:>7,} T={T:>2}: default "
              f"{default_us:8.1f} us, best "
              f"{best[0]:8.1f} us (split {best[1][0]}, wide {best[1][1]}, warps "
              f"{best[1][2]}), floor {floor_us:7.1f} us", file=sys.stderr)
    # the default config's two passes at the longest context
    from torch.profiler import ProfilerActivity, profile

    L = contexts[-1]
    q = torch.randn(1, 1, H, D, generator=gen, device=DEVICE).bfloat16()
    start = torch.tensor([L - 1], device=DEVICE)
    launch_decode_attention(q, k, v, start, D**-0.5, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            launch_decode_attention(q, k, v, start, D**-0.5, None)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6), file=sys.stderr)
    return rows


def tiles_part(bw: float, contexts: list[int], stages: tuple[int, ...] = (2,),
               warp_counts: tuple[int, ...] = (4, 8)) -> list[dict[str, Any]]:
    H, HKV, D = 16, 4, 256
    S = max(contexts) + 64
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k = torch.randn(1, HKV, S, D, generator=gen, device=DEVICE).bfloat16()
    v = torch.randn(1, HKV, S, D, generator=gen, device=DEVICE).bfloat16()
    rows = []
    for L in contexts:
        floor_us = 2 * L * HKV * D * 2 / bw * 1e6
        q = torch.randn(1, 16, H, D, generator=gen, device=DEVICE).bfloat16()
        start = torch.tensor([L - 16], device=DEVICE)
        # rows of every call against 16 one-row calls as plain decoding makes them (the
        # default warps): a row's bits depend on neither the row tiles nor the warps
        alone = torch.cat([
            launch_decode_attention(q[:, t : t + 1], k, v, start + t, D**-0.5, None)
            for t in range(16)], 1)
        for warps, st in itertools.product(warp_counts, stages):
            for T, tiles in ((1, 1), (16, 1), (16, 2), (16, 4)):
                out = torch.empty_like(q[:, :T])
                fn = partial(launch_decode_attention, q[:, :T], k, v, start, D**-0.5, out,
                             num_warps=warps, row_tiles=tiles, num_stages=st)
                us = timed(fn)
                equal = bool(torch.equal(out, alone[:, :T]))
                row = {"context": L, "T": T, "warps": warps, "stages": st, "row_tiles": tiles,
                       "us": round(us, 1), "floor_us": round(floor_us, 1),
                       "rows_equal_one_row_calls": equal}
                rows.append(row)
                print(f"attention tiles L={L:>7,} T={T:>2} warps {warps} stages {st} row tiles "
                      f"{tiles}: {us:8.1f} us (floor {floor_us:6.1f}), rows equal T=1 calls: "
                      f"{equal}", file=sys.stderr)
    return rows


def fp8_part(bw: float, shapes: tuple[tuple[int, int], ...] = ((4096, 4096), (12288, 4096),
                                                              (4096, 12288), (8192, 4096)),
             ) -> list[dict[str, Any]]:
    """Each 9B projection shape at M = 1 and 16: the bf16 linear, the FP8 default, its
    x-major form with ``.to`` and with the bit conversion (bitwise checked against each
    other), and the best of a sweep over N tiles, splits, warps, stages and the forms."""
    rows = []
    forms = ((False, False), (True, False), (True, True))
    configs = list(itertools.product((64, 128), (1, 2, 4, 8), (4, 8), (4, 6), forms))
    for N, K in shapes:
        w = torch.randn(N, K, device=DEVICE) / K**0.5
        wq, s = quantize_fp8(w)
        wb = w.bfloat16()
        floor_us = (N * K + s.numel() * 4) / bw * 1e6
        for M in (1, 16):
            x = torch.randn(M, K, device=DEVICE).bfloat16()
            y = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
            bf16_us = timed(partial(linear, x, wb, None))
            default = replace(fp8_linear_config(N, K, torch.bfloat16), x_major=False,
                              bit_convert=False)
            default_us = timed(partial(launch_fp8_linear, x, wq, s, None, (128, 128), y,
                                       default))
            form_us, outs = {}, {}
            for name, (xm, bits) in (("x_major", (True, False)), ("x_major_bits", (True, True))):
                cfg = replace(default, x_major=xm, bit_convert=bits)
                form_us[name] = timed(partial(launch_fp8_linear, x, wq, s, None, (128, 128),
                                              y, cfg))
                outs[name] = launch_fp8_linear(x, wq, s, None, (128, 128), None, cfg)
            bits_equal = bool(torch.equal(outs["x_major"], outs["x_major_bits"]))
            best: tuple[float, Fp8LinearConfig] | None = None
            for bn, split, warps, stages, (xm, bits) in configs:
                cfg = Fp8LinearConfig(bn, 128, split, warps, stages, xm, bits)
                try:
                    us = timed(partial(launch_fp8_linear, x, wq, s, None, (128, 128), y, cfg))
                except Exception as exc:  # a config the compiler refuses is skipped
                    print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            assert best is not None
            b = best[1]
            row = {"N": N, "K": K, "M": M, "bf16_us": round(bf16_us, 1),
                   "default_us": round(default_us, 1),
                   "default": [default.block_n, default.split_k, default.num_warps,
                               default.num_stages],
                   "x_major_us": round(form_us["x_major"], 1),
                   "x_major_bits_us": round(form_us["x_major_bits"], 1),
                   "bits_equal_to_cvt": bits_equal,
                   "best_us": round(best[0], 1),
                   "best": [b.block_n, b.split_k, b.num_warps, b.num_stages, b.x_major,
                            b.bit_convert],
                   "floor_us": round(floor_us, 1)}
            rows.append(row)
            print(f"fp8 {N:>5}x{K:<5} M={M:>2}: bf16 {bf16_us:7.1f} us, fp8 default "
                  f"{default_us:7.1f}, x-major {form_us['x_major']:7.1f}, x-major + bits "
                  f"{form_us['x_major_bits']:7.1f} (bits equal: {bits_equal}), best "
                  f"{best[0]:7.1f} ({row['best']}: block_n, split, warps, stages, x_major, "
                  f"bits), floor {floor_us:6.1f} us", file=sys.stderr)
    return rows


def prefill_part(contexts: list[int], chunk: int = 4096) -> list[dict[str, Any]]:
    H, HKV, D = 16, 4, 256
    S = max(contexts)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    k = torch.randn(1, HKV, S, D, generator=gen, device=DEVICE).bfloat16()
    v = torch.randn(1, HKV, S, D, generator=gen, device=DEVICE).bfloat16()
    q = torch.randn(1, chunk, H, D, generator=gen, device=DEVICE).bfloat16()
    default = prefill_config(D, (H // HKV) * chunk, 2)
    configs = [default] + [
        PrefillConfig(bm, bn, w, st)
        for bm, bn, w, st in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))
        if (bm, bn, w, st) != (default.block_m, default.block_n, default.num_warps,
                               default.num_stages)
    ]
    rows = []
    for L in contexts:
        start = L - chunk
        pairs = sum(start + t + 1 for t in range(chunk))
        flops = 4 * D * H * pairs
        want = launch_prefill_attention(q, k, v, start, D**-0.5, None)
        for cfg in configs:
            out = torch.empty_like(q)
            fn = partial(launch_prefill_attention, q, k, v, start, D**-0.5, out, config=cfg)
            try:
                us = timed(fn)
            except Exception as exc:  # a config the compiler refuses is skipped
                print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            diff = float((out.float() - want.float()).abs().max())
            row = {"context": L, "chunk": chunk, "block_m": cfg.block_m,
                   "block_n": cfg.block_n, "warps": cfg.num_warps, "stages": cfg.num_stages,
                   "default": cfg == default, "us": round(us, 1),
                   "tflops": round(flops / us / 1e6, 1), "max_abs_diff_vs_default": diff}
            rows.append(row)
            print(f"prefill L={L:>7,} {cfg.block_m:>3}x{cfg.block_n:<3} warps {cfg.num_warps} "
                  f"stages {cfg.num_stages}{' (default)' if cfg == default else ''}: "
                  f"{us:10.1f} us, {row['tflops']:6.1f} TFLOPS, max diff {diff:.2e}",
                  file=sys.stderr)
    return rows


def gdn_part(T: int) -> list[dict[str, Any]]:
    """One 9B GDN layer's prefill of ``T`` tokens: the token loop against the chunk-parallel
    form (each chunk size, float32 and tf32 products)."""
    HK, HV, K, V = 16, 32, 128, 128
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE)

    q, k, v = rnd(1, T, HK, K).bfloat16(), rnd(1, T, HK, K).bfloat16(), rnd(1, T, HV, V).bfloat16()
    g = torch.nn.functional.logsigmoid(rnd(1, T, HV) + 2.0)
    beta = torch.sigmoid(rnd(1, T, HV)).bfloat16()
    state = rnd(1, HV, K, V) * 0.5
    rows = []
    loop_us = timed(partial(gdn_verify, q, k, v, g, beta, state, state.unsqueeze(1), None,
                            final_state_only=True, backend="triton"))
    rows.append({"form": "token loop", "T": T, "us": round(loop_us, 1)})
    print(f"gdn T={T}: token loop {loop_us:9.1f} us", file=sys.stderr)
    for chunk, precision in itertools.product((32, 64), ("ieee", "tf32")):
        us = timed(partial(gdn_chunk_prefill, q, k, v, g, beta, state, chunk=chunk,
                           precision=precision, backend="triton"))
        rows.append({"form": "chunked", "chunk": chunk, "precision": precision, "T": T,
                     "us": round(us, 1)})
        print(f"gdn T={T}: chunked {chunk:>3} {precision:>4} {us:9.1f} us", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", choices=("attention", "tiles", "prefill", "fp8", "gdn"),
                    default=["attention", "fp8", "gdn"])
    ap.add_argument("--gdn-tokens", type=int, default=4096, help="tokens of the GDN prefill")
    ap.add_argument("--contexts", default="8192,32768,131072,262144")
    ap.add_argument("--prefill-contexts", default="8192,32768,131072",
                    help="contexts at which a 4,096-token prefill chunk ends")
    ap.add_argument("--stages", default="2", help="the tiles part's pipeline stages (a list)")
    ap.add_argument("--warps", default="4,8", help="the tiles part's warp counts (a list)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "copy_bandwidth_bytes_per_s": bw,
    }
    if "attention" in args.part:
        report["attention"] = attention_part(bw, [int(c) for c in args.contexts.split(",")])
    if "tiles" in args.part:
        report["tiles"] = tiles_part(bw, [int(c) for c in args.contexts.split(",")],
                                     tuple(int(s) for s in args.stages.split(",")),
                                     tuple(int(w) for w in args.warps.split(",")))
    if "prefill" in args.part:
        report["prefill"] = prefill_part([int(c) for c in args.prefill_contexts.split(",")])
    if "fp8" in args.part:
        report["fp8"] = fp8_part(bw)
    if "gdn" in args.part:
        report["gdn"] = gdn_part(args.gdn_tokens)
    text = json.dumps(report, indent=2)
    if args.out is None:
        print(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
