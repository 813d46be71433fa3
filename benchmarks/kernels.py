"""Kernel benchmark on one GPU: rollback restore, slot remap, verify with capture.

Prints a table and writes JSON. Times are medians from CUDA events: ``do_bench`` for
launches long enough to hide launch overhead, CUDA-graph replay (``do_bench_cudagraph``)
for the short ones. Floors are bytes read + written over the copy bandwidth measured in
the same run. Verify runs rotate over several buffer sets so the 50 MB of checkpoints a
27B layer writes per call does not sit in the 60 MB L2.

    python benchmarks/kernels.py [--out benchmarks/results/kernels.json] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing

from dflash.kernels import causal_conv1d_capture
from dflash.kernels.gdn_triton import default_config, launch_gdn_verify
from dflash.kernels.rollback_triton import launch_rollback_restore

# Qwen3.5-27B recurrent layers
L, HK, HV, K, V, C, KC, T = 48, 16, 48, 128, 128, 10240, 4, 16
ROTATE = 4  # buffer sets per verify measurement (4 x 50 MB > L2)
DEVICE = "cuda"


def bench(fn: Callable[[], object], graph: bool) -> float:
    """Median milliseconds of one ``fn()``."""
    fn()
    torch.cuda.synchronize()
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.randn(256 * 2**20, device=DEVICE)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), graph=False)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def row(name: str, ms: float, moved: int, bw: float, target: str = "", ok: bool | None = None,
        **extra: Any) -> dict[str, Any]:
    floor_us = moved / bw * 1e6
    us = ms * 1e3
    return {
        "name": name, "median_us": round(us, 2), "bytes": moved,
        "GB_per_s": round(moved / (us * 1e-6) / 1e9, 1) if moved else 0.0,
        "frac_copy_bw": round(moved / (us * 1e-6) / bw, 3) if moved else 0.0,
        "floor_us": round(floor_us, 2), "x_floor": round(us / floor_us, 2) if moved else None,
        "target": target, "met": ok, **extra,
    }


def gdn_sets(n: int, T: int) -> list[dict[str, torch.Tensor]]:
    sets = []
    for j in range(n):
        gen = torch.Generator(device=DEVICE).manual_seed(j)

        def rnd(*shape: int, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=DEVICE)

        sets.append({
            "q": rnd(1, T, HK, K).bfloat16(), "k": rnd(1, T, HK, K).bfloat16(),
            "v": rnd(1, T, HV, V).bfloat16(),
            "g": torch.nn.functional.logsigmoid(rnd(1, T, HV) + 2.0),
            "beta": torch.sigmoid(rnd(1, T, HV)),
            "h0": rnd(1, HV, K, V) * 0.5,
            "ckpt": torch.empty(1, T, HV, K, V, device=DEVICE),
            "snap": torch.empty(1, HV, K, V, device=DEVICE),
        })
    return sets


def verify_fn(sets: list[dict[str, torch.Tensor]], snapshot: bool, final_only: bool = False,
              **cfg: int) -> Callable[[], None]:
    def fn() -> None:
        for s in sets:
            launch_gdn_verify(
                s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"],
                s["h0"].unsqueeze(1) if final_only else s["ckpt"], None, scale=K**-0.5,
                use_qk_l2norm=True, final_state_only=final_only,
                snapshot=s["snap"] if snapshot else None, **cfg,  # type: ignore[arg-type]
            )
    return fn


def capture_once(s: dict[str, torch.Tensor], **cfg: int) -> torch.Tensor:
    """The checkpoints one verify writes with launch config ``cfg``."""
    ckpt = torch.full_like(s["ckpt"], float("nan"))
    launch_gdn_verify(s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"], ckpt, None,
                      scale=K**-0.5, use_qk_l2norm=True, final_state_only=False,
                      snapshot=None, **cfg)  # type: ignore[arg-type]
    return ckpt


def decode_matches(s: dict[str, torch.Tensor], ckpt: torch.Tensor, **cfg: int) -> bool:
    """Token-by-token in-place decode with config ``cfg`` reproduces every slot bit for bit."""
    state = s["h0"].clone()
    ok = True
    for t in range(ckpt.shape[1]):
        one = slice(t, t + 1)
        launch_gdn_verify(s["q"][:, one], s["k"][:, one], s["v"][:, one], s["g"][:, one],
                          s["beta"][:, one], state, state.unsqueeze(1), None, scale=K**-0.5,
                          use_qk_l2norm=True, final_state_only=True, snapshot=None,
                          **cfg)  # type: ignore[arg-type]
        ok = ok and torch.equal(state, ckpt[:, t])
    return ok


def verify_bytes(T: int, capture: bool, snapshot: bool) -> int:
    state = HV * K * V * 4
    inputs = 2 * T * HK * K * 2 + 2 * T * HV * V * 2 + 2 * T * HV * 4  # q,k; v,o; g,beta
    return inputs + state * (1 + (T if capture else 1) + (1 if snapshot else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time kernel launch configs")
    args = ap.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []

    # rollback restore: 48 layers, one launch
    S = T
    ckpt = torch.randn(L, 1, S, HV, K, V, device=DEVICE)
    cap = torch.randn(L, 1, KC - 1 + S, C, device=DEVICE).bfloat16()
    states = torch.empty(L, 1, HV, K, V, device=DEVICE)
    conv = torch.empty(L, 1, KC - 1, C, device=DEVICE, dtype=torch.bfloat16)
    moved = 2 * (states.numel() * 4 + conv.numel() * 2)

    def restore(**cfg: int) -> Callable[[], None]:
        return lambda: launch_rollback_restore(states, conv, ckpt, cap, 7, **cfg)

    if args.sweep:
        for block, warps in [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)]:
            ms = bench(restore(block=block, num_warps=warps), graph=True)
            sweep.append(row(f"rollback block={block} warps={warps}", ms, moved, bw))
    ms = bench(restore(), graph=False)
    ms_g = bench(restore(), graph=True)
    floor = moved / bw * 1e3
    rows.append(row("rollback 48 layers (1 launch)", ms, moved, bw, "<= 1.25x floor",
                    ms <= 1.25 * floor))
    rows.append(row("rollback 48 layers (graph)", ms_g, moved, bw, "<= 1.25x floor",
                    ms_g <= 1.25 * floor))
    rows.append(row("  torch states.copy_(slot), for scale", bench(
        lambda: states.copy_(ckpt[:, :, 6]), graph=False), 2 * states.numel() * 4, bw))
    torch.cuda.synchronize()
    assert torch.equal(states, ckpt[:, :, 6]) and torch.equal(conv, cap[:, :, 7:10])

    # verify with capture: one 27B layer, T = 16
    sets = gdn_sets(ROTATE, T)
    if args.sweep:
        base = capture_once(sets[0])
        # store_hint: checkpoint stores plain (0), streaming .cs (1) or evict_first (2)
        for BV, warps, hint in itertools.product((8, 16, 32), (1, 2, 4), (0, 1, 2)):
            cfg = {"block_v": BV, "num_warps": warps, "store_hint": hint}
            ms = bench(verify_fn(sets, False, **cfg), graph=True)
            ckpt_cfg = capture_once(sets[0], **cfg)
            sweep.append(row(
                f"verify T=16 BV={BV} warps={warps} store_hint={hint}", ms / ROTATE,
                verify_bytes(T, True, False), bw,
                rel_rms_vs_default=float((ckpt_cfg - base).norm() / base.norm()),
                decode_bit_exact=decode_matches(sets[0], ckpt_cfg, **cfg),
            ))
    ms_v = bench(verify_fn(sets, False), graph=True) / ROTATE
    ms_vs = bench(verify_fn(sets, True), graph=True) / ROTATE
    fla_ms = None
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        fused_recurrent_gated_delta_rule = None
    if fused_recurrent_gated_delta_rule is not None:

        def fla_fn() -> None:
            for s in sets:
                fused_recurrent_gated_delta_rule(
                    s["q"], s["k"], s["v"], g=s["g"], beta=s["beta"], scale=K**-0.5,
                    initial_state=s["h0"], output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
        fla_ms = bench(fla_fn, graph=True) / ROTATE
        rows.append(row("fla fused_recurrent T=16 (no capture)", fla_ms,
                        verify_bytes(T, False, False), bw))
    vb = verify_bytes(T, True, False)
    ok = ms_v <= 2 * vb / bw * 1e3 and (fla_ms is None or ms_v <= fla_ms)
    rows.append(row("verify+capture T=16 (1 layer)", ms_v, vb, bw,
                    "<= 2x floor, <= fla" if fla_ms else "<= 2x floor", ok,
                    vs_fla=round(ms_v / fla_ms, 2) if fla_ms else None))
    rows.append(row("verify+capture+snapshot T=16", ms_vs, verify_bytes(T, True, True), bw))

    # remapped verify: initial state read from a checkpoint slot (strided view)
    remapped = [{**s, "h0": s["ckpt"][:, 4]} for s in sets]
    rows.append(row("verify T=16 from remapped slot", bench(verify_fn(remapped, False),
                    graph=True) / ROTATE, vb, bw))

    # decode step (T = 1, in place) and the conv capture
    dsets = gdn_sets(ROTATE, 1)
    rows.append(row("decode step T=1 (in place)", bench(verify_fn(dsets, False, True),
                    graph=True) / ROTATE, verify_bytes(1, False, False), bw))
    if fused_recurrent_gated_delta_rule is not None:

        def fla_decode() -> None:
            for s in dsets:
                fused_recurrent_gated_delta_rule(
                    s["q"], s["k"], s["v"], g=s["g"], beta=s["beta"], scale=K**-0.5,
                    initial_state=s["h0"], output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
        rows.append(row("fla fused_recurrent T=1", bench(fla_decode, graph=True) / ROTATE,
                        verify_bytes(1, False, False), bw))
    x = torch.randn(1, T, C, device=DEVICE).bfloat16()
    crow = torch.randn(1, KC - 1, C, device=DEVICE).bfloat16()
    w = torch.randn(C, KC, device=DEVICE).bfloat16()
    bias = torch.randn(C, device=DEVICE).bfloat16()
    ccap = torch.empty(1, KC - 1 + T, C, device=DEVICE, dtype=torch.bfloat16)
    rows.append(row("conv1d+capture T=16 (1 layer)", bench(
        lambda: causal_conv1d_capture(x, crow, w, bias, ccap), graph=True),
        2 * (x.numel() * 2) + crow.numel() * 2 + ccap[:, : KC - 1 + T].numel() * 2, bw))

    BV, warps = default_config(K, V)
    report = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "command": " ".join(sys.argv), "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "shape": {"L": L, "HK": HK, "HV": HV, "K": K, "V": V, "C": C, "Kc": KC, "T": T},
        "verify_default_config": {"BV": BV, "num_warps": warps},
        "rows": rows, "sweep": sweep,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if sweep:
        print("\nsweep:")
        for r in sorted(sweep, key=lambda r: r["name"]):
            extra = ""
            if "decode_bit_exact" in r:
                extra = (f"  rel {r['rel_rms_vs_default']:.1e}"
                         f"  decode-exact {r['decode_bit_exact']}")
            print(f"  {r['name']:<34} {r['median_us']:>9.2f} us  "
                  f"{r['frac_copy_bw']:.2f} of copy{extra}")
    print(f"\n{report['gpu']}  torch {report['torch']}  triton {report['triton']}  "
          f"copy {report['copy_bandwidth_GBps']} GB/s")
    print(f"{'kernel':<38}{'us':>9}{'floor':>9}{'x floor':>9}{'GB/s':>8}  target")
    for r in rows:
        xf = "" if r["x_floor"] is None else f"{r['x_floor']:.2f}"
        met = "" if r["met"] is None else ("ok" if r["met"] else "MISSED")
        print(f"{r['name']:<38}{r['median_us']:>9.2f}{r['floor_us']:>9.2f}{xf:>9}"
              f"{r['GB_per_s']:>8.0f}  {r['target']} {met}")


if __name__ == "__main__":
    main()
