"""``dflash generate``: speculative decoding on a target model (the main job).

With no ``--model`` it runs the built-in tiny default model and its default drafter.
``--json`` prints exactly one JSON object (the ``GenerationResult``) on stdout; the
progress bar and the summary table go to stderr.  Exit status: 0 done, 1 ``--check-parity``
found a difference, 2 unusable arguments, 3 a failure while decoding.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from dflash.execution.errors import LayerSplitError, RollbackConfigError
from dflash.execution.policy import ENV_VAR, ROLLBACK_MODES, RollbackPolicy
from dflash.execution.results import GenerationResult

USAGE_ERRORS: tuple[type[Exception], ...] = (LayerSplitError, RollbackConfigError)


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``generate`` and ``bench``."""
    p.add_argument(
        "--model",
        default="tiny",
        help="checkpoint directory, 'tiny' (built-in default) or 'nine-b-shape' "
        "(seeded weights in the Qwen3.5-9B shape)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of built-in model weights")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model dtype (default: float32 for tiny or on CPU, else bfloat16)",
    )
    p.add_argument(
        "--draft",
        default="dflash",
        help="DFlash drafter directory, 'dflash' (built-in seeded default), "
        "'prompt-lookup' or 'synthetic' (benchmark drafter, see --acceptance)",
    )
    acc = p.add_mutually_exclusive_group()
    acc.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help="synthetic drafter: per-slot probability of proposing the target's token "
        "(given the earlier slots were right; default 0.8)",
    )
    acc.add_argument(
        "--drafted-acceptance",
        type=float,
        default=None,
        help="synthetic drafter: choose the per-slot probability so that this share of "
        "the drafted tokens is accepted on average (e.g. 0.4 with block 16)",
    )
    p.add_argument("--draft-seed", type=int, default=0)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text")
    src.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 3,14,15")
    src.add_argument(
        "--prompt-len", type=int, default=None, help="a prompt of N seeded random token ids"
    )
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--eos-id", type=int, default=None, help="stop after this token id")
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, one per shard (default: cuda:0 if available, else cpu)",
    )
    p.add_argument(
        "--layer-split", default=None, help="layers per shard, e.g. 16,16 (default: even split)"
    )
    p.add_argument(
        "--non-deterministic",
        action="store_true",
        help="let decode forwards use their natural shapes (parity then holds only "
        "up to floating-point ties)",
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="speculative decoding (the main job)", description=__doc__.splitlines()[0]
    )
    add_generation_options(p)
    p.add_argument(
        "--rollback",
        choices=ROLLBACK_MODES,
        default=None,
        help=f"rollback mode (default: ${ENV_VAR}, else replay)",
    )
    p.add_argument(
        "--check-parity",
        action="store_true",
        help="also run target-only greedy decoding and compare token for token",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def default_devices() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


class Progress:
    """A one-line progress bar on a stream (stderr)."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled

    def __call__(self, done: int, engine: Any) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        status = engine.status.value
        self.stream.write(f"\r[{bar}] {done}/{self.total} tokens  rollback {status}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def summary_table(r: GenerationResult) -> str:
    rows = [
        ("tokens", f"{len(r.tokens)} (stop: {r.stop_reason})"),
        ("sha256", r.sha256),
        ("drafter", r.drafter),
        ("block size", str(r.block_size)),
        ("steps", str(r.steps)),
        ("acceptance rate", f"{r.acceptance_rate:.3f}"),
        ("avg commit", f"{r.avg_commit:.2f}"),
        (
            "target forwards/step",
            f"{r.target_forwards_per_step:.2f}"
            + (
                ""
                if r.effective_forwards_per_step is None
                else f" ({r.effective_forwards_per_step:.2f} while effective)"
            ),
        ),
        (
            "rollback",
            f"requested {r.rollback.requested}, status {r.rollback.status.value} "
            f"(at start {r.rollback.status_at_start.value})",
        ),
        (
            "rollbacks",
            f"fast {r.rollback.fast}, replay {r.rollback.replay}, "
            f"replay after failure {r.rollback.replay_after_failure}",
        ),
        ("capture gate", r.capture.verdict + (f": {r.capture.reason}" if r.capture.reason else "")),
        ("checkpoint bytes", f"{r.checkpoint_bytes:,}"),
        ("devices / split", f"{','.join(r.devices)} / {','.join(map(str, r.layer_split))}"),
        ("deterministic", str(r.deterministic)),
        ("parity", "not checked" if r.parity is None else str(r.parity).lower()),
        ("prefill", f"{r.timings.prefill_s:.3f} s"),
        ("decode", f"{r.timings.decode_s:.3f} s, {r.timings.tokens_per_s:.1f} tokens/s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def synthetic_acceptance(args: argparse.Namespace) -> float:
    """The synthetic drafter's per-slot probability from --acceptance / --drafted-acceptance."""
    from dflash.execution.session import per_slot_probability

    if args.drafted_acceptance is not None:
        if args.block_size < 2:
            raise ValueError(f"--block-size must be >= 2 (got {args.block_size})")
        return per_slot_probability(args.drafted_acceptance, args.block_size)
    p = 0.8 if args.acceptance is None else args.acceptance
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"--acceptance must be in [0, 1] (got {p})")
    return float(p)


