"""``dflash generate``: speculative decoding on a target model (the main job).

Text in, text out: with a model that has a ``tokenizer.json``, ``--prompt`` is tokenized
and the generated text is printed on stdout as it is committed (``GenerationResult.text``
holds it, without a final EOS token). A model without a tokenizer refuses a text prompt
unless ``--bytes`` asks for the text's UTF-8 bytes as ids (output bytes are then decoded
the same way; ids >= 256 show as U+FFFD); otherwise stdout gets the token ids. After the
speculative decode the same number of tokens is decoded with plain target-only greedy (same
shards, devices and CUDA-graph setting, decode timed the same way) and the speed-up over
it is reported (``speedup_vs_greedy``); ``--no-baseline`` skips that. Generation
stops at the model's EOS id (``generation_config.json``, else ``config.json``) unless
``--eos-id`` names another. ``--json`` prints exactly one JSON object (the
``GenerationResult``) on stdout and nothing else there; progress and the summary table go
to stderr, the progress bar only when stderr is a terminal. Exit status: 0 done, 1
``--check-parity`` found a difference, 2 unusable arguments, 3 a failure while decoding
(also: the model does not fit in memory), 4 an internal error (a bug; ``dflash --debug
generate`` prints its traceback), 130 Ctrl-C, 141 stdout closed early.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from dflash.commands.settings import DEFAULT_PROMPT, cli_message, set_cpu_threads
from dflash.errors import CheckpointError, ConfigError, DFlashError, UsageError
from dflash.execution.eos import Eos, before_eos, eos_set
from dflash.execution.errors import ContextLengthError
from dflash.execution.policy import ENV_VAR, ROLLBACK_MODES, RollbackPolicy
from dflash.execution.results import GenerationResult

#: ``--quantize``'s values, as :data:`dflash.model.fp8.QUANTIZE_CHOICES` (a test holds them
#: equal; that module imports torch, which a command loads only when it runs)
QUANTIZE_CHOICES = ("fp8", "fp8-lm-head")

if TYPE_CHECKING:
    from dflash.execution.window import WindowChoice
    from dflash.sampling import SamplingParams

#: unusable arguments, model or checkpoint: exit 2 (LayerSplitError, RollbackConfigError,
#: SessionError and the drafters' argument errors are UsageErrors). Any other exception
#: while preparing is a bug: it reaches ``dflash.cli.main`` (exit 4).
USAGE_ERRORS: tuple[type[Exception], ...] = (UsageError, ConfigError, CheckpointError)
SEED_MAX = 2**63 - 1  # torch.manual_seed takes a signed 64-bit seed


def seed_value(text: str) -> int:
    """An argparse ``type`` for a seed: an integer in [0, 2**63 - 1]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [0, 2**63 - 1] (got {text!r})"
        ) from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63 - 1] (got {value})")
    return value


