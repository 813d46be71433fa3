"""Layer maths of the hybrid model: norms, rotary embedding, MLP and the two mixers.

Parameter names mirror the Hugging Face Qwen3.5 modules so checkpoints map 1:1
(``layers.{i}.linear_attn.in_proj_qkv.weight`` …). The mixers read and write their
caches through the views handed to them by :class:`dflash.model.target.TargetModel`;
the recurrent maths runs in :mod:`dflash.kernels` (Triton on CUDA, reference on CPU).

Which kernels a forward runs on is an :class:`Ops` value. Decode, verify and replay
forwards use ``Ops(invariant=True)``: their results are *M-invariant* (a token's row does
not depend on how many rows the forward carries), so a token's row of a ``T``-token verify
is bitwise the ``T = 1`` decode of the same state. On CUDA every projection goes through
:func:`dflash.kernels.linear` and attention through :func:`dflash.kernels.decode_attention`,
both M-invariant by construction. On CPU projections and the per-token maths (gates,
activations, norms) run on fixed-shape position tiles (:mod:`dflash.model.tiles`): the
token at position ``p`` is always row ``p mod 16`` of a 16-row call. The prefill (shared
by plain and speculative decoding) may use any kernels: ``Ops(invariant=False)`` runs
``F.linear`` and the chunked prefill kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.geometry import ChainGeometry, TreeGeometry
from dflash.kernels import (
    act_mul,
    add_rms_norm,
    causal_conv1d_capture,
    decode_attention,
    gdn_chunk_prefill,
    gdn_gates,
    gdn_verify,
    linear,
    prefill_attention,
    rms_norm,
    rms_norm_rotary,
    rotary_reference,
)
from dflash.kernels.checks import use_triton
from dflash.kernels.fp8_linear import fp8_linear
from dflash.kernels.gdn_chunk import MAX_TRITON_CHUNK, PRECISIONS
from dflash.model.config import HybridConfig
from dflash.model.fp8 import Fp8Linear
from dflash.model.tiles import PositionTiles

if TYPE_CHECKING:  # caches.py imports this module (the rotary table)
    from dflash.model.caches import LayerCapture

KernelBackend = Literal["auto", "triton", "reference"]

#: the fewest tokens whose prefill runs the gated delta rule in chunk-parallel form (when
#: the model asks for it, :attr:`dflash.model.TargetModel.chunked_prefill`): below, the
#: token loop is cheap and rounds closest to the recurrence it stands for
CHUNKED_PREFILL_MIN = 256
#: the most rows a prefill multiplies by an FP8 weight in the FP8 kernel; more rows go
#: through the weight dequantized once (one large product). A ShardedTarget's prefill
#: takes the LM head on its last row only, which this keeps from dequantizing the whole
#: head (2 GB in bf16 at the 9B shape) for one row
FP8_KERNEL_ROWS = 128


@dataclass(frozen=True)
class GdnChunking:
    """The chunk-parallel gated delta rule's settings for a prefill
    (:func:`dflash.kernels.gdn_chunk_prefill`): tokens per chunk (a power of two in
    16 … 128 for Triton) and the products' precision (``"ieee"``: float32; ``"tf32"``:
    tensor-core products on 10-bit mantissas, float32 accumulation)."""

    chunk: int = 64
    precision: str = "ieee"

    def __post_init__(self) -> None:
        if (isinstance(self.chunk, bool) or not isinstance(self.chunk, int)
                or self.chunk < 16 or self.chunk > MAX_TRITON_CHUNK
                or self.chunk & (self.chunk - 1)):
            raise ValueError(f"GdnChunking: 'chunk' must be a power of two in 16 … "
                             f"{MAX_TRITON_CHUNK} (got {self.chunk!r})")
        if self.precision not in PRECISIONS:
            raise ValueError(f"GdnChunking: 'precision' must be one of "
                             f"{', '.join(PRECISIONS)} (got {self.precision!r})")


#: a CUDA prefill's chunk-parallel gated delta rule when the model sets none
#: (:attr:`dflash.model.TargetModel.gdn_chunk`): chunks of 32 with tf32 products. Measured
#: on the H200 (9B shape, bf16, 4,096-token prefill chunks, ``benchmarks/long_context.py``)
#: against the token loop, the CUDA form before: 28.1k against 18.7k tok/s at 8k tokens,
#: 22.0k against 15.9k at 32k, 11.1k against 9.4k at 128k. The products round their inputs
#: to 10-bit mantissas, finer than the bfloat16 activations they multiply; the state stays
#: within 5e-3 relative of the token loop's (``tests/gpu/test_gdn_chunk_gpu.py``)
CUDA_GDN_CHUNKING = GdnChunking(32, "tf32")


def default_gdn_chunking(device: torch.device) -> GdnChunking:
    """The chunk-parallel form's settings for a prefill on ``device`` when the model sets
    none: :data:`CUDA_GDN_CHUNKING` on CUDA, chunks of 64 in float32 elsewhere (the CPU's
    torch form, where float32 products cost what tf32 ones would)."""
    return CUDA_GDN_CHUNKING if device.type == "cuda" else GdnChunking()


class Ops:
    """The kernels of one forward.

    ``invariant``: M-invariant evaluation (decode / verify / replay); otherwise ``F.linear``
    and the prefill kernels. ``backend`` picks Triton or the torch references for every
    :mod:`dflash.kernels` call. ``start`` is the position of the forward's row 0, and
    ``offsets`` (a tree verify) each row's position past it (its depth); invariant
    CPU forwards need them for their position tiles (``tiles``; None elsewhere: CUDA
    forwards read positions from the device).
    """

    __slots__ = ("backend", "chunked_prefill", "gdn_chunk", "invariant", "tiles")

    def __init__(
        self,
        *,
        invariant: bool,
        backend: KernelBackend,
        device: torch.device,
        start: int | None = None,
        offsets: tuple[int, ...] | None = None,
        chunked_prefill: bool = False,
        gdn_chunk: GdnChunking | None = None,
    ) -> None:
        self.invariant = invariant
        #: a prefill's gated delta rule in chunk-parallel form
        #: (:func:`dflash.kernels.gdn_chunk_prefill`), never an invariant forward's
        self.chunked_prefill = chunked_prefill and not invariant
        #: that form's chunk and product precision
        self.gdn_chunk = gdn_chunk or GdnChunking()
        self.backend: KernelBackend = backend
        self.tiles: PositionTiles | None = None
        if invariant and device.type == "cpu":
            if start is None:
                raise ValueError("an invariant CPU forward needs the position of its row 0")
            self.tiles = PositionTiles(start, offsets)

    def linear(self, module: nn.Linear | Fp8Linear, x: Tensor) -> Tensor:
        """``module(x)`` on this forward's kernels (``x: [..., in]`` → ``[..., out]``): an
        FP8 linear through :func:`dflash.kernels.fp8_linear` (M-invariant) in decode,
        verify and replay, and in a prefill of at most :data:`FP8_KERNEL_ROWS` rows (a
        prefill's last row through an FP8 LM head: no dequantized copy of the head);
        through its dequantized weight in a longer prefill."""
        if isinstance(module, Fp8Linear):
            rows = x.numel() // max(1, x.shape[-1])
            if not self.invariant and rows > FP8_KERNEL_ROWS:
                return F.linear(x, module.dequantized(x.dtype), module.bias)
            return fp8_linear(x, module.weight, module.weight_scale_inv, module.bias,
                              block=module.block, backend=self.backend)
        return self._matmul(x, module.weight, module.bias)

    def linear_group(self, group: LinearGroup, x: Tensor) -> list[Tensor]:
        """Every linear of ``group`` applied to ``x``, as one product: ``[..., N_i]`` views
        (a group mixing FP8 and float members: one product per linear; an FP8 group in a
        prefill too long for the FP8 kernel: one dequantized product per linear, so no
        more than one member's weight is dequantized at a time)."""
        if group.unfused:
            return [self.linear(m, x) for m in group.linears]
        weight, bias = group.weight_and_bias()
        if group.fp8_block is not None:
            rows = x.numel() // max(1, x.shape[-1])
            if not self.invariant and rows > FP8_KERNEL_ROWS:
                return [self.linear(m, x) for m in group.linears]
            return group.members(fp8_linear(x, weight, group.fp8_scale(), bias,
                                            block=group.fp8_block, backend=self.backend))
        return list(torch.split(self._matmul(x, weight, bias), group.sizes, dim=-1))

    def _matmul(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not self.invariant:
            return F.linear(x, weight, bias)
        if self.tiles is not None and not use_triton(self.backend, x.device):
            return self.tiles.apply(_TileLinear(weight, bias, x.dtype), x)
        return linear(x, weight, bias, backend=self.backend)

    def fused(self, x: Tensor) -> bool:
        """Whether the glue around the kernels runs fused (:meth:`add_norm`,
        :meth:`norm_rotary`, :meth:`act_mul`, and a verify's gates written straight into
        its capture): on Triton, on CUDA or where the forward asks for Triton by name (the
        interpreter on CPU). The one predicate for every fused launch. Each fused kernel computes a
        row from that row alone, so it needs no position tiles. CPU forwards on the
        references keep the torch formulation (on position tiles when invariant)."""
        return (x.is_cuda or self.backend == "triton") and use_triton(self.backend, x.device)

    def add_norm(self, norm: RMSNorm, hidden: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """``(hidden + delta, norm(hidden + delta))``: the residual stream's add and the
        next norm, in one launch when fused (the same bits: the add is rounded once,
        as its own launch rounds it)."""
        if self.fused(hidden):
            normed, summed = add_rms_norm(delta, hidden, norm.weight, norm.eps)
            return summed, normed
        hidden = hidden + delta
        return hidden, self.each_token(norm, hidden)

    def norm_rotary(self, norm: RMSNorm, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``apply_rotary(norm(x), cos, sin)`` for a head's rows ``x: [B, T, H, D]`` (a
        strided view is read in place when fused; the same bits for 16-bit models)."""
        if self.fused(x):
            return rms_norm_rotary(x, norm.weight, norm.eps, cos, sin)
        return apply_rotary(self.each_token(norm, x), cos, sin)

    def act_mul(self, gate: Tensor, x: Tensor, act: Literal["silu", "sigmoid"]) -> Tensor:
        """``act(gate) · x`` (the activation rounded to x's dtype first), in one launch
        when fused."""
        if self.fused(x):
            return act_mul(gate, x, act)
        return self.each_token(_silu_mul if act == "silu" else _sigmoid_mul, gate, x)

    def each_token(self, fn: Callable[..., Tensor], *xs: Tensor) -> Tensor:
        """``fn(*xs)`` for ``xs: [B, T, ...]`` such that a token's result cannot depend on ``T``.

        ``fn`` computes each token's row from that token's rows alone (pointwise maths,
        norms over trailing dimensions). Invariant CPU forwards evaluate it on position
        tiles; elsewhere it is called once (CUDA pointwise kernels need no such care).
        """
        if self.tiles is None:
            return fn(*xs)
        return self.tiles.apply(fn, *xs)

    def each_token_many(
        self, fn: Callable[..., tuple[Tensor, ...]], *xs: Tensor
    ) -> tuple[Tensor, ...]:
        """:meth:`each_token` for an ``fn`` with several results."""
        if self.tiles is None:
            return fn(*xs)
        return self.tiles.apply_many(fn, *xs)


class _TileLinear:
    """``x @ weight.T + bias`` of one tile, accumulated in float32 (float64 for float64
    inputs) and rounded once to the input dtype, as :func:`dflash.kernels.linear` does."""

    __slots__ = ("bias", "dtype", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        self.dtype = dtype
        self.weight = weight.to(acc)  # converted once per call, not once per tile
        self.bias = None if bias is None else bias.to(acc)

    def __call__(self, tile: Tensor) -> Tensor:
        return F.linear(tile.to(self.weight.dtype), self.weight, self.bias).to(self.dtype)


class LinearGroup:
    """Linears that read the same input, multiplied as one ``[sum N_i, K]`` weight.

    The parameters stay the separate ``nn.Linear`` modules (checkpoint names map 1:1), but
    their weights (and biases) become row blocks of one contiguous tensor, so one launch —
    one BLAS call per tile on CPU — computes them all: fewer launches, and small
    projections (Gated DeltaNet's ``a``/``b``, attention's ``k``/``v``) ride along with a
    large one instead of paying a launch each. In-place writes to a parameter (an
    optimizer step, ``load_state_dict`` without ``assign``) reach the product through the
    views.

    **FP8 groups** (every member an :class:`~dflash.model.fp8.Fp8Linear` of one scale
    block ``bn × bk``) fuse too: the e4m3 weights become row blocks of one weight and the
    ``weight_scale_inv`` buffers row blocks of one scale tensor. A scale row covers ``bn``
    weight rows, so every member starts at a whole block: a member whose ``out_features``
    is not a multiple of ``bn`` (Gated DeltaNet's 32-row ``b`` and ``a``) is followed by
    zero rows up to the next block, the last one too, so the fused weight is whole 128-row
    tiles (the kernel then loads without masks). Their outputs are computed and never read;
    :attr:`offsets` says where each member's rows start. A group mixing FP8 and
    float members (a checkpoint's ``modules_to_not_convert`` naming one of them), or FP8
    members of different blocks, is multiplied member by member (:attr:`unfused`).

    When the fused tensor is built (:meth:`fuse_`): only at the places where parameters
    get new storage, never from a product. The group is fused when it is constructed (a
    no-op on the meta device); the :class:`GroupedModule` that owns it fuses it again
    after every move or cast that reaches it (``.to()``, ``.cuda()``, ``.float()`` … of
    it or of any module above it: all go through ``nn.Module._apply``, which it
    overrides) and after every ``load_state_dict`` that reaches it (a post-hook:
    ``assign=True`` gives the linears new parameters). :meth:`weight_and_bias` then
    returns the fused tensors without any check.

    A parameter replaced behind the owner's back — ``param.data = t``, or one linear of
    the group moved or loaded on its own — leaves the group *stale* (:attr:`stale`: a
    parameter is no longer a view of the fused tensor) and its products would read the
    weights as they were when fused. That is detected where a generation starts: every
    prefill (:meth:`dflash.model.TargetModel.begin_layers`, and a ``ShardedTarget``
    before it) runs :func:`fuse_linear_groups_`, one address comparison per parameter.
    """

    __slots__ = ("_bias", "_ptrs", "_scale", "_weight", "fp8_block", "linears", "offsets",
                 "rows", "sizes", "unfused")

    def __init__(self, *linears: nn.Linear | Fp8Linear) -> None:
        if not linears:
            raise ValueError("a linear group needs at least one linear")
        fp8 = [isinstance(m, Fp8Linear) for m in linears]
        blocks = {m.block for m in linears if isinstance(m, Fp8Linear)}
        #: the scale block of an FP8 group (every member FP8, one block), else None
        self.fp8_block: tuple[int, int] | None = (
            next(iter(blocks)) if all(fp8) and len(blocks) == 1 else None)
        #: FP8 and float members mixed, or FP8 blocks that differ: multiplied one by one,
        #: never fused, never stale
        self.unfused = any(fp8) and self.fp8_block is None
        if len({m.in_features for m in linears}) != 1:
            raise ValueError(
                f"grouped linears must share in_features (got {[m.in_features for m in linears]})"
            )
        if len({m.bias is None for m in linears}) != 1:
            raise ValueError("grouped linears must all have a bias or none")
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        #: the fused weight's first row of each member (FP8: each padded to whole blocks)
        self.offsets: list[int] = []
        step = self.fp8_block[0] if self.fp8_block is not None else 1
        lo = 0
        for n in self.sizes:
            self.offsets.append(lo)
            lo += -(-n // step) * step
        #: the fused weight's rows (FP8: every member padded, so whole N tiles stay whole)
        self.rows = lo
        self._weight: Tensor | None = None
        self._scale: Tensor | None = None
        self._bias: Tensor | None = None
        self._ptrs: tuple[int, ...] = ()
        self.fuse_()

    def _params(self) -> list[Tensor]:
        scales = ([m.weight_scale_inv for m in self.linears if isinstance(m, Fp8Linear)]
                  if self.fp8_block is not None else [])
        return [m.weight for m in self.linears] + scales + [
            m.bias for m in self.linears if m.bias is not None
        ]

    def _current_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self._params())

    def fuse_(self) -> None:
        """Copy the weights (FP8: and scales) into one tensor and make each parameter a
        view of its rows.

        Left unfused (:attr:`stale`) while a parameter is on the meta device (a model
        being built); weights (or biases, or scales) of different dtypes, or parameters on
        different devices, are refused (a concatenation would silently cast them)."""
        if self.unfused:
            return
        params = self._params()
        if any(p.is_meta for p in params):
            self._weight, self._scale, self._bias, self._ptrs = None, None, None, ()
            return
        roles: dict[str, list[Tensor]] = {
            "weights": [m.weight for m in self.linears],
            "biases": [m.bias for m in self.linears if m.bias is not None]}
        if self.fp8_block is not None:
            roles["scales"] = [m.weight_scale_inv for m in self.linears
                               if isinstance(m, Fp8Linear)]
        devices = sorted({str(p.device) for p in params})
        mixed = {role: sorted({str(t.dtype) for t in ts}) for role, ts in roles.items()}
        if len(devices) != 1 or any(len(kinds) > 1 for kinds in mixed.values()):
            raise ValueError(
                f"grouped linears must share dtype and device (got devices {devices}, "
                f"dtypes {mixed})")
        last = self.rows
        with torch.no_grad(), torch.inference_mode(False):
            first = self.linears[0].weight
            weight = first.new_zeros(last, first.shape[1])
            bias = (None if not roles["biases"]
                    else roles["biases"][0].new_zeros(last))
            for m, lo, n in zip(self.linears, self.offsets, self.sizes, strict=True):
                weight[lo : lo + n].copy_(m.weight.detach())
                if bias is not None and m.bias is not None:
                    bias[lo : lo + n].copy_(m.bias.detach())
            scale = None
            if self.fp8_block is not None:
                # a member's scale rows cover its padded rows exactly (ceil(n / bn) each)
                scale = torch.cat([m.weight_scale_inv for m in self.linears
                                   if isinstance(m, Fp8Linear)])
            for m, lo, n in zip(self.linears, self.offsets, self.sizes, strict=True):
                m.weight.data = weight[lo : lo + n]
                if bias is not None and m.bias is not None:
                    m.bias.data = bias[lo : lo + n]
                if scale is not None and isinstance(m, Fp8Linear):
                    bn = m.block[0]
                    m.weight_scale_inv = scale[lo // bn : lo // bn + -(-n // bn)]
        self._weight, self._scale, self._bias = weight, scale, bias
        self._ptrs = self._current_ptrs()

    @property
    def stale(self) -> bool:
        """True when a parameter is no longer a view of the fused tensor (or none exists).

        Reads every parameter's address: for the fuse points, not for products."""
        if self.unfused:
            return False
        return self._weight is None or self._current_ptrs() != self._ptrs

    def weight_and_bias(self) -> tuple[Tensor, Tensor | None]:
        """The fused ``[rows, K]`` weight and ``[rows]`` bias (or None), as built by the
        last :meth:`fuse_` (no check of the parameters: see the class docstring); ``rows``
        is :attr:`rows`: ``sum N_i`` plus an FP8 group's padding."""
        if self._weight is None:
            raise RuntimeError(
                "this linear group was never fused: its weights were on the meta device "
                "when it was last built, moved or loaded"
            )
        return self._weight, self._bias

    def fp8_scale(self) -> Tensor:
        """An FP8 group's fused ``weight_scale_inv`` ``[rows / bn, ceil(K / bk)]``."""
        self.weight_and_bias()  # the same never-fused error
        if self._scale is None:
            raise RuntimeError("this linear group is not an FP8 group")
        return self._scale

    def members(self, y: Tensor) -> list[Tensor]:
        """Each member's ``[..., N_i]`` view of the fused product ``y`` (padding left out)."""
        return [y[..., lo : lo + n] for lo, n in zip(self.offsets, self.sizes, strict=True)]


def fuse_linear_groups_(module: nn.Module) -> None:
    """:meth:`LinearGroup.fuse_` for every stale group of every submodule of ``module``."""
    for sub in module.modules():
        for group in getattr(sub, "linear_groups", ()):
            if group.stale:
                group.fuse_()


def _fuse_after_load(module: nn.Module, incompatible: object) -> None:
    """``load_state_dict`` post-hook of a :class:`GroupedModule`: with ``assign=True`` the
    linears got new parameters, so the groups they left are fused again."""
    fuse_linear_groups_(module)


class GroupedModule(nn.Module):
    """A module whose projections include :class:`LinearGroup` s (``linear_groups``).

    It keeps them fused: its ``load_state_dict`` post-hook and :meth:`_apply` fuse them
    again whenever parameters got new storage (see :class:`LinearGroup` for what is not
    covered and where that is detected).
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear_groups: tuple[LinearGroup, ...] = ()
        self.register_load_state_dict_post_hook(_fuse_after_load)  # type: ignore[no-untyped-call]  # untyped in torch

    def group_linears(self, *groups: LinearGroup) -> None:
        """Declare this module's groups (built, and so fused, from its linears)."""
        self.linear_groups = groups

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> GroupedModule:
        """``Module._apply`` (``.to()``, ``.cuda()``, ``.half()`` …; also reached from any
        module above this one), then every group a move left stale is fused again: a
        moved or cast view is a tensor of its own."""
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # untyped in torch
        fuse_linear_groups_(self)
        return self


def _norm_backend(x: Tensor) -> KernelBackend:
    """Norms run the Triton kernel on CUDA and the torch reference elsewhere."""
    return "auto" if x.is_cuda else "reference"


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + weight)``, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        # one fused launch on CUDA (the torch formulation is eight); reference on CPU
        return rms_norm(x, self.weight, self.eps, zero_centred=True, backend=_norm_backend(x))


class GatedRMSNorm(nn.Module):
    """Output norm of Gated DeltaNet: ``weight · x / rms(x) · silu(z)`` per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return rms_norm(
            x, self.weight, self.eps, zero_centred=False, gate=z, backend=_norm_backend(x)
        )


class MLP(GroupedModule):
    """SwiGLU MLP: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)
        self.group_linears(self.gate_up)

    def forward(self, x: Tensor, ops: Ops | None = None) -> Tensor:
        if ops is None:
            out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return out
        gate, up = ops.linear_group(self.gate_up, x)
        return ops.linear(self.down_proj, ops.act_mul(gate, up, "silu"))


def _silu_mul(gate: Tensor, x: Tensor) -> Tensor:
    return F.silu(gate) * x


def _sigmoid_mul(gate: Tensor, x: Tensor) -> Tensor:
    return torch.sigmoid(gate) * x


def rotary_cos_sin(
    config: HybridConfig, positions: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[T, rotary_dim]`` for integer ``positions`` ``[T]`` (float32 maths)."""
    dim = config.rotary_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


ROTARY_CHUNK = 64  # positions per cos/sin evaluation of a rotary table


def rotary_table(
    config: HybridConfig, length: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """cos/sin ``[length, rotary_dim]`` for positions ``0 … length-1``.

    Evaluated in chunks of :data:`ROTARY_CHUNK` positions (the last one padded), so the
    entry of a position is the same bits whatever ``length`` is: caches of different
    capacities (the speculative loop's and the greedy oracle's) rotate identically.
    """
    padded = -(-length // ROTARY_CHUNK) * ROTARY_CHUNK
    cos, sin = [], []
    for lo in range(0, padded, ROTARY_CHUNK):
        c, s = rotary_cos_sin(config, torch.arange(lo, lo + ROTARY_CHUNK, device=device), dtype)
        cos.append(c)
        sin.append(s)
    return torch.cat(cos)[:length].contiguous(), torch.cat(sin)[:length].contiguous()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x: [B, T, H, D]`` (rotate-half form)
    by ``cos, sin: [T, rotary_dim]``: the formula the fused norm-and-rotary kernel is
    checked against (:func:`dflash.kernels.rotary_reference`)."""
    return rotary_reference(x, cos, sin)


class GatedAttention(GroupedModule):
    """Full attention with q/k RMSNorm, partial rotary, grouped KV heads and an output gate.

    ``q_proj`` yields, per query head, ``[query (D) | gate (D)]``; the attention output is
    multiplied by ``sigmoid(gate)`` before ``o_proj``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)
        self.group_linears(self.qkv)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        positions: Tensor,
        ops: Ops,
        prefill_start: int | None = None,
        tree: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``x: [B, T, hidden]`` at ``positions: [T]`` (int64, on x's device, consecutive).

        ``k_cache, v_cache: [B, HKV, max_len, D]`` receive this step's keys/values at
        ``positions``; query row ``t`` attends to cache rows ``0 … positions[t]``. Invariant
        forwards read the cache through :func:`decode_attention` (length from the device,
        no slicing); a prefill (``prefill_start``: its row 0's position, a host int)
        through :func:`dflash.kernels.prefill_attention`, which attends the cache so far
        and the chunk's own rows without ever forming a ``T × T`` (or ``T × S``) tensor.

        ``tree = (rows [T], paths [T, T])`` for a tree verify: ``positions`` are then the
        nodes' positions (``start + depth``, rotary), the keys/values go to cache ``rows``
        (``start + slot``), and row ``t`` attends the committed keys and its ancestors
        (``paths``, :func:`dflash.kernels.tree_paths`).
        """
        b, t, _ = x.shape
        d = self.head_dim
        q_and_gate, k, v = ops.linear_group(self.qkv, x)
        q_and_gate = q_and_gate.view(b, t, self.num_heads, 2 * d)
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
        q = ops.norm_rotary(self.q_norm, q, cos, sin)  # [B, T, H, D]
        k = ops.norm_rotary(self.k_norm, k.view(b, t, self.num_kv_heads, d), cos, sin)
        v = v.view(b, t, self.num_kv_heads, d)
        rows, paths = (positions, None) if tree is None else tree
        k_cache.index_copy_(2, rows, k.transpose(1, 2))  # rows[0..T-1]
        v_cache.index_copy_(2, rows, v.transpose(1, 2))
        if ops.invariant:
            start = rows[:1].expand(b).contiguous()  # [B], the position of row 0
            out = decode_attention(
                q, k_cache, v_cache, start, scale=d**-0.5, paths=paths, backend=ops.backend
            )
        else:
            if prefill_start is None:
                raise ValueError("a prefill's attention needs the position of its row 0")
            out = prefill_attention(
                q, k_cache, v_cache, prefill_start, scale=d**-0.5, backend=ops.backend
            )
        # the output gate, per head: sigmoid(gate) · out (gate read in place when fused)
        gated = ops.act_mul(gate, out.reshape(b, t, self.num_heads, d), "sigmoid")
        return ops.linear(self.o_proj, gated.reshape(b, t, self.num_heads * d))


class GatedDeltaNet(GroupedModule):
    """Gated DeltaNet mixer: projections, causal conv, gated delta rule, gated RMSNorm.

    ``in_proj_qkv`` feeds the causal conv over ``conv_dim = 2·HK·K + HV·V`` channels
    (q, k, v in that order, head-major); ``in_proj_z`` the output gate; ``in_proj_b``
    → ``beta = sigmoid(b)``; ``in_proj_a`` → ``g = -exp(A_log) · softplus(a + dt_bias)``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, hv = config.hidden_size, config.linear_num_value_heads
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, hv
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(h, config.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, config.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, hv, bias=False)
        self.in_proj_a = nn.Linear(h, hv, bias=False)
        self.conv1d = nn.Conv1d(
            config.conv_dim,
            config.conv_dim,
            kernel_size=config.linear_conv_kernel_dim,
            groups=config.conv_dim,
            bias=False,
            padding=config.linear_conv_kernel_dim - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(config.linear_value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(config.linear_value_dim, h, bias=False)
        self.in_proj = LinearGroup(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self.group_linears(self.in_proj)

    def forward(
        self,
        x: Tensor,
        state: Tensor,
        conv_rows: Tensor,
        geometry: ChainGeometry | TreeGeometry | None,
        capture: LayerCapture | None,
        ops: Ops,
        remap: tuple[Tensor, Tensor] | None = None,
        paths: Tensor | None = None,
        tree_table: Tensor | None = None,
    ) -> Tensor:
        """``x: [B, T, hidden]`` → ``[B, T, hidden]``.

        ``state: [B, HV, K, V]`` f32 and ``conv_rows: [B, Kc-1, C]`` are the home recurrent
        state and the live conv window (views into the pool); ``remap = (slot bank
        [B, S, HV, K, V], live [1] int64)``: when ``live >= 0`` (read on the device) the
        live state is ``bank[:, live]`` instead of ``state``. ``capture`` is None to advance
        in place (prefill / decode / replay: the new state goes to ``state``), or where a
        verify writes (:class:`dflash.model.caches.LayerCapture`): the conv inputs always;
        the per-token states and the pre-verify state (capturing states), or the conv
        outputs and gates the recurrence consumed (capturing inputs: the conv and the gates
        write there directly, and the recurrence writes no state). The live state and
        ``conv_rows`` are only read (``geometry`` is the validated chain or tree; a tree
        also passes its ``paths`` [T, T] and the recurrence's ``tree_table``
        (:func:`dflash.kernels.tree_parents_into`), so each node's conv window and
        recurrence follow its ancestors).
        """
        bank, live = remap if remap is not None else (None, None)
        b, t, _ = x.shape
        kc1 = self.conv_kernel - 1
        backend = ops.backend
        mixed, z, b_in, a_in = ops.linear_group(self.in_proj, x)  # [B, T, C | V | HV | HV]
        z = z.view(b, t, self.num_v_heads, self.head_v_dim)
        # the conv writes its outputs straight into the inputs capture (one [B, T, C] run
        # whenever B = 1 or the verify fills every slot; copied there otherwise)
        inputs = None if capture is None else capture.inputs
        direct = inputs is not None and inputs[:, :t].is_contiguous()
        # the gates [B, T, HV] (g float32), one launch on Triton; a verify that captures the
        # recurrence's inputs keeps them for the recompute rollback (the Triton kernel,
        # a row's result from that row alone, writes them there directly)
        g_cap = beta_cap = None
        if capture is not None and capture.g is not None and capture.beta is not None:
            g_cap, beta_cap = capture.g[:, :t], capture.beta[:, :t]
        if (g_cap is not None and beta_cap is not None and g_cap.is_contiguous()
                and beta_cap.is_contiguous() and ops.fused(x)):
            beta, g = gdn_gates(a_in, b_in, self.A_log, self.dt_bias, beta_out=beta_cap,
                                g_out=g_cap, backend=backend)
        else:
            beta, g = ops.each_token_many(
                lambda a, b_: gdn_gates(a, b_, self.A_log, self.dt_bias, backend=backend),
                a_in, b_in,
            )
            if g_cap is not None and beta_cap is not None:
                g_cap.copy_(g)
                beta_cap.copy_(beta)
        weight = self.conv1d.weight.squeeze(1)  # [C, Kc]
        if capture is None:  # in place: conv inputs go to scratch, the new window is its tail
            captured = mixed.new_empty(b, kc1 + t, mixed.shape[-1])
        else:
            captured = capture.captured
        mixed = causal_conv1d_capture(  # in place (no capture): conv_rows <- the new window
            mixed, conv_rows, weight, None, captured,
            out=inputs[:, :t] if inputs is not None and direct else None, paths=paths,
            advance_rows=capture is None, backend=backend,
        )
        if inputs is not None and not direct:
            inputs[:, :t].copy_(mixed)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        if capture is None:
            if ops.chunked_prefill and t >= CHUNKED_PREFILL_MIN and bank is None:
                o = gdn_chunk_prefill(q, k, v, g, beta, state, chunk=ops.gdn_chunk.chunk,
                                      precision=ops.gdn_chunk.precision, backend=backend)
            else:
                o = gdn_verify(  # state <- state after the last token (from the live one)
                    q, k, v, g, beta, state, state.unsqueeze(1), None,
                    final_state_only=True, slot_bank=bank, live_slot=live, backend=backend,
                )
        else:  # states capture: every token's state and the pre-verify one; inputs: none
            # (a tree's reloaded nodes go to the pool's one-layer scratch)
            o = gdn_verify(
                q, k, v, g, beta, state, capture.checkpoints, geometry,
                snapshot=capture.snapshot, slot_bank=bank, live_slot=live,
                tree_states=capture.tree_states, tree_table=tree_table, backend=backend,
            )
        o = ops.each_token(self.norm, o, z)  # [B, T, HV, V]
        return ops.linear(self.out_proj, o.reshape(b, t, self.value_dim))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``.

    The MLP is dense, or a sparse mixture of experts in ``config.sparse_layer_ids``.
    """

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if layer_id in config.sparse_layer_ids:
            from dflash.model.moe import SparseMoE

            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)


class DeltaNetLayer(DecoderLayer):
    """A recurrent (``linear_attention``) layer: Gated DeltaNet mixer + MLP."""

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.linear_attn = GatedDeltaNet(config)


class AttentionLayer(DecoderLayer):
    """A ``full_attention`` layer: gated attention mixer + MLP."""

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.self_attn = GatedAttention(config)