@dataclass(frozen=True)
class Prepared:
    """What one generation (or one bench) needs, built from the shared options."""

    model: Any  # TargetModel (imported lazily: torch loads only when a command runs)
    plan: Any  # ShardPlan
    prompt: list[int]
    drafter: Any  # Drafter
    oracle: list[int] | None  # target-only greedy tokens, when the drafter needed them
    dtype: Any  # torch.dtype
    devices: str
    acceptance: float


def prepare(args: argparse.Namespace, *, deterministic: bool) -> Prepared:
    """Check the shared options, then build model, shards, prompt and drafter.

    The layer split is checked against the layer count before any weights are built, so
    a bad ``--layer-split`` fails in milliseconds even for a large model.
    """
    import torch

    from dflash.execution.session import (
        build_drafter,
        build_model,
        encode_prompt,
        model_config,
        parse_dtype,
    )
    from dflash.execution.shards import plan_shards
    from dflash.geometry import MAX_SLOTS

    if args.devices is not None and not args.devices.strip():
        raise ValueError("--devices must name at least one device (got '')")
    devices = args.devices or default_devices()
    first = devices.split(",")[0].strip()
    dtype = parse_dtype(args.dtype, args.model, first)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if not 2 <= args.block_size <= MAX_SLOTS:
        raise ValueError(f"--block-size must be in [2, {MAX_SLOTS}] (got {args.block_size})")
    acceptance = synthetic_acceptance(args)
    config = model_config(args.model)
    if args.eos_id is not None and not 0 <= args.eos_id < config.vocab_size:
        raise ValueError(
            f"--eos-id must be a token id in [0, {config.vocab_size}) (got {args.eos_id})"
        )
    plan = plan_shards(config.num_hidden_layers, devices, args.layer_split)
    if first.startswith("cuda"):
        torch.cuda.set_device(torch.device(first))
    model = build_model(args.model, seed=args.seed, dtype=dtype, device=first)
    prompt = encode_prompt(
        args.model,
        model.config.vocab_size,
        text=args.prompt,
        ids=args.prompt_ids,
        length=args.prompt_len,
        seed=args.prompt_seed,
    )
    drafter, oracle = build_drafter(
        args.draft,
        model,
        prompt,
        plan=plan,
        acceptance=acceptance,
        seed=args.draft_seed,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        deterministic=deterministic,
    )
    return Prepared(model, plan, prompt, drafter, oracle, dtype, devices, acceptance)


def usage_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean "unusable arguments" (exit 2) for generate and bench."""
    from dflash.execution.session import SessionError
    from dflash.model import ConfigError
    from dflash.model.drafters import DrafterError

    return (*USAGE_ERRORS, SessionError, ConfigError, DrafterError, ValueError)


def execute(
    args: argparse.Namespace, policy: RollbackPolicy, ready: Prepared, *, progress: bool
) -> GenerationResult:
    """Run one generation on what :func:`prepare` built."""
    from dflash.execution.run import generate

    start = "off" if not policy.fast else "requested"
    print(
        f"dflash generate: rollback requested {policy.mode}, status {start}; "
        f"deterministic {policy.deterministic}",
        file=sys.stderr,
    )
    bar = Progress(args.max_new_tokens, sys.stderr, progress)
    try:
        return generate(
            ready.model,
            ready.drafter,
            ready.prompt,
            plan=ready.plan,
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            policy=policy,
            check_parity=bool(getattr(args, "check_parity", False)),
            oracle_tokens=ready.oracle,
            eos_id=args.eos_id,
            on_progress=bar,
        )
    finally:
        bar.close()


def run(args: argparse.Namespace) -> int:
    try:  # everything that depends only on the arguments: exit 2 when unusable
        policy = RollbackPolicy.resolve(
            getattr(args, "rollback", None),
            environ=os.environ,
            deterministic=not args.non_deterministic,
        )
        ready = prepare(args, deterministic=policy.deterministic)
    except usage_errors() as exc:
        print(f"dflash generate: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = execute(args, policy, ready, progress=not args.no_progress)
    except Exception as exc:  # a failure while decoding: exit 3 with its type, no traceback
        print(f"dflash generate: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    print(summary_table(result), file=sys.stderr)
    if args.json:
        sys.stdout.write(result.model_dump_json() + "\n")
    else:
        print(" ".join(map(str, result.tokens)))
    return 1 if result.parity is False else 0
