"""Checkpoint loading: ``config.json`` + safetensors (single file or sharded index).

Files are opened with ``safetensors.safe_open`` (memory-mapped; nothing is unpickled).
Every tensor is read into a fresh tensor, checked against the expected name, shape and
dtype kind, and only after *all* checks pass are the tensors assigned to a new model, so
a failed load never leaves a half-loaded model behind.

Key names accepted (prefix stripped, then matched against the model's parameters):

================================  ===========================================
checkpoint key                    meaning
================================  ===========================================
``model.language_model.X``        ``X`` (Qwen3.5 multimodal wrapper)
``model.X``                       ``X`` (``*ForCausalLM``)
``lm_head.weight``                LM head (ignored when embeddings are tied)
``model.visual.*``, ``visual.*``  vision tower — ignored, counted in the report
``mtp.*``                         multi-token-prediction head — ignored, counted
================================  ===========================================

Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are split into the per-role
projections ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; its
mixture-of-experts layers read the per-expert keys (``mlp.experts.{e}.gate_proj.weight``
…, ``mlp.gate.weight``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from dflash.errors import CheckpointError as CheckpointError  # re-exported: one family
from dflash.model.config import ConfigError, HybridConfig
from dflash.model.fp8 import FP8, Fp8Linear, parse_fp8_config, replace_linears_

if TYPE_CHECKING:
    from dflash.model.target import TargetModel

log = logging.getLogger(__name__)

_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")
_FLOAT_CODES = ("F32", "BF16", "F16", "F64")
# PyTorch pickle checkpoints (pytorch_model.bin, *.pt, *.pth, *.ckpt): never opened
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class LoadReport:
    """What a load read and what it ignored (and why), and where from: ``directory`` and
    the special token ids its ``config.json`` names (``token_ids``: ``bos_token_id``,
    ``eos_token_id``, ``pad_token_id`` as written, top level or ``text_config``), which
    :meth:`TargetModel.save_pretrained` writes back with the files beside the weights."""

    files: tuple[str, ...]
    tensors_loaded: int
    ignored: dict[str, int] = field(default_factory=dict)  # prefix/reason -> count
    directory: Path | None = None
    token_ids: dict[str, object] = field(default_factory=dict)


#: the special token ids a saved ``config.json`` carries over from the loaded one
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: the files beside the weights that make a checkpoint usable as an LLM (its tokenizer,
#: chat template and generation settings); :func:`save_target` copies those the loaded
#: checkpoint had
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _token_ids(raw: Mapping[str, object]) -> dict[str, object]:
    """The special token ids of a raw ``config.json``: top level first, then
    ``text_config`` (a Qwen3.5 multimodal checkpoint names them there)."""
    text = raw.get("text_config")
    inner: Mapping[str, object] = text if isinstance(text, dict) else {}
    ids: dict[str, object] = {}
    for name in TOKEN_ID_FIELDS:
        value = raw.get(name, inner.get(name))
        if value is not None:
            ids[name] = value
    return ids


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():  # transformers' order: the single file first, an index beside it
        return [single], None  # unread (it may be left over from an earlier save)
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: JSON, and text that is not UTF-8
            raise CheckpointError(f"index {str(index)!r} is not readable JSON: {exc}") from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"index {str(index)!r} must hold a 'weight_map' object of tensor -> file names"
            )
        files = []
        for name in sorted(set(weight_map.values())):
            path = directory / name
            if Path(name).name != name or not path.is_file():
                raise CheckpointError(
                    f"index {str(index)!r} names shard {name!r}, which is not a file in "
                    f"{str(directory)!r}"
                )
            files.append(path)
        return files, weight_map
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(
            f"{str(directory)!r} holds only pickle weights ({', '.join(pickled[:3])}"
            f"{', …' if len(pickled) > 3 else ''}); dflash refuses pickle on purpose, since "
            "unpickling a file can run arbitrary code. Convert it once to safetensors, e.g. "
            "python -c \"import sys, transformers as t; "
            "t.AutoModelForCausalLM.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], "
            "safe_serialization=True)\" DIR OUT_DIR (then copy the tokenizer files to OUT_DIR)"
        )
    raise CheckpointError(
        f"no weights in {str(directory)!r}: expected 'model.safetensors' or "
        "'model.safetensors.index.json'"
    )


@dataclass(frozen=True)
class _Entry:
    """One tensor as the file header describes it (nothing read yet)."""

    key: str
    path: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: F32, BF16, I32, …


def _scan_headers(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, _Entry]:
    """Phase 1: every tensor's name, shape and dtype from the headers (a truncated file
    fails here: safetensors checks that the header's offsets cover the file)."""
    entries: dict[str, _Entry] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles have keys(), no __iter__
                    if key in entries:
                        raise CheckpointError(
                            f"tensor {key!r} appears in both {entries[key].path.name!r} and "
                            f"{path.name!r}"
                        )
                    if weight_map is not None and weight_map.get(key) != path.name:
                        raise CheckpointError(
                            f"tensor {key!r} found in shard {path.name!r} but the index says "
                            f"{weight_map.get(key)!r}"
                        )
                    part = f.get_slice(key)
                    entries[key] = _Entry(key, path, tuple(part.get_shape()), part.get_dtype())
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(
                f"weights file {path.name!r} is truncated or corrupt ({exc})"
            ) from exc
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(entries))
        if missing:
            raise CheckpointError(
                f"tensor {missing[0]!r} is listed in the index (shard {weight_map[missing[0]]!r})"
                f" but absent from that file ({len(missing)} such tensors)"
            )
    return entries


