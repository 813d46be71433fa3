"""M-invariant kernels against cuBLAS / SDPA at the Qwen3.5-9B decode shapes (one GPU).

Linear: every projection shape for M = 1, 4, 16 rows, the Triton kernel against
``torch.nn.functional.linear`` (cuBLAS), in µs and as a fraction of the weight-read floor
(weight bytes / 4.2e12 B/s). Attention: 1,024 keys of context, T = 1 (decode) and
T = 16 (verify), H = 16, HKV = 4, D = 256, against ``scaled_dot_product_attention``.
"M-invariant" compares every row of the 16-row call with the 1-row call on that row
(attention: row t of the T=16 call with the T=1 call at position start + t).

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``); each
replay walks several copies of the weight (or KV cache) so no call finds its operand in
the 60 MB L2 left by the previous one. bfloat16 throughout.

    python benchmarks/minv_kernels.py [--out benchmarks/results/minv_kernels.json] [--sweep]

``--sweep`` also times up to 19 tile / split configurations per distinct linear shape at
M = 1 and 16 and prints the fastest (the defaults live in ``dflash.kernels.linear_triton``);
it adds several minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from dflash.kernels import decode_attention, linear
from dflash.kernels.linear_triton import LinearConfig, launch_linear, linear_config

HBM_BYTES_PER_S = 4.2e12
HIDDEN = 4096
LINEAR_SHAPES: list[tuple[str, int, int]] = [
    ("gdn.in_proj_qkv", 8192, HIDDEN),
    ("gdn.in_proj_z", 4096, HIDDEN),
    ("gdn.in_proj_a/b", 32, HIDDEN),
    ("gdn.out_proj", 4096, HIDDEN),
    ("attn.q_proj (gated)", 8192, HIDDEN),
    ("attn.k_proj/v_proj", 1024, HIDDEN),
    ("attn.o_proj", HIDDEN, 4096),
    ("mlp.gate/up", 12288, HIDDEN),
    ("mlp.down", HIDDEN, 12288),
    ("lm_head", 248320, HIDDEN),
]
ROWS = (1, 4, 16)
H, HKV, D, CONTEXT, S_MAX = 16, 4, 256, 1024, 2048
ROTATE_BYTES = 256 * 2**20   # operand bytes walked per replay (> L2)
MAX_COPIES = 16


def bench_us(fn: Callable[[], object], copies: int) -> float:
    """Median µs of one call, from CUDA-graph replays of ``fn`` (which makes ``copies``
    calls)."""
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")
    return float(ms) * 1e3 / copies


def n_copies(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-ROTATE_BYTES // nbytes)))


def rows_invariant(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    full = f(x)
    return all(torch.equal(f(x[i : i + 1])[0], full[i]) for i in range(x.shape[0]))


def bench_linear(name: str, N: int, K: int) -> list[dict[str, Any]]:
    copies = n_copies(N * K * 2)
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    ws = [(torch.randn(N, K, generator=gen, device="cuda") / K**0.5).bfloat16()
          for _ in range(copies)]
    x16 = torch.randn(16, K, generator=gen, device="cuda").bfloat16()
    floor_us = N * K * 2 / HBM_BYTES_PER_S * 1e6
    inv_triton = rows_invariant(lambda x: linear(x, ws[0]), x16)
    inv_cublas = rows_invariant(lambda x: F.linear(x, ws[0]), x16)
    max_diff = float((linear(x16, ws[0]).float() - F.linear(x16, ws[0]).float()).abs().max())
    out = []
    for M in ROWS:
        x = x16[:M].contiguous()
        y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        def run_triton(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            for w in ws:
                linear(x, w, out=y)

        def run_cublas(x: torch.Tensor = x) -> None:
            for w in ws:
                F.linear(x, w)

        t_us = bench_us(run_triton, copies)
        c_us = bench_us(run_cublas, copies)
        out.append({
            "kernel": "linear", "name": name, "N": N, "K": K, "M": M,
            "config": linear_config(N, K, torch.bfloat16).__dict__,
            "floor_us": round(floor_us, 2),
            "triton_us": round(t_us, 2), "triton_frac_floor": round(floor_us / t_us, 3),
            "cublas_us": round(c_us, 2), "cublas_frac_floor": round(floor_us / c_us, 3),
            "triton_m_invariant": inv_triton, "cublas_m_invariant": inv_cublas,
            "max_abs_diff_vs_cublas": max_diff,
        })
        print(f"  {name:22s} M={M:2d}  triton {t_us:8.2f} us ({floor_us / t_us:5.1%})  "
              f"cublas {c_us:8.2f} us ({floor_us / c_us:5.1%})", flush=True)
    return out


def sweep_linear(name: str, N: int, K: int) -> list[dict[str, Any]]:
    copies = n_copies(N * K * 2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = [(torch.randn(N, K, generator=gen, device="cuda") / K**0.5).bfloat16()
          for _ in range(copies)]
    floor_us = N * K * 2 / HBM_BYTES_PER_S * 1e6
    default = linear_config(N, K, torch.bfloat16)
    candidates = {default}
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            for split in {max(1, default.split_k // 2), default.split_k, 2 * default.split_k}:
                if block_n <= max(16, triton.next_power_of_2(N)) and 2 * block_k * split <= K:
                    candidates.add(LinearConfig(block_n, block_k, split, 4, 4))
    results = []
    for cfg in sorted(candidates, key=lambda c: tuple(c.__dict__.values())):
        row: dict[str, Any] = {"name": name, "N": N, "K": K, **cfg.__dict__,
                               "default": cfg == default}
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda").bfloat16()
            y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            try:
                def run(x: torch.Tensor = x, y: torch.Tensor = y,
                        cfg: LinearConfig = cfg) -> None:
                    for w in ws:
                        launch_linear(x, w, None, y, cfg)

                us = bench_us(run, copies)
            except Exception as exc:   # a config may not fit the SM's shared memory
                row[f"M{M}_error"] = type(exc).__name__
                break
            row[f"M{M}_us"] = round(us, 2)
            row[f"M{M}_frac_floor"] = round(floor_us / us, 3)
        results.append(row)
    ok = [r for r in results if "M16_us" in r]
    if ok:
        best = min(ok, key=lambda r: r["M1_us"] + r["M16_us"])
        print(f"  sweep {name}: best {best}", flush=True)
    return results


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          L: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k[:, :, :L], v[:, :, :L], attn_mask=mask, enable_gqa=True,
    ).transpose(1, 2)


def bench_attention() -> list[dict[str, Any]]:
    cache_bytes = 2 * HKV * S_MAX * D * 2
    copies = n_copies(2 * HKV * CONTEXT * D * 2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [(torch.randn(1, HKV, S_MAX, D, generator=gen, device="cuda").bfloat16(),
               torch.randn(1, HKV, S_MAX, D, generator=gen, device="cuda").bfloat16())
              for _ in range(copies)]
    q16 = torch.randn(1, 16, H, D, generator=gen, device="cuda").bfloat16()
    start = torch.tensor([CONTEXT], device="cuda")
    k0, v0 = caches[0]
    ar = torch.arange(CONTEXT + 16, device="cuda")
    full_mask = ar[None, :] <= CONTEXT + torch.arange(16, device="cuda")[:, None]
    # M-invariance: row t of the T=16 call against the T=1 call at start + t
    tri16 = decode_attention(q16, k0, v0, start)
    inv_triton = all(torch.equal(decode_attention(q16[:, t : t + 1], k0, v0, start + t)[:, 0],
                                 tri16[:, t]) for t in range(16))
    sd16 = _sdpa(q16, k0, v0, full_mask, CONTEXT + 16)
    inv_sdpa = all(torch.equal(_sdpa(q16[:, t : t + 1], k0, v0, None, CONTEXT + t + 1)[:, 0],
                               sd16[:, t]) for t in range(16))
    out = []
    for T in (1, 16):
        q = q16[:, :T].contiguous()
        y = torch.empty_like(q)
        mask = None if T == 1 else full_mask[:T, : CONTEXT + T]
        def run_triton(q: torch.Tensor = q, y: torch.Tensor = y) -> None:
            for k, v in caches:
                decode_attention(q, k, v, start, out=y)

        def run_sdpa(q: torch.Tensor = q, mask: torch.Tensor | None = mask, T: int = T) -> None:
            for k, v in caches:
                _sdpa(q, k, v, mask, CONTEXT + T)

        t_us = bench_us(run_triton, copies)
        sdpa_graph = True
        try:
            s_us = bench_us(run_sdpa, copies)
        except Exception as exc:   # an SDPA back end that cannot be captured
            print(f"  sdpa T={T}: not capturable ({type(exc).__name__}); eager timing")
            sdpa_graph = False
            s_us = float(triton.testing.do_bench(run_sdpa, return_mode="median")) * 1e3 / copies
        kv_read = 2 * HKV * (CONTEXT + T) * D * 2
        out.append({
            "kernel": "attention", "T": T, "context": CONTEXT, "S_max": S_MAX,
            "H": H, "HKV": HKV, "D": D, "cache_bytes": cache_bytes,
            "floor_us": round(kv_read / HBM_BYTES_PER_S * 1e6, 2),
            "triton_us": round(t_us, 2), "sdpa_us": round(s_us, 2), "sdpa_graph": sdpa_graph,
            "triton_m_invariant": inv_triton, "sdpa_m_invariant": inv_sdpa,
            "target_us": 10.0 if T == 1 else 20.0, "met": t_us <= (10.0 if T == 1 else 20.0),
        })
        print(f"  attention T={T:2d}  triton {t_us:7.2f} us  sdpa {s_us:7.2f} us", flush=True)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    yn = {True: "yes", False: "no"}
    lines = [
        "| kernel | shape | M/T | Triton µs | % floor | M-inv | torch µs | % floor | M-inv |",
        "|---|---|---:|---:|---:|:-:|---:|---:|:-:|",
    ]
    for r in rows:
        if r["kernel"] == "linear":
            lines.append(
                f"| linear {r['name']} | N={r['N']} K={r['K']} | {r['M']} | "
                f"{r['triton_us']:.2f} | {r['triton_frac_floor']:.0%} | "
                f"{yn[r['triton_m_invariant']]} | {r['cublas_us']:.2f} (cuBLAS) | "
                f"{r['cublas_frac_floor']:.0%} | {yn[r['cublas_m_invariant']]} |")
        else:
            lines.append(
                f"| attention | ctx {r['context']}, H={r['H']} HKV={r['HKV']} D={r['D']} | "
                f"{r['T']} | {r['triton_us']:.2f} | {r['floor_us'] / r['triton_us']:.0%} | "
                f"{yn[r['triton_m_invariant']]} | {r['sdpa_us']:.2f} (SDPA) | "
                f"{r['floor_us'] / r['sdpa_us']:.0%} | {yn[r['sdpa_m_invariant']]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/minv_kernels.json"))
    ap.add_argument("--sweep", action="store_true", help="also sweep linear configs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    print("linear (bfloat16):", flush=True)
    for name, N, K in LINEAR_SHAPES:
        rows.extend(bench_linear(name, N, K))
        torch.cuda.empty_cache()
    print("attention (bfloat16):", flush=True)
    rows.extend(bench_attention())
    sweep: list[dict[str, Any]] = []
    if args.sweep:
        print("linear config sweep:", flush=True)
        seen: set[tuple[int, int]] = set()
        for name, N, K in LINEAR_SHAPES:
            if (N, K) not in seen:
                seen.add((N, K))
                sweep.extend(sweep_linear(name, N, K))
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "seconds": round(time.time() - t0, 1), "rows": rows, "sweep": sweep,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['seconds']} s)\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
