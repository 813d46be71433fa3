"""The library API: load a target and a drafter once, then generate, stream and chat.

::

    import dflash

    llm = dflash.load()                       # the embedded default pair, on the CPU
    r = llm.generate("def add(a, b):", max_new_tokens=32)
    print(r.text, r.acceptance_rate)          # r: the CLI's --json object
    for piece in llm.stream("import os\\n", max_new_tokens=32):
        print(piece, end="")
    r = llm.chat([{"role": "user", "content": "write a sort"}], max_new_tokens=32)

An :class:`LLM` keeps its target, drafter and engine across calls, so the capture gate
validates fast rollback once, in the first generation, and later ones roll back fast from
their first step. A call that needs more positions than the kept target holds builds a
larger one (and a new engine, whose gate runs again). One generation runs on an ``LLM`` at
a time.

Decoding is lossless: the tokens equal plain target-only decoding (``draft=None``) under
the same rule, bit for bit — greedy by default; with ``temperature`` > 0 every token is
drawn by the seeded sampling rule (``top_k``, ``top_p``, ``min_p``, ``seed``;
:mod:`dflash.sampling`) at its absolute position, so a seed gives the same text with and
without speculation. ``tree_budget=N`` verifies a tree of at most ``N`` nodes per step
instead of a chain (grown from the drafter's per-slot candidates), with the same
guarantee.

Stop strings: generation stops at the earliest occurrence of any of them in the decoded
new text. ``text`` ends right before it; ``tokens`` keeps the tokens whose text (as the
incremental decoder completes it) ends at or before the stop string's start, so the one
token the stop string begins in is left out, and ``text`` may hold the part of that
token's text before the stop string. ``stop_reason`` is then ``"stop"`` and ``sha256``
covers the kept tokens. The decode ends at the step whose tokens completed the stop
string; the step statistics and timings describe the steps that ran.

Chat: the checkpoint's chat template (``chat_template`` in ``tokenizer_config.json``, else
a ``chat_template.jinja`` file) rendered as ``transformers``' ``apply_chat_template``
renders it (jinja2's immutable sandbox, ``messages``, ``add_generation_prompt``, the
special tokens such as ``bos_token`` / ``eos_token``, ``raise_exception``). A model
without one, like the default pair (a code model), gets :data:`PLAIN_CHAT_TEMPLATE`:
one ``"{role}: {content}\\n"`` line per message, then ``"assistant: "``.
"""

from __future__ import annotations

import json
import numbers
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.errors import CheckpointError, ExecutionError, UsageError, param
from dflash.execution.engine import SpecDecoder
from dflash.execution.eos import Eos, before_eos, eos_ids
from dflash.execution.oracle import next_token
from dflash.execution.policy import RollbackPolicy, RollbackStatus, parse_mode
from dflash.execution.prefix import PrefixCache, prefill_through
from dflash.execution.results import (
    CaptureReport,
    GenerationResult,
    RollbackReport,
    Timings,
    token_sha256,
)
from dflash.execution.run import check_positions, decode_rate, spec_capacity, verify_slots
from dflash.execution.run import generate as run_generate
from dflash.execution.session import (
    DTYPES,
    build_drafter,
    build_model,
    eos_for,
    model_config,
    model_directory,
    parse_dtype,
    tokenizer_for,
)
from dflash.execution.shards import DEFAULT_PREFILL_CHUNK, ShardedTarget, ShardPlan, plan_shards
from dflash.geometry import MAX_SLOTS
from dflash.model import TargetModel
from dflash.model.caches import capture_kind
from dflash.model.drafters import Drafter
from dflash.model.drafters.trees import CandidateDrafter, TreeDrafter
from dflash.model.fp8 import QUANTIZE_CHOICES, quantize_spec
from dflash.model.tokenizer import TextTokenizer, require_utf8
from dflash.sampling import GREEDY, SamplingError, SamplingParams

__all__ = [
    "LLM",
    "PLAIN_CHAT_TEMPLATE",
    "ArgumentError",
    "ChatTemplateError",
    "GenerationResult",
    "load",
]

#: the chat template of a model without one (the default pair): ``role: content`` lines,
#: then ``assistant: `` when a generation prompt is asked for
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
#: the fewest positions a kept target holds (a longer generation builds a larger one)
MIN_CAPACITY = 256
WINDOWS = ("auto", "full")


class ArgumentError(UsageError):
    """An argument of :func:`load` or of an :class:`LLM` method that cannot be used."""


class ChatTemplateError(CheckpointError):
    """A checkpoint's chat template that cannot be read or rendered; names the file."""


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        rule = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ArgumentError(f"{param(name)} must be an int {rule} (got {value!r})")
    return value