def _strip(
    entries: dict[str, _Entry], tied: bool
) -> tuple[dict[str, _Entry], dict[str, int]]:
    out: dict[str, _Entry] = {}
    ignored: dict[str, int] = {}
    tied_head: _Entry | None = None
    for key, entry in entries.items():
        prefix = next((p for p in _IGNORED_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            ignored[prefix + "*"] = ignored.get(prefix + "*", 0) + 1
            continue
        if key == "lm_head.weight" and tied:
            tied_head = entry
            continue
        name = key
        for p in ("model.language_model.", "model."):
            if key.startswith(p):
                name = key[len(p) :]
                break
        if name in out:
            raise CheckpointError(f"tensor {key!r} maps to {name!r}, which is already present")
        out[name] = entry
    if tied_head is not None:
        if "embed_tokens.weight" in out:
            ignored["lm_head.weight (tied to embed_tokens)"] = 1
        else:  # a tied checkpoint that stores the shared matrix as the head, as
            out["embed_tokens.weight"] = tied_head   # transformers reads it
    return out, ignored


# A parameter comes from one checkpoint tensor, or (Qwen3-Next) from a slice of a fused one:
# (entry, role) with role None for "the whole tensor".
_Source = tuple[_Entry, str | None]


def _sources(config: HybridConfig, entries: dict[str, _Entry]) -> dict[str, _Source]:
    sources: dict[str, _Source] = {name: (entry, None) for name, entry in entries.items()}
    if config.model_type != "qwen3_next":
        return sources
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    r = config.linear_num_value_heads // hk
    rdv = r * config.linear_value_head_dim
    for layer in config.recurrent_layer_ids:
        base = f"layers.{layer}.linear_attn."
        for fused, rows, roles in (
            ("in_proj_qkvz", hk * (2 * dk + 2 * rdv), ("in_proj_qkv", "in_proj_z")),
            ("in_proj_ba", hk * 2 * r, ("in_proj_b", "in_proj_a")),
        ):
            key = base + fused + ".weight"
            if key not in sources:
                raise CheckpointError(f"missing tensor {key!r} (qwen3_next fused projection)")
            entry, _ = sources.pop(key)
            _check_shape(key, entry.shape, (rows, config.hidden_size))
            for role in roles:
                sources[base + role + ".weight"] = (entry, role)
    return sources


def _split_fused(config: HybridConfig, fused: Tensor, role: str) -> Tensor:
    """Qwen3-Next rows are grouped per key head: [q | k | v | z] and [b | a]."""
    hk, dk, h = config.linear_num_key_heads, config.linear_key_head_dim, config.hidden_size
    r = config.linear_num_value_heads // hk
    rdv = r * config.linear_value_head_dim
    if role in ("in_proj_qkv", "in_proj_z"):
        q, k, v, z = torch.split(fused.reshape(hk, 2 * dk + 2 * rdv, h), [dk, dk, rdv, rdv], 1)
        if role == "in_proj_z":
            return z.reshape(-1, h)
        return torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)], dim=0)
    ba = fused.reshape(hk, 2 * r, h)
    return (ba[:, :r] if role == "in_proj_b" else ba[:, r:]).reshape(-1, h)


