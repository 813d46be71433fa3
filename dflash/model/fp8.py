"""FP8 weights: Hugging Face's fine-grained format, read, written, or made at load time.

A quantized linear holds ``weight [N, K]`` in ``float8_e4m3fn`` and ``weight_scale_inv
[ceil(N/bn), ceil(K/bk)]`` in float32 (``bn × bk`` = ``weight_block_size``, 128 × 128 in
Qwen's checkpoints): the real weight is ``weight[n, k] * weight_scale_inv[n // bn, k // bk]``.
Activations stay in the model's dtype (weight-only: half the bytes a decode reads, no
activation rounding). The projections of the decoder layers are quantized — attention's
``q/k/v/o_proj``, Gated DeltaNet's ``in_proj_*`` and ``out_proj``, the MLP's
``gate/up/down_proj`` — except those a checkpoint's ``modules_to_not_convert`` names;
embeddings, norms, the conv, the gates' parameters and the LM head stay in the model dtype,
unless the LM head is quantized too (:attr:`Fp8Spec.lm_head`: a checkpoint that stores
``lm_head.weight`` in e4m3 with its scales, or ``quantize="fp8-lm-head"``; never a head
tied to the embedding). Reading, the file's dtype of ``lm_head.weight`` decides; writing,
``modules_to_not_convert`` says it the way transformers reads it (absent: the LM head is
left alone; a list: only what it names).

Every product of a quantized linear goes through :func:`dflash.kernels.fp8_linear`, which
is M-invariant: speculative decoding of an FP8 model is bitwise plain decoding of the same
FP8 model. A prefill (any kernel allowed) of more than
:data:`dflash.model.layers.FP8_KERNEL_ROWS` rows multiplies by the dequantized weight; a
shorter one (the LM head on a target prefill's last row) runs the FP8 kernel.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.errors import CheckpointError
from dflash.kernels.fp8_linear import dequantize_fp8, quantize_fp8

FP8 = torch.float8_e4m3fn

#: the linears of a decoder layer that a fine-grained FP8 checkpoint quantizes
QUANTIZED = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
    "linear_attn.in_proj_a", "linear_attn.out_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


@dataclass(frozen=True)
class Fp8Spec:
    """A checkpoint's ``quantization_config`` (``quant_method: "fp8"``)."""

    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()
    #: the LM head quantized too (its weight e4m3 with block scales)
    lm_head: bool = False

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` that Hugging Face reads as this spec: an FP8 LM head
        needs an explicit ``modules_to_not_convert`` (absent, transformers leaves the LM
        head unquantized), and a bf16 one beside other skipped modules is named in it."""
        skip = list(self.modules_to_not_convert)
        if not self.lm_head and skip and "lm_head" not in skip:
            skip.append("lm_head")
        return {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
            **({"modules_to_not_convert": skip} if skip or self.lm_head else {}),
        }

    def converts(self, name: str) -> bool:
        """Whether the linear ``name`` (``layers.3.mlp.up_proj``, ``lm_head``) is
        quantized."""
        if name == "lm_head":
            return self.lm_head and self.converts_name(name)
        if not name.startswith("layers.") or not any(name.endswith("." + q) for q in QUANTIZED):
            return False
        return self.converts_name(name)

    def converts_name(self, name: str) -> bool:
        """Whether ``modules_to_not_convert`` leaves the module ``name`` to be converted."""
        full = name if name == "lm_head" else "model." + name
        return not any(_names(m, full) for m in self.modules_to_not_convert)


def _names(pattern: str, full: str) -> bool:
    """Whether a ``modules_to_not_convert`` entry names the module ``full``
    (``model.layers.3.mlp.up_proj``): a glob matching it (with or without ``model.``), or
    a run of whole name components in it (``mlp``, ``layers.3.mlp``, the full name)."""
    # a multimodal checkpoint names the text model's modules model.language_model.*
    pattern = pattern.replace("model.language_model.", "model.")
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(full, pattern) or fnmatch.fnmatchcase(
            full.removeprefix("model."), pattern)
    return bool(pattern) and f".{pattern}." in f".{full}."


def parse_fp8_config(raw: object, source: str) -> Fp8Spec | None:
    """The :class:`Fp8Spec` of a ``quantization_config`` (None when there is none); a
    field that is not the fine-grained FP8 format dflash runs is a
    :class:`CheckpointError` naming ``source``, the field and its value."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{source}: 'quantization_config' must be an object (got {raw!r})")

    def want(field: str, ok: bool, rule: str) -> None:
        if not ok:
            raise CheckpointError(
                f"{source}: quantization_config field {field!r} must be {rule} "
                f"(got {raw.get(field)!r})"
            )

    want("quant_method", raw.get("quant_method") == "fp8", "'fp8' (the fine-grained format)")
    want("fmt", raw.get("fmt", "e4m3") == "e4m3", "'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")   # transformers lowercases it
    want("activation_scheme", isinstance(scheme, str) and scheme.lower() == "dynamic",
         "'dynamic' (weights in FP8; dflash keeps the activations in the model dtype)")
    block = raw.get("weight_block_size", [128, 128])
    want("weight_block_size", isinstance(block, list) and len(block) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block),
        "a list of two positive ints, e.g. [128, 128]")
    # ``ignored_layers``: transformers' alias of the skip list (when the list is absent)
    skip_field = ("modules_to_not_convert" if raw.get("modules_to_not_convert") is not None
                  or "ignored_layers" not in raw else "ignored_layers")
    skip = raw.get(skip_field) or []
    want(skip_field, isinstance(skip, list) and all(
        isinstance(m, str) for m in skip), "a list of module names")
    # what transformers' FineGrainedFP8Config writes beside them, at the values that
    # describe the format above (anything else is a different format, refused)
    want("dequantize", raw.get("dequantize", False) is False,
         "false (dflash runs the FP8 weights)")
    want("modules_to_convert", raw.get("modules_to_convert") is None,
         "null (every linear of the format, less modules_to_not_convert)")
    want("scale_fmt", raw.get("scale_fmt", "float") == "float", "'float' (float32 scales)")
    want("expert_dtype", raw.get("expert_dtype", "fp8") == "fp8", "'fp8'")
    known = {"quant_method", "fmt", "activation_scheme", "weight_block_size",
             "modules_to_not_convert", "ignored_layers", "dequantize", "modules_to_convert",
             "scale_fmt", "expert_dtype"}
    extra = sorted(set(raw) - known)
    if extra:
        raise CheckpointError(
            f"{source}: quantization_config field {extra[0]!r} is not part of the "
            "fine-grained FP8 format dflash reads"
        )
    return Fp8Spec(block=(block[0], block[1]), modules_to_not_convert=tuple(skip))


#: the values of ``--quantize`` / ``quantize=``: the decoder layers' projections, or those
#: and the LM head
QUANTIZE_CHOICES = ("fp8", "fp8-lm-head")


def quantize_spec(choice: str) -> Fp8Spec:
    """The :class:`Fp8Spec` of a :data:`QUANTIZE_CHOICES` value (128 × 128 blocks)."""
    if choice not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)} "
                         f"(got {choice!r})")
    return Fp8Spec(lm_head=choice == "fp8-lm-head")


class Fp8Linear(nn.Module):
    """A linear whose weight is FP8 with per-block scales (see the module docstring).

    ``weight`` is a parameter without gradient (so checkpoints and ``state_dict`` name it
    as for a float linear), ``weight_scale_inv`` a buffer."""

    weight_scale_inv: Tensor  # [ceil(N/bn), ceil(K/bk)] float32, a buffer

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int],
                 bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.dtype = dtype  # the model's dtype: what a dequantized product runs in
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8,
                                               device=device), requires_grad=False)
        rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
        self.register_buffer("weight_scale_inv",
                             torch.ones(rows, cols, dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                     if bias else None)

    @classmethod
    def quantized(cls, linear: nn.Linear, block: tuple[int, int]) -> Fp8Linear:
        """``linear``'s weight quantized (per-block absmax scaling); its bias kept."""
        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, block, bias=linear.bias is not None,
                  device=w.device, dtype=w.dtype)
        q, scale = quantize_fp8(w, block)
        with torch.no_grad():
            out.weight.data = q
            out.weight_scale_inv.copy_(scale)
            if linear.bias is not None and out.bias is not None:
                out.bias.copy_(linear.bias.detach())
        return out

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.block,
                              dtype or self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None
                        else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3, block={self.block}"


def fp8_linears(model: nn.Module, spec: Fp8Spec) -> list[str]:
    """The names of ``model``'s linears that ``spec`` quantizes."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, Fp8Linear)) and spec.converts(name)]


def replace_linears_(model: nn.Module, spec: Fp8Spec, *, quantize: bool) -> None:
    """Swap every linear ``spec`` quantizes for an :class:`Fp8Linear`: quantized from its
    weight (``quantize``), or empty (a model about to load an FP8 checkpoint)."""
    swapped: dict[int, nn.Module] = {}
    for name in fp8_linears(model, spec):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if isinstance(linear, Fp8Linear):
            continue
        if quantize:
            new = Fp8Linear.quantized(linear, spec.block)
        else:
            new = Fp8Linear(linear.in_features, linear.out_features, spec.block,
                            bias=linear.bias is not None, device=linear.weight.device,
                            dtype=linear.weight.dtype)
        setattr(parent, child, new)
        swapped[id(linear)] = new
    # the projection groups (dflash.model.layers.LinearGroup) that held a swapped linear
    # are built again over the new modules, under the same attribute names
    for module in model.modules():
        groups = getattr(module, "linear_groups", ())
        if not groups or not any(id(m) in swapped for g in groups for m in g.linears):
            continue
        rebuilt = []
        for group in groups:
            new_group = type(group)(*[swapped.get(id(m), m) for m in group.linears])
            for attr, value in list(vars(module).items()):
                if value is group:
                    object.__setattr__(module, attr, new_group)
            rebuilt.append(new_group)
        setattr(module, "linear_groups", tuple(rebuilt))  # noqa: B010 - a module attribute


__all__ = [
    "FP8",
    "QUANTIZED",
    "QUANTIZE_CHOICES",
    "Fp8Linear",
    "Fp8Spec",
    "fp8_linears",
    "parse_fp8_config",
    "quantize_spec",
    "replace_linears_",
]
