"""`TargetModel`: the hybrid target model and its four forward modes.

=========  =====================================================================
mode       what happens to the caches
=========  =====================================================================
prefill    ``T`` tokens at ``start``, advancing the live state in place: at 0 the caches
           are reset first (a new sequence); at the committed length it continues
           (a chunk of a long prompt, a conversation's next turn) — any other start is
           refused
decode     one token at ``start``; live state advanced in place
replay     ``T`` tokens at ``start``; live state advanced in place
verify     ``T = geometry.n_actual`` draft tokens at ``start``: per-token states go to
           checkpoint slots ``0..T-1``, conv inputs to ``captured``, the pre-verify
           state to ``snapshot``; the live state is left for the rollback to set
=========  =====================================================================

Attention layers write keys/values at ``start … start+T-1`` in every mode, and the KV
length becomes ``start+T`` (the execution layer truncates it after a verify).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import Tensor, nn

from dflash.geometry import ChainGeometry, TreeGeometry
from dflash.model.caches import CacheError, CaptureKind, ShardCaches
from dflash.model.config import HybridConfig
from dflash.model.fp8 import Fp8Linear, Fp8Spec, replace_linears_
from dflash.model.layers import (
    AttentionLayer,
    DecoderLayer,
    DeltaNetLayer,
    GdnChunking,
    KernelBackend,
    Ops,
    RMSNorm,
    default_gdn_chunking,
    fuse_linear_groups_,
)

if TYPE_CHECKING:
    from dflash.model.loading import LoadReport

Mode = Literal["prefill", "decode", "verify", "replay"]
_MODES = ("prefill", "decode", "verify", "replay")


class TargetModel(nn.Module):
    """Embeddings → decoder layers → final norm → LM head.

    ``kernel_backend`` picks the recurrent kernels of :mod:`dflash.kernels`: ``"auto"``
    runs Triton on CUDA tensors and the torch reference on CPU tensors (also under
    ``TRITON_INTERPRET=1``: the interpreter is for kernel tests, not model runs);
    ``"reference"`` forces the reference (the float32 oracle on GPU); ``"triton"`` forces
    Triton (CUDA, or CPU under the interpreter).

    Projections that read the same input are multiplied as one fused weight
    (:class:`dflash.model.layers.LinearGroup`), built when the model is constructed,
    loaded (``load_state_dict``, :meth:`from_pretrained`) or moved (``.to()`` …), and
    checked at every prefill for parameters replaced since.
    """

    def __init__(self, config: HybridConfig, *, kernel_backend: KernelBackend = "auto") -> None:
        super().__init__()
        self.config = config
        self.kernel_backend: KernelBackend = kernel_backend
        #: a prefill chunk of at least :data:`dflash.model.layers.CHUNKED_PREFILL_MIN`
        #: tokens runs the gated delta rule in chunk-parallel form
        #: (:func:`dflash.kernels.gdn_chunk_prefill`) rather than token by token, on every
        #: device (the torch form is 4-20x faster on CPU on long prompts; the Triton form
        #: with :data:`dflash.model.layers.CUDA_GDN_CHUNKING` 1.2-1.5x on the H200); False:
        #: the token loop
        self.chunked_prefill = True
        #: the chunk-parallel form's chunk and product precision; None: the device's
        #: (:func:`dflash.model.layers.default_gdn_chunking`)
        self.gdn_chunk: GdnChunking | None = None
        #: the FP8 format of the decoder layers' projections (None: the model dtype)
        self.quantization: Fp8Spec | None = None
        self.load_report: LoadReport | None = None  # set by from_pretrained
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeltaNetLayer(config, i) if kind == "linear_attention" else AttentionLayer(config, i)
            for i, kind in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def tiny_default(cls, seed: int = 0) -> TargetModel:
        """The built-in default: :meth:`HybridConfig.tiny_default` with seeded weights (CPU)."""
        return cls.seeded(HybridConfig.tiny_default(), seed=seed)

    @classmethod
    def seeded(
        cls,
        config: HybridConfig,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> TargetModel:
        """A model of ``config`` with weights drawn from ``seed`` directly on ``device``.

        The draw happens in float32 on ``device`` and is then cast, so the same seed gives
        the same weights (up to rounding) in every dtype on one device.
        """
        from dflash.model.init import seeded_parameters

        dtype, device = _checked_placement(dtype, device)
        with torch.device("meta"):
            model = cls(config)
        params = seeded_parameters(model, seed=seed, dtype=dtype, device=torch.device(device))
        model.load_state_dict(params, strict=True, assign=True)  # fuses the linear groups
        model.tie_weights_()
        return model.eval()

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> TargetModel:
        """Load ``config.json`` + safetensors weights (memory-mapped, never pickle)."""
        from dflash.model.loading import load_target

        dtype, device = _checked_placement(dtype, device)
        return load_target(cls, Path(directory), dtype=dtype, device=device)

    def save_pretrained(self, directory: str | Path, *, companions: bool = True) -> None:
        """Write a Hugging Face ``qwen3_5_text`` checkpoint that :meth:`from_pretrained`
        reads; a loaded model's special token ids, and with ``companions`` its tokenizer,
        chat template and generation settings, go with it
        (:func:`dflash.model.loading.save_target`)."""
        from dflash.model.loading import save_target

        save_target(self, Path(directory), companions=companions)

    def quantize_fp8_(self, spec: Fp8Spec | None = None) -> TargetModel:
        """Quantize the decoder layers' projections to FP8 in place (``spec``: the block,
        the modules left alone and whether the LM head too; default 128 × 128, every
        projection, not the head): each weight per block by its absolute maximum
        (:mod:`dflash.model.fp8`). The embedding, norms, conv and gates keep the model
        dtype, and so does the LM head unless ``spec.lm_head`` (refused when it is tied to
        the embedding). Returns ``self``."""
        spec = spec or Fp8Spec()
        if self.quantization is not None:
            raise ValueError(f"the model is already quantized ({self.quantization})")
        if spec.lm_head and self.config.tie_word_embeddings:
            raise ValueError(
                "the LM head is tied to the embedding (tie_word_embeddings): it cannot be "
                "quantized on its own; quantize the projections only"
            )
        replace_linears_(self, spec, quantize=True)
        self.quantization = spec
        return self

    def tie_weights_(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def new_caches(
        self,
        *,
        max_len: int,
        max_draft: int = 16,
        batch: int = 1,
        layer_ids: Sequence[int] | None = None,
        capture: CaptureKind = "states",
        trees: bool = False,
    ) -> ShardCaches:
        """Caches for ``layer_ids`` (default: all layers) on this model's device and dtype,
        capturing ``capture`` in a verify, of trees too with ``trees``
        (:class:`dflash.model.caches.RecurrentPool`)."""
        weight = self.embed_tokens.weight
        ids = tuple(range(self.config.num_hidden_layers)) if layer_ids is None else tuple(layer_ids)
        return ShardCaches.for_layers(
            self.config, ids, max_len=max_len, max_draft=max_draft, batch=batch,
            dtype=weight.dtype, device=weight.device, capture=capture,
            kernel_backend=self.backend_for(weight.device), trees=trees,
        )

    # -- forward --------------------------------------------------------------------------

    def run_layers(
        self,
        hidden: Tensor,
        layer_ids: Sequence[int],
        caches: ShardCaches,
        start_pos: int,
        mode: Mode,
        geometry: ChainGeometry | TreeGeometry | None = None,
        taps: Sequence[int] = (),
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run ``hidden: [B, T, hidden]`` through ``layer_ids`` (ascending, all in ``caches``).

        Returns the output hidden states and ``{layer: output of that layer}`` for every
        tap layer among ``layer_ids``.
        """
        ids = tuple(layer_ids)
        t = self.begin_layers(tuple(hidden.shape), ids, caches, start_pos, mode, geometry)
        mark = caches.pool.end_verify_layer if mode == "verify" else None
        hidden, tapped = self.compute_layers(hidden, ids, caches, mode, geometry, taps, mark)
        self.end_layers(ids, caches, start_pos, mode, t)
        return hidden, tapped

    # A forward is three parts: ``begin_layers`` (host: checks, cache bookkeeping),
    # ``compute_layers`` (device only: no host synchronisation, no shape that depends on
    # a runtime value, positions read from the device — a CUDA graph can capture it for
    # decode, verify and replay) and ``end_layers`` (host: the caches' length mirrors).

    def begin_layers(
        self,
        shape: tuple[int, ...],
        ids: tuple[int, ...],
        caches: ShardCaches,
        start_pos: int,
        mode: Mode,
        geometry: ChainGeometry | TreeGeometry | None,
    ) -> int:
        """Check a forward of hidden states of ``shape`` ``[B, T, H]`` and prepare the
        caches (nothing changes when a check fails); returns ``T``."""
        t = self._check_run(shape, ids, caches, start_pos, mode, geometry)
        kv, pool = caches.kv, caches.pool
        if mode == "prefill" and start_pos == 0:  # a new sequence
            for layer in ids:  # a parameter replaced behind the model's back (LinearGroup)
                fuse_linear_groups_(self.layers[layer])
            pool.reset()
            kv.reset()
        elif mode == "verify":
            if isinstance(geometry, TreeGeometry):  # the tables the tree's kernels read
                caches.tree.fill(geometry)
            pool.begin_verify(
                start_pos, t, geometry.parents if isinstance(geometry, TreeGeometry) else None
            )
        else:
            pool.check_can_advance(mode)
            pool.move_live_home()  # decode / replay read and write the home state
        return t

    def compute_layers(
        self,
        hidden: Tensor,
        ids: tuple[int, ...],
        caches: ShardCaches,
        mode: Mode,
        geometry: ChainGeometry | TreeGeometry | None = None,
        taps: Sequence[int] = (),
        on_layer: Callable[[int], None] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """The device work of a forward prepared by :meth:`begin_layers`.

        Positions come from ``caches.pool.position`` (device); decode, replay and prefill
        advance it on the device. ``on_layer(layer)`` runs after each recurrent layer of a
        verify (host bookkeeping of which layers wrote their checkpoints; None while a
        CUDA graph is captured).
        """
        kv, pool = caches.kv, caches.pool
        t = hidden.shape[1]
        tree = geometry if isinstance(geometry, TreeGeometry) else None
        depth = None if tree is None else tree.depth
        ops = self.ops(mode, hidden.device, _host_start(pool.position, hidden.device), depth)
        rows = pool.position[:1] + torch.arange(t, device=hidden.device)  # [T] int64
        paths, tree_rows = None, None
        if tree is None:
            positions = rows  # a chain: row t at position start + t
        else:  # node t at position start + depth(t); its keys at cache row start + t
            # (device tables begin_layers filled: one CUDA graph serves every tree)
            positions = pool.position[:1] + caches.tree.depth[:t]
            paths = caches.tree.paths[:t, :t]
            tree_rows = (rows, paths)
        cos, sin = caches.rotary(positions)  # [T, rotary_dim] each
        # a prefill (never captured) attends the cache so far and its own rows, causally
        # from its host start: the committed length begin_layers checked
        prefill_start = caches.length if mode == "prefill" else None
        wanted = set(taps)
        tapped: dict[int, Tensor] = {}
        # the last MLP's output while its add waits for the next layer's input norm (one
        # fused launch, Ops.add_norm); added here after a tapped layer and the last one
        pending: Tensor | None = None
        for layer_id in ids:
            layer = cast(DecoderLayer, self.layers[layer_id])
            if pending is None:
                x = ops.each_token(layer.input_layernorm, hidden)
            else:
                hidden, x = ops.add_norm(layer.input_layernorm, hidden, pending)
            if isinstance(layer, AttentionLayer):
                k_cache, v_cache = kv.views(layer_id)
                x = layer.self_attn(
                    x, cos, sin, k_cache, v_cache, positions, ops, prefill_start, tree_rows
                )
            elif not isinstance(layer, DeltaNetLayer):
                kind = type(layer).__name__
                raise TypeError(f"layer {layer_id} is a {kind}, not a decoder layer")
            elif mode == "verify":
                state, conv_rows, bank, live = pool.kernel_views(layer_id)
                capture = pool.capture_views(layer_id)
                remap = None if bank is None or live is None else (bank, live)
                x = layer.linear_attn(
                    x, state, conv_rows, geometry, capture, ops, remap, paths,
                    None if tree is None else caches.tree.parents,
                )
                if on_layer is not None:
                    on_layer(layer_id)
            else:  # the live state is home (begin_layers moved it there)
                state, conv_rows = pool.live_views(layer_id)
                x = layer.linear_attn(x, state, conv_rows, None, None, ops)
            hidden, x = ops.add_norm(layer.post_attention_layernorm, hidden, x)
            pending = layer.mlp(x, ops)
            if layer_id in wanted or layer_id == ids[-1]:
                hidden, pending = hidden + pending, None
            if layer_id in wanted:
                tapped[layer_id] = hidden
        if mode != "verify":
            pool.advance_device(t)
        return hidden, tapped

    def end_layers(
        self, ids: tuple[int, ...], caches: ShardCaches, start_pos: int, mode: Mode, t: int
    ) -> None:
        """Host part after :meth:`compute_layers`: the caches' length mirrors."""
        kv, pool = caches.kv, caches.pool
        kv.advance(start_pos, t)
        if mode == "verify":
            for layer in ids:
                if layer in pool.layer_ids:
                    pool.end_verify_layer(layer)
            pool.end_verify()
        else:
            pool.advance(start_pos, t)

    def ops(
        self, mode: Mode, device: torch.device, start: int | None = None,
        offsets: tuple[int, ...] | None = None,
    ) -> Ops:
        """The kernels of a ``mode`` forward on ``device`` whose row 0 sits at ``start``
        and, in a tree verify, row ``t`` at ``start + offsets[t]`` (needed by invariant CPU
        forwards): M-invariant unless prefill."""
        invariant = mode != "prefill"
        setting = self.gdn_chunk or default_gdn_chunking(device)
        return Ops(invariant=invariant, backend=self.backend_for(device), device=device,
                   start=start if invariant else None, offsets=offsets if invariant else None,
                   chunked_prefill=self.chunked_prefill, gdn_chunk=setting)

    def logits(
        self, hidden: Tensor, mode: Mode, start: int | None = None,
        offsets: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Final norm and LM head: ``hidden: [B, T, H]`` → ``[B, T, vocab]``; ``start``
        is the position of row 0, ``offsets`` a tree's depths (needed on CPU outside
        prefill)."""
        ops = self.ops(mode, hidden.device, start, offsets)
        return ops.linear(self.lm_head, ops.each_token(self.norm, hidden))

    def head_weight(self) -> Tensor:
        """The LM head's weight as a dense ``[vocab, H]`` tensor, what a drafter that
        shares the head multiplies by: the parameter itself, or for an FP8 head a
        dequantized copy in the model's dtype (``vocab × H`` more memory while a drafter
        holds it; only guesses come out of a drafter, so the output is unchanged)."""
        head = self.lm_head
        if isinstance(head, Fp8Linear):
            return head.dequantized().detach()
        return head.weight

    def backend_for(self, device: torch.device) -> KernelBackend:
        """The kernels of this model's forwards on ``device`` (the torch references on CPU
        unless ``kernel_backend`` says otherwise); a recompute rollback runs the same."""
        if self.kernel_backend == "auto" and device.type == "cpu":
            return "reference"
        return self.kernel_backend

    def forward(
        self,
        ids: Tensor,
        caches: ShardCaches,
        mode: Mode,
        *,
        geometry: ChainGeometry | TreeGeometry | None = None,
        taps: Sequence[int] = (),
        start: int = 0,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """One-shard composition: ``ids: [B, T]`` → ``(logits [B, T, vocab], taps)``.

        Positions start at the caches' committed length; a prefill starts at ``start``:
        0 (a new sequence, the default) or the committed length (it continues).
        """
        if ids.dim() != 2:
            raise ValueError(f"'ids' must be [B, T] (got shape {tuple(ids.shape)})")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"'ids' must be int64 or int32 token ids (got {ids.dtype})")
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.config.vocab_size:
            raise ValueError(
                f"'ids' must lie in [0, {self.config.vocab_size}) "
                f"(got min {int(ids.min())}, max {int(ids.max())})"
            )
        if mode != "prefill":
            start = caches.length
        hidden = self.embed_tokens(ids)
        hidden, tapped = self.run_layers(
            hidden, range(self.config.num_hidden_layers), caches, start, mode, geometry, taps
        )
        offsets = geometry.depth if isinstance(geometry, TreeGeometry) else None
        return self.logits(hidden, mode, start, offsets), tapped

    def _check_run(
        self,
        shape: tuple[int, ...],
        ids: tuple[int, ...],
        caches: ShardCaches,
        start_pos: int,
        mode: str,
        geometry: object,
    ) -> int:
        if mode not in _MODES:
            raise ValueError(f"'mode' must be one of {list(_MODES)} (got {mode!r})")
        if len(shape) != 3 or shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"'hidden' must be [B, T, {self.config.hidden_size}] (got {tuple(shape)})"
            )
        t = shape[1]
        if t == 0:
            raise ValueError("'hidden' must hold at least one token (got T=0)")
        if mode == "decode" and t != 1:
            raise ValueError(f"mode 'decode' takes exactly one token (got T={t})")
        if mode == "verify":
            if not isinstance(geometry, (ChainGeometry, TreeGeometry)):
                raise TypeError(
                    "mode 'verify' needs a validated ChainGeometry or TreeGeometry "
                    f"(got {type(geometry).__name__})"
                )
            if isinstance(geometry, TreeGeometry):
                if shape[0] != 1:
                    raise ValueError(f"a tree verify takes one sequence (got B={shape[0]})")
                pool = caches.pool
                if pool.capture == "inputs" and pool.layer_ids and pool.tree_states is None:
                    raise ValueError(
                        "a tree verify on a pool that captures the recurrence's inputs needs "
                        "its node-state scratch: build the caches with trees=True"
                    )
            if geometry.n_actual != t:
                raise ValueError(
                    f"'geometry' has n_actual={geometry.n_actual} slots but 'hidden' has T={t}"
                )
        elif geometry is not None:
            raise ValueError(f"'geometry' is only taken by mode 'verify' (got mode {mode!r})")
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"'layer_ids' must be strictly ascending (got {list(ids)})")
        owned = set(caches.layer_ids)
        for layer in ids:
            if layer not in owned:
                raise CacheError(
                    f"layer {layer} is not in these caches (they hold {sorted(owned)})"
                )
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"'start_pos' must be an int >= 0 (got {start_pos!r})")
        continues = mode != "prefill" or start_pos != 0  # a prefill at 0 starts over
        if continues:
            caches.pool.check_can_advance(mode)
            if caches.kv.layer_ids and start_pos != caches.kv.length:
                raise CacheError(
                    f"'start_pos'={start_pos} does not match the KV cache length {caches.kv.length}"
                )
            if caches.pool.layer_ids and start_pos != caches.pool.length:
                raise CacheError(
                    f"'start_pos'={start_pos} does not match the recurrent length "
                    f"{caches.pool.length}"
                )
        if start_pos + t > caches.kv.max_len:
            raise CacheError(
                f"positions up to {start_pos + t} exceed the caches' 'max_len'={caches.kv.max_len}"
            )
        return t


@torch.inference_mode()
def _host_start(position: Tensor, device: torch.device) -> int | None:
    """The position of a forward's row 0 as a host int on CPU (for position tiles); None on
    other devices, where forwards read it from the device (reading it would synchronise)."""
    return int(position[0]) if device.type == "cpu" else None


@torch.inference_mode()
def greedy_generate(model: TargetModel, prompt: Sequence[int], n: int) -> list[int]:
    """Plain target-only greedy decoding: the ``n`` tokens after ``prompt`` (the oracle)."""
    if len(prompt) == 0:
        raise ValueError("'prompt' must hold at least one token (got an empty prompt)")
    if n < 0:
        raise ValueError(f"'n' must be >= 0 (got {n})")
    vocab = model.config.vocab_size
    for i, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise ValueError(f"'prompt' entry {i} must be a token id in [0, {vocab}) (got {tok!r})")
    if n == 0:
        return []
    device = model.embed_tokens.weight.device
    caches = model.new_caches(max_len=len(prompt) + n, max_draft=1)
    ids = torch.tensor([list(prompt)], device=device)
    logits, _ = model(ids, caches, "prefill")
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        logits, _ = model(torch.tensor([[out[-1]]], device=device), caches, "decode")
        out.append(int(logits[0, -1].argmax()))
    return out


_MODEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _checked_placement(
    dtype: object, device: object
) -> tuple[torch.dtype, torch.device]:
    """``(dtype, device)`` for a model, or a ValueError naming the unusable one."""
    if dtype not in _MODEL_DTYPES:
        names = ", ".join(str(d) for d in _MODEL_DTYPES)
        raise ValueError(f"'dtype' must be one of {names} (got {dtype!r})")
    try:
        dev = torch.device(device)  # type: ignore[call-overload]  # checked right here
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"'device' is not a torch device (got {device!r}): {exc}") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"'device' {dev} is not available ({count} CUDA devices)")
    elif dev.type != "cpu":
        raise ValueError(f"'device' must be a CPU or CUDA device (got {dev})")
    assert isinstance(dtype, torch.dtype)  # narrowed: a member of _MODEL_DTYPES
    return dtype, dev