def _dtype_name(name: str, value: object,
                choices: Mapping[str, torch.dtype] = DTYPES) -> str | None:
    """A dtype argument as a name of ``choices`` (a ``torch.dtype`` is accepted too)."""
    if value is None:
        return None
    for key, dtype in choices.items():
        if value == key or value is dtype:
            return key
    raise ArgumentError(
        f"{param(name)} must be one of {', '.join(choices)} or None (got {value!r})"
    )


#: the drafter's product dtypes (``draft_dtype``): the model's, and float64
DRAFT_DTYPES = {**DTYPES, "float64": torch.float64}


def _reworded(exc: UsageError, names: Mapping[str, str]) -> UsageError:
    """``exc`` (same class) with the parameters in ``names`` spelled as this API's."""
    text = exc.worded(lambda p: repr(names.get(p, p)))
    try:
        return type(exc)(text)
    except TypeError:  # a class with another constructor: keep the original
        return exc


def load(
    model: str | os.PathLike[str] = "default",
    draft: str | None = "dflash+lookup",
    device: str | Sequence[str] = "cpu",
    dtype: str | torch.dtype | None = None,
    rollback: str | None = None,
    block_size: int = 16,
    tree_budget: int | None = None,
    layer_split: str | Sequence[int] | int | None = None,
    verify_window: str = "auto",
    draft_dtype: str | torch.dtype | None = None,
    seed: int = 0,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    max_context: int | None = None,
    draft_window: int | None = None,
    prefix_cache_mb: int = 0,
    quantize: str | None = None,
) -> LLM:
    """Build a target model and a drafter, ready to generate.

    Args:
        model: a checkpoint directory (a str or a path), or ``"default"`` (the embedded
            trained pair's
            target), ``"tiny"``, ``"nine-b-shape"``, ``"twenty-seven-b-shape"`` (seeded).
        draft: a DFlash drafter directory, ``"dflash"`` (with the default model the
            shipped drafter, else a seeded one), either followed by ``"+lookup"``
            (assisted by prompt lookup), ``"prompt-lookup"``; ``None``: plain decoding,
            one token per target forward.
        device: ``"cpu"``, ``"cuda:0"``, or several (``"cuda:0,cuda:1"`` or a list), one
            per shard, with ``layer_split``.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` (or the ``torch.dtype``);
            None: float32 on the CPU or for ``tiny``, else bfloat16.
        rollback: ``"checkpoint"`` (fast rollback requested; the capture gate decides),
            ``"remap"``, or ``"replay"`` (opts out). None: ``$DFLASH_ROLLBACK``, else
            ``"checkpoint"``.
        block_size: tokens per draft, the pending one included (2 … 1024).
        tree_budget: verify a tree of at most this many nodes per step (2 … 1024, the
            pending token included) instead of a chain: grown best first from the
            drafter's per-slot candidates (a DFlash drafter; with ``+lookup`` prompt
            lookup's copy is one branch; a DFlash2 drafter's selector paths), each
            validated before any kernel runs; the output is unchanged. None: chains.
        layer_split: layers per shard (``"16,16"``, a list, or one int for one shard);
            None: an even split.
        verify_window: ``"auto"`` (on the CPU the part of each draft that pays) or
            ``"full"`` (every draft whole).
        draft_dtype: the dtype of the DFlash drafter's products: ``"float32"``,
            ``"bfloat16"``, ``"float16"``, ``"float64"`` (or the ``torch.dtype``); None:
            its weights'. Only guesses come out of the drafter: the output is unchanged.
        seed: seed of seeded models and drafters.
        prefill_chunk: prompt tokens per prefill forward (None: a whole prompt in one);
            a long prompt needs the caches plus one chunk's activations.
        max_context: the caches hold this many tokens (prompt and output, at most the
            model's ``max_position_embeddings``), sized once at the first call and checked
            against the device's free memory before they are allocated; a request past it
            is refused. None: sized per request, grown as requests grow.
        draft_window: a DFlash drafter's blocks attend only the last ``N`` committed tokens
            (None: all of them), so a drafting step costs the same at any context length;
            the output does not change.
        quantize: ``"fp8"``: the decoder layers' projections quantized to FP8 at load
            (:meth:`TargetModel.quantize_fp8_`); ``"fp8-lm-head"``: the LM head too (not
            a head tied to the embedding); an FP8 checkpoint is read as FP8 anyway.
        prefix_cache_mb: keep up to this many MB of prefilled prefixes (0: none): a prompt
            that extends a cached one at a ``prefill_chunk`` boundary prefills only the
            rest (``cached_tokens`` in the result), and its output is the same bits as
            without the cache (:mod:`dflash.execution.prefix`).

    Raises :class:`dflash.errors.UsageError` subclasses naming the bad argument, and
    checkpoint / config errors naming the file.
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise ArgumentError(
            f"{param('model')} must be a non-empty str or a path (got {model!r})"
        )
    if draft is not None and (not isinstance(draft, str) or not draft):
        raise ArgumentError(f"{param('draft')} must be a non-empty str or None (got {draft!r})")
    if draft == "synthetic":
        raise ArgumentError(
            f"{param('draft')}='synthetic' is the command line's benchmark drafter (it is "
            "built from one prompt's target continuation); the library takes the others"
        )
    _int("block_size", block_size, 2, MAX_SLOTS)
    if tree_budget is not None:
        _int("tree_budget", tree_budget, 2, MAX_SLOTS)
        if draft is None:
            raise ArgumentError(
                f"{param('tree_budget')}={tree_budget} needs a drafter (draft=None decodes "
                "plainly)"
            )
    _int("seed", seed, 0, 2**63 - 1)
    if prefill_chunk is not None:
        _int("prefill_chunk", prefill_chunk, 1)
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ArgumentError(f"{param('quantize')} must be None, "
                            f"{' or '.join(repr(c) for c in QUANTIZE_CHOICES)} "
                            f"(got {quantize!r})")
    _int("prefix_cache_mb", prefix_cache_mb, 0)
    if prefix_cache_mb and prefill_chunk is None:
        raise ArgumentError(
            f"{param('prefix_cache_mb')}={prefix_cache_mb} needs a 'prefill_chunk': the "
            "cache keeps prefixes at its boundaries"
        )
    if draft_window is not None:
        _int("draft_window", draft_window, 1)
        if draft is None:
            raise ArgumentError(
                f"{param('draft_window')}={draft_window} needs a DFlash drafter (draft=None "
                "decodes plainly)"
            )
    if verify_window not in WINDOWS:
        raise ArgumentError(
            f"{param('verify_window')} must be one of {', '.join(WINDOWS)} (got {verify_window!r})"
        )
    policy = (
        RollbackPolicy.resolve(None, environ=os.environ)
        if rollback is None
        else RollbackPolicy(mode=parse_mode(rollback, source=param("rollback")))
    )
    if isinstance(device, str):
        devices = [d.strip() for d in device.split(",")]
    elif isinstance(device, Sequence) and all(isinstance(d, str) for d in device):
        devices = [d.strip() for d in device]
    else:
        raise ArgumentError(f"{param('device')} must be a str or a list of str (got {device!r})")
    config = model_config(model)
    if max_context is not None:
        _int("max_context", max_context, 1, config.max_position_embeddings)
    try:
        plan = plan_shards(config.num_hidden_layers, devices, layer_split)
    except UsageError as exc:
        raise _reworded(exc, {"devices": "device"}) from None
    first = plan.devices[0]
    torch_dtype = parse_dtype(_dtype_name("dtype", dtype), model, first)
    drafter_dtype_name = _dtype_name("draft_dtype", draft_dtype, DRAFT_DTYPES)
    target = build_model(model, seed=seed, dtype=torch_dtype, device=first)
    if quantize is not None:
        if target.quantization is not None:
            raise ArgumentError(
                f"{param('quantize')}={quantize!r}: {model!r} is an FP8 checkpoint already"
            )
        try:
            target.quantize_fp8_(quantize_spec(quantize))
        except ValueError as exc:  # a tied LM head
            raise ArgumentError(f"{param('quantize')}={quantize!r}: {exc}") from None
    drafter: Drafter | None = None
    if draft is not None:
        drafter, _ = build_drafter(
            draft,
            target,
            [],
            plan=plan,
            acceptance=0.0,  # synthetic only, refused above
            seed=seed,
            max_new_tokens=1,
            block_size=block_size,
            model_spec=model,
            draft_dtype=(None if drafter_dtype_name is None
                         else DRAFT_DTYPES[drafter_dtype_name]),
            draft_window=draft_window,
        )
        if tree_budget is not None and not isinstance(drafter, (TreeDrafter, CandidateDrafter)):
            raise ArgumentError(
                f"{param('tree_budget')}={tree_budget} needs a drafter that gives per-slot "
                f"candidates: 'dflash+lookup', 'dflash' or a DFlash drafter directory (got "
                f"{param('draft')}={draft!r})"
            )
    return LLM(
        target,
        drafter,
        plan=plan,
        policy=policy,
        block_size=block_size,
        tree_budget=tree_budget,
        verify_window=verify_window,
        prefill_chunk=prefill_chunk,
        max_context=max_context,
        prefix_cache_bytes=prefix_cache_mb * 10**6,
        tokenizer=tokenizer_for(model),
        eos_id=eos_for(model),
        directory=model_directory(model),
    )


@dataclass(frozen=True)
class _Request:
    """One generation's checked arguments."""

    prompt: list[int]
    max_new_tokens: int
    stops: tuple[str, ...]
    sampling: SamplingParams = GREEDY


