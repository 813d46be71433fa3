"""Reading and writing DFlash drafter checkpoints in z-lab's format.

A checkpoint directory holds ``config.json`` (a Qwen3 config with
``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}``; see :mod:`dflash_config`) and
``model.safetensors`` (bfloat16) with the tensors::

    fc.weight                       [H, len(target_layer_ids) * H]
    hidden_norm.weight, norm.weight [H]
    layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight   [H]
    layers.{i}.self_attn.q_proj.weight [heads * D, H]   (+ .bias when attention_bias)
    layers.{i}.self_attn.{k,v}_proj.weight [kv_heads * D, H]
    layers.{i}.self_attn.o_proj.weight [H, heads * D]
    layers.{i}.self_attn.{q,k}_norm.weight [D]
    layers.{i}.mlp.{gate,up}_proj.weight [I, H],  layers.{i}.mlp.down_proj.weight [H, I]

A DFlash2 checkpoint (``architectures: ["DFlash2DraftModel"]``, ``specs/dflash2.md``)
adds ``dflash_config`` keys (``block_size``, ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``, optional ``input_embedding_scale``,
``output_multiplier``, ``final_logit_softcapping``; ``num_target_layers`` optional) and::

    layers.{i}.{attention,mlp}_conv.base_kernel               [2, Kc, H]
    layers.{i}.{attention,mlp}_conv.kernel_projection.weight  [2 * Kc * H / G, H]
    candidate_selector.hidden_projection.weight               [R, H]
    candidate_selector.{predecessor,successor}_codebook       [V, R]   (bare names)

Reading is all-or-nothing: the config is parsed and validated, every tensor's name and
shape is checked and every tensor read before any is handed out, so a bad checkpoint
raises a typed :class:`DrafterCheckpointError` naming the file, field or tensor and the
expected and found values, and nothing half-loaded is used. Nothing is unpickled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import torch
from pydantic_core import ErrorDetails
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from dflash.model.drafters.dflash_config import (
    ARCHITECTURE,
    ARCHITECTURE_V2,
    MODEL_TYPE,
    DFlash2Config,
    DFlashConfig,
    default_tap_layers,
)
from dflash.model.drafters.errors import (
    MISSING,
    CheckpointConfigError,
    CheckpointFileError,
    ConfigFieldError,
    DrafterCheckpointError,
    MaskTokenRangeError,
    MissingKeysError,
    TensorShapeError,
    UnexpectedKeysError,
    UnknownArchitectureError,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# dflash_config keys with the value that leaves z-lab's DFlashDraftModel unchanged
_NEUTRAL_DFLASH_KEYS: dict[str, object] = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}
_DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size")
#: a DFlash2 config's ``dflash_config`` keys: required, then optional (with their defaults)
_DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_DFLASH2_OPTIONAL: dict[str, object] = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}


#: DFlash2's codebooks under the name an ``nn.Embedding`` saves them with → their bare name
_CODEBOOK_ALIASES = {
    f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
    for name in ("predecessor_codebook", "successor_codebook")
}


def read_config(directory: str | Path) -> DFlashConfig:
    """Read, translate and validate ``directory/config.json``."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointFileError(f"drafter checkpoint {str(root)!r} is not a directory")
    path = root / CONFIG_FILE
    if not path.is_file():
        raise CheckpointFileError(f"drafter checkpoint {str(root)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointConfigError(f"{path}: must hold a JSON object (got {type(raw).__name__})")
    return config_from_hf(raw, str(path))


def config_from_hf(raw: Mapping[str, Any], where: str = CONFIG_FILE) -> DFlashConfig:
    """Translate a z-lab ``config.json`` object into a :class:`DFlashConfig` (a
    :class:`DFlash2Config` for ``architectures: ["DFlash2DraftModel"]``)."""
    arch = raw.get("architectures", MISSING)
    if arch not in ([ARCHITECTURE], [ARCHITECTURE_V2]):
        raise UnknownArchitectureError(
            where, "architectures", f"[{ARCHITECTURE!r}] or [{ARCHITECTURE_V2!r}]", arch
        )
    v2 = arch == [ARCHITECTURE_V2]
    model_type = raw.get("model_type", MISSING)
    if model_type != MODEL_TYPE:
        raise UnknownArchitectureError(where, "model_type", repr(MODEL_TYPE), model_type)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigFieldError(where, "hidden_act", "'silu'", act)
    dflash = raw.get("dflash_config", {})
    if not isinstance(dflash, dict):
        raise ConfigFieldError(where, "dflash_config", "a JSON object", dflash)
    for key, value in dflash.items():
        if key in _DFLASH_KEYS or (v2 and (key in _DFLASH2_REQUIRED or key in _DFLASH2_OPTIONAL)):
            continue
        if key in _NEUTRAL_DFLASH_KEYS and value == _NEUTRAL_DFLASH_KEYS[key]:
            continue
        expected = (
            f"{_NEUTRAL_DFLASH_KEYS[key]!r} (other values are not supported)"
            if key in _NEUTRAL_DFLASH_KEYS
            else f"one of {list(_DFLASH_KEYS)} (this DFlash variant is not supported)"
        )
        raise ConfigFieldError(where, f"dflash_config.{key}", expected, value)

    def need(name: str) -> Any:
        if name not in raw:
            raise ConfigFieldError(where, name, "an integer", MISSING)
        return raw[name]

    def dflash_value(name: str, default: object = MISSING) -> Any:
        value = dflash.get(name, raw.get(name, default))
        if value is MISSING:
            raise ConfigFieldError(where, f"dflash_config.{name}", "a value", MISSING)
        return value

    required = ["hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size"]
    # DFlash2 checkpoints may leave the target's depth out (its reference never reads it):
    # the taps are then checked against the target when the pair is made
    if not v2 or "num_target_layers" in raw:
        required.append("num_target_layers")
    fields: dict[str, Any] = {name: need(name) for name in required}
    for name in fields:
        if isinstance(fields[name], bool) or not isinstance(fields[name], int):
            raise ConfigFieldError(where, name, "an integer", fields[name])
    heads = fields["num_attention_heads"]
    fields["head_dim"] = raw.get("head_dim") or (fields["hidden_size"] // heads if heads > 0 else 0)
    for name, default in (
        ("rms_norm_eps", 1e-6),
        ("max_position_embeddings", 32768),
        ("attention_bias", False),
        ("sliding_window", None),
        ("is_causal", None),
    ):
        fields[name] = raw.get(name, default)
    for name in ("is_causal", "attention_bias"):  # a string "false" would read as true
        if fields[name] is not None and not isinstance(fields[name], bool):
            raise ConfigFieldError(where, name, "true or false", fields[name])
    theta, scaling = _rope(raw, where)
    fields["rope_theta"], fields["rope_scaling"] = theta, scaling
    fields["block_size"] = dflash_value("block_size", 16)
    mask = dflash_value("mask_token_id")
    vocab = fields["vocab_size"]
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise MaskTokenRangeError(
            where, "dflash_config.mask_token_id", f"a token id in [0, vocab_size={vocab})", mask
        )
    fields["mask_token_id"] = mask
    taps = dflash_value("target_layer_ids", None)
    if taps is None and not v2 and isinstance(fields["num_target_layers"], int):
        num_layers = fields["num_hidden_layers"]
        taps = default_tap_layers(fields["num_target_layers"], max(1, num_layers))
    fields["target_layer_ids"] = taps
    layer_types = raw.get("layer_types")
    fields["layer_types"] = layer_types
    if layer_types is not None and "sliding_attention" not in layer_types:
        fields["sliding_window"] = None  # no layer uses it
    _require_types(fields, where)
    kind: type[DFlashConfig] = DFlashConfig
    if v2:
        kind = DFlash2Config
        _dflash2_fields(fields, dflash, where)
    try:
        return kind.model_validate(fields)
    except pydantic.ValidationError as exc:
        problems = "; ".join(_describe(err) for err in exc.errors())
        raise CheckpointConfigError(f"{where}: invalid DFlash drafter config: {problems}") from exc


def _dflash2_fields(fields: dict[str, Any], dflash: Mapping[str, Any], where: str) -> None:
    """DFlash2's ``dflash_config`` keys into ``fields``; without ``num_target_layers`` the
    taps bound it (the target checks them when the pair is made)."""
    taps = fields.get("target_layer_ids")
    if not isinstance(taps, (list, tuple)) or not taps:
        raise ConfigFieldError(where, "dflash_config.target_layer_ids",
                               "a non-empty list of layer ids", MISSING if taps is None else taps)
    if "block_size" not in dflash:
        raise ConfigFieldError(where, "dflash_config.block_size", "an integer", MISSING)
    if "num_target_layers" not in fields:
        bound = max((t for t in taps if isinstance(t, int) and not isinstance(t, bool)),
                    default=0)
        fields["num_target_layers"] = bound + 1
        fields["declares_target_depth"] = False
    for key in _DFLASH2_REQUIRED:
        if key not in dflash:
            raise ConfigFieldError(where, f"dflash_config.{key}", "an integer", MISSING)
        value = dflash[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigFieldError(where, f"dflash_config.{key}", "an integer", value)
        fields[key] = value
    for key, default in _DFLASH2_OPTIONAL.items():
        value = dflash.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigFieldError(where, f"dflash_config.{key}", "a number", value)
        if key == "final_logit_softcapping" and value is not None and value <= 0:
            value = None  # z-lab: a cap <= 0 is no cap
        fields[key] = value


#: fields whose JSON value must be an integer (null allowed where the field is optional),
#: and those that must be a finite number: read as transformers reads them, never
#: converted from strings or fractional numbers
_INT_FIELDS = ("head_dim", "max_position_embeddings", "block_size", "sliding_window")
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")


def _require_types(fields: Mapping[str, Any], where: str) -> None:
    """Refuse a field of the wrong JSON type by name, before pydantic's lax conversions
    (``"16"`` or ``16.0`` for an integer, ``"1e6"`` or Infinity for a number)."""
    for name in _INT_FIELDS:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigFieldError(where, name, "an integer", value)
    for name in _NUMBER_FIELDS:
        value = fields.get(name)
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value)):
            raise ConfigFieldError(where, name, "a finite number", value)
    taps = fields.get("target_layer_ids")
    if isinstance(taps, list | tuple):
        for i, t in enumerate(taps):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ConfigFieldError(where, f"dflash_config.target_layer_ids[{i}]",
                                       "an integer layer id", t)


def _rope(raw: Mapping[str, Any], where: str) -> tuple[Any, Any]:
    """``(rope_theta, rope_scaling)`` from either the legacy keys or ``rope_parameters``."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigFieldError(where, "rope_parameters", "a JSON object", params)
    theta = raw.get("rope_theta", (params or {}).get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if scaling is None and params is not None:
        kind = params.get("rope_type", "default")
        if kind != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigFieldError(where, "rope_scaling", "a JSON object or null", scaling)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def _describe(err: ErrorDetails) -> str:
    """``field: rule (got value)``; a missing field or a cross-field rule has no value."""
    where = ".".join(str(p) for p in err["loc"]) or "<config>"
    shown = err["loc"] and err["type"] != "missing"
    return f"{where}: {err['msg']}" + (f" (got {err['input']!r})" if shown else "")


def expected_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of ``config`` and its shape (z-lab's names)."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, config.feature_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
                p + "self_attn.o_proj.bias": (h,),
            }
        if isinstance(config, DFlash2Config):
            taps, groups = config.conv_kernel_size, config.conv_groups
            for conv in ("attention_conv", "mlp_conv"):
                shapes |= {
                    p + f"{conv}.base_kernel": (2, taps, h),
                    p + f"{conv}.kernel_projection.weight": (2 * taps * groups, h),
                }
    if isinstance(config, DFlash2Config):
        rank = config.selector_rank
        shapes |= {  # the codebooks are bare tensors (no ".weight")
            "candidate_selector.hidden_projection.weight": (rank, h),
            "candidate_selector.predecessor_codebook": (config.vocab_size, rank),
            "candidate_selector.successor_codebook": (config.vocab_size, rank),
        }
    return shapes


def read_weights(
    directory: str | Path, expected: Mapping[str, tuple[int, ...]]
) -> dict[str, Tensor]:
    """Read ``directory/model.safetensors`` after checking names and shapes.

    Raises (in this order): :class:`CheckpointFileError` (missing/unreadable/corrupt file),
    :class:`MissingKeysError`, :class:`UnexpectedKeysError`, :class:`TensorShapeError`,
    :class:`DrafterCheckpointError` (a tensor that is not floating point).
    """
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointFileError(f"drafter checkpoint {str(directory)!r} has no {WEIGHTS_FILE}")
    shown = str(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            # a codebook saved as "….weight" (what the reference's own save_pretrained
            # writes from its nn.Embedding) reads as its bare name; both spellings at
            # once leave the alias unexpected
            names = set(f.keys())
            stored: dict[str, str] = {}  # the name read -> its name in the file
            for name in names:
                bare = _CODEBOOK_ALIASES.get(name, name)
                stored[bare if bare in expected and bare not in names else name] = name
            keys = set(stored)
            missing = sorted(set(expected) - keys)
            if missing:
                raise MissingKeysError(shown, missing)
            unexpected = sorted(keys - set(expected))
            if unexpected:
                raise UnexpectedKeysError(shown, unexpected)
            for key in sorted(keys):
                found = tuple(int(n) for n in f.get_slice(stored[key]).get_shape())
                if found != expected[key]:
                    raise TensorShapeError(shown, key, expected[key], found)
            tensors: dict[str, Tensor] = {key: f.get_tensor(stored[key]) for key in sorted(keys)}
    except DrafterCheckpointError:
        raise
    except Exception as exc:  # safetensors reports corruption with its own (untyped) errors
        raise CheckpointFileError(
            f"{shown}: unreadable safetensors file ({type(exc).__name__}: {exc})"
        ) from exc
    for key, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.dtype in _FP8_DTYPES:
            raise DrafterCheckpointError(
                f"{shown}: tensor {key!r} has dtype {tensor.dtype}, "
                f"a floating-point dtype of 16 bits or more is required (a drafter's "
                "weights are not quantized)"
            )
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DrafterCheckpointError(
                f"{shown}: tensor {key!r} holds {bad} NaN or infinite value(s)"
            )
    return tensors


#: float8 dtypes: floating point to torch, but not weights a drafter multiplies by
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))


def write_checkpoint(
    directory: str | Path,
    config: DFlashConfig,
    tensors: Mapping[str, Tensor],
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (tensors as contiguous CPU ``dtype``)."""
    shapes = expected_shapes(config)
    if set(tensors) != set(shapes):
        raise DrafterCheckpointError(
            f"tensors to save differ from the config's: missing "
            f"{sorted(set(shapes) - set(tensors))}, extra {sorted(set(tensors) - set(shapes))}"
        )
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    cpu = {key: t.detach().to("cpu", dtype).contiguous() for key, t in tensors.items()}
    save_file(cpu, str(root / WEIGHTS_FILE), metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")


__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "config_from_hf",
    "expected_shapes",
    "read_config",
    "read_weights",
    "write_checkpoint",
]
