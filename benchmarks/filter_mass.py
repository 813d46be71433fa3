"""Top-p's mass launches (``dflash.kernels.filter_triton.launch_filter_nucleus``) across
launch configurations, on Qwen3.5-sized rows.

Top-p alone must know, for every row, the exact integer mass of the tokens above its cut
before the cut can be found; those passes read every token and are most of what top-p
costs. This sweeps the tokens per program (``--chunks``), the tokens per step
(``--blocks``) and the warps per program (``--warps``) on ``--rows`` bf16 rows of 248,320
tokens at two spreads of logits, checks that every configuration's results (the cut's
eighth, the mass above it, the total, min-p's lowest bin, the row's top bin and the
second level's masses by bucket) equal the product configuration's (integers: any
difference is a bug), and times each as 20 calls inside one CUDA graph. GPU only.

    python benchmarks/filter_mass.py [--rows 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from typing import Any

import torch
from sampling_cost import _graphed  # 20 calls in one CUDA graph, timed by events

from dflash.kernels import filter_triton as ft
from dflash.model import HybridConfig


def _ints(arg: str) -> list[int]:
    return [int(x) for x in arg.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--chunks", type=_ints, default=[4096, 2048, 1024, 512])
    ap.add_argument("--blocks", type=_ints, default=[128, 256, 512])
    ap.add_argument("--warps", type=_ints, default=[2, 4, 8])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    vocab = HybridConfig.nine_b_shape().vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    for spread, inv_t in ((4.0, 1 / 0.7), (1.0, 1.0)):
        logits = (torch.randn(args.rows, vocab, generator=gen, device="cuda") * spread
                  ).to(torch.bfloat16)
        bits16 = logits.view(torch.int16)
        inv = float(torch.tensor(inv_t, dtype=torch.float32))
        # the rows' group maxima, as the floors' first launch finds them
        chunks = math.ceil(vocab / ft.CHUNK)
        maxima = torch.empty(args.rows, chunks * ft.GROUPS, dtype=torch.int32, device="cuda")
        hist = torch.empty(args.rows, ft.NBINS, dtype=torch.int32, device="cuda")
        ft.filter_maxima_kernel[(args.rows, chunks)](bits16, maxima, hist, vocab, chunks,
                                                     BV=ft.CHUNK, SUB=ft.GROUPS, num_warps=4)
        want = _integers(ft.launch_filter_nucleus(bits16, maxima, inv, 0.95, math.log(0.001),
                                                  True))
        for chunk, block, warps in itertools.product(args.chunks, args.blocks, args.warps):
            if block > chunk:
                continue

            def run(chunk: int = chunk, block: int = block, warps: int = warps,
                    bits16: torch.Tensor = bits16, maxima: torch.Tensor = maxima,
                    inv: float = inv) -> dict[str, torch.Tensor]:
                return ft.launch_filter_nucleus(bits16, maxima, inv, 0.95, math.log(0.001),
                                                True, chunk=chunk, block=block, warps=warps)

            try:
                got = _integers(run())
                exact = all(torch.equal(got[k], want[k]) for k in want)
                us = _graphed(run, 20) * 1e3  # ms per call -> µs
            except Exception as exc:  # a configuration that does not compile is reported
                print(f"spread {spread} chunk {chunk} block {block} warps {warps}: "
                      f"{type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            product = (chunk, block, warps) == (ft.MASS_CHUNK, ft.MASS_BLOCK, ft.MASS_WARPS)
            rows.append({"spread": spread, "inv_t": inv, "chunk": chunk, "block": block,
                         "warps": warps, "us": us, "exact": exact, "product": product})
            print(f"spread {spread} chunk {chunk:5d} block {block:4d} warps {warps}: "
                  f"{us:8.1f} us exact {exact}{'  (product)' if product else ''}", flush=True)
    print("\n| spread | chunk | block | warps | µs | results equal |")
    print("|---|---:|---:|---:|---:|---|")
    for spread in sorted({r["spread"] for r in rows}):
        best = sorted((r for r in rows if r["spread"] == spread), key=lambda r: r["us"])
        for r in best[:5] + [r for r in best[5:] if r["product"]]:
            print(f"| {r['spread']} | {r['chunk']} | {r['block']} | {r['warps']} | "
                  f"{r['us']:.1f}{' (product)' if r['product'] else ''} | {r['exact']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "rows": args.rows, "vocab": vocab, "results": rows}, f, indent=2)
        print(f"wrote {args.json}")


def _integers(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The launch's results with its partials summed: the same for every configuration."""
    return {**out, "masses": out["masses"].sum(1)}


if __name__ == "__main__":
    main()
