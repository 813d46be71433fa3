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
        [--seed 1] [--device cpu|cuda]   # on CUDA the target runs in bf16, as in training

With no directory, the shipped drafter (``dflash/data/default/drafter``) is measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sysconfig
from pathlib import Path

import torch

from dflash.data import require_default
from dflash.model import TargetModel
from dflash.model.drafters import DFlashDrafter, make_drafter
from dflash.model.tokenizer import load_tokenizer
from dflash.training.loop import evaluate, prompt_lookup_tau

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="*", help="DFlash drafter directories")
    ap.add_argument("--prompts", type=int, default=12, help="files sampled (short ones skipped)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    target_dir = require_default("target")
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SystemExit(f"{target_dir} has no tokenizer.json")
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = TargetModel.from_pretrained(target_dir, dtype=dtype, device=args.device)
    rng = random.Random(args.seed)
    held = heldout_files(root)
    prompts = []
    for path in rng.sample(held, min(args.prompts, len(held))):
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) > 3 * args.prompt_len:
            start = rng.randrange(0, len(ids) - args.prompt_len)
            prompts.append(ids[start : start + args.prompt_len])
    rows = {"python_stdlib": str(root), "python": platform.python_version(),
            "device": args.device, "seed": args.seed,
            "heldout_files": len(held), "prompts": len(prompts),
            "tokens": args.tokens, "block_size": BLOCK,
            "prompt_lookup_tau": prompt_lookup_tau(model, prompts, args.tokens, BLOCK)}
    print(f"{len(held)} held-out files under {root}; {len(prompts)} prompts x {args.tokens} tokens")
    print(f"prompt-lookup      tau {rows['prompt_lookup_tau']:.3f}")
    for name in args.drafters or [str(require_default("drafter"))]:
        drafter = make_drafter(name, model)
        if not isinstance(drafter, DFlashDrafter) or drafter.config.block_size != BLOCK:
            raise SystemExit(f"{name!r} is not a DFlash drafter directory of block {BLOCK}")
        scores = evaluate(model, drafter, prompts, args.tokens)
        rows[name] = scores
        print(f"{name:<18} tau {scores['tau']:.3f}  acceptance {scores['acceptance_rate']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