def mode_name(text: str) -> str:
    """``--rollback``: case and surrounding spaces are ignored, as for $DFLASH_ROLLBACK."""
    return text.strip().lower()


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``generate`` and ``bench``."""
    p.add_argument(
        "--model",
        default="default",
        help="checkpoint directory (safetensors; pickle is refused), 'default' (the embedded "
        "trained pair; the default), or seeded weights: 'tiny', 'nine-b-shape', "
        "'twenty-seven-b-shape' (the Qwen3.5-9B / 27B shapes)",
    )
    p.add_argument(
        "--seed",
        type=seed_value,
        default=0,
        help="seed of the sampling noise (with --temperature > 0) and of the seeded models' "
        "weights, in [0, 2**63 - 1] (default 0)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (0, the default: greedy). Every token is drawn by "
        "one seeded rule at its absolute position, so the output is plain sampled "
        "decoding's, seed for seed (README)",
    )
    p.add_argument("--top-k", type=int, default=0,
                   help="keep the K most likely tokens when sampling (0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="keep the smallest set of most likely tokens reaching probability P "
                   "when sampling (1: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least M times as likely as the most likely when "
                   "sampling (0: off)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model dtype (default: float32 for tiny or on CPU, else bfloat16)",
    )
    p.add_argument(
        "--draft",
        default="dflash+lookup",
        help="DFlash drafter directory, 'dflash' (with --model default the shipped drafter, "
        "else a seeded one), either followed by '+lookup' (assisted by prompt lookup; the "
        "default: 'dflash+lookup'), 'prompt-lookup' or 'synthetic' (benchmark drafter, "
        "see --acceptance)",
    )
    acc = p.add_mutually_exclusive_group()
    acc.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help="--draft synthetic only: per-slot probability of proposing the target's token "
        "(given the earlier slots were right; default 0.8)",
    )
    acc.add_argument(
        "--drafted-acceptance",
        type=float,
        default=None,
        help="--draft synthetic only: choose the per-slot probability so that this share of "
        "the drafted tokens is accepted on average (e.g. 0.4 with block 16)",
    )
    p.add_argument(
        "--draft-seed",
        type=seed_value,
        default=0,
        help="seed of the seeded and synthetic drafters, in [0, 2**63 - 1]",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        default=None,
        help="prompt text, tokenized with the model's tokenizer.json (see --bytes)",
    )
    src.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 3,14,15")
    src.add_argument(
        "--prompt-len", type=int, default=None, help="a prompt of N seeded random token ids"
    )
    p.add_argument(
        "--bytes",
        action="store_true",
        help="for a model without tokenizer.json: encode --prompt as its UTF-8 bytes and "
        "decode the output the same way",
    )
    p.add_argument(
        "--prompt-seed",
        type=seed_value,
        default=None,
        help="seed of --prompt-len's random ids, in [0, 2**63 - 1] (default 0)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--eos-id",
        type=int,
        default=None,
        help="stop after this token id (default: the model's eos_token_id from "
        "generation_config.json, else config.json, any of them when it lists several; none "
        "for seeded models)",
    )
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, one per shard (default: cuda:0 if available, else cpu)",
    )
    p.add_argument(
        "--layer-split", default=None, help="layers per shard, e.g. 16,16 (default: even split)"
    )
    p.add_argument(
        "--no-graphs",
        action="store_true",
        help="run every forward eagerly (default on CUDA: decode, verify and replay "
        "forwards replay CUDA graphs)",
    )
    p.add_argument(
        "--verify-window",
        choices=("auto", "full"),
        default="auto",
        help="how much of each draft a step verifies: 'auto' (on CPU the part the step's "
        "cost model says pays, elsewhere the whole draft; the default) or 'full' (every "
        "draft whole, as a drafter's tau is measured); the tokens are the same",
    )
    p.add_argument(
        "--tree-budget",
        type=int,
        default=None,
        help="verify trees of at most N nodes (root included) instead of chains, grown best "
        "first from the drafter's per-slot candidates (--draft dflash+lookup, the default, "
        "adds prompt lookup's copy as one branch; dflash or a DFlash drafter directory; "
        "with --draft synthetic a SYNTHETIC tree drafter: the target's token at "
        "rank r of each depth's candidates with probability a*(1-a)**r, r < 4, a from "
        "--acceptance); off by default",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=4096,
        help="prompt tokens per prefill forward (default 4096; 0: the whole prompt in one): "
        "a long prompt needs the caches plus one chunk's activations, never a "
        "prompt-by-prompt tensor",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="size the caches for N tokens (prompt and output; at most the model's "
        "max_position_embeddings) instead of this run's prompt + --max-new-tokens; checked "
        "against the device's free memory before anything is allocated",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,   # dflash.model.fp8's (torch loads only when a command runs)
        default=None,
        help="quantize the decoder layers' projections at load to FP8 (e4m3, 128x128 "
        "block scales, Hugging Face's fine-grained format): half the bytes a decode reads; "
        "fp8-lm-head: the LM head too (not a head tied to the embedding); the output is "
        "plain decoding's of the same FP8 model (an FP8 checkpoint is read as FP8 without "
        "this flag)",
    )
    p.add_argument(
        "--draft-window",
        type=int,
        default=None,
        help="a DFlash drafter's blocks attend only the last N committed tokens (default: "
        "all of them, or the drafter's own sliding window): a drafting step then costs the "
        "same at any context length; only guesses change, the output does not",
    )
    p.add_argument(
        "--draft-dtype",
        choices=("float32", "bfloat16", "float16", "float64"),
        default=None,
        help="dtype of the DFlash drafter's products (default: its weights' dtype); only "
        "guesses come out of the drafter, so the output is unchanged",
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="speculative decoding (the main job)", description=__doc__.splitlines()[0]
    )
    add_generation_options(p)
    p.add_argument(
        "--rollback",
        type=mode_name,
        choices=ROLLBACK_MODES,
        default=None,
        help=f"rollback mode, case-insensitive (default: ${ENV_VAR}, else checkpoint)",
    )
    p.add_argument(
        "--check-parity",
        action="store_true",
        help="compare the tokens with target-only greedy decoding, token for token (the "
        "greedy baseline's run, which is compared anyway; one of its own with --no-baseline)",
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the plain target-only greedy decode that measures the speed-up "
        "(timings.greedy_tokens_per_s and speedup_vs_greedy are then null)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="time the speculative and the plain greedy decode this many times each, "
        "alternately, and report the median of each (the text streams from the first run; "
        "every run must give its tokens). Default: 3 on CPU, where a shared machine's "
        "speed drifts from run to run, 1 on CUDA",
    )
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help="first decode this many tokens untimed, twice, speculatively and (with the "
        "baseline) greedily, on the same targets, so the timed runs compare steady states: "
        "Triton compiled, CUDA graphs captured (a graph's first forward runs eagerly, its "
        "second captures it; default: 32 on CUDA, 0 on CPU)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on stdout (and nothing else there)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway when stderr is not a terminal or the "
        "text is streamed)",
    )
    p.set_defaults(run=run)


def default_devices() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


class Progress:
    """A one-line progress bar on a stream (stderr); off unless the stream is a terminal."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream = total, stream
        self.enabled = enabled and is_terminal(stream)

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


