"""τ of the default pair under sampling: coupled drafts against argmax drafts, on held-out
standard-library prompts.

The prompts are :mod:`drafter_tau`'s. For each temperature the shipped drafter (the
``dflash`` drafter, without prompt lookup, every draft verified whole at block 16) drafts
either with the target's rule and noise (coupled: its guess at position ``p`` is the
rule's draw from its own logits with the target's ``G(seed, p)``) or its argmax guesses;
τ is the mean committed length per step (the bonus token included), pooled over every
step and every seed; every run's tokens are compared with plain sampled decoding.

    python3 benchmarks/sampled_tau.py [--temperatures 0.7,1.0] [--prompts 6] [--tokens 64]
        [--seeds 2] [--tree-budget N] [--device cpu|cuda] [--json FILE]

``--tree-budget N`` adds a row per temperature: trees of ``N`` nodes grown from the
coupled drafter's candidates, its coupled proposal held whole as one branch.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # drafter_tau, beside this file

from drafter_tau import default_heldout_prompts  # after the path above

from dflash.data import require_default  # after the path above
from dflash.execution import generate, plan_shards, reference_greedy
from dflash.model import TargetModel
from dflash.model.drafters import DFlashDrafter, make_drafter
from dflash.sampling import GREEDY, SamplingParams

BLOCK = 16


class ArgmaxDrafter(DFlashDrafter):
    """The DFlash drafter with coupling switched off: argmax guesses whatever the rule."""

    def couple(self, sampling: SamplingParams) -> None:
        super().couple(GREEDY)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tree-budget", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = TargetModel.from_pretrained(require_default("target"), dtype=dtype, device=args.device)
    drafter_dir = str(require_default("drafter"))
    plan = plan_shards(model.config.num_hidden_layers, args.device)
    prompts = default_heldout_prompts(args.prompts, seed=7)
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        kinds = [(True, None), (False, None)]
        if args.tree_budget is not None:
            kinds.append((True, args.tree_budget))
        for coupled, budget in kinds:
            steps = committed = 0
            exact = True
            t0 = time.perf_counter()
            for seed in range(args.seeds):
                rule = SamplingParams(temperature=temperature, seed=seed)
                for prompt in prompts:
                    drafter = make_drafter(drafter_dir, model)
                    if not coupled:
                        drafter.__class__ = ArgmaxDrafter
                    r = generate(model, drafter, prompt, plan=plan, max_new_tokens=args.tokens,
                                 block_size=BLOCK, verify_window="full", sampling=rule,
                                 tree_budget=budget)
                    plain = reference_greedy(model, plan, prompt, len(r.tokens), sampling=rule)
                    exact &= r.tokens == plain
                    steps += r.steps
                    committed += round(r.avg_commit * r.steps)
            drafts = ("coupled" if coupled else "argmax") + ("" if budget is None else
                                                             f" tree {budget}")
            row = {"temperature": temperature, "drafts": drafts, "steps": steps,
                   "tau": committed / steps, "plain_sampled": exact,
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"T={temperature:<4} {row['drafts']:<16} tau {row['tau']:.3f}  steps {steps}  "
                  f"plain sampled {exact}  {row['seconds']:.0f} s", flush=True)
    if args.json:
        out = {"python": platform.python_version(), "device": args.device,
               "prompts": len(prompts), "tokens": args.tokens, "seeds": args.seeds,
               "block_size": BLOCK, "tree_budget": args.tree_budget, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
