"""Registers and local-memory stack of hot kernels compiled for sm_90, on any machine.

Each case compiles one Triton kernel for an H100/H200 (``GPUTarget("cuda", 90, 32)``) with
the divisibility hints Triton gives every argument at run time at the 9B shapes (pointers
16-byte aligned; sizes and strides that are multiples of 16), then reads the cubin's
resource usage with the ``cuobjdump`` Triton ships. No GPU is needed: this is what a
launch at those shapes would run. A stack of more than a few hundred bytes means spilled
registers (local memory in the inner loop); ``ptxas`` may then also report a small
register count (32) for a binary whose values all live on the stack.

    python benchmarks/sm90_resources.py [--only NAME_PREFIX] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dflash.kernels import attention_triton as attn
from dflash.kernels import conv_triton as conv
from dflash.kernels import filter_triton as filt
from dflash.kernels import fp8_linear_triton as fp8
from dflash.kernels import gdn_chunk_triton as chunk
from dflash.kernels import pointwise_triton as pointwise
from dflash.kernels import rmsnorm_triton as norm
from dflash.kernels import sample_triton as sample

#: arguments whose values are multiples of 16 at the 9B shapes (Triton's run-time hint)
ALIGNED_INTS = {"N", "K", "s_xm", "s_wn", "s_ym"}
#: the attention's strides that Triton specialises (all but ``do_not_specialize``'s), each a
#: multiple of 16 at the 9B shape: without their hint the K/V loads compile to 16-bit ones,
#: which is not what a launch runs
ATTENTION_ALIGNED = frozenset({"s_qt", "s_qh", "s_kb", "s_kh", "s_ks", "s_vb", "s_vh", "s_vs",
                               "s_yt", "s_yh"})


@dataclass(frozen=True)
class Case:
    name: str
    kernel: Callable[..., Any]
    signature: dict[str, str]
    constants: dict[str, Any]
    num_warps: int
    num_stages: int = 2
    #: False for the launches compiled as written (``filter_triton.EXACT``)
    fp_fusion: bool = True
    #: this case's integer arguments that are multiples of 16 (with :data:`ALIGNED_INTS`)
    aligned: frozenset[str] = frozenset()


def _attention(tree: bool, tiles: int, warps: int) -> Case:
    sig = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "start": "*i64", "paths": "*i32",
           "ws_m": "*fp32", "ws_l": "*fp32", "ws_o": "*fp32", "y": "*bf16",
           "qk_scale": "fp32", "T": "i32", "S_max": "i32", "s_pt": "i32"}
    strides = ["s_qb", "s_qt", "s_qh", "s_kb", "s_kh", "s_ks", "s_vb", "s_vh", "s_vs", "s_yb",
               "s_yt", "s_yh"]
    sig.update({n: "i32" for n in strides})
    cst = dict(H=16, HKV=4, D=256, NS=8, SPLIT=attn.SPLIT_KEYS, WIDE_FROM=attn.WIDE_FROM,
               WIDE=attn.WIDE_KEYS, BLOCK_M=attn.BLOCK_M, BLOCK_N=attn.BLOCK_N, BD=256,
               TREE=tree, M_TILES=tiles, F32_DOT=False, EMULATE=False,
               # a cache past WIDE_FROM (a long context): its wide splits' block count
               SPLIT_BLOCKS=max(attn.SPLIT_KEYS, attn.WIDE_KEYS) // attn.BLOCK_N)
    kind = "tree" if tree else "chain"
    return Case(f"attention {kind} row_tiles={tiles} warps={warps}",
                attn.attention_split_kernel, sig, cst, warps, aligned=ATTENTION_ALIGNED)


def _gdn(part: str, C: int, precision: str) -> Case:
    if part == "wy":
        sig = {"k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*fp32", "w": "*fp32",
               "u": "*fp32", "T": "i32"}
        block = 64 if C <= 64 else 32
        cst = dict(HK=16, HV=32, K=128, V=128, C=C, BK=min(128, block), BV=min(128, block),
                   USE_QK_L2NORM=True, DOT_PRECISION=precision)
        return Case(f"gdn_chunk wy C={C} {precision}", chunk.gdn_chunk_wy_kernel, sig, cst,
                    4 if C <= 64 else 8)
    sig = {"q": "*bf16", "k": "*bf16", "g": "*fp32", "w": "*fp32", "u": "*fp32",
           "o": "*bf16", "h": "*fp32", "scale": "fp32", "T": "i32", "n_chunks": "i32",
           "s_h_b": "i32", "s_h_h": "i32", "s_h_k": "i32", "s_h_v": "i32"}
    BV, warps = chunk.default_config(128, 128)
    cst = dict(HK=16, HV=32, K=128, V=128, C=C, BK=128, BV=BV, USE_QK_L2NORM=True,
               DOT_PRECISION=precision)
    return Case(f"gdn_chunk state C={C} BV={BV} {precision}", chunk.gdn_chunk_state_kernel,
                sig, cst, warps)


def _fp8(x_major: bool, bits: bool, tiles: int = 1) -> Case:
    sig = {"x": "*bf16", "w": "*fp8e4nv", "s": "*fp32", "b": "*bf16", "y": "*bf16",
           "ws": "*fp32", "counters": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "s_xm": "i32", "s_wn": "i32", "s_sn": "i32", "s_sk": "i32", "s_ym": "i32"}
    cfg = fp8.fp8_linear_config(4096, 4096, torch.bfloat16, m_tiles=tiles)
    cst = dict(BN=128, BK=128, K_BLOCKS=32, K_BLOCKS_PER_SPLIT=32 // cfg.split_k,
               SPLIT_K=cfg.split_k, HAS_BIAS=False, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
               BLOCK_M=16, M_TILES=tiles, F32_DOT=False, EMULATE=False, X_MAJOR=x_major,
               BITS=bits, EVEN=True, FIXUP=True)
    form = ("x-major" if x_major else "weight-major") + (", bit conversion" if bits else "")
    form += f", {tiles} row tile{'s' if tiles > 1 else ''}"
    return Case(f"fp8_linear 4096x4096 {form}", fp8.fp8_linear_kernel, sig, cst,
                cfg.num_warps, cfg.num_stages)


def _filter(part: str, level: int = 0, coarse: bool = True) -> Case:
    """The sampling filters' launches at Qwen3.5's vocabulary (248,320 tokens, bf16)."""
    V = 248320
    chunks, parts = -(-V // filt.CHUNK), -(-V // filt.MASS_CHUNK)
    if part == "maxima":
        sig = {"bits16": "*i16", "maxima": "*i32", "hist": "*i32", "V": "i32", "chunks": "i32"}
        return Case("filter maxima (+ the histogram's zeroing)", filt.filter_maxima_kernel,
                    sig, dict(BV=filt.CHUNK, SUB=filt.GROUPS), 4, fp_fusion=False)
    if part == "table":
        sig = {"maxima": "*i32", "tops": "*i32", "table": "*i64", "inv_t": "fp32",
               "log_min_p": "fp32", "n": "i32"}
        cst = dict(HAS_MIN_P=False, IS_BF16=True, TB=filt.TABLE_BLOCK, NB=filt.BUCKETS,
                   BN=filt.block_of(chunks * filt.GROUPS))
        return Case("filter table", filt.filter_table_kernel, sig, cst, 4, fp_fusion=False)
    if part == "mass":
        sig = {n: "*i32" for n in ("bits16", "table", "masses", "lowest", "prior",
                                   "coarse", "above", "total", "least", "cut_top")}
        sig.update(bits16="*i16", table="*i64", masses="*i64", prior="*i64", above="*i64",
                   total="*i64", top_p="fp32", V="i32")
        cst = dict(LEVEL=level, HAS_MIN_P=False, BV=filt.MASS_CHUNK, BS=filt.MASS_BLOCK,
                   BC=filt.block_of(parts))
        return Case(f"filter mass level {level}", filt.filter_mass_kernel, sig, cst,
                    filt.MASS_WARPS, fp_fusion=False)
    sig = {"bits16": "*i16", "bound": "*i32", "high": "*i32", "hist": "*i32",
           "masses": "*i64", "coarse": "*i32", "prior_above": "*i64", "total": "*i64",
           "bucket": "*i32", "above": "*i64", "cut_top": "*i32", "top_p": "fp32", "V": "i32",
           "parts": "i32"}
    cst = dict(COARSE=coarse, BV=filt.CHUNK, BC=filt.block_of(parts if coarse else 1))
    return Case(f"filter hist{' (top-p alone)' if coarse else ''}", filt.filter_hist_kernel,
                sig, cst, 4, fp_fusion=False)


def _norm(form: str) -> Case:
    """The fused glue's norms at the 9B widths: a block norm (4096; ``residual``: fed by
    the residual add), a head's norm followed by the rotation (256, rotary 64), the
    recurrent output norm gated by a strided gate (128)."""
    sig = {n: "*bf16" for n in ("x", "w", "z", "y", "r", "s", "cs", "sn")}
    sig.update({n: "i32" for n in ("sx", "sz", "D", "H", "T", "RD")}, eps="fp32")
    D = {"rotary": 256, "gated": 128}.get(form, 4096)
    cst = dict(ZERO_CENTRED=form != "gated", HAS_GATE=form == "gated",
               HAS_RES=form == "residual", HAS_ROT=form == "rotary",
               BD=triton.next_power_of_2(D))
    return Case(f"rms_norm {form} D={D}", norm.rms_norm_kernel, sig, cst,
                4 if D <= 1024 else 8)


def _act_mul(silu: bool) -> Case:
    sig = {"gate": "*bf16", "x": "*bf16", "y": "*bf16", "stride_g": "i32", "stride_x": "i32",
           "N": "i32"}
    return Case(f"act_mul {'silu' if silu else 'sigmoid'}", pointwise.act_mul_kernel, sig,
                dict(SILU=silu, BN=pointwise.BLOCK), 4)


def _conv(advance: bool) -> Case:
    """The recurrent layers' conv at the 9B's 8,192 channels, kernel 4, a chain."""
    sig = {"x": "*bf16", "rows": "*bf16", "w": "*bf16", "bias": "*bf16", "cap": "*bf16",
           "y": "*bf16", "paths": "*i32", "T": "i32", "C": "i32"}
    sig.update({n: "i32" for n in ("s_x_b", "s_x_t", "s_r_b", "s_r_t", "s_r_c", "s_w_c",
                                   "s_w_k", "s_c_b", "s_c_t", "s_y_b", "s_y_t", "s_p_t",
                                   "s_p_d")})
    cst = dict(KC=4, BW=4, BT=16, BC=128, BD=32, HAS_BIAS=False, SILU=True, HAS_PATHS=False,
               ADVANCE=advance)
    return Case(f"conv chain{' (advance_rows)' if advance else ''}",
                conv.causal_conv1d_capture_kernel, sig, cst, 4)


def _gumbel(floor: bool) -> Case:
    """The sampling rule's draw over Qwen3.5's vocabulary: a chunk's noise and maximum."""
    sig = {"logits": "*bf16", "positions": "*i64", "floor": "*fp32", "floor_id": "*i64",
           "best": "*fp32", "best_id": "*i64", "seed": "i64", "inv_t": "fp32", "V": "i32",
           "chunks": "i32"}
    return Case(f"gumbel draw{' under a floor' if floor else ''}",
                sample.gumbel_argmax_chunk_kernel, sig, dict(HAS_FLOOR=floor, BV=sample.CHUNK),
                4)


