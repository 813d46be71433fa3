"""What prompt lookup adds to the default pair's DFlash drafter (``dflash`` vs ``dflash+lookup``).

Two measurements, both lossless (every run's tokens are compared with plain greedy):

- **τ** (every draft verified whole, bonus token included, as ``benchmarks/drafter_tau.py``
  measures it) over ``--prompts`` 64-token windows of this interpreter's held-out
  standard-library files per seed in ``--seeds``;
- **CPU speed-up over plain greedy** with the engine's verify windows, as the main job runs
  it (``dflash.commands.harness``): the main job's prompt at each ``--tokens`` length,
  and the first ``--heldout`` of those held-out prompts at 64 tokens (their decode times
  summed). The two drafters alternate, ``--reps`` runs each; the median and range of the
  speed-up, the average commit and the steps are reported per drafter, and the share of
  steps whose draft was a copy.

    python3 benchmarks/lookup_assist.py [--prompts 42] [--seeds 1,2] [--tokens 64,128,256]
        [--heldout 12] [--reps 5] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_tau import heldout_files, heldout_prompts  # the benchmarks' own helper

from dflash.commands.harness import Harness
from dflash.commands.settings import DEFAULT_PROMPT
from dflash.data import require_default
from dflash.execution import RollbackPolicy, plan_shards
from dflash.execution.session import encode_prompt
from dflash.model import TargetModel
from dflash.model.drafters import LookupAssistedDrafter, make_drafter
from dflash.model.tokenizer import load_tokenizer
from dflash.training.loop import speculative_scores

BLOCK = 16
SPECS = ("dflash", "dflash+lookup")


def run(model: TargetModel, drafter: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Speculative + plain decodes of ``tokens`` tokens after each prompt: summed times."""
    plan = plan_shards(model.config.num_hidden_layers, "cpu")
    spec_s = plain_s = 0.0
    steps = committed = copied = 0
    parity = True
    for prompt in prompts:
        drafter.reset()
        harness = Harness.kept(model, drafter, prompt, plan, max_new_tokens=tokens,
                               block_size=BLOCK, greedy_tokens=tokens)
        r = harness.against_greedy(RollbackPolicy(mode="checkpoint"))
        assert r.timings.greedy_decode_s is not None
        spec_s += r.timings.decode_s
        plain_s += r.timings.greedy_decode_s
        steps += r.steps
        committed += len(r.tokens)
        copied += r.copied_drafts or 0
        parity = parity and bool(r.parity)
    return {"speedup": plain_s / spec_s, "steps": steps, "commit": committed / steps,
            "copied_share": copied / steps, "parity": parity}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=42)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--tokens", default="64,128,256")
    ap.add_argument("--heldout", type=int, default=12)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = require_default("target")
    model = TargetModel.from_pretrained(target_dir, dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(target_dir)
    assert tokenizer is not None
    drafters = {spec: make_drafter(str(require_default("drafter")) + spec[len("dflash"):], model)
                for spec in SPECS}
    assert isinstance(drafters["dflash+lookup"], LookupAssistedDrafter)
    held = heldout_files(Path(sysconfig.get_paths()["stdlib"]))
    prompts = [p for s in args.seeds.split(",")
               for p in heldout_prompts(tokenizer, held, args.prompts, 64, int(s))]
    out: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "heldout_prompts": len(prompts), "tau": {}, "speedup": {},
    }
    for spec, drafter in drafters.items():
        def fresh(d: Any = drafter) -> Any:
            d.reset()
            return d

        out["tau"][spec] = speculative_scores(model, fresh, prompts, 64, BLOCK)
        print(f"tau  {spec:14s} {out['tau'][spec]['tau']:.3f} "
              f"({out['tau'][spec]['steps']:.0f} steps, {len(prompts)} prompts)", flush=True)
    main_prompt = encode_prompt("default", model.config.vocab_size, text=DEFAULT_PROMPT, ids=None,
                                length=None, seed=0, allow_bytes=False)
    cases = [(f"main job, {n} tokens", [main_prompt], int(n)) for n in args.tokens.split(",")]
    if args.heldout:
        cases.append((f"{args.heldout} held-out prompts, 64 tokens", prompts[: args.heldout], 64))
    for name, case_prompts, tokens in cases:
        runs: dict[str, list[dict[str, Any]]] = {spec: [] for spec in SPECS}
        for _ in range(args.reps):
            for spec in SPECS:  # alternating: a machine that drifts slows both alike
                runs[spec].append(run(model, drafters[spec], case_prompts, tokens))
        out["speedup"][name] = runs
        for spec in SPECS:
            rs = runs[spec]
            ups = [r["speedup"] for r in rs]
            print(f"{name:32s} {spec:14s} speed-up {statistics.median(ups):.2f}x "
                  f"({min(ups):.2f}-{max(ups):.2f})  commit {rs[0]['commit']:.2f}  "
                  f"steps {rs[0]['steps']}  copied {rs[0]['copied_share']:.0%}  "
                  f"parity {all(r['parity'] for r in rs)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