class _Cancelled(ExecutionError):
    """Raised from the progress callback when a stream's consumer stopped reading: it
    ends the generation at that step (caught by the stream, never seen by a caller)."""


class _Text:
    """The new text of a generation as its tokens are committed, cut at a stop string.

    Tokens after the first EOS are not text. ``push`` returns the text that may be
    handed out: complete characters (:class:`dflash.model.tokenizer.TextStream`), less
    the last ``len(longest stop) - 1`` characters, which a stop string could still start
    in, and nothing from a stop string on.
    """

    def __init__(self, tokenizer: TextTokenizer, eos: frozenset[int], stops: tuple[str, ...]):
        self._stream = tokenizer.stream()
        self._eos, self._stops = eos, stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.ends = [0]  # ends[k]: len(text) once k tokens were decoded
        self._sent = 0
        self.stop_at: int | None = None

    def _visible(self, tokens: Sequence[int]) -> list[int]:
        return before_eos(tokens, self._eos)

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """``tokens``: every token generated so far; ``final``: there are no more."""
        if self.stop_at is not None:
            return ""
        for t in self._visible(tokens)[len(self.ends) - 1 :]:
            self.text += self._stream.push([t])
            self.ends.append(len(self.text))
        if final:
            self.text += self._stream.flush()
            self.ends[-1] = len(self.text)
        start = max(0, self._sent - self._hold)
        found = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self.stop_at = min(found)
            end = self.stop_at
        else:
            end = len(self.text) if final else len(self.text) - self._hold
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent : end], end
        return piece

    def result(self, r: GenerationResult) -> GenerationResult:
        """``r`` with its text, and cut at the stop string when one was found."""
        if self.stop_at is None:
            return r.model_copy(update={"text": self.text})
        kept = max(k for k, end in enumerate(self.ends) if end <= self.stop_at)
        tokens = r.tokens[:kept]
        return r.model_copy(
            update={
                "text": self.text[: self.stop_at],
                "tokens": tokens,
                "sha256": token_sha256(tokens),
                "stop_reason": "stop",
            }
        )


