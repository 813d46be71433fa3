"""`HybridConfig`: the shape of a Qwen3.5 / Qwen3-Next style hybrid text model.

Read from a Hugging Face ``config.json`` with :meth:`HybridConfig.from_hf_config`
(``model_type`` ``qwen3_5_text``, ``qwen3_5`` with a ``text_config``, or ``qwen3_next``)
or built from the named constructors :meth:`HybridConfig.tiny_default` and
:meth:`HybridConfig.nine_b_shape`. Every bad value is rejected with a
:class:`ConfigError` that names the field, the rule and the value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash.errors import ConfigError as ConfigError  # re-exported: the config layer error

LayerType = Literal["linear_attention", "full_attention"]
ModelFamily = Literal["qwen3_5_text", "qwen3_next"]

_SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next")


class HybridConfig(BaseModel):
    """Frozen shape of a hybrid Gated-DeltaNet / gated-attention text model.

    Attention layers: ``num_attention_heads`` query heads sharing ``num_key_value_heads``
    KV heads of ``head_dim``; rotary embedding on the first
    ``rotary_dim = head_dim * partial_rotary_factor`` channels. Recurrent (linear
    attention) layers: ``linear_num_key_heads`` q/k heads of ``linear_key_head_dim``
    (``HK``, ``K``), ``linear_num_value_heads`` value heads of ``linear_value_head_dim``
    (``HV``, ``V``), a causal conv of width ``linear_conv_kernel_dim`` (``Kc``) over the
    ``conv_dim = 2·HK·K + HV·V`` mixed q/k/v channels.
    """

    # strict: a JSON string "512" is not an int, 1 is not a bool (an int is a valid float)
    # NaN and infinities are refused in every float field (a JSON config may spell them)
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, protected_namespaces=(),
                              allow_inf_nan=False)

    model_type: ModelFamily = "qwen3_5_text"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    layer_types: tuple[LayerType, ...] = Field(min_length=1)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    linear_num_key_heads: int = Field(gt=0)
    linear_num_value_heads: int = Field(gt=0)
    linear_key_head_dim: int = Field(gt=0)
    linear_value_head_dim: int = Field(gt=0)
    linear_conv_kernel_dim: int = Field(ge=2)
    rms_norm_eps: float = Field(gt=0.0, lt=1.0)
    rope_theta: float = Field(gt=0.0)
    partial_rotary_factor: float = Field(gt=0.0, le=1.0)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = Field(default=32768, gt=0)
    # Qwen3-Next mixture-of-experts MLPs (in the layers ``sparse_layer_ids``; dense elsewhere)
    sparse_layer_ids: tuple[int, ...] = ()
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_intermediate_size: int = Field(default=0, ge=0)
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    norm_topk_prob: bool = True

    @model_validator(mode="after")
    def _check_consistency(self) -> HybridConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"'num_key_value_heads' must divide num_attention_heads="
                f"{self.num_attention_heads} (got {self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"'linear_num_key_heads' must divide linear_num_value_heads="
                f"{self.linear_num_value_heads} (got {self.linear_num_key_heads})"
            )
        if self.sparse_layer_ids:
            bad = [i for i in self.sparse_layer_ids if not 0 <= i < len(self.layer_types)]
            if bad:
                raise ValueError(
                    f"'sparse_layer_ids' must lie in [0, {len(self.layer_types)}) (got {bad})"
                )
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"'num_experts_per_tok' must be in [1, num_experts={self.num_experts}] "
                    f"(got {self.num_experts_per_tok})"
                )
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) <= 0:
                    raise ValueError(
                        f"{name!r} must be > 0 with sparse layers (got {getattr(self, name)})"
                    )
        rotary = self.head_dim * self.partial_rotary_factor
        if rotary != int(rotary) or int(rotary) % 2 or int(rotary) < 2:
            raise ValueError(
                f"'partial_rotary_factor' × head_dim must be an even integer >= 2 "
                f"(got {self.partial_rotary_factor} × {self.head_dim} = {rotary})"
            )
        return self

    # -- derived sizes ----------------------------------------------------------------

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def to_hf_config(self) -> dict[str, Any]:
        """This shape as a Hugging Face ``qwen3_5_text`` ``config.json`` dict."""
        if self.sparse_layer_ids:
            raise ConfigError(
                f"'sparse_layer_ids' = {list(self.sparse_layer_ids)}: a model with "
                "mixture-of-experts layers cannot be written as a qwen3_5_text config"
            )
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }

    # -- named constructors ------------------------------------------------------------

    @classmethod
    def tiny_default(cls) -> HybridConfig:
        """The built-in default: 6 layers [lin, lin, full, lin, lin, full], hidden 64, vocab 256."""
        return cls(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            layer_types=("linear_attention", "linear_attention", "full_attention") * 2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            max_position_embeddings=4096,
        )

    @classmethod
    def twenty_seven_b_shape(cls) -> HybridConfig:
        """The shape of Qwen3.5-27B (its published ``text_config``).

        64 layers, full attention every 4th; hidden 5120, intermediate 17408, vocab 248320;
        attention 24 query / 4 KV heads of 256 with a quarter of each head rotated (theta 1e7);
        Gated DeltaNet HK=16, HV=48, K=V=128, conv width 4; untied LM head.
        """
        return cls(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            layer_types=tuple(
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)
            ),
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            max_position_embeddings=262144,
        )

    @classmethod
    def nine_b_shape(cls) -> HybridConfig:
        """The shape of Qwen3.5-9B (the defaults of transformers' ``Qwen3_5TextConfig``).

        32 layers, full attention every 4th; hidden 4096, intermediate 12288, vocab 248320;
        attention 16 query / 4 KV heads of 256 with a quarter of each head rotated;
        Gated DeltaNet HK=16, HV=32, K=V=128, conv width 4; untied LM head.
        """
        return cls(
            vocab_size=248320,
            hidden_size=4096,
            intermediate_size=12288,
            layer_types=_interval_layout(32, 4),
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            max_position_embeddings=262144,
        )

    @classmethod
    def from_hf_config(cls, source: Mapping[str, Any] | str | Path) -> HybridConfig:
        """Read a Hugging Face ``config.json`` (a path to it, its directory, or the dict)."""
        raw = _read_json(source) if isinstance(source, (str, Path)) else dict(source)
        model_type = raw.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config field 'model_type' must be one of {list(_SUPPORTED_MODEL_TYPES)} "
                f"(got {model_type!r})"
            )
        if model_type == "qwen3_5":
            text = raw.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError(
                    f"config field 'text_config' must be an object for model_type 'qwen3_5' "
                    f"(got {type(text).__name__})"
                )
            text = dict(text)
            text.setdefault("model_type", "qwen3_5_text")
            # the wrapper's own flag decides, as in transformers' ForConditionalGeneration
            # (its save_pretrained writes the top-level flag and leaves text_config's False)
            if "tie_word_embeddings" in raw:
                text["tie_word_embeddings"] = raw["tie_word_embeddings"]
            return cls.from_hf_config(text)
        fields = _fields_from_hf(raw, model_type)
        if model_type == "qwen3_next":
            fields.update(_moe_fields(raw, len(fields["layer_types"])))
        return _build(cls, fields)


def _interval_layout(num_layers: int, interval: int) -> tuple[LayerType, ...]:
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


def _read_json(source: str | Path) -> dict[str, Any]:
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a JSON object (got {type(data).__name__})"
        )
    return data


def _need(raw: Mapping[str, Any], name: str) -> Any:
    if name not in raw:
        raise ConfigError(f"config field {name!r} is required for this model type (missing)")
    return raw[name]


def _int_field(raw: Mapping[str, Any], name: str) -> int:
    value = _need(raw, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field {name!r} must be an integer (got {value!r})")
    return value


def _fields_from_hf(raw: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act' must be 'silu' (got {act!r})")
    num_layers = _int_field(raw, "num_hidden_layers")
    if num_layers <= 0:
        raise ConfigError(f"config field 'num_hidden_layers' must be > 0 (got {num_layers})")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = raw.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ConfigError(
                f"config field 'full_attention_interval' must be a positive integer "
                f"(got {interval!r})"
            )
        layer_types = _interval_layout(num_layers, interval)
    else:
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(
                f"config field 'layer_types' must be a list (got {type(layer_types).__name__})"
            )
        for i, kind in enumerate(layer_types):
            if kind not in ("linear_attention", "full_attention"):
                raise ConfigError(
                    f"config field 'layer_types' entry {i} must be 'linear_attention' or "
                    f"'full_attention' (got {kind!r})"
                )
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"config field 'layer_types' must have num_hidden_layers={num_layers} entries "
                f"(got {len(layer_types)})"
            )
    scaling = raw.get("rope_scaling")
    if raw.get("rope_parameters") and scaling:
        # transformers folds rope_scaling into rope_parameters: a scaling beside them is
        # not dropped silently, it is refused unless it changes nothing
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(
            scaling, Mapping) else scaling
        if kind not in ("default", "mrope", None):
            raise ConfigError(
                f"config field 'rope_scaling' ({scaling!r}) beside 'rope_parameters': only "
                f"the default rotary is supported (got rope_type {kind!r})"
            )
    rope = raw.get("rope_parameters") or scaling or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"config field 'rope_parameters' must be an object (got {rope!r})")
    # Multimodal rotary sections (mrope_section / mrope_interleaved) split the rotary
    # channels between the temporal/height/width position streams; for text all three
    # streams carry the same position, so the result is plain rotary and they are ignored.
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(
            f"config field 'rope_parameters.rope_type' must be 'default' (got {rope_type!r})"
        )
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    head_dim = raw.get("head_dim")
    if head_dim is None:
        head_dim = _int_field(raw, "hidden_size") // max(1, _int_field(raw, "num_attention_heads"))
    return {
        "model_type": model_type,
        "vocab_size": _need(raw, "vocab_size"),
        "hidden_size": _need(raw, "hidden_size"),
        "intermediate_size": _need(raw, "intermediate_size"),
        "layer_types": tuple(layer_types),
        "num_attention_heads": _need(raw, "num_attention_heads"),
        "num_key_value_heads": raw.get("num_key_value_heads", raw.get("num_attention_heads")),
        "head_dim": head_dim,
        "linear_num_key_heads": _need(raw, "linear_num_key_heads"),
        "linear_num_value_heads": _need(raw, "linear_num_value_heads"),
        "linear_key_head_dim": _need(raw, "linear_key_head_dim"),
        "linear_value_head_dim": _need(raw, "linear_value_head_dim"),
        "linear_conv_kernel_dim": raw.get("linear_conv_kernel_dim", 4),
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "partial_rotary_factor": partial,
        "attention_bias": raw.get("attention_bias", False),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "max_position_embeddings": raw.get("max_position_embeddings", 32768),
    }


def _moe_fields(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-Next: a layer is sparse unless listed in ``mlp_only_layers`` or off-step."""
    num_experts = raw.get("num_experts", 512)
    if not num_experts:
        return {}
    step = raw.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ConfigError(
            f"config field 'decoder_sparse_step' must be a positive integer (got {step!r})"
        )
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not sparse:
        return {}
    return {
        "sparse_layer_ids": sparse,
        "num_experts": num_experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok", 10),
        "moe_intermediate_size": raw.get("moe_intermediate_size", 512),
        "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size", 512),
        "norm_topk_prob": raw.get("norm_topk_prob", True),
    }


def _build(cls: type[HybridConfig], fields: dict[str, Any]) -> HybridConfig:
    try:
        return cls(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a cross-field rule: its message starts with the field's name
            message = first["msg"].removeprefix("Value error, ")
            raise ConfigError(f"config field {message}") from exc
        where = ".".join(str(p) for p in first["loc"])
        value = first.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        raise ConfigError(f"config field {where!r}: {first['msg']}{shown}") from exc
