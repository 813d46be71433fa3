"""What the sampling rule adds to a verify step, on the seeded 9B-shaped model.

For a graphed verify forward of ``T`` rows (a chain at the 9B shape, bf16, one GPU) and
the plain decode forward (``T = 1``), measures host-synchronised wall time per call of

- the forward, then the greedy acceptance (argmax, the leading-match count) and the step's
  one host read, the acceptance replayed from a CUDA graph as the engine's step does
  (``ShardedTarget.on_logits``);
- the same with each sampling rule's acceptance instead (the seeded Gumbel draw at the
  rows' absolute positions, and its filters);

and, from CUDA events, the GPU time of each rule's acceptance alone on the forward's
logits: over many back-to-back calls (launch gaps included) and inside one CUDA graph
(the kernels alone). The added cost is the sampled wall minus the
greedy wall, as a share of the greedy step. GPU only; about a minute on an H200.

    python benchmarks/sampling_cost.py [--rows 16] [--calls 32] [--head-scale 4]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
from collections.abc import Callable
from typing import Any

import torch
from profile_step import _wall  # the same host-synchronised wall time per call

from dflash.execution import ShardedTarget, plan_shards
from dflash.execution.engine import TokenAcceptance, chain_of
from dflash.model import HybridConfig, TargetModel
from dflash.sampling import GREEDY, SamplingParams

RULES: dict[str, SamplingParams] = {
    "greedy": GREEDY,
    "T0.7": SamplingParams(temperature=0.7, seed=1),
    "T1.0": SamplingParams(temperature=1.0, seed=1),
    "T0.7 top_k 50": SamplingParams(temperature=0.7, top_k=50, seed=1),
    "T0.7 min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05, seed=1),
    "T0.7 top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95, seed=1),
    "T0.7 all filters": SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05,
                                       seed=1),
    "T0.6 top_k 20 top_p 0.95": SamplingParams(temperature=0.6, top_k=20, top_p=0.95,
                                               seed=1),
    "T1.0 top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95, seed=1),
}


def _gpu(run: Callable[[], object], calls: int) -> float:
    """GPU ms per call of ``run`` from CUDA events around ``calls`` back-to-back calls."""
    run()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch's stub
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch's stub
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / calls


def _graphed(run: Callable[[], object], calls: int) -> float:
    """GPU ms per call of ``run`` with no launch gaps: ``calls`` calls captured in one CUDA
    graph, its replays timed by CUDA events."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch's stub
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch's stub
    start.record()
    for _ in range(4):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / (4 * calls)


