"""Where the default pair's drafts stop: the target's own confidence at each first miss.

Runs the main job's generation (the default pair, ``dflash+lookup``, checkpoint rollback,
``--max-new-tokens`` tokens on CPU in float32) on the default prompt and, with
``--heldout N``, on N held-out standard-library prompts (``benchmarks/drafter_tau.py``'s,
seed 7). For every step whose draft was not accepted to its end it takes the first
rejected slot and asks how sure the *target* was of the token it chose there: its softmax
probability of its own greedy token, from one plain forward over the prompt and the
generated tokens (whose argmax must equal those tokens, else the run stops). It prints,
per prompt set, the steps, the misses, how many of them fell where the target gave its
token less than 0.5 (and less than 0.25), and the median of that probability at the
misses and at the accepted guesses. ``--json`` writes the rows. (A step that accepts its
whole verified window has no miss to count.)

Where the target's greedy token wins with a probability of 0.2, its runners-up are
close behind it, and a drafter has to pick the target's choice among them from the
target's intermediate features alone.

    python3 benchmarks/draft_misses.py [--max-new-tokens 64] [--heldout 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dflash.commands.settings import DEFAULT_PROMPT
from dflash.execution import RollbackPolicy, ShardedTarget, SpecDecoder, plan_shards
from dflash.execution.session import build_drafter, build_model, encode_prompt


def target_confidence(target: ShardedTarget, ids: list[int]) -> tuple[list[float], list[int]]:
    """``(p, argmax)`` of one plain forward over ``ids``: ``p[j]`` the softmax probability
    of the greedy token after ``ids[: j + 1]``, ``argmax[j]`` that token."""
    logits, _ = target.forward(ids, "prefill", 0)
    probs = torch.softmax(logits.double(), dim=-1)
    top = probs.max(dim=-1)
    return [float(p) for p in top.values], [int(t) for t in top.indices]


def misses(prompt: list[int], n: int, model: Any, plan: Any, drafter: Any) -> dict[str, Any]:
    """One generation's steps and, per partly accepted step, its first miss."""
    target = ShardedTarget(model, plan, max_len=len(prompt) + n + 17, max_draft=16)
    engine = SpecDecoder(target, drafter, block_size=16, policy=RollbackPolicy(mode="checkpoint"))
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    ids = [*prompt, *out[:n]]
    plain = ShardedTarget(model, plan, max_len=len(ids) + 1, max_draft=1)
    conf, greedy = target_confidence(plain, ids)
    if greedy[len(prompt) - 1 : len(ids) - 1] != ids[len(prompt) :]:
        raise SystemExit("the plain forward's argmax differs from the generated tokens")
    at_miss, at_hit = [], []
    start = len(prompt)  # position of the first draft slot's token (d[0] = last)
    for record in engine.records:
        draft, accepted = record.draft, record.accept_n
        for i in range(1, accepted):  # accepted guesses: d[i] at position start + i
            if start + i < len(ids):
                at_hit.append(conf[start + i - 1])
        if accepted < len(draft) and start + accepted < len(ids):
            at_miss.append(conf[start + accepted - 1])
        start += accepted
    return {"steps": len(engine.records), "at_miss": at_miss, "at_hit": at_hit}


def summary(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    at_miss = [p for r in runs for p in r["at_miss"]]
    at_hit = [p for r in runs for p in r["at_hit"]]
    row = {
        "prompts": label, "steps": sum(r["steps"] for r in runs), "misses": len(at_miss),
        "below_0.5": sum(p < 0.5 for p in at_miss), "below_0.25": sum(p < 0.25 for p in at_miss),
        "median_target_p_at_miss": statistics.median(at_miss) if at_miss else None,
        "median_target_p_at_accepted": statistics.median(at_hit) if at_hit else None,
    }
    print(f"{label:<24} steps {row['steps']:4d}  misses {row['misses']:4d}  target p < 0.5 at "
          f"{row['below_0.5']} ({row['below_0.5'] / max(1, len(at_miss)):.0%}), < 0.25 at "
          f"{row['below_0.25']} ({row['below_0.25'] / max(1, len(at_miss)):.0%})  median "
          f"target p: at misses {row['median_target_p_at_miss']:.2f}, at accepted guesses "
          f"{row['median_target_p_at_accepted']:.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.max_new_tokens
    model = build_model("default", seed=0, dtype=torch.float32, device="cpu")
    plan = plan_shards(model.config.num_hidden_layers, "cpu")
    prompt = encode_prompt(
        "default", model.config.vocab_size, text=DEFAULT_PROMPT, ids=None, length=None, seed=0,
        allow_bytes=False,
    )
    drafter, _ = build_drafter("dflash+lookup", model, prompt, plan=plan, acceptance=0.0,
                               seed=0, max_new_tokens=n, block_size=16, model_spec="default")
    with torch.inference_mode():
        rows = [summary("the main job's prompt", [misses(prompt, n, model, plan, drafter)])]
        if args.heldout:
            sys.path.insert(0, str(Path(__file__).parent))
            from drafter_tau import default_heldout_prompts

            prompts = default_heldout_prompts(args.heldout)
            runs = [misses(p, n, model, plan, drafter) for p in prompts]
            rows.append(summary(f"{len(prompts)} held-out prompts", runs))
    if args.json:
        env = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
               "python": platform.python_version(), "torch": torch.__version__,
               "max_new_tokens": n}
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