def _check_shape(name: str, found: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if found != expected:
        raise CheckpointError(
            f"tensor {name!r} has shape {list(found)} but the config expects "
            f"{list(expected)} (config.json does not match these weights?)"
        )


def _check_names(
    expected: Mapping[str, Tensor], found: dict[str, _Source], config: HybridConfig
) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        name = unexpected[0]
        hint = ""
        parts = name.split(".")
        if parts[0] == "layers" and parts[1].isdigit():
            layer = int(parts[1])
            if layer >= config.num_hidden_layers:
                hint = f"; config.json has num_hidden_layers={config.num_hidden_layers}"
            else:
                hint = f"; config.json says layer {layer} is {config.layer_types[layer]!r}"
        raise CheckpointError(
            f"unexpected tensor {name!r} in the checkpoint ({len(unexpected)} unexpected "
            f"in all){hint}"
        )
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]!r} (expected shape {list(expected[missing[0]].shape)}; "
            f"{len(missing)} missing in all)"
        )


def _dtype_codes(dtype: torch.dtype) -> tuple[str, ...]:
    """The safetensors dtype codes a tensor loaded as ``dtype`` may have."""
    if dtype == FP8:
        return ("F8_E4M3",)
    return _FLOAT_CODES


def _raw_config(directory: Path) -> dict[str, object]:
    """``config.json`` as JSON (already checked readable by the config parser)."""
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return raw if isinstance(raw, dict) else {}


def _read(entry: _Entry) -> Tensor:
    try:
        with safe_open(str(entry.path), framework="pt", device="cpu") as f:
            return f.get_tensor(entry.key)  # type: ignore[no-any-return]  # untyped library
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(
            f"tensor {entry.key!r} in {entry.path.name!r} cannot be read ({exc})"
        ) from exc