def cases() -> list[Case]:
    out = [_attention(False, t, 4) for t in (1, 2, 4)]
    out += [_attention(False, t, 8) for t in (1, 4)]
    out += [_attention(True, t, 4) for t in (1, 4)] + [_attention(True, 4, 8)]
    out += [_gdn(p, C, prec) for p in ("wy", "state") for C in (32, 64)
            for prec in ("ieee", "tf32")]
    out += [_fp8(False, False), _fp8(True, False), _fp8(True, True), _fp8(True, True, 4),
            _fp8(True, True, 8)]
    out += [_filter("maxima"), _filter("table"), _filter("mass", 0), _filter("mass", 1),
            _filter("hist"), _filter("hist", coarse=False)]
    out += [_norm(f) for f in ("plain", "residual", "rotary", "gated")]
    out += [_act_mul(True), _act_mul(False), _conv(False), _conv(True)]
    out += [_gumbel(False), _gumbel(True)]
    return out


def resources(case: Case) -> dict[str, Any]:
    names = list(case.signature)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if case.signature[n].startswith("*") or n in ALIGNED_INTS | case.aligned}
    src = ASTSource(case.kernel, case.signature, case.constants, attrs=aligned)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": case.num_warps, "num_stages": case.num_stages,
                                "enable_fp_fusion": case.fp_fusion})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"{case.name}: no resource line in cuobjdump's output:\n{text}")
    return {"kernel": case.name, "registers": int(found[1]), "stack_bytes": int(found[2]),
            "num_warps": case.num_warps, "shared_bytes": int(k.metadata.shared),
            # asynchronous global-to-shared copies: loads the compiler pipelined
            "async_copies": len(re.findall(r"\bLDGSTS\b", sass))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="the cases whose name starts with this")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    print("| kernel (sm_90, 9B shape) | warps | registers | stack bytes | shared bytes | "
          "LDGSTS |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in cases():
        if not case.name.startswith(args.only):
            continue
        row = resources(case)
        rows.append(row)
        print(f"| {row['kernel']} | {row['num_warps']} | {row['registers']} | "
              f"{row['stack_bytes']} | {row['shared_bytes']:,} | {row['async_copies']} |",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows},
                                        indent=2) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
