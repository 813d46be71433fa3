"""Wall time vs GPU time of one forward and one speculative step, with and without CUDA graphs.

On the seeded 9B-shaped model (bf16, one GPU, a seeded random prompt): for graphs off and
on, measures

- one target-only decode forward (``T = 1``, what plain greedy decoding runs per token);
- one verify forward (``T = block``);
- one speculative step per rollback mode (verify + rollback, replay mode: + the replay);

each as wall time per call (host-synchronised, after warm-up so graphs are captured) and
as GPU time per call (sum of the kernel and copy durations torch.profiler records over as
many further calls). ``wall / GPU`` near 1 means the host keeps the GPU busy. Every wall time is
taken before the first profile (the profiler's CUPTI hooks stay installed in the process
once it has run, and slow each later CUDA API call), and from a collected heap. Prints a
table and, with ``--json``, writes the numbers. GPU only; ~1-2 minutes
on an H200.

    python benchmarks/profile_step.py [--calls 16] [--prompt-len 1024] [--block 16]
        [--layers 32] [--json out.json] [--table] [--tree N]

``--draft synthetic``: chain steps draft with the SYNTHETIC drafter of ``dflash bench``'s
profile (acceptance 0.874 per slot, on the target's greedy continuation) instead of prompt
lookup. ``--host-profile``: after the table, the host's functions over the measured
checkpoint steps by own time (cProfile), the work the GPU may wait on.

``--tree N``: the speculative steps are tree steps of ``N`` nodes (depth ``block - 1``) from
the SYNTHETIC tree drafter (acceptance 0.874, on the target's greedy continuation), and
``--table`` then also lists the CUDA kernels of four eager (graphs off) tree steps by GPU
time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.execution import RollbackPolicy, ShardedTarget, SpecDecoder, plan_shards
from dflash.execution.engine import chain_of
from dflash.execution.oracle import reference_greedy
from dflash.execution.session import tree_rank_probs
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters import PromptLookupDrafter, SyntheticDrafter
from dflash.model.drafters.trees import SyntheticTreeDrafter


def _device_us(prof: profile) -> float:
    """Summed duration (µs) of every device-side event (kernels, copies) in ``prof``."""
    total = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            got = getattr(evt, "self_device_time_total", None)
            if got is None:
                got = getattr(evt, "self_cuda_time_total", 0.0)
            total += float(got)
    return total


def _wall(run: Callable[[], object], calls: int, warmup: int) -> float:
    """Wall ms per call of ``run`` after ``warmup`` calls (host-synchronised)."""
    for _ in range(warmup):
        run()
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def _gpu(run: Callable[[], object], calls: int) -> float:
    """GPU ms per call of ``run``: kernel and copy durations recorded by torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    return _device_us(prof) / calls / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32, help="first N layers of the 9B shape")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--table", action="store_true", help="also print the profiler's top ops")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager (graphs off) half")
    ap.add_argument("--tree", type=int, default=None, help="tree steps of N nodes")
    ap.add_argument("--draft", choices=("lookup", "synthetic"), default="lookup",
                    help="the chain steps' drafter (synthetic: dflash bench's profile)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also list the host's functions over checkpoint steps (cProfile)")
    args = ap.parse_args()
    nine = HybridConfig.nine_b_shape()
    config = HybridConfig(**{**nine.model_dump(), "layer_types": nine.layer_types[: args.layers]})
    model = TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")
    rng = random.Random(0)
    prompt = [rng.randrange(config.vocab_size) for _ in range(args.prompt_len)]
    plan = plan_shards(config.num_hidden_layers, "cuda:0")
    calls, warm, block = args.calls, args.warmup, args.block
    loops = 3 if args.host_profile else 2  # the wall loop, the GPU loop, the host profile's
    budget = (warm + loops * calls) * (block + 1) + 8  # positions every measured loop may use
    slots = max(block, args.tree or 0)
    synthetic = args.tree is not None or args.draft == "synthetic"
    oracle = prompt + (  # the synthetic drafters need the target's own greedy continuation
        reference_greedy(model, plan, prompt, budget + slots) if synthetic else [])

    def drafter() -> object:
        if args.tree is None:
            if args.draft == "synthetic":
                return SyntheticDrafter(oracle, 0.874, config.vocab_size, seed=1)
            return PromptLookupDrafter()
        return SyntheticTreeDrafter(oracle, tree_rank_probs(0.874), config.vocab_size, seed=1)
    rows: list[dict[str, object]] = []

    def record(what: str, graphs: bool, wall: float, gpu: float, extra: str = "") -> None:
        rows.append({"what": what, "graphs": graphs, "wall_ms": wall, "gpu_ms": gpu})
        ratio = wall / gpu if gpu > 0 else float("inf")
        print(f"{what:<34} graphs {'on ' if graphs else 'off'}  wall {wall:8.3f} ms  "
              f"GPU {gpu:8.3f} ms  wall/GPU {ratio:5.2f}  {extra}", flush=True)

    # every wall time is taken before the first profile: once torch.profiler has run in a
    # process its CUPTI hooks stay installed and slow every later CUDA API call, which
    # would inflate the wall time of each row measured after another row's profile
    walls: list[tuple[str, bool, float, Callable[[], object], Callable[[], str]]] = []
    keep: list[object] = []  # the targets and engines the GPU-time pass runs again

    def no_extra() -> str:
        return ""

    with torch.inference_mode():
        for graphs in (True,) if args.graphs_only else (False, True):
            # one decode forward (T = 1): plain greedy decoding's unit of work
            target = ShardedTarget(
                model, plan, max_len=args.prompt_len + budget, max_draft=block, graphs=graphs
            )
            logits, _ = target.forward(prompt, "prefill", 0)
            state = {"pos": len(prompt), "tok": int(logits[-1].argmax())}

            def decode(target: ShardedTarget = target, state: dict[str, int] = state) -> None:
                out, _ = target.forward([state["tok"]], "decode", state["pos"])
                state["pos"] += 1
                state["tok"] = int(out[0].argmax())  # the per-token host read of greedy

            walls.append(("decode forward (T=1)", graphs, _wall(decode, calls, warm), decode,
                          no_extra))

            # one verify forward (T = block), rolled back by a snapshot restore each time
            def verify(target: ShardedTarget = target, state: dict[str, int] = state) -> None:
                target.forward([state["tok"]] * block, "verify", state["pos"],
                               geometry=chain_of(block))
                for shard in target.shards:
                    shard.caches.pool.restore_pre_verify()
                    shard.truncate_kv(state["pos"])

            walls.append((f"verify forward (T={block})", graphs, _wall(verify, calls, warm),
                          verify, no_extra))
            keep.append(target)

            for mode in ("replay", "checkpoint", "remap"):
                spec_target = ShardedTarget(
                    model, plan, max_len=args.prompt_len + budget + slots, max_draft=slots,
                    graphs=graphs, trees=args.tree is not None,
                )
                engine = SpecDecoder(
                    spec_target, drafter(), block_size=block,  # type: ignore[arg-type]  # a tree drafter is a Drafter
                    policy=RollbackPolicy(mode=mode), tree_budget=args.tree,
                )
                engine.prefill(prompt)
                wall = _wall(engine.step, calls, warm)

                def extra(engine: SpecDecoder = engine) -> str:
                    avg = sum(r.accept_n for r in engine.records) / len(engine.records)
                    return f"(status {engine.status.value}, avg commit {avg:.2f})"

                what = f"spec step, {mode}" + (f", tree {args.tree}" if args.tree else "")
                walls.append((what, graphs, wall, engine.step, extra))
                keep.append(engine)
                if spec_target.graphs is not None:
                    fails = [f for g in spec_target.graphs for f in g.failures]
                    if fails:
                        print(f"  capture failures: {fails}", flush=True)
        if args.host_profile:  # before any torch.profiler run (see above)
            step = next(run for what, g, _, run, _ in walls if g and "checkpoint" in what)
            host = cProfile.Profile()
            host.enable()
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
            host.disable()
            print(f"host functions over {calls} checkpoint steps (cProfile, by own time):")
            pstats.Stats(host).sort_stats("tottime").print_stats(25)
        for what, graphs, wall, run, describe in walls:  # then the GPU times
            record(what, graphs, wall, _gpu(run, calls), describe())
        if args.table:
            step = next(run for what, g, _, run, _ in walls if g and "checkpoint" in what)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(4):
                    step()
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cpu_time_total", row_limit=20))
            if args.tree is not None:  # the kernels of eager tree steps, by GPU time
                eager_target = ShardedTarget(
                    model, plan, max_len=args.prompt_len + budget + slots, max_draft=slots,
                    graphs=False, trees=True,
                )
                eager = SpecDecoder(eager_target, drafter(), block_size=block,  # type: ignore[arg-type]  # as above
                                    tree_budget=args.tree)
                eager.prefill(prompt)
                for _ in range(warm):
                    eager.step()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    for _ in range(4):
                        eager.step()
                    torch.cuda.synchronize()
                print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_len": args.prompt_len, "block": block, "layers": args.layers,
                       "calls": calls, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