class PrefillProgress:
    """Progress of a prefill that takes several chunks, one line on a terminal (stderr):
    tokens done, tokens/s so far and the time left at that rate."""

    def __init__(self, total: int, chunk: int | None, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled and chunk is not None and total > chunk and is_terminal(stream)
        self._start: float | None = None
        self._first = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start is None:  # the first chunk: its tokens over its time from now on
            self._start, self._first = now, done
            return
        rate = (done - self._first) / max(now - self._start, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0.0
        self.stream.write(
            f"\rprefill {done:,}/{total:,} tokens  {rate:,.0f} tokens/s  ETA {eta:.0f} s   "
        )
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def summary_table(r: GenerationResult) -> str:
    rows = [
        ("tokens", f"{len(r.tokens)} (stop: {r.stop_reason})"),
        ("sha256", r.sha256),
        ("drafter", r.drafter),
        *(
            []
            if r.sampling is None
            else [("sampling", ", ".join(f"{k} {v}" for k, v in r.sampling.items()))]
        ),
        ("block size", str(r.block_size)),
        *(
            []
            if r.tree_budget is None
            else [("tree", f"budget {r.tree_budget}, {r.nodes_per_step or 0:.1f} nodes/step")]
        ),
        ("steps", str(r.steps)),
        ("acceptance rate", f"{r.acceptance_rate:.3f}"),
        ("avg commit", f"{r.avg_commit:.2f}"),
        *(
            []
            if r.copied_drafts is None
            else [("copied drafts", f"{r.copied_drafts} of {r.steps} steps (prompt lookup)")]
        ),
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
            f"(at start {r.rollback.status_at_start.value})"
            + (
                ""
                if r.rollback.fast_unavailable_reason is None
                else f"; fast rollback unavailable: {r.rollback.fast_unavailable_reason}"
            ),
        ),
        (
            "rollbacks",
            f"fast {r.rollback.fast}, replay {r.rollback.replay}, "
            f"replay after failure {r.rollback.replay_after_failure}",
        ),
        ("capture gate", r.capture.verdict + (f": {r.capture.reason}" if r.capture.reason else "")),
        ("checkpoint bytes", f"{r.checkpoint_bytes:,}"),
        ("devices / split", f"{','.join(r.devices)} / {','.join(map(str, r.layer_split))}"),
        ("parity", "not checked" if r.parity is None else str(r.parity).lower()),
        ("text", text_row(r)),
        ("prefill", f"{r.timings.prefill_s:.3f} s" + (
            "" if r.timings.prefill_tokens_per_s is None
            else f" ({r.prompt_len - r.cached_tokens} tokens, "
            f"{r.timings.prefill_tokens_per_s:,.0f} tokens/s)"
        )),
        ("decode", decode_row(r)),
        (f"speed-up vs plain {'greedy' if r.sampling is None else 'sampled'}", speedup_row(r)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def text_row(r: GenerationResult) -> str:
    if r.text is None:
        return "none (no tokenizer: token ids on stdout)"
    return f"{len(r.text)} characters"


def decode_row(r: GenerationResult) -> str:
    rate = r.timings.tokens_per_s
    if rate is None:
        return f"{r.timings.decode_s:.3f} s (no decode step: the only token came from prefill)"
    return f"{r.timings.decode_s:.3f} s, {rate:.1f} tokens/s"


def speedup_row(r: GenerationResult) -> str:
    greedy = r.timings.greedy_tokens_per_s
    if r.speedup_vs_greedy is not None and greedy is not None:
        runs = len(r.timings.greedy_decode_runs_s)
        how = f"; medians of {runs} alternating runs each" if runs > 1 else ""
        plain = "greedy" if r.sampling is None else "sampled"
        return f"{r.speedup_vs_greedy:.2f}x ({plain} {greedy:.1f} tokens/s{how})"
    if greedy is None and r.timings.greedy_decode_s is None:
        return "not measured (--no-baseline)"
    return "none (no decode step: the only token came from prefill)"


def synthetic_acceptance(args: argparse.Namespace) -> float:
    """The synthetic drafter's per-slot probability from --acceptance / --drafted-acceptance."""
    from dflash.execution.session import per_slot_probability

    if args.draft != "synthetic":
        for option, value in (
            ("--acceptance", args.acceptance),
            ("--drafted-acceptance", args.drafted_acceptance),
        ):
            if value is not None:
                raise UsageError(
                    f"{option} applies only to --draft synthetic (got --draft {args.draft}); "
                    "other drafters' acceptance is measured, not chosen"
                )
    if args.drafted_acceptance is not None:
        if args.block_size < 2:
            raise UsageError(f"--block-size must be >= 2 (got {args.block_size})")
        return per_slot_probability(args.drafted_acceptance, args.block_size)
    p = 0.8 if args.acceptance is None else args.acceptance
    if not 0.0 <= p <= 1.0:
        raise UsageError(f"--acceptance must be in [0, 1] (got {p})")
    return float(p)


def _greedy() -> SamplingParams:
    from dflash.sampling import GREEDY  # torch loads only when a command runs

    return GREEDY


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
    text: TextCodec | None = None  # how generated ids become text (None: ids only)
    eos_id: Eos = None  # --eos-id, else the model directory's EOS ids (any of them stops)
    sampling: SamplingParams = field(default_factory=_greedy)


class TextStreamLike(Protocol):
    def push(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class TextCodec(Protocol):
    """What text output needs: :class:`dflash.model.tokenizer.TextTokenizer` or bytes."""

    def decode(self, ids: Sequence[int]) -> str: ...
    def stream(self) -> TextStreamLike: ...


class ByteStream:
    """Incremental UTF-8 decoding of byte ids (ids >= 256 become U+FFFD)."""

    def __init__(self) -> None:
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        out = []
        for t in ids:
            out.append("\ufffd" if not 0 <= t < 256 else self._decoder.decode(bytes([t])))
        return "".join(out)

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


class ByteText:
    """``--bytes``: token ids are UTF-8 bytes."""

    def decode(self, ids: Sequence[int]) -> str:
        stream = ByteStream()
        return stream.push(ids) + stream.flush()

    def stream(self) -> TextStreamLike:
        return ByteStream()


def prepare(args: argparse.Namespace) -> Prepared:
    """Check the shared options, then build model, shards, prompt and drafter.

    The layer split is checked against the layer count before any weights are built, so
    a bad ``--layer-split`` fails in milliseconds even for a large model; so is the memory
    the weights need (:class:`InsufficientMemoryError`, exit 3).
    """
    import torch

    from dflash.commands.resources import check_memory
    from dflash.execution.session import (
        build_drafter,
        encode_prompt,
        eos_for,
        model_config,
        parse_dtype,
        tokenizer_for,
    )
    from dflash.execution.shards import plan_shards
    from dflash.geometry import MAX_SLOTS
    from dflash.model.drafters.trees import CandidateDrafter, TreeDrafter

    if args.devices is not None and not args.devices.strip():
        raise UsageError("--devices must name at least one device (got '')")
    devices = args.devices or default_devices()
    first = devices.split(",")[0].strip()
    dtype = parse_dtype(args.dtype, args.model, first)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    warm = getattr(args, "warmup_tokens", None)
    if warm is not None and warm < 0:
        raise UsageError(f"--warmup-tokens must be >= 0 (got {warm})")
    repeats = getattr(args, "repeats", None)
    if repeats is not None and repeats < 1:
        raise UsageError(f"--repeats must be >= 1 (got {repeats})")
    if repeats is not None and repeats > 1 and getattr(args, "no_baseline", False):
        raise UsageError(
            f"--repeats {repeats} times the plain greedy baseline too: drop --no-baseline"
        )
    if not 2 <= args.block_size <= MAX_SLOTS:
        raise UsageError(f"--block-size must be in [2, {MAX_SLOTS}] (got {args.block_size})")
    tree_budget = getattr(args, "tree_budget", None)
    if tree_budget is not None and not 2 <= tree_budget <= MAX_SLOTS:
        raise UsageError(f"--tree-budget must be in [2, {MAX_SLOTS}] (got {tree_budget})")
    acceptance = synthetic_acceptance(args)
    sampling = sampling_params(args)
    if args.prompt_seed is not None and args.prompt_len is None:
        raise UsageError(
            f"--prompt-seed {args.prompt_seed} seeds --prompt-len's random ids: give "
            "--prompt-len, or drop --prompt-seed"
        )
    if args.draft_window is not None and args.draft_window < 1:
        raise UsageError(f"--draft-window must be >= 1 (got {args.draft_window})")
    if args.prefill_chunk < 0:
        raise UsageError(
            f"--prefill-chunk must be >= 1, or 0 for one forward (got {args.prefill_chunk})"
        )
    config = model_config(args.model)
    if args.max_context is not None and not 1 <= args.max_context <= (
        config.max_position_embeddings
    ):
        raise UsageError(
            f"--max-context must be in [1, {config.max_position_embeddings}] (the model's "
            f"max_position_embeddings; got {args.max_context})"
        )
    eos_id = (args.eos_id,) if args.eos_id is not None else eos_for(args.model)
    for eos in eos_id:
        if not 0 <= eos < config.vocab_size:
            source = "--eos-id" if args.eos_id is not None else f"the EOS id of {args.model!r}"
            raise UsageError(
                f"{source} must be a token id in [0, {config.vocab_size}) (got {eos})"
            )
    plan = plan_shards(config.num_hidden_layers, devices, args.layer_split)
    tokenizer = tokenizer_for(args.model)
    if tokenizer is not None and args.bytes:
        raise UsageError(
            f"--bytes is for models without a tokenizer; {args.model!r} has "
            f"{str(tokenizer.path)!r}"
        )
    default_text = args.prompt is None and args.prompt_ids is None and args.prompt_len is None
    byte_prompt = tokenizer is None and (args.bytes or default_text)
    prompt = encode_prompt(
        args.model,
        config.vocab_size,
        text=DEFAULT_PROMPT if default_text else args.prompt,
        ids=args.prompt_ids,
        length=args.prompt_len,
        seed=args.prompt_seed or 0,
        allow_bytes=byte_prompt,
    )
    if tokenizer is None and default_text and not args.bytes:
        print(
            f"dflash {getattr(args, 'command', 'generate')}: the model has no tokenizer: the "
            "built-in prompt is given as its UTF-8 bytes",
            file=sys.stderr,
        )
    from dflash.model.catalog import model_quantization

    check_memory(args.model, config, dtype, first, model_quantization(args.model))
    if first.startswith("cuda"):
        torch.cuda.set_device(torch.device(first))
    set_cpu_threads(args.model, first)
    model = build_model_checked(args.model, config, seed=args.seed, dtype=dtype, device=first)
    quantize = getattr(args, "quantize", None)
    if quantize is not None:
        from dflash.model.fp8 import quantize_spec

        if model.quantization is not None:
            raise UsageError(f"--quantize {quantize}: {args.model!r} is an FP8 checkpoint "
                             "already")
        try:
            model.quantize_fp8_(quantize_spec(quantize))
        except ValueError as exc:  # a tied LM head
            raise UsageError(f"--quantize {quantize}: {exc}") from None
    codec: TextCodec | None = tokenizer
    if codec is None and args.bytes:
        codec = ByteText()
    drafter, oracle = build_drafter(
        args.draft,
        model,
        prompt,
        plan=plan,
        acceptance=acceptance,
        seed=args.draft_seed,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        model_spec=args.model,
        draft_dtype=None if args.draft_dtype is None else getattr(torch, args.draft_dtype),
        tree_budget=tree_budget,
        sampling=sampling,
        prefill_chunk=prefill_chunk(args),
        draft_window=args.draft_window,
    )
    if tree_budget is not None and not isinstance(drafter, (TreeDrafter, CandidateDrafter)):
        raise UsageError(
            f"--tree-budget needs a drafter that gives per-slot candidates: --draft "
            f"dflash+lookup, dflash, a DFlash drafter directory, or synthetic (got --draft "
            f"{args.draft})"
        )
    return Prepared(
        model, plan, prompt, drafter, oracle, dtype, devices, acceptance, codec, eos_id, sampling
    )


def prefill_chunk(args: argparse.Namespace) -> int | None:
    """``--prefill-chunk`` as the engine takes it (0: None, the whole prompt at once)."""
    chunk: int = args.prefill_chunk
    return chunk or None


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``--temperature/--top-k/--top-p/--min-p/--seed`` as a checked
    :class:`dflash.sampling.SamplingParams` (a bad value: :class:`UsageError` naming it)."""
    from dflash.sampling import SamplingError, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, seed=args.seed,
        )
    except SamplingError as exc:
        flag = str(exc).split("'")[1].replace("_", "-")
        raise UsageError(f"--{flag}: {exc}") from None
    if params.greedy:  # every filter keeps the argmax: at temperature 0 one changes nothing
        for flag, value, off in (("--top-k", params.top_k, 0), ("--top-p", params.top_p, 1.0),
                                 ("--min-p", params.min_p, 0.0)):
            if value != off:
                raise UsageError(
                    f"{flag} {value} filters sampled tokens: give --temperature > 0 (at "
                    "temperature 0, greedy, every filter keeps the argmax and changes "
                    "nothing)"
                )
    return params


def build_model_checked(
    name: str, config: Any, *, seed: int, dtype: Any, device: str
) -> Any:
    """``build_model``; an allocation failure becomes :class:`InsufficientMemoryError`."""
    from dflash.commands.resources import InsufficientMemoryError, describe_need, weight_bytes
    from dflash.execution.session import build_model
    from dflash.model.caches import is_out_of_memory

    try:
        return build_model(name, seed=seed, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        params, need = weight_bytes(config, dtype)
        first = (str(exc).splitlines() or [type(exc).__name__])[0]  # MemoryError() is empty
        raise InsufficientMemoryError(
            f"{describe_need(name, params, need, dtype)}, and {device} ran out of memory "
            f"while building it ({first[:200]})"
        ) from None


def usage_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean "unusable arguments" (exit 2) for generate and bench."""
    return USAGE_ERRORS


def decoding_failures() -> tuple[type[Exception], ...]:
    """Exceptions that mean "decoding failed" (exit 3) for generate and bench.

    dflash's own refusals (every :class:`DFlashError`) and device faults: out of device or
    host memory, and a CUDA error (``torch.AcceleratorError``, torch >= 2.8). Anything
    else is a bug and reaches ``dflash.cli.main`` (exit 4, ``--debug`` for the traceback).
    """
    import torch

    # the exception types of dflash.model.caches.is_out_of_memory; an allocation failure
    # reported as a plain RuntimeError is classified by it where `execute` is called
    faults: tuple[type[Exception], ...] = (DFlashError, torch.OutOfMemoryError, MemoryError)
    accelerator = getattr(torch, "AcceleratorError", None)
    if isinstance(accelerator, type) and issubclass(accelerator, Exception):
        faults = (*faults, accelerator)
    return faults


def report_error(args: argparse.Namespace, line: str, exc: BaseException) -> None:
    """One line on stderr; with ``dflash --debug`` the traceback first."""
    if getattr(args, "debug", False):
        traceback.print_exception(exc, file=sys.stderr)
    print(line, file=sys.stderr)


class TextPrinter:
    """Streams generated text to ``out`` as tokens are committed.

    Each call looks at every token generated so far (prompt excluded), stops before an
    EOS token, and hands the not-yet-printed ids to an incremental decoder, which holds
    back a character whose UTF-8 bytes are still split across tokens.
    """

    def __init__(self, codec: TextCodec, eos_id: Eos, out: TextIO | None) -> None:
        self.stream, self.eos, self.out = codec.stream(), eos_set(eos_id), out
        self.pushed: list[int] = []
        self.parts: list[str] = []

    def _visible(self, tokens: Sequence[int]) -> list[int]:
        return before_eos(tokens, self.eos)

    def _emit(self, piece: str) -> None:
        if piece:
            self.parts.append(piece)
            if self.out is not None:
                self.out.write(piece)
                self.out.flush()

    def update(self, tokens: Sequence[int]) -> None:
        """``tokens``: every token generated so far."""
        visible = self._visible(tokens)
        if visible[: len(self.pushed)] != self.pushed:  # pragma: no cover - commits are final
            raise RuntimeError("committed tokens changed while streaming text")
        new = visible[len(self.pushed) :]
        if new:
            self.pushed.extend(new)
            self._emit(self.stream.push(new))

    def finish(self, tokens: Sequence[int]) -> str:
        """Print what is left of the final ``tokens``; return the whole text."""
        self.update(tokens)
        self._emit(self.stream.flush())
        if self.out is not None:
            self.out.write("\n")
            self.out.flush()
        return "".join(self.parts)


def execute(
    args: argparse.Namespace, policy: RollbackPolicy, ready: Prepared, *, progress: bool
) -> GenerationResult:
    """Run one generation on what :func:`prepare` built.

    With a text codec the text is streamed to stdout (unless ``--json``) and stored in
    the result's ``text``; the progress bar is then off (the text shows the progress).
    The timing (warm-up, repeats, the greedy baseline) is :mod:`dflash.commands.harness`'s.
    """
    from dflash.commands.harness import Harness
    from dflash.model.caches import capture_kind as capture_for

    start = "off" if not policy.fast else "requested"
    print(
        f"dflash generate: rollback requested {policy.mode}, status {start}",
        file=sys.stderr,
    )
    json_out = bool(getattr(args, "json", False))
    printer = (
        None
        if ready.text is None
        else TextPrinter(ready.text, ready.eos_id, None if json_out else sys.stdout)
    )
    bar = Progress(args.max_new_tokens, sys.stderr, progress and (printer is None or json_out))
    prompt_len = len(ready.prompt)

    def on_progress(done: int, engine: Any) -> None:
        bar(done, engine)
        if printer is not None:  # generated so far: committed context + the pending token
            printer.update([*engine.context[prompt_len:], engine.last][:done])

    graphs = False if getattr(args, "no_graphs", False) else None
    baseline = not getattr(args, "no_baseline", False)
    repeats = getattr(args, "repeats", None)
    if repeats is None:
        cpu = all(d.startswith("cpu") for d in ready.plan.devices)
        repeats = 3 if cpu and baseline else 1
    warm = args.warmup_tokens
    if warm is None:
        warm = 32 if any(d.startswith("cuda") for d in ready.plan.devices) else 0
    # --warmup-tokens and --repeats keep one speculative target, one engine and (with the
    # baseline) one greedy target across the runs; one timed run gets new ones
    n, keep = args.max_new_tokens, warm > 0 or repeats > 1
    what = (ready.model, ready.drafter, ready.prompt, ready.plan)
    window: WindowChoice = args.verify_window  # argparse's choices are the literals
    sampling = ready.sampling
    chunk, max_context = prefill_chunk(args), args.max_context
    prefilling = PrefillProgress(len(ready.prompt), chunk, sys.stderr, progress)
    if keep:
        harness = Harness.kept(*what, max_new_tokens=n, block_size=args.block_size,
                               eos_id=ready.eos_id, graphs=graphs,
                               greedy_tokens=n if baseline else None, verify_window=window,
                               capture=capture_for(policy.mode),
                               tree_budget=getattr(args, "tree_budget", None),
                               sampling=sampling, prefill_chunk=chunk, max_context=max_context,
                               on_prefill_chunk=prefilling)
    else:
        harness = Harness(*what, n, args.block_size, ready.eos_id, graphs,
                          verify_window=window, tree_budget=getattr(args, "tree_budget", None),
                          sampling=sampling, prefill_chunk=chunk, max_context=max_context,
                          on_prefill_chunk=prefilling)
    engine = harness.engine(policy) if keep else None
    if warm > 0:
        harness.warm_up(policy, engine, warm, baseline=baseline)
    try:
        if baseline:
            result = harness.against_greedy(policy, repeats=repeats, engine=engine,
                                            on_progress=on_progress, oracle_tokens=ready.oracle)
        else:
            result = harness.speculative(
                policy, engine=engine, on_progress=on_progress,
                check_parity=bool(getattr(args, "check_parity", False)),
                oracle_tokens=ready.oracle,
            )
    finally:
        bar.close()
    if printer is None:
        return result
    return result.model_copy(update={"text": printer.finish(result.tokens)})


def run(args: argparse.Namespace) -> int:
    try:  # everything that depends only on the arguments: exit 2 when unusable
        policy = RollbackPolicy.resolve(getattr(args, "rollback", None), environ=os.environ)
        ready = prepare(args)
    except usage_errors() as exc:
        report_error(args, f"dflash generate: error: {cli_message(exc)}", exc)
        return 2
    except decoding_failures() as exc:  # e.g. the synthetic drafter's oracle run ran out of memory
        report_error(args, f"dflash generate: failed: {type(exc).__name__}: {exc}", exc)
        return 3
    try:
        result = execute(args, policy, ready, progress=not args.no_progress)
    except ContextLengthError as exc:  # the budget past the model's positions, refused
        report_error(args, f"dflash generate: error: {cli_message(exc)}", exc)  # before decoding
        return 2
    except decoding_failures() as exc:  # a failure while decoding: exit 3, no traceback
        report_error(args, f"dflash generate: failed: {type(exc).__name__}: {exc}", exc)
        return 3
    except RuntimeError as exc:  # out of memory reported as a plain RuntimeError: exit 3
        from dflash.model.caches import is_out_of_memory

        if not is_out_of_memory(exc):
            raise  # any other RuntimeError is a bug (exit 4)
        first = str(exc).splitlines()[0] if str(exc) else ""
        report_error(args, f"dflash generate: failed: out of memory: {first}", exc)
        return 3
    print(summary_table(result), file=sys.stderr)
    if args.json:
        sys.stdout.write(result.model_dump_json() + "\n")
    elif result.text is None:  # no tokenizer: the ids (text was streamed as it came)
        print(" ".join(map(str, result.tokens)))
    return 1 if result.parity is False else 0
