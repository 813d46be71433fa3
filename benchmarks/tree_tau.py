"""τ of the default pair with tree drafts against chains, on held-out standard-library prompts.

The prompts are :mod:`drafter_tau`'s (64-token windows of the held-out ``.py`` files of this
interpreter's standard library, tokenized with the default target's tokenizer). For the
chain (block 16, every draft verified whole) and for each tree budget, the shipped drafter
drafts and the engine verifies: τ is the mean committed length per step (the bonus token
included: ``avg_commit``), pooled over every step; every run's tokens are compared with
plain greedy decoding.

    python3 benchmarks/tree_tau.py [--budgets 8,16,32,64] [--prompts 6] [--tokens 96]
        [--seed 7] [--device cpu|cuda] [--drafter DIR] [--json FILE]

``--drafter``: another drafter for the default target (a DFlash or DFlash2 checkpoint
directory) in place of the shipped one.
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
from dflash.model.drafters import make_drafter

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default=None,
                    help="a drafter checkpoint directory (default: the shipped drafter)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = TargetModel.from_pretrained(require_default("target"), dtype=dtype, device=args.device)
    drafter_dir = args.drafter or str(require_default("drafter"))
    plan = plan_shards(model.config.num_hidden_layers, args.device)
    prompts = default_heldout_prompts(args.prompts, seed=args.seed)
    oracles = [reference_greedy(model, plan, p, args.tokens) for p in prompts]
    rows = []
    for budget in [None, *budgets]:
        steps = committed = 0
        nodes = 0.0
        exact = True
        t0 = time.perf_counter()
        for prompt, oracle in zip(prompts, oracles, strict=True):
            r = generate(
                model, make_drafter(drafter_dir, model), prompt, plan=plan,
                max_new_tokens=args.tokens, block_size=BLOCK, verify_window="full",
                tree_budget=budget,
            )
            exact &= r.tokens == oracle
            steps += r.steps
            committed += round(r.avg_commit * r.steps)
            nodes += (r.nodes_per_step or 0.0) * r.steps
        row = {
            "tree_budget": budget, "steps": steps, "tau": committed / steps,
            "nodes_per_step": nodes / steps, "plain_greedy": exact,
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        name = "chain (block 16)" if budget is None else f"tree budget {budget}"
        print(f"{name:<18} tau {row['tau']:.3f}  nodes/step {row['nodes_per_step']:.1f}  "
              f"steps {steps}  plain greedy {exact}  {row['seconds']:.0f} s", flush=True)
    chain = rows[0]["tau"]
    best = max(rows[1:], key=lambda r: r["tau"])
    print(f"best tree: budget {best['tree_budget']}, tau {best['tau']:.3f} = "
          f"{best['tau'] / chain:.2f}x the chain's {chain:.3f}")
    if args.json:
        out = {"python": platform.python_version(), "device": args.device,
               "drafter": drafter_dir, "prompts": len(prompts), "tokens": args.tokens,
               "block_size": BLOCK,
               "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