def load_target(
    cls: type[TargetModel], directory: Path, *, dtype: torch.dtype, device: torch.device
) -> TargetModel:
    """Build ``cls`` from ``directory``; raise :class:`CheckpointError` on any defect.

    Phase 1 checks names, shapes and dtypes from the file headers alone; phase 2 reads
    one tensor at a time into a fresh tensor on ``device`` (checking it is finite); the
    model is assembled only when every tensor has been read.
    """
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    try:
        config = HybridConfig.from_hf_config(directory / "config.json")
    except ConfigError as exc:
        raise CheckpointError(f"config.json in {str(directory)!r}: {exc}") from exc
    raw = _raw_config(directory)
    spec = parse_fp8_config(raw.get("quantization_config"), str(directory / "config.json"))
    files, weight_map = _weight_files(directory)
    entries, ignored = _strip(_scan_headers(files, weight_map), config.tie_word_embeddings)
    sources = _sources(config, entries)
    if spec is not None and config.model_type == "qwen3_next":
        raise CheckpointError(
            f"{str(directory)!r}: FP8 weights of a qwen3_next checkpoint (fused projections, "
            "experts) are not read yet; a qwen3_5 FP8 checkpoint is"
        )
    head = sources.get("lm_head.weight")
    if spec is not None and head is not None and head[0].dtype == "F8_E4M3":
        # the file's dtype says whether the LM head is quantized too
        if not spec.converts_name("lm_head"):
            raise CheckpointError(
                f"tensor 'lm_head.weight' is F8_E4M3 but the quantization_config's "
                f"modules_to_not_convert names it ({list(spec.modules_to_not_convert)})"
            )
        spec = replace(spec, lm_head=True)
    with torch.device("meta"):
        model = cls(config)
        if spec is not None:  # the quantized projections: an FP8 weight and its scales
            replace_linears_(model, spec, quantize=False)
    # a tied lm_head is listed once, as embed_tokens
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    _check_names(expected, sources, config)
    for name, param in expected.items():
        entry, role = sources[name]
        want = _dtype_codes(param.dtype)
        if entry.dtype not in want:
            expected_kind = (
                "F8_E4M3 is expected (an FP8 checkpoint's quantized weight)"
                if param.dtype == FP8 else f"a floating dtype ({', '.join(want)}) is expected"
            )
            raise CheckpointError(f"tensor {name!r} has dtype {entry.dtype} but {expected_kind}")
        if role is None:
            _check_shape(name, entry.shape, tuple(param.shape))
    fresh: dict[str, Tensor] = {}
    fused_cache: dict[str, Tensor] = {}
    for name in expected:
        entry, role = sources[name]
        if role is None:
            tensor = _read(entry)
        else:
            if entry.key not in fused_cache:
                fused_cache = {entry.key: _read(entry)}  # both roles of a layer read it once
            tensor = _split_fused(config, fused_cache[entry.key], role)
        kind = expected[name].dtype
        # FP8 weights and their float32 scales keep their dtype; the rest takes the model's
        keep = kind in (FP8, torch.float32) and spec is not None and (
            kind == FP8 or name.endswith(".weight_scale_inv")
        )
        fresh[name] = tensor.to(device=device, dtype=kind if keep else dtype, copy=True)
        bad = int((~torch.isfinite(fresh[name].float())).sum())
        if bad:
            raise CheckpointError(
                f"tensor {name!r} holds {bad} non-finite value(s) of {tensor.numel()} "
                f"(corrupt weights, or out of range for {dtype})"
            )
    if "lm_head.weight" not in fresh:
        fresh["lm_head.weight"] = fresh["embed_tokens.weight"]
    model.load_state_dict(fresh, strict=True, assign=True)  # fuses the linear groups
    model.tie_weights_()
    if spec is not None:
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.dtype = dtype  # what its dequantized products run in
        model.quantization = spec
    report = LoadReport(
        files=tuple(p.name for p in files), tensors_loaded=len(fresh), ignored=ignored,
        directory=directory, token_ids=_token_ids(raw),
    )
    for what, count in ignored.items():
        log.info("ignored %d tensor(s) matching %s (not part of the text model)", count, what)
    model.load_report = report
    return model.eval()


def save_target(model: TargetModel, directory: Path, *, companions: bool = True) -> None:
    """Write ``model`` as a Hugging Face ``qwen3_5_text`` checkpoint (config + safetensors).

    Keys get the ``model.`` prefix of ``Qwen3_5ForCausalLM`` (``lm_head.weight`` is left
    out when tied). A Qwen3-Next model is written with the split projections, which is
    the same maths in the Qwen3.5 layout.

    A model read by :func:`load_target` keeps what makes it an LLM rather than weights:
    ``config.json`` carries the loaded one's special token ids, and with ``companions``
    the loaded directory's tokenizer, chat template and generation settings
    (:data:`COMPANION_FILES`, those it has) are copied beside the weights, so the saved
    directory (FP8-quantized, say) decodes, stops and chats as the loaded one did. A
    loaded directory that no longer exists is a :class:`CheckpointError` before anything
    is written (``companions=False`` writes the weights and config alone).
    """
    from safetensors.torch import save_file

    report = model.load_report
    source = report.directory if report is not None else None
    copies: list[Path] = []
    if companions and source is not None:
        if not source.is_dir():
            raise CheckpointError(
                f"the model was loaded from {str(source)!r}, which no longer exists: its "
                "tokenizer and generation files cannot be copied (save with "
                "companions=False to write the weights and config alone)"
            )
        if source.resolve() != directory.resolve():
            copies = [source / name for name in COMPANION_FILES if (source / name).is_file()]
    directory.mkdir(parents=True, exist_ok=True)
    hf = model.config.to_hf_config()
    if report is not None:
        hf.update(report.token_ids)
    if model.quantization is not None:
        hf["quantization_config"] = model.quantization.to_hf()
    (directory / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head.") else "model." + name
        # clone: grouped projections are views of one tensor (safetensors refuses shared memory)
        tensors[key] = tensor.detach().to("cpu").contiguous().clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for path in copies:
        shutil.copyfile(path, directory / path.name)