def _profile(rows: int, spread: float) -> None:
    """Each rule's acceptance on random ``[rows, vocab]`` bf16 logits (``N(0, spread²)``)
    under torch.profiler: the CUDA kernels it runs, by total time."""
    from torch.profiler import ProfilerActivity, profile

    vocab = HybridConfig.nine_b_shape().vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * spread
              ).to(torch.bfloat16)
    ids = torch.zeros(rows, dtype=torch.int64, device="cuda")
    positions = torch.arange(rows, device="cuda")
    for name, params in RULES.items():
        rule = TokenAcceptance(params)
        at = None if params.greedy else positions
        for _ in range(3):
            rule.on_device(logits, ids, at)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                rule.on_device(logits, ids, at)
            torch.cuda.synchronize()
        print(f"== {name} (T={rows}; per call, µs)")
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events) / 10
        print(f"   total GPU {total:8.1f}")
        for e in events[:6]:
            print(f"   {e.self_device_time_total / 10:8.1f}  {e.key[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="verify rows T")
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3,
                    help="greedy / rule alternations per rule (the added share's median)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--head-scale", type=float, default=1.0,
                    help="multiply the seeded LM head by this: the seeded head gives logits "
                    "close to N(0, 1), whose top-p nucleus is most of the vocabulary (top-p's "
                    "worst case); 4 gives N(0, 16), a nucleus of a few hundred tokens at "
                    "T = 1, closer to a trained model's")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="only profile each rule's acceptance on random logits (no model): "
                         "its CUDA kernels by total time")
    ap.add_argument("--spread", type=float, default=4.0,
                    help="--profile's logits: N(0, spread²) (1: the seeded model's flat rows)")
    args = ap.parse_args()
    if args.profile:
        _profile(args.rows, args.spread)
        return
    config = HybridConfig.nine_b_shape()
    model = TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")
    if args.head_scale != 1.0:  # the 9B shape's head is its own (untied)
        with torch.no_grad():
            model.lm_head.weight.mul_(args.head_scale)
    rng = random.Random(0)
    prompt = [rng.randrange(config.vocab_size) for _ in range(args.prompt_len)]
    plan = plan_shards(config.num_hidden_layers, "cuda:0")
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for T in (1, args.rows):
            # a decode moves the position every call; a verify is undone every call
            n_walls = 2 * args.rounds + 1  # per rule: the rounds, and the eager acceptance
            room = len(RULES) * n_walls * (args.warmup + args.calls) + 8 if T == 1 else T + 8
            target = ShardedTarget(model, plan, max_len=args.prompt_len + room, max_draft=T)
            target.forward(prompt, "prefill", 0)
            state = {"pos": len(prompt)}
            ids = torch.tensor([[rng.randrange(config.vocab_size) for _ in range(T)]],
                               device="cuda:0")
            positions = torch.arange(len(prompt) + 1, len(prompt) + T + 1, device="cuda:0")
            last: dict[str, torch.Tensor] = {}

            def forward(target: ShardedTarget = target, ids: torch.Tensor = ids,
                        T: int = T, state: dict[str, int] = state) -> torch.Tensor:
                if T == 1:
                    logits, _ = target.forward(ids, "decode", state["pos"])
                    state["pos"] += 1
                    return logits
                logits, _ = target.forward(ids, "verify", state["pos"], geometry=chain_of(T))
                for shard in target.shards:
                    shard.caches.pool.restore_pre_verify()
                    shard.truncate_kv(state["pos"])
                return logits

            last["logits"] = forward()

            def make_step(rule: TokenAcceptance, at: torch.Tensor | None,
                          forward: Callable[[], torch.Tensor] = forward,
                          ids: torch.Tensor = ids,
                          target: ShardedTarget = target) -> Callable[[], None]:
                def run_step() -> None:
                    logits = forward()
                    # the engine's path: the acceptance replayed from a graph that reads
                    # the forward graph's logits
                    t, count = target.on_logits("chain", logits, ids[0], rule,
                                                lambda d: rule.on_device(logits, d, at))
                    torch.cat([t, count]).tolist()  # the step's one host read
                return run_step

            greedy_step = make_step(TokenAcceptance(GREEDY), None)
            for name, params in RULES.items():
                rule = TokenAcceptance(params)
                at = None if params.greedy else positions
                step = make_step(rule, at)

                def eager_step(rule: TokenAcceptance = rule, at: torch.Tensor | None = at,
                               forward: Callable[[], torch.Tensor] = forward,
                               ids: torch.Tensor = ids) -> None:
                    logits = forward()
                    t, count = rule.on_device(logits, ids[0], at)  # launched one by one
                    torch.cat([t, count]).tolist()

                def accept(rule: TokenAcceptance = rule, at: torch.Tensor | None = at,
                           last: dict[str, torch.Tensor] = last,
                           ids: torch.Tensor = ids) -> None:
                    rule.on_device(last["logits"], ids[0], at)

                graphs = target.graphs[-1] if target.graphs is not None else None
                before = (graphs.replays, len(graphs.failures)) if graphs else (0, 0)
                # interleaved with the greedy step, so drift (clocks, context) cancels:
                # the added share is the median over rounds of rule / greedy - 1
                shares: list[float] = []
                walls: list[float] = []
                for _ in range(1 if params.greedy else args.rounds):
                    base = _wall(greedy_step, args.calls, args.warmup)
                    walls.append(_wall(step, args.calls, args.warmup))
                    shares.append((walls[-1] / base - 1) * 100)
                wall = statistics.median(walls)
                added = statistics.median(shares) if not params.greedy else 0.0
                replayed = graphs.replays - before[0] if graphs else 0
                failures = graphs.failures[before[1]:] if graphs else []
                eager_wall = _wall(eager_step, args.calls, args.warmup)
                gpu = _gpu(accept, args.calls * 4)
                try:
                    graphed = _graphed(accept, 10)
                except RuntimeError as e:  # a capture failure is reported, not fatal
                    print(f"T={T} {name}: graph capture failed: {e}", flush=True)
                    graphed = float("nan")
                rows.append({"rows": T, "rule": name, "step_wall_ms": wall,
                             "step_eager_accept_ms": eager_wall,
                             "accept_gpu_ms": gpu, "accept_graphed_ms": graphed,
                             "added_pct": added, "graph_replays": replayed,
                             "graph_failures": failures})
                print(f"T={T:<3} {name:<18} step {wall:7.3f} ms (eager acceptance "
                      f"{eager_wall:7.3f})  acceptance GPU {gpu * 1e3:8.1f} us (graphed "
                      f"{graphed * 1e3:6.1f})  added {added:+6.2f} %  graph replays "
                      f"{replayed} failures {failures}", flush=True)
            del target
            gc.collect()
            torch.cuda.empty_cache()
    print("\n| T | rule | step wall ms | eager acceptance ms | acceptance GPU µs | graphed µs "
          "| added to the step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['rule']} | {float(r['step_wall_ms']):.3f} | "
              f"{float(r['step_eager_accept_ms']):.3f} | "
              f"{float(r['accept_gpu_ms']) * 1e3:.1f} | "
              f"{float(r['accept_graphed_ms']) * 1e3:.1f} | {float(r['added_pct']):+.2f} % |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_len": args.prompt_len, "calls": args.calls,
                       "head_scale": args.head_scale,
                       "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
