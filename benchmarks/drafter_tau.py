"""τ of DFlash drafters against prompt-lookup on held-out standard-library prompts.

Prompts are 64-token windows of the ``.py`` files of *this* interpreter's standard library
that the default pair's recipe holds out (the same rule as ``scripts/build_default.py``: a
file is held out when the first 8 hex digits of the SHA-256 of its path relative to the
standard library are below 5 % of 16^8; test directories and installed packages skipped),
tokenized with the default target's tokenizer. τ is the mean accepted length per step
(bonus included) of real speculative decoding with the engine, as ``dflash train-drafter``
reports it. On another Python version the held-out files have the same names but
slightly different contents, so the numbers are close to, not equal to, the recipe's.

    python3 benchmarks/drafter_tau.py [DRAFTER_DIR ...] [--prompts 12] [--tokens 128]
        [--seeds 1,2,3] [--device cpu|cuda]   # on CUDA the target runs in bf16, as in training
        [--target TARGET_DIR]                 # another target (a fresh build's OUT/target)

With no directory, the shipped drafter (``dflash/data/default/drafter``) is measured; with
no ``--target``, the shipped target. Prompts are always tokenized with the target's own
``tokenizer.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sysconfig
from pathlib import Path
from typing import Any

import torch

from dflash.data import require_default
from dflash.model import TargetModel
from dflash.model.drafters import DFlashDrafter, PromptLookupDrafter, make_drafter
from dflash.model.tokenizer import TextTokenizer, load_tokenizer
from dflash.training.loop import evaluate, speculative_scores

SKIPPED = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
HELDOUT_FRACTION = 0.05
BLOCK = 16  # the shipped drafter's block; prompt-lookup proposes as many tokens


def heldout_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED & set(p.relative_to(root).parts))
    cut = HELDOUT_FRACTION * 16**8
    return [
        p for p in files
        if int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest()[:8], 16) < cut
    ]


def heldout_prompts(
    tokenizer: TextTokenizer, held: list[Path], count: int, length: int, seed: int
) -> list[list[int]]:
    """One ``length``-token window of each of ``count`` files drawn with ``seed`` (files of
    at most 3 × ``length`` tokens skipped)."""
    rng = random.Random(seed)
    prompts = []
    for path in rng.sample(held, min(count, len(held))):
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) > 3 * length:
            start = rng.randrange(0, len(ids) - length)
            prompts.append(ids[start : start + length])
    return prompts


def default_heldout_prompts(count: int, length: int = 64, seed: int = 7) -> list[list[int]]:
    """:func:`heldout_prompts` of this interpreter's held-out standard-library files,
    tokenized with the default target's tokenizer (the CPU step benchmarks' prompt set)."""
    tokenizer = load_tokenizer(require_default("target"))
    assert tokenizer is not None  # the default target ships one
    held = heldout_files(Path(sysconfig.get_paths()["stdlib"]))
    return heldout_prompts(tokenizer, held, count, length, seed)


def pooled(rows: list[dict[str, float]]) -> dict[str, float]:
    """τ over every step of several runs: (accepted + steps) / steps of their sums."""
    steps = sum(r["steps"] for r in rows)
    tokens = sum(r["tau"] * r["steps"] for r in rows)
    return {"tau": tokens / steps if steps else 0.0, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="*", help="DFlash drafter directories")
    ap.add_argument("--prompts", type=int, default=12, help="files sampled (short ones skipped)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--seeds", default="1",
                    help="comma-separated prompt seeds; each draws its own windows, and the "
                    "result pools every step")
    ap.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--target", default=None,
                    help="target model directory (default: the shipped target)")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(
            f"--seeds must be comma-separated integers (got {args.seeds!r})"
        ) from None
    root = Path(sysconfig.get_paths()["stdlib"])
    target_dir = Path(args.target) if args.target else require_default("target")
    if not (target_dir / "config.json").is_file():
        raise SystemExit(f"--target {str(target_dir)!r} is not a model directory (no config.json)")
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SystemExit(f"{target_dir} has no tokenizer.json")
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = TargetModel.from_pretrained(target_dir, dtype=dtype, device=args.device)
    paths = {name: name for name in args.drafters}
    if not paths:
        paths = {"shipped drafter": str(require_default("drafter"))}
    drafters = {}
    for name, path in paths.items():
        drafter = make_drafter(path, model)
        if not isinstance(drafter, DFlashDrafter) or drafter.config.block_size != BLOCK:
            raise SystemExit(f"{path!r} is not a DFlash drafter directory of block {BLOCK}")
        drafters[name] = drafter
    names = list(paths)
    held = heldout_files(root)
    print(f"{len(held)} held-out files under {root}; seeds {seeds}; {args.tokens} tokens each")
    every = ["prompt-lookup", *names]
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        prompts = heldout_prompts(tokenizer, held, args.prompts, args.prompt_len, seed)
        scores = {"prompt-lookup": speculative_scores(
            model, PromptLookupDrafter, prompts, args.tokens, BLOCK
        )}
        for name, drafter in drafters.items():
            scores[name] = evaluate(model, drafter, prompts, args.tokens)
        runs.append({"seed": seed, "prompts": len(prompts), "scores": scores})
        line = "  ".join(f"{name} {scores[name]['tau']:.3f}" for name in every)
        print(f"seed {seed}, {len(prompts)} prompts: tau  {line}", flush=True)
    total = {name: pooled([r["scores"][name] for r in runs]) for name in every}
    print("pooled: " + "  ".join(
        f"{name} {t['tau']:.3f} ({t['steps']:.0f} steps)" for name, t in total.items()
    ))
    if args.json:
        out = {"python_stdlib": str(root), "python": platform.python_version(),
               "target": str(target_dir),
               "device": args.device, "heldout_files": len(held), "tokens": args.tokens,
               "prompt_len": args.prompt_len, "block_size": BLOCK, "runs": runs,
               "pooled": total}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
