"""Profile speculative steps on the seeded 9B-shaped model: where does a step's time go?

Prints the top operators by device time and by host time for a few steady-state steps of
each rollback mode (torch.profiler), plus plain per-forward wall times. GPU only.

    python benchmarks/profile_step.py [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.execution import RollbackPolicy, ShardedTarget, SpecDecoder, plan_shards
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters import PromptLookupDrafter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    model = TargetModel.seeded(
        HybridConfig.nine_b_shape(), seed=0, dtype=torch.bfloat16, device="cuda:0"
    )
    rng = random.Random(0)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(args.prompt_len)]
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0", None)
    for mode in ("replay", "checkpoint"):
        target = ShardedTarget(model, plan, max_len=args.prompt_len + 600, max_draft=16)
        drafter = PromptLookupDrafter()  # no oracle needed: only the step's cost matters
        eng = SpecDecoder(target, drafter, block_size=16, policy=RollbackPolicy(mode=mode))
        eng.prefill(prompt)
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / args.steps
        print(f"[{mode}] {per * 1e3:.2f} ms per step (wall)", flush=True)
    # a profiled run of checkpoint steps
    target = ShardedTarget(model, plan, max_len=args.prompt_len + 600, max_draft=16)
    drafter = PromptLookupDrafter()
    eng = SpecDecoder(target, drafter, block_size=16, policy=RollbackPolicy(mode="checkpoint"))
    eng.prefill(prompt)
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    main()