class LLM:
    """A loaded target and drafter (see :func:`load`); keeps its target and engine."""

    def __init__(
        self,
        model: TargetModel,
        drafter: Drafter | None,
        *,
        plan: ShardPlan,
        policy: RollbackPolicy,
        block_size: int,
        verify_window: str,
        tree_budget: int | None = None,
        tokenizer: TextTokenizer | None,
        eos_id: Eos,
        directory: Path | None,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        max_context: int | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model, self.drafter, self.plan = model, drafter, plan
        self.prefill_chunk, self.max_context = prefill_chunk, max_context
        self.prefix_cache_bytes = prefix_cache_bytes
        #: the kept target's prefilled prefixes (None: no cache, or no target yet)
        self.prefix_cache: PrefixCache | None = None
        self.policy, self.block_size, self.verify_window = policy, block_size, verify_window
        self.tree_budget = tree_budget
        #: slots a verify may write: the block, or a tree of ``tree_budget`` nodes
        self.slots = verify_slots(block_size, tree_budget)
        self.tokenizer, self.directory = tokenizer, directory
        #: the ids a generation stops at, in the checkpoint's order (Qwen's instruct
        #: models name two: the turn's end and the text's); empty: none
        self.eos_ids = eos_ids(eos_id)
        self._eos = frozenset(self.eos_ids)
        self.target: ShardedTarget | None = None  # kept across calls
        self.engine: SpecDecoder | None = None  # kept with the target (draft given)
        self._busy = threading.Lock()
        self._chat: tuple[str, dict[str, str], str] | None = None  # template, tokens, source

    # -- arguments -------------------------------------------------------------------------

    def _request(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        seed: int,
        stop: str | Sequence[str] | None,
    ) -> _Request:
        try:
            sampling = SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
            )
        except SamplingError as exc:
            raise ArgumentError(str(exc)) from None
        n = _int("max_new_tokens", max_new_tokens, 1)
        stops: tuple[str, ...] = ()
        if stop is not None:
            if not isinstance(stop, str | list | tuple):
                raise ArgumentError(
                    f"{param('stop')} must be a non-empty str or a list of them (got {stop!r})"
                )
            stops = (stop,) if isinstance(stop, str) else tuple(stop)
            if not stops or any(not isinstance(s, str) or not s for s in stops):
                raise ArgumentError(
                    f"{param('stop')} must be a non-empty str or a list of them (got {stop!r})"
                )
            for s in stops:
                require_utf8(s, "stop")
            self._need_tokenizer("stop")
        ids = self.encode(prompt)
        check_positions(self.model, len(ids), n, self._verify_slots, self.max_context)
        return _Request(ids, n, stops, sampling)

    @property
    def _verify_slots(self) -> int:
        """Positions past the committed ones a step may write: a verify's slots, or 1 for
        plain decoding (its last token is never fed back)."""
        return 1 if self.drafter is None else self.slots

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens may ask for: what
        ``max_context`` (or the model's ``max_position_embeddings``) leaves after it and
        after the last verify's slots (0 or less: the prompt leaves no room)."""
        n = _int("prompt_len", prompt_len, 0)
        limit = self.model.config.max_position_embeddings
        room = limit - n - self._verify_slots + 2
        if self.max_context is not None:
            room = min(room, self.max_context - n)
        return room

    def _need_tokenizer(self, what: str) -> TextTokenizer:
        if self.tokenizer is None:
            raise ArgumentError(
                f"{param(what)} needs a tokenizer and this model has none (no "
                "tokenizer.json); give the prompt as token ids"
            )
        return self.tokenizer

    def encode(self, prompt: str | Sequence[int] | torch.Tensor) -> list[int]:
        """The token ids a generation of ``prompt`` starts from: text tokenized by the
        model's tokenizer (it needs one), or token ids (a sequence of ints, numpy integers
        included, or a 1-D integer tensor) checked against the vocabulary.
        Passing the ids back as the prompt gives the same generation.

        Raises:
            ArgumentError: an empty prompt, text without a tokenizer or that is not valid
                UTF-8 or encodes to nothing, an entry that is not a token id of the model.
        """
        vocab = self.model.config.vocab_size
        ids: list[object]
        if isinstance(prompt, str):
            if not prompt:
                raise ArgumentError(f"{param('prompt')} must not be empty")
            require_utf8(prompt, "prompt")
            ids = [*self._need_tokenizer("prompt").encode(prompt)]
            if not ids:
                raise ArgumentError(f"{param('prompt')} {prompt!r} encodes to no tokens")
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.is_complex() or (
                prompt.dtype == torch.bool
            ):
                raise ArgumentError(
                    f"{param('prompt')} as a tensor must be 1-D of integer token ids (got "
                    f"{prompt.dtype} of shape {tuple(prompt.shape)})"
                )
            ids = prompt.tolist()
            if not ids:
                raise ArgumentError(f"{param('prompt')} must hold at least one token id")
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            # numpy's and other integer scalars count as ints (numbers.Integral)
            ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool)
                   else t for t in prompt]  # checked below: token ids
            if not ids:
                raise ArgumentError(f"{param('prompt')} must hold at least one token id")
        else:
            raise ArgumentError(
                f"{param('prompt')} must be a str or a sequence of token ids "
                f"(got {type(prompt).__name__})"
            )
        out: list[int] = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ArgumentError(
                    f"{param('prompt')} entry {i} must be a token id in [0, {vocab}) (got {t!r})"
                )
            out.append(t)
        return out

    # -- decoding ---------------------------------------------------------------------------

    def _capacity(self, need: int) -> int:
        """Positions for a new kept target: ``need`` rounded up to a power of two (at least
        :data:`MIN_CAPACITY`), capped at what the model's positions allow."""
        cap = 1 << max(need - 1, MIN_CAPACITY - 1).bit_length()
        limit = self.model.config.max_position_embeddings + self.slots + 1
        return max(need, min(cap, limit))

    def _kept_target(self, need: int, max_draft: int) -> ShardedTarget:
        """The kept target, or a larger one (and no engine) when it holds fewer than
        ``need`` positions; with ``max_context`` one of that size, built once."""
        if self.target is None or self.target.max_len < need:
            self.target = self.engine = None  # free the old caches first
            capacity = (
                self._capacity(need) if self.max_context is None
                else spec_capacity(0, self.max_context, self.slots)
            )
            self.target = ShardedTarget(
                self.model, self.plan, max_len=capacity, max_draft=max_draft,
                capture=capture_kind(self.policy.mode), prefill_chunk=self.prefill_chunk,
                trees=self.tree_budget is not None and max_draft > 1,
            )
            # the entries are the old caches' shapes: a new target starts a new cache
            self.prefix_cache = (
                PrefixCache(self.prefix_cache_bytes, self.prefill_chunk)
                if self.prefix_cache_bytes and self.prefill_chunk else None
            )
        return self.target

    def _speculative(
        self, req: _Request, drafter: Drafter, on_tokens: Callable[[list[int]], object],
        until: Callable[[], bool],
    ) -> GenerationResult:
        n, block = req.max_new_tokens, self.block_size
        target = self._kept_target(len(req.prompt) + n + self.slots + 1, self.slots)
        if self.engine is None:
            self.engine = SpecDecoder(
                target, drafter, block_size=block, policy=self.policy,
                verify_window=self.verify_window,  # type: ignore[arg-type]  # checked by load
                sampling=req.sampling, tree_budget=self.tree_budget,
            )
        self.engine.use_sampling(req.sampling)  # the kept engine draws by this request's rule
        prompt_len = len(req.prompt)

        def progress(done: int, engine: SpecDecoder) -> None:
            # generated so far: the committed context after the prompt + the pending token
            on_tokens([*engine.context[prompt_len:], engine.last][:done])

        return run_generate(
            self.model, drafter, req.prompt, plan=self.plan, max_new_tokens=n,
            block_size=block, policy=self.policy, eos_id=self.eos_ids, on_progress=progress,
            target=target, engine=self.engine, stop_when=until, sampling=req.sampling,
            prefill_chunk=self.prefill_chunk, prefix_cache=self.prefix_cache,
            tree_budget=self.tree_budget,
        )

    @torch.inference_mode()
    def _plain(
        self, req: _Request, on_tokens: Callable[[list[int]], object], until: Callable[[], bool]
    ) -> GenerationResult:
        """Plain decoding, one token per target forward, each drawn by the request's rule:
        the parity oracle's forwards (:func:`dflash.execution.oracle.reference_greedy`),
        stopping at EOS."""
        n = req.max_new_tokens
        target = self._kept_target(len(req.prompt) + n, 1)
        t0 = time.perf_counter()
        cache = self.prefix_cache
        hit = None if cache is None else cache.lookup(req.prompt)
        if hit is not None:
            target.restore(hit.snapshots)
        keep = 0 if hit is None else hit.length
        logits, _ = prefill_through(target, req.prompt, keep=keep, hit=hit, cache=cache)
        out = [next_token(target, logits[-1:], req.sampling, decode=False)]
        _sync(self.plan)
        t1 = time.perf_counter()
        on_tokens(out)
        committed = len(req.prompt)
        stopped = until()
        while len(out) < n and out[-1] not in self._eos and not stopped:
            logits, _ = target.forward([out[-1]], "decode", committed)
            committed += 1
            out.append(next_token(target, logits[:1], req.sampling))
            on_tokens(out)
            stopped = until()
        _sync(self.plan)
        t2 = time.perf_counter()
        decodes = len(out) - 1
        off = RollbackStatus.OFF
        return GenerationResult(
            tokens=out,
            sha256=token_sha256(out),
            steps=decodes,
            acceptance_rate=0.0,
            avg_commit=1.0 if decodes else 0.0,
            target_forwards_per_step=1.0 if decodes else 0.0,
            rollback=RollbackReport(requested="replay", status=off, status_at_start=off),
            capture=CaptureReport(),
            checkpoint_bytes=target.checkpoint_bytes,
            timings=Timings(
                prefill_s=t1 - t0, decode_s=t2 - t1, tokens_per_s=decode_rate(len(out), t2 - t1),
                prefill_tokens_per_s=(len(req.prompt) - keep) / (t1 - t0) if t1 > t0 else None,
            ),
            prompt_len=len(req.prompt),
            cached_tokens=keep,
            block_size=1,
            devices=list(self.plan.devices),
            layer_split=list(self.plan.split),
            drafter="none (plain decoding)",
            stop_reason=(
                "eos" if out[-1] in self._eos else "stop" if stopped else "max_new_tokens"
            ),
            target_forwards=decodes,   # the steps' forwards, the prefill not counted (as spec)
        )

    def _run(
        self, req: _Request, on_tokens: Callable[[list[int]], object], until: Callable[[], bool]
    ) -> GenerationResult:
        if not self._busy.acquire(blocking=False):
            raise ArgumentError(
                "another generation is running on this LLM (read a stream to its end or "
                "close it first)"
            )
        try:
            if self.drafter is None:
                return self._plain(req, on_tokens, until)
            return self._speculative(req, self.drafter, on_tokens, until)
        except _Cancelled:  # a closed stream: raised between steps, the target is clean
            raise
        except BaseException:
            # a step cut short (Ctrl-C, a device error) may leave the kept target mid-step:
            # the next call builds a fresh one instead of refusing every call after this
            self.target = self.engine = None
            raise
        finally:
            self._busy.release()

    # -- public ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationResult:
        """Decode up to ``max_new_tokens`` tokens after ``prompt`` (text, which needs the
        model's tokenizer, or token ids). ``text`` holds the decoded new text (without a
        final EOS token) when the model has a tokenizer; ``stop``: see the module's
        description. ``temperature`` > 0 samples by the seeded rule (``top_k``, ``top_p``,
        ``min_p``, ``seed``; :mod:`dflash.sampling`): the text of plain sampled decoding
        with that seed. Returns the command line's ``--json`` object."""
        req = self._request(prompt, max_new_tokens, temperature, top_k, top_p, min_p, seed,
                            stop)
        if self.tokenizer is None:
            return self._run(req, lambda tokens: None, lambda: False)
        text = _Text(self.tokenizer, self._eos, req.stops)
        if req.stops:  # decoded as it commits, so the decode ends at the stop string
            result = self._run(req, text.push, lambda: text.stop_at is not None)
        else:
            result = self._run(req, lambda tokens: None, lambda: False)
        text.push(result.tokens, final=True)
        return text.result(result)

    def stream(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
    ) -> TextStream:
        """Iterate the new text in pieces as tokens are committed (needs a tokenizer).

        Pieces never split a character: bytes of a character spread over tokens are held
        back until it is complete, and text a stop string could start in until it is
        decided. Their concatenation equals the final result's ``text``; the result is
        the returned stream's :attr:`TextStream.result` once the iteration has ended.
        Arguments are checked when ``stream`` is called; the decode runs (in a worker
        thread) as the pieces are read. Closing the stream early
        (:meth:`TextStream.close`), or dropping it (a ``break`` out of the loop that read
        it, which leaves it unreferenced), stops the decode at its next step and frees this
        LLM for the next call.
        """
        req = self._request(prompt, max_new_tokens, temperature, top_k, top_p, min_p, seed,
                            stop)
        tokenizer = self._need_tokenizer("stream")
        return TextStream(self, req, _Text(tokenizer, self._eos, req.stops))

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationResult:
        """:meth:`generate` on the prompt :meth:`render_chat` makes of ``messages``
        (``[{"role": "user", "content": "..."}, ...]``)."""
        return self.generate(self.render_chat(messages), max_new_tokens, temperature, top_k,
                             top_p, min_p, seed, stop)

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt the chat template makes of ``messages`` (see the module's
        description); ``stream(llm.render_chat(messages))`` streams a chat reply."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not (
            messages
        ):
            raise ArgumentError(
                f"{param('messages')} must be a non-empty list of {{'role': ..., 'content': "
                f"...}} dicts (got {messages!r})"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not all(
                isinstance(m.get(k), str) for k in ("role", "content")
            ):
                raise ArgumentError(
                    f"{param('messages')} entry {i} must be a dict with str 'role' and "
                    f"'content' (got {m!r})"
                )
            require_utf8(m["content"], "messages")
        template, tokens, source = self._chat_template()
        return _render(template, source, tokens, messages, add_generation_prompt)

    def use_chat_template(self, path: str | Path) -> None:
        """Render chats with the jinja template in the file ``path`` instead of the
        checkpoint's (``dflash serve --chat-template FILE``); the checkpoint's special
        tokens stay available to it. A file that cannot be read, or is not valid UTF-8, is
        a :class:`ChatTemplateError` naming it, and so is one that is not a jinja template
        (checked here, not at the next chat); the template in use is then unchanged."""
        if not isinstance(path, str | os.PathLike):
            raise ArgumentError(f"{param('path')} must be a str or a path (got {path!r})")
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read the chat template {str(file)!r}: {exc}") from None
        _compile(text, repr(str(file)))
        _, tokens, _ = _read_chat_template(self.directory)
        self._chat = (text, tokens, str(file))

    @property
    def eos_id(self) -> int | None:
        """The first of :attr:`eos_ids` (None: the model names no EOS)."""
        return self.eos_ids[0] if self.eos_ids else None

    def _chat_template(self) -> tuple[str, dict[str, str], str]:
        if self._chat is None:
            self._chat = _read_chat_template(self.directory)
        return self._chat


#: the name of a :class:`TextStream`'s decode thread
STREAM_THREAD = "dflash-stream"


class _StreamWork:
    """The decode a :class:`TextStream` reads, run in the stream's worker thread. It holds
    no reference to the stream, so a stream its reader drops (a ``break`` out of the
    loop, an exception in the reader) is collected, and its ``__del__`` closes it: the
    decode stops at its next step and the LLM is free again."""

    def __init__(self, llm: LLM, req: _Request, text: _Text) -> None:
        self.llm, self.req, self.text = llm, req, text
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.cancel = threading.Event()

    def run(self, grad: bool, inference: bool) -> None:
        def on_tokens(tokens: list[int]) -> None:
            if self.cancel.is_set():
                raise _Cancelled
            piece = self.text.push(tokens)
            if piece:
                self.queue.put(("piece", piece))

        # the caller's autograd modes are per thread: the worker runs under the same ones
        with torch.set_grad_enabled(grad), torch.inference_mode(inference):
            try:
                result = self.llm._run(
                    self.req, on_tokens, lambda: self.text.stop_at is not None
                )
            except _Cancelled:
                self.queue.put(("cancelled", None))
                return
            except BaseException as exc:  # handed to the reading thread, raised there
                self.queue.put(("error", exc))
                return
        try:
            piece = self.text.push(result.tokens, final=True)
            if piece:
                self.queue.put(("piece", piece))
            self.queue.put(("done", self.text.result(result)))
        except BaseException as exc:  # the reader must hear of it, never wait forever
            self.queue.put(("error", exc))


class TextStream:
    """What :meth:`LLM.stream` returns: an iterator of text pieces; :attr:`result` holds
    the :class:`GenerationResult` once the iteration has ended. Closing it, or dropping
    it unread (a ``break``), stops its decode at the next step."""

    def __init__(self, llm: LLM, req: _Request, text: _Text) -> None:
        self._work = _StreamWork(llm, req, text)
        self._thread: threading.Thread | None = None
        self._done = False
        self._result: GenerationResult | None = None

    @property
    def result(self) -> GenerationResult:
        """The generation's result (text cut at a stop string as the pieces were)."""
        if self._result is None:
            raise ArgumentError(
                "the stream's result is there once its pieces have all been read"
            )
        return self._result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work.run,
                args=(torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
                name=STREAM_THREAD,
                daemon=True,
            )
            self._thread.start()
        kind, value = self._work.queue.get()
        if kind == "piece":
            return str(value)
        self._done = True
        self._thread.join()
        if kind == "error":
            raise value
        if kind == "done":
            self._result = value
        raise StopIteration

    def close(self) -> None:
        """Stop reading: the decode stops at its next step (no result then)."""
        if self._thread is not None and not self._done:
            self._work.cancel.set()
            if self._thread is not threading.current_thread():
                self._thread.join()
        self._done = True

    def __del__(self) -> None:
        self.close()


def _sync(plan: ShardPlan) -> None:
    for d in plan.devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def _token_text(value: object) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_chat_template(directory: Path | None) -> tuple[str, dict[str, str], str]:
    """(template, special tokens, where it came from) of a model directory."""
    if directory is None:
        return PLAIN_CHAT_TEMPLATE, {}, "the plain template"
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {str(config_path)!r}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ChatTemplateError(f"{str(config_path)!r} must hold a JSON object")
        config = loaded
    tokens = {
        k: text for k, v in config.items()
        if k.endswith("_token") and (text := _token_text(v)) is not None
    }
    # transformers' order: the chat_template.jinja file first, then tokenizer_config.json's
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), tokens, str(jinja_path)
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {str(jinja_path)!r}: {exc}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", ...)  # no default: refused below
    if template is not None:
        if not isinstance(template, str):
            raise ChatTemplateError(
                f"{str(config_path)!r} field 'chat_template' must be a string or a list of "
                "{'name', 'template'} with a 'default' one"
            )
        return template, tokens, str(config_path)
    return PLAIN_CHAT_TEMPLATE, tokens, "the plain template"


def _raise_exception(message: str) -> None:
    """``raise_exception(message)``, as chat templates call it on messages they refuse."""
    raise ArgumentError(f"{param('messages')}: the chat template refuses them: {message}")


def _render(
    template: str,
    source: str,
    tokens: Mapping[str, str],
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool,
) -> str:
    """Render a chat template as ``transformers``' ``apply_chat_template`` does."""
    import jinja2

    compiled = _compile(template, source)
    variables = {**tokens, "messages": [dict(m) for m in messages],
                 "add_generation_prompt": add_generation_prompt}
    try:
        return str(compiled.render(**variables))
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template of {source} failed: {exc}") from None


def _compile(template: str, source: str) -> Any:
    """``template`` compiled in the sandbox ``transformers`` renders chat templates in
    (its ``tojson``, ``raise_exception`` and ``strftime_now``); a syntax error is a
    :class:`ChatTemplateError` naming ``source``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template of {source} is not valid: {exc}") from None

