"""``dflash train-drafter``: train a DFlash drafter (z-lab's format) for a target model.

Writes ``--out/{config.json, model.safetensors}`` (loadable by ``dflash generate --draft``,
vLLM, SGLang and z-lab's code), ``--out/train_log.json`` (loss curve, held-out τ) and
step checkpoints under ``--out/checkpoints`` (``--resume`` continues from the last one).
Exit status: 0 done, 2 unusable arguments or data, 3 a failure while training.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a target model",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--model",
        required=True,
        help="target checkpoint directory, or 'tiny' / 'nine-b-shape' (seeded built-ins)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files / directories (tokenized with the target's tokenizer.json) or "
        ".npy token files (1-D int32/int64)",
    )
    p.add_argument(
        "--eval-data", nargs="+", default=(), help="held-out prompts (default: tail of --data)"
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps (0: 4%% of --steps)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=1, help="drafter layers")
    p.add_argument(
        "--format",
        choices=("dflash", "dflash2"),
        default="dflash",
        help="dflash: z-lab's DFlash drafter (default); dflash2: DFlash2 (convolutions "
        "around each sublayer, a candidate selector; specs/dflash2.md)",
    )
    p.add_argument(
        "--target-layers",
        type=_layer_list,
        default=(),
        help="target layers whose outputs the drafter reads, comma-separated "
        "(default: z-lab's spread for the target's depth)",
    )
    p.add_argument("--anchors", type=int, default=32, help="anchored blocks per sequence")
    p.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="loss decay (default: 7 for B=16, 5 for 10, 4 for 8)",
    )
    p.add_argument(
        "--teacher",
        choices=("generate", "data"),
        default="generate",
        help="generate: train on the target's own greedy responses to data prompts "
        "(default); data: train on the raw data",
    )
    p.add_argument(
        "--teacher-samples",
        type=int,
        default=0,
        help="sequences in the training pool (0: min(steps*batch, 4096))",
    )
    p.add_argument(
        "--prompt-len", type=int, default=0, help="prompt tokens (0: seq-len/4); also eval prompts"
    )
    p.add_argument("--teacher-batch", type=int, default=128, help="sequences generated at once")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evals (0: 10 evals)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per eval prompt")
    p.add_argument("--save-every", type=int, default=0, help="0: at every evaluation")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mask-token-id", type=int, default=None, help="default: vocab_size - 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    p.set_defaults(run=run)


def _layer_list(text: str) -> tuple[int, ...]:
    """``--target-layers 1,3,5,7`` → ``(1, 3, 5, 7)``; the range is checked against the target."""
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated layer indices, e.g. 1,3,5,7 (got {text!r})"
        ) from None
    return layers


def run(args: argparse.Namespace) -> int:
    import torch

    from dflash.model import ConfigError
    from dflash.model.catalog import SessionError
    from dflash.model.drafters import DrafterError
    from dflash.training import DataError, TrainConfig, train_drafter

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(
        model=args.model,
        data=tuple(args.data),
        eval_data=tuple(args.eval_data),
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        block_size=args.block_size,
        num_layers=args.num_layers,
        format=args.format,
        anchors=args.anchors,
        gamma=args.gamma,
        teacher=args.teacher,
        teacher_samples=args.teacher_samples,
        prompt_len=args.prompt_len,
        teacher_batch=args.teacher_batch,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        save_every=args.save_every,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        mask_token_id=args.mask_token_id,
        target_layers=args.target_layers,
        seed=args.seed,
        device=device,
        dtype=args.dtype,
        resume=args.resume,
        progress=not args.no_progress,
    )
    usage = (DataError, SessionError, ConfigError, DrafterError, ValueError, OSError)
    try:
        result = train_drafter(cfg)
    except usage as exc:
        from dflash.commands.settings import cli_message

        print(f"dflash train-drafter: error: {cli_message(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failure while training: exit 3 with its type, no traceback
        print(f"dflash train-drafter: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    last = result.evals[-1] if result.evals else {}
    print(
        f"dflash train-drafter: wrote {result.out} after {result.steps} steps; final loss "
        f"{result.final_loss:.4f}, held-out tau {last.get('tau', float('nan')):.3f}",
        file=sys.stderr,
    )
    return 0
