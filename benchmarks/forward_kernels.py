"""Where one forward's GPU time goes: the kernels of a graphed decode and verify, by part.

On the seeded 9B-shaped model (one GPU, CUDA graphs on, a seeded random prompt), for each
``--quantize`` choice (``none``: bf16; ``fp8``: the linears in FP8 as ``--quantize fp8``
makes them), profiles ``--calls`` forwards of ``T`` rows (``T = 1``: a plain greedy
decode; larger: a chain verify, rolled back after each) and sums each kernel's GPU time,
then groups the kernels into parts:

- ``weights``: the linears (bf16 or FP8) and the LM head: bound by the weight read;
- ``attention``, ``gdn`` (the recurrence and its gates), ``conv``, ``norm``;
- ``torch``: PyTorch's own kernels (elementwise, copies, concatenations, reductions):
  the glue between the project's kernels, each a launch of its own.

Prints per forward: each part's µs and share, the launches per part, the weight-read
floor of the forward at ``--bandwidth`` GB/s (the bytes of every weight the forward reads
once), the host's time to issue the forward (median, the GPU idle before each call: Python,
staging and the graph launch, which the GPU waits for whenever the host issues the next
forward after reading the last) and the top kernels. ``--json`` writes the rows. GPU only;
about a minute. ``--tree``: verifies of more than one row are trees of that many nodes (a
binary heap: node ``i``'s parent is ``(i - 1) // 2``) on a target built for trees.

    python benchmarks/forward_kernels.py [--rows 1 16] [--quantize none fp8] [--calls 8]
        [--bandwidth 4200] [--tree] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.execution import ShardedTarget, plan_shards
from dflash.execution.engine import chain_of
from dflash.geometry import require_tree
from dflash.model import HybridConfig, TargetModel
from dflash.model.fp8 import quantize_spec

#: a kernel's part: the first pattern its name contains (checked in this order)
PARTS = (
    ("weights", ("linear", "fp8", "gemm", "gemv", "lm_head", "matmul", "sm90", "cutlass")),
    ("attention", ("attention", "attn")),
    ("gdn", ("gdn", "delta", "gate")),
    ("conv", ("conv",)),
    ("norm", ("norm",)),
    ("torch", ("at::", "at_cuda", "elementwise", "reduce", "copy", "cat", "index", "memcpy",
               "memset", "void ")),
)


def part_of(name: str) -> str:
    """The part of a kernel named ``name`` (``"other"`` when no pattern matches)."""
    low = name.lower()
    for part, patterns in PARTS:
        if any(p in low for p in patterns):
            return part
    return "other"


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes one forward reads of the weights: every parameter and buffer but the
    embedding table (a forward reads only its rows)."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed" in name:
            continue
        total += t.numel() * t.element_size()
    return total


def profile_forward(target: ShardedTarget, prompt_len: int, tok: int, rows: int,
                    calls: int, tree: bool = False) -> dict[str, float]:
    """Each kernel's GPU µs per forward over ``calls`` graphed forwards of ``rows`` rows
    (a chain, or with ``tree`` a binary-heap tree of ``rows`` nodes)."""
    geometry = (require_tree([-1, *((i - 1) // 2 for i in range(1, rows))]) if tree
                else chain_of(rows))
    pos = [prompt_len]

    def once() -> None:
        if rows == 1:  # a decode commits its token: the next one decodes after it
            target.forward([tok], "decode", pos[0])
            pos[0] += 1
            return
        # at the cache's length (earlier decodes of this target advanced it), then back
        # there: every call sees the same cache
        target.forward([tok] * rows, "verify", pos[0], geometry=geometry)
        for shard in target.shards:
            shard.caches.pool.restore_pre_verify()
            shard.truncate_kv(pos[0])

    for _ in range(4):  # warm-up: the graphs are captured
        once()
    torch.cuda.synchronize()
    # the host's time to issue one forward (Python, table staging, the graph launch),
    # measured with the GPU idle before each call and before any profile (the profiler's
    # hooks stay installed once it has run, and slow every later CUDA call)
    issue = []
    for _ in range(calls):
        t0 = time.perf_counter()
        once()
        issue.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            once()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        per[e.key] += e.self_device_time_total / calls
        launches[e.key] += e.count / calls
    return {**{f"us:{k}": v for k, v in per.items()},
            **{f"n:{k}": v for k, v in launches.items()},
            "host_us": statistics.median(issue) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quantize", nargs="+", default=["none", "fp8"])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--bandwidth", type=float, default=4200.0, help="GB/s of the floor")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tree", action="store_true", help="verifies are trees, not chains")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config = HybridConfig.nine_b_shape()
    rng = random.Random(0)
    prompt = [rng.randrange(config.vocab_size) for _ in range(args.prompt_len)]
    plan = plan_shards(config.num_hidden_layers, "cuda:0")
    table: list[dict[str, object]] = []
    for quantize in args.quantize:
        model = TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")
        if quantize != "none":
            model.quantize_fp8_(quantize_spec(quantize))
        floor_us = weight_bytes(model) / (args.bandwidth * 1e3)
        with torch.inference_mode():
            max_len = args.prompt_len + 4 * (args.calls + 4) + 256
            target = ShardedTarget(model, plan, max_len=max_len, max_draft=max(args.rows),
                                   graphs=True, trees=args.tree)
            logits, _ = target.forward(prompt, "prefill", 0)
            tok = int(logits[-1].argmax())
            for rows in args.rows:
                got = profile_forward(target, args.prompt_len, tok, rows, args.calls,
                                      args.tree and rows > 1)
                by_part: dict[str, float] = defaultdict(float)
                n_part: dict[str, float] = defaultdict(float)
                host_us = got.pop("host_us")
                for key, v in got.items():
                    kind, _, name = key.partition(":")
                    (by_part if kind == "us" else n_part)[part_of(name)] += v
                total = sum(by_part.values())
                kind = "tree" if args.tree and rows > 1 else "T"
                print(f"== {quantize}, {kind}={rows}: GPU {total:8.1f} µs per forward, weight "
                      f"floor {floor_us:8.1f} µs ({floor_us / total:5.1%}); "
                      f"{sum(n_part.values()):.0f} launches; the host issues it in "
                      f"{host_us:7.1f} µs")
                for part in sorted(by_part, key=lambda p: -by_part[p]):
                    print(f"   {part:<10} {by_part[part]:8.1f} µs  {by_part[part] / total:6.1%}"
                          f"  {n_part[part]:6.0f} launches")
                kernels = sorted(((v, k[3:]) for k, v in got.items() if k.startswith("us:")),
                                 reverse=True)
                for v, name in kernels[: args.top]:
                    print(f"      {v:8.1f}  {got['n:' + name]:5.0f}x  {name[:80]}")
                table.append({"quantize": quantize, "rows": rows, "tree": kind == "tree",
                              "gpu_us": total,
                              "host_us": host_us,
                              "floor_us": floor_us, "parts_us": dict(by_part),
                              "parts_launches": dict(n_part)})
        del target, model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "device": torch.cuda.get_device_name(0),
                       "torch": torch.__version__}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
