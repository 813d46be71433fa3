"""Wall time of one ``dflash train-drafter`` step on the default target, blocked vs dense.

The step of :func:`dflash.training.train_drafter`: the frozen target's tap features of a
batch of sequences (no gradients), the block loss of ``--anchors`` anchored blocks per
sequence under bf16 autocast (float32 master weights), backward, gradient clipping, AdamW.
``--attention blocked`` is the training forward (each block attends over the context and
itself: ``C + B`` scores per query), ``dense`` the same function as one attention over
[context ; every block] with the other blocks masked out (``C + A*B`` scores per query), as
training ran before. Sequences are raw windows of this interpreter's standard library
(``.py`` files of ``json``, ``asyncio``, ``email``), tokenized with the target's tokenizer;
the drafter is the recipe's shape (3 layers, block 16). Median wall time per step after
``--warmup`` steps, host-synchronised; ``--json`` writes the rows.

    python3 benchmarks/train_step.py [--device cuda] [--steps 25] [--batch 128]
        [--anchors 32] [--attention blocked,dense] [--formats dflash,dflash2] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from dflash.data import require_default
from dflash.model.drafters import DFlashDrafter
from dflash.model.drafters.dflash_layers import math_attention
from dflash.training.data import Encoder, data_set, read_documents
from dflash.training.loop import TrainConfig, _features, drafter_config, load_target
from dflash.training.objective import block_loss, default_gamma, sample_anchors

PACKAGES = ("json", "asyncio", "email")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--attention", default="blocked,dense")
    ap.add_argument("--formats", default="dflash",
                    help="drafter formats to time, comma-separated: dflash, dflash2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda"):  # as train_drafter runs (cuBLAS deterministic)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    modes = [m.strip() for m in args.attention.split(",") if m.strip()]
    if not modes or any(m not in ("blocked", "dense") for m in modes):
        ap.error(f"--attention takes blocked and/or dense (got {args.attention!r})")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or any(f not in ("dflash", "dflash2") for f in formats):
        ap.error(f"--formats takes dflash and/or dflash2 (got {args.formats!r})")
    target_dir = require_default("target")
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(f) for pkg in PACKAGES for f in (lib / pkg).glob("*.py"))
    cfg = TrainConfig(
        model=str(target_dir), data=tuple(files), out="unused", device=args.device,
        num_layers=3, batch_size=args.batch, seq_len=args.seq_len,
    )
    model = load_target(cfg)
    encoder = Encoder(target_dir, model.config.vocab_size)
    docs = read_documents(files, encoder, model.config.vocab_size)
    train = data_set(docs, seq_len=args.seq_len, count=4096, seed=0)
    cuda = args.device.startswith("cuda")
    rows: list[dict[str, Any]] = []
    for fmt, mode in ((f, m) for f in formats for m in modes):
        config = drafter_config(dataclasses.replace(cfg, format=fmt), model)
        gamma = default_gamma(config.block_size)
        drafter = DFlashDrafter.random(
            config, model.embed_tokens.weight, model.lm_head.weight, 0, dtype=torch.float32
        )
        drafter.train().requires_grad_(True)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95))
        caches = model.new_caches(max_len=args.seq_len, max_draft=1, batch=args.batch)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
        times = []
        for step in range(args.warmup + args.steps):
            sync(args.device)
            t0 = time.perf_counter()
            gen = torch.Generator().manual_seed(step)
            picked = torch.randint(0, train.tokens.shape[0], (args.batch,), generator=gen)
            ids = torch.as_tensor(train.tokens[picked.numpy()], device=args.device)
            anchors = sample_anchors(
                train.label_start, args.seq_len, config.block_size, args.anchors, args.batch, gen
            )
            feats = _features(model, ids, config.target_layer_ids, caches)
            with autocast, math_attention():  # as train_drafter (dense: SDPA's math backend)
                result = block_loss(drafter, ids, feats, anchors, gamma, dense=mode == "dense")
            opt.zero_grad(set_to_none=True)
            result.loss.backward()  # type: ignore[no-untyped-call]  # torch's stub is untyped
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            loss = float(result.loss.detach())
            sync(args.device)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        row = {
            "format": fmt, "attention": mode, "ms_per_step": ms, "batch": args.batch,
            "anchors": args.anchors,
            "seq_len": args.seq_len, "steps": args.steps, "last_loss": loss,
            "sequence_tokens_per_s": args.batch * args.seq_len / (ms / 1e3),
        }
        rows.append(row)
        print(f"{fmt:<8} {mode:<8} {ms:8.1f} ms/step  "
              f"{row['sequence_tokens_per_s']:>10,.0f} tokens/s  "
              f"(batch {args.batch}, {args.anchors} anchors)", flush=True)
    if args.json:
        env = {
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "python": platform.python_version(), "torch": torch.__version__,
        }
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
