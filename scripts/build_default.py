#!/usr/bin/env python3
"""Rebuild the embedded default pair from scratch: tokenizer, target, DFlash drafter.

The data is the Python standard library of the interpreter running this script (its
``.py`` files), which every machine with Python has. With fixed seeds the recipe

1. **data**: collects ``sysconfig.get_paths()["stdlib"]/**/*.py``, skipping
   ``site-packages`` / ``dist-packages``, ``__pycache__`` and the test directories
   (``test``, ``tests``, ``idle_test``: distributions ship them separately, so leaving them
   out keeps the data the same for every install of one Python version; ``--include-tests``
   keeps them), and files that are not UTF-8. It records the Python version, the file
   count, a SHA-256 of the sorted relative file list and one of the contents, and splits
   train / held-out **by file**: a file is held out when the first 8 hex digits of the
   SHA-256 of its relative path, as an integer, are < ``heldout_fraction`` × 16^8;
2. **tokenizer**: trains a byte-level BPE (``tokenizers``) on the train split, special
   tokens ``<|endoftext|>`` (EOS, id 0, also the separator between files) and ``<|mask|>``
   (the drafter's mask token, the last id: the mask id DFlash drafters default to);
3. **target**: trains a small model in the Qwen3.5 architecture with transformers'
   ``Qwen3_5ForCausalLM`` (Gated DeltaNet layers, a gated-attention layer every
   ``full_attention_interval``, tied embeddings) with bf16 autocast, AdamW, linear warm-up
   and cosine decay, on random windows of the train stream; saves a Hugging Face directory
   (``config.json``, bf16 ``model.safetensors``, ``tokenizer.json``,
   ``tokenizer_config.json``, ``generation_config.json`` with the EOS id);
4. **evaluation**: held-out perplexity of the saved (bf16) weights in float32, and a
   check that dflash loads the directory and its logits equal transformers';
5. **drafter**: ``python -m dflash.cli train-drafter`` on the same token streams (with
   ``--work W --resume``, a stopped stage continues from its last step checkpoint in ``W``
   and ends with the uninterrupted run's bytes);
6. **report**: ``loss_curves.png`` and ``summary.json`` (perplexity, τ, data hashes,
   timings).

Everything is written under ``--out``, every file ≤ 16 MiB (the checkpoint is sharded if
it would be larger). The step counts are arguments, never derived from the clock; the
recipe prints its measured throughput early, with the projected duration. On CUDA,
``torch.use_deterministic_algorithms(True, warn_only=True)`` is set (it warns about any
operation without a deterministic implementation) and attention, in the target and in the
drafter, runs on SDPA's math backend: the fused attention kernels' backward accumulates
with atomics. With these two the stages are deterministic on one GPU model and software
stack: BENCHMARKS.md records two runs of a stage with the same output bytes.

Usage::

    python3 scripts/build_default.py --out OUT                 # everything (GPU)
    python3 scripts/build_default.py --out OUT --skip-drafter  # data, tokenizer, target
    python3 scripts/build_default.py --out OUT2 --only-drafter --target-dir OUT/target
    python3 scripts/build_default.py --out OUT2 --only-drafter --target-dir OUT/target \
        --work W --resume      # the drafter stage, continued from its last checkpoint in W
    python3 scripts/build_default.py --out OUT --tiny          # CPU smoke run, ~1 minute
    python3 scripts/build_default.py --out OUT --set drafter_steps=8000   # one field changed
    python3 scripts/build_default.py --install-from OUT        # copy into dflash/data/default
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DATA = REPO / "dflash" / "data" / "default"
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and vocab_size - 1
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
MAX_FILE_BYTES = 16 * 2**20  # every output file
MAX_PAIR_BYTES = 24 * 2**20  # target + drafter as shipped
SHARD_SIZE = 15 * 2**20  # checkpoint shards (a little under the file limit)
TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
DRAFTER_FILES = ("config.json",)


class RecipeError(RuntimeError):
    """A stage that cannot run or whose result fails a check; the message says which."""


@dataclass(frozen=True)
class Recipe:
    """Every knob of the recipe (recorded in ``summary.json``)."""

    seed: int = 0
    heldout_fraction: float = 0.05
    include_tests: bool = False
    max_files: int | None = None  # --tiny: the first files of each split, by path
    max_file_bytes: int | None = None  # --tiny: skip larger files
    vocab_size: int = 4096
    # target (Qwen3.5 text architecture)
    hidden_size: int = 256
    num_layers: int = 8
    full_attention_interval: int = 4
    intermediate_size: int = 640
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    # target training (the shipped pair: these defaults; BENCHMARKS.md)
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_windows: int = 32  # held-out windows for the curve (the final eval uses all)
    final_eval_max_tokens: int = 2_000_000
    # drafter (dflash train-drafter; the shipped drafter: these defaults)
    drafter_steps: int = 10500
    drafter_batch_size: int = 128
    drafter_seq_len: int = 256
    drafter_prompt_len: int = 64  # teacher prompts and held-out eval prompts
    drafter_lr: float = 1e-3
    drafter_warmup: int = 200
    drafter_block_size: int = 16
    drafter_num_layers: int = 3
    drafter_eval_every: int = 2000
    drafter_save_every: int = 1000
    drafter_eval_prompts: int = 16
    drafter_eval_tokens: int = 128  # generated per held-out prompt when measuring τ
    drafter_teacher: str = "generate"  # train on the target's own greedy responses
    drafter_teacher_samples: int = 393216  # teacher responses generated once, then reused
    drafter_teacher_batch: int = 8192  # responses generated at once
    drafter_anchors: int = 32  # anchored blocks per sequence per step

TINY = Recipe(
    max_files=24,
    max_file_bytes=24_000,
    vocab_size=512,
    hidden_size=64,
    num_layers=4,
    full_attention_interval=2,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    max_position_embeddings=1024,
    steps=40,
    batch_size=4,
    seq_len=128,
    warmup=5,
    eval_every=20,
    eval_windows=4,
    final_eval_max_tokens=4096,
    drafter_steps=8,
    drafter_batch_size=2,
    drafter_seq_len=128,
    drafter_warmup=2,
    drafter_block_size=8,
    drafter_num_layers=1,
    drafter_eval_every=8,
    drafter_eval_prompts=2,
    drafter_teacher_samples=16,
    drafter_anchors=8,
    drafter_eval_tokens=16,
    drafter_prompt_len=32,
    drafter_save_every=0,
    drafter_teacher="data",  # the smoke run skips generating teacher responses
)


def log(msg: str) -> None:
    print(f"[build_default {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# -- stage 1: data ------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """The split corpus: sorted relative paths and their texts, plus its manifest."""

    train: tuple[tuple[str, str], ...]
    heldout: tuple[tuple[str, str], ...]
    manifest: dict[str, Any]


def is_heldout(relpath: str, fraction: float) -> bool:
    """The deterministic by-file split: a hash of the relative path, not its contents."""
    return int(sha256_hex(relpath.encode("utf-8"))[:8], 16) < fraction * 16**8


def stdlib_files(root: Path, include_tests: bool) -> Iterator[Path]:
    skip = EXCLUDED_DIRS if include_tests else EXCLUDED_DIRS | TEST_DIRS
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def collect_corpus(recipe: Recipe, root: Path | None = None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    if not root.is_dir():
        raise RecipeError(f"standard library directory {str(root)!r} does not exist")
    files: list[tuple[str, str]] = []
    skipped: list[str] = []
    for path in stdlib_files(root, recipe.include_tests):
        rel = path.relative_to(root).as_posix()
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        files.append((rel, text))
    files.sort()
    if not files:
        raise RecipeError(f"no .py files under {str(root)!r}")
    listing = "\n".join(rel for rel, _ in files).encode("utf-8")
    content = hashlib.sha256()
    for rel, text in files:
        content.update(rel.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    train = [f for f in files if not is_heldout(f[0], recipe.heldout_fraction)]
    heldout = [f for f in files if is_heldout(f[0], recipe.heldout_fraction)]
    if recipe.max_file_bytes is not None:  # --tiny: small files only (after the hashes)
        limit = recipe.max_file_bytes
        train = [f for f in train if len(f[1].encode("utf-8")) <= limit]
        heldout = [f for f in heldout if len(f[1].encode("utf-8")) <= limit]
    if recipe.max_files is not None:
        train = train[: recipe.max_files]
        heldout = heldout[: max(2, recipe.max_files // 6)]
    if not train or not heldout:
        raise RecipeError(
            f"the split left {len(train)} train and {len(heldout)} held-out files "
            f"(heldout_fraction={recipe.heldout_fraction}); both must be non-empty"
        )
    skipped_dirs = EXCLUDED_DIRS if recipe.include_tests else EXCLUDED_DIRS | TEST_DIRS
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": str(root),
        "rule": (
            "*.py under stdlib_dir; skipped dirs: "
            + ", ".join(sorted(skipped_dirs))
            + "; non-UTF-8 files skipped; held out when int(sha256(relpath)[:8], 16) < "
            f"{recipe.heldout_fraction} * 16**8"
        ),
        "file_count": len(files),
        "file_list_sha256": sha256_hex(listing),
        "content_sha256": content.hexdigest(),
        "skipped_not_utf8": skipped,
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(len(t.encode("utf-8")) for _, t in train),
        "heldout_bytes": sum(len(t.encode("utf-8")) for _, t in heldout),
        "heldout_list": [rel for rel, _ in heldout],
        "train_list_sha256": sha256_hex("\n".join(r for r, _ in train).encode("utf-8")),
    }
    return Corpus(tuple(train), tuple(heldout), manifest)


# -- stage 2: tokenizer --------------------------------------------------------------------


def train_tokenizer(corpus: Corpus, recipe: Recipe) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size - 1,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text for _, text in corpus.train], trainer=trainer)
    tok.add_special_tokens([MASK_TOKEN])  # the last id: DFlash's default mask id
    eos, mask, size = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN), tok.get_vocab_size()
    if eos != 0 or mask != size - 1:
        raise RecipeError(f"special token ids: EOS {eos} (want 0), mask {mask} (want {size - 1})")
    return tok


def token_stream(tok: Any, files: Sequence[tuple[str, str]]) -> Any:
    """All files' ids in path order, each followed by EOS, as an int32 numpy array."""
    import numpy as np

    eos = tok.token_to_id(EOS_TOKEN)
    parts = []
    for enc in tok.encode_batch([text for _, text in files], add_special_tokens=False):
        parts.append(np.asarray([*enc.ids, eos], dtype=np.int32))
    return np.concatenate(parts)


def write_tokenizer_files(tok: Any, directory: Path, recipe: Recipe) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "mask_token": MASK_TOKEN,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": recipe.max_position_embeddings,
        },
    )


# -- stage 3: target -----------------------------------------------------------------------


def target_hf_config(recipe: Recipe, vocab_size: int) -> Any:
    import transformers

    layer_types = [
        "full_attention" if (i + 1) % recipe.full_attention_interval == 0 else "linear_attention"
        for i in range(recipe.num_layers)
    ]
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        layer_types=layer_types,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim,
        linear_num_key_heads=recipe.linear_num_key_heads,
        linear_num_value_heads=recipe.linear_num_value_heads,
        linear_key_head_dim=recipe.linear_key_head_dim,
        linear_value_head_dim=recipe.linear_value_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": recipe.rope_theta,
            "partial_rotary_factor": 0.25,
        },
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )


def lr_at(step: int, recipe: Recipe, base: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``base``, then cosine decay to ``min_lr_ratio × base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    floor = recipe.min_lr_ratio
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _autocast(device: str, enabled: bool) -> Any:
    import torch

    kind = "cuda" if device.startswith("cuda") else "cpu"
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=enabled)


def mean_loss(model: Any, windows: Any, device: str, bf16: bool, batch: int) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over ``windows`` [N, L+1]; and tokens scored."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            w = windows[i : i + batch].to(device)
            with _autocast(device, bf16):
                logits = model(input_ids=w[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += w[:, 1:].numel()
    return total / max(1, count), count


def heldout_windows(stream: Any, seq_len: int, max_tokens: int | None) -> Any:
    """Non-overlapping windows of ``seq_len + 1`` ids (each scores ``seq_len`` tokens)."""
    import torch

    data = torch.from_numpy(stream.astype("int64"))
    n = (len(data) - 1) // seq_len
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    if n < 1:
        raise RecipeError(f"held-out stream of {len(data)} tokens is shorter than seq_len+1")
    return torch.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


def train_target(
    recipe: Recipe,
    train_ids: Any,
    heldout_ids: Any,
    vocab_size: int,
    device: str,
    max_minutes: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Train the target; stop early with an error when its projected time is too long."""
    import torch
    import torch.nn.functional as F
    import transformers

    config = target_hf_config(recipe, vocab_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(recipe.seed)
    model = transformers.Qwen3_5ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    if 2 * n_params > MAX_FILE_BYTES and device != "cpu":
        log(f"note: {n_params:,} parameters are {2 * n_params / 2**20:.1f} MiB in bf16 (sharded)")
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    bf16 = device.startswith("cuda")
    # attention on SDPA's math backend: the fused kernels' backward is not deterministic
    from torch.nn.attention import SDPBackend, sdpa_kernel

    data = torch.from_numpy(train_ids.astype("int64")).to(device)
    span = recipe.seq_len + 1
    if len(data) <= span:
        raise RecipeError(f"train stream of {len(data)} tokens is shorter than seq_len+1={span}")
    eval_w = heldout_windows(heldout_ids, recipe.seq_len, recipe.eval_windows * recipe.seq_len)
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    offsets = torch.arange(span, device=device)
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    tokens_per_step = recipe.batch_size * recipe.seq_len
    t0 = time.perf_counter()
    measured: dict[str, float] = {}
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe, recipe.lr, recipe.warmup, recipe.steps)
        starts = torch.randint(0, len(data) - span, (recipe.batch_size,), generator=gen)
        batch = data[starts.to(device)[:, None] + offsets]
        with _autocast(device, bf16), sdpa_kernel(SDPBackend.MATH):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        if step % 10 == 0 or step == recipe.steps - 1:
            curve.append({"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"]})
        if step == min(29, recipe.steps - 1):  # throughput, measured early (not used to size)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            rate = (step + 1) * tokens_per_step / elapsed
            projected = recipe.steps * tokens_per_step / rate
            measured = {"tokens_per_s_early": rate, "projected_s": projected}
            log(
                f"target: {n_params:,} parameters; {rate:,.0f} tokens/s after {step + 1} steps;"
                f" {recipe.steps} steps projected to take {projected / 60:.1f} min"
            )
            if max_minutes is not None and projected > 60 * max_minutes:
                fits = int(60 * max_minutes * rate / tokens_per_step) // 100 * 100
                raise RecipeError(
                    f"{recipe.steps} target steps would take {projected / 60:.1f} min, over "
                    f"--max-train-minutes {max_minutes:g}; about --steps {fits} fit"
                )
        if (step + 1) % recipe.eval_every == 0 or step == recipe.steps - 1:
            model.eval()
            held, _ = mean_loss(model, eval_w, device, bf16, recipe.batch_size)
            model.train()
            evals.append({"step": step + 1, "heldout_loss": held})
            log(f"target step {step + 1}/{recipe.steps}: train loss {loss.item():.3f}, "
                f"held-out loss {held:.3f} (ppl {math.exp(held):.2f})")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    model.eval()
    info = {
        "parameters": n_params,
        "train_s": train_s,
        "tokens_seen": recipe.steps * tokens_per_step,
        "tokens_per_s": recipe.steps * tokens_per_step / train_s,
        "train_tokens": len(train_ids),
        "epochs": recipe.steps * tokens_per_step / len(train_ids),
        "curve": curve,
        "heldout_curve": evals,
        **measured,
    }
    return model, info


def save_target(model: Any, tok: Any, directory: Path, recipe: Recipe) -> None:
    import torch
    from transformers import GenerationConfig

    eos = tok.token_to_id(EOS_TOKEN)
    if directory.exists():
        shutil.rmtree(directory)
    model = model.to("cpu").to(torch.bfloat16)
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None
    )
    model.save_pretrained(str(directory), max_shard_size=SHARD_SIZE)
    write_tokenizer_files(tok, directory, recipe)


def evaluate_saved(
    directory: Path, heldout_ids: Any, recipe: Recipe, device: str
) -> dict[str, Any]:
    """Held-out perplexity of the saved bf16 weights, computed in float32."""
    import torch
    import transformers

    model = transformers.Qwen3_5ForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32
    ).to(device).eval()
    windows = heldout_windows(heldout_ids, recipe.seq_len, recipe.final_eval_max_tokens)
    loss, count = mean_loss(model, windows, device, False, recipe.batch_size)
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss), "heldout_tokens_scored": count}


def check_dflash_parity(directory: Path, heldout_ids: Any, n: int = 48) -> dict[str, Any]:
    """dflash's logits of the saved directory against transformers', float32 on CPU."""
    import torch
    import transformers

    from dflash.model import TargetModel

    ids = torch.from_numpy(heldout_ids[:n].astype("int64"))[None]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    with torch.inference_mode():
        ref = hf.eval()(input_ids=ids, use_cache=False).logits[0]
        ours = TargetModel.from_pretrained(directory, dtype=torch.float32, device="cpu")
        caches = ours.new_caches(max_len=n + 1)
        got, _ = ours(ids, caches, "prefill")
    diff = float((got[0] - ref).abs().max())
    same_argmax = bool((got[0].argmax(-1) == ref.argmax(-1)).all())
    return {"tokens": n, "max_abs_logit_diff": diff, "same_argmax": same_argmax}


# -- stage 5: drafter ----------------------------------------------------------------------


def drafter_command(
    recipe: Recipe, target_dir: Path, train_npy: Path, heldout_npy: Path, out: Path, device: str
) -> list[str]:
    return [
        sys.executable, "-m", "dflash.cli", "train-drafter",
        "--model", str(target_dir),
        "--data", str(train_npy),
        "--eval-data", str(heldout_npy),
        "--out", str(out),
        "--steps", str(recipe.drafter_steps),
        "--batch-size", str(recipe.drafter_batch_size),
        "--seq-len", str(recipe.drafter_seq_len),
        "--lr", str(recipe.drafter_lr),
        "--warmup", str(recipe.drafter_warmup),
        "--block-size", str(recipe.drafter_block_size),
        "--num-layers", str(recipe.drafter_num_layers),
        "--eval-every", str(recipe.drafter_eval_every),
        "--eval-prompts", str(recipe.drafter_eval_prompts),
        "--eval-tokens", str(recipe.drafter_eval_tokens),
        "--teacher", recipe.drafter_teacher,
        "--teacher-samples", str(recipe.drafter_teacher_samples),
        "--anchors", str(recipe.drafter_anchors),
        "--prompt-len", str(recipe.drafter_prompt_len),
        "--teacher-batch", str(recipe.drafter_teacher_batch),
        "--save-every", str(recipe.drafter_save_every),
        "--seed", str(recipe.seed),
        "--device", "cuda" if device.startswith("cuda") else "cpu",
        "--dtype", "bfloat16" if device.startswith("cuda") else "float32",
    ]  # fmt: skip


def _records(node: Any, key: str) -> list[dict[str, Any]]:
    """Every dict under ``node`` holding a numeric ``key`` and a ``step``, in order."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if isinstance(node.get(key), (int, float)) and "step" in node:
            found.append(node)
        for value in node.values():
            found.extend(_records(value, key))
    elif isinstance(node, list):
        for value in node:
            found.extend(_records(value, key))
    return found


def drafter_summary(train_log: Any) -> dict[str, Any]:
    """τ (the last held-out evaluation), prompt-lookup's τ and the loss curve.

    ``train_log.json`` of ``dflash train-drafter`` holds ``loss``: ``[step, loss,
    accuracy]`` rows, ``eval``: ``{step, tau, ...}`` records and ``prompt_lookup_tau``;
    records of the form ``{step, loss}`` / ``{step, tau}`` anywhere are read as well.
    """
    rows = train_log.get("loss") if isinstance(train_log, dict) else None
    if isinstance(rows, list) and rows and all(isinstance(r, list) for r in rows):
        losses = [{"step": r[0], "loss": r[1]} for r in rows if len(r) >= 2]
    else:
        losses = [{"step": r["step"], "loss": r["loss"]} for r in _records(train_log, "loss")]
    taus = _records(train_log, "tau")
    held = [r for r in taus if isinstance(r.get("heldout_loss"), (int, float))]
    thinned = losses[:: max(1, len(losses) // 500)]  # at most ~500 points in the summary
    if losses and thinned[-1] is not losses[-1]:
        thinned.append(losses[-1])
    out: dict[str, Any] = {
        "loss_curve": thinned,
        "tau_curve": [{"step": r["step"], "tau": r["tau"]} for r in taus],
        "heldout_loss_curve": [
            {"step": r["step"], "heldout_loss": r["heldout_loss"]} for r in held
        ],
    }
    if taus:
        out["tau"] = taus[-1]["tau"]
        out["final_eval"] = {k: v for k, v in taus[-1].items() if isinstance(v, (int, float))}
    if isinstance(train_log, dict):
        for key in ("prompt_lookup_tau", "gamma", "seconds", "resumed_at"):
            if key in train_log:
                out[key] = train_log[key]
    return out


def run_drafter(
    recipe: Recipe,
    target_dir: Path,
    corpus: Corpus,
    work: Path,
    out: Path,
    device: str,
    extra: Sequence[str] = (),
    resume: bool = False,
) -> dict[str, Any]:
    """Train the drafter in ``work`` (its step checkpoints stay there); copy the result.

    With ``resume``, a run stopped after a step checkpoint under ``work/drafter`` continues
    from that checkpoint (``train-drafter --resume``: the weights, the optimizer's state and
    the step; each step's batch is drawn from a generator seeded by the step, so the result
    is the uninterrupted run's); without a checkpoint it starts afresh."""
    import numpy as np

    from dflash.model.tokenizer import TextTokenizer
    from dflash.training.loop import latest_checkpoint

    tok = TextTokenizer.from_file(target_dir / "tokenizer.json")._backend
    work.mkdir(parents=True, exist_ok=True)
    train_npy, heldout_npy = work / "train.npy", work / "heldout.npy"
    np.save(train_npy, token_stream(tok, corpus.train))
    np.save(heldout_npy, token_stream(tok, corpus.heldout))
    trained = work / "drafter"
    cmd = [*drafter_command(recipe, target_dir, train_npy, heldout_npy, trained, device), *extra]
    last = latest_checkpoint(trained) if resume else None
    if last is None and trained.exists():
        shutil.rmtree(trained)
    log("drafter: " + " ".join(cmd) + (f" --resume  # from {last}" if last else ""))
    run = [*cmd, "--resume"] if last else cmd
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    done = subprocess.run(run, env=env, cwd=str(REPO), check=False)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise RecipeError(f"dflash train-drafter exited with status {done.returncode}")
    log_path = trained / "train_log.json"
    if not log_path.is_file():
        raise RecipeError(f"dflash train-drafter wrote no {str(log_path)!r}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in shipped_files(trained, DRAFTER_FILES):
        shutil.copyfile(f, out / f.name)
    shutil.copyfile(log_path, out / "train_log.json")
    summary = drafter_summary(json.loads(log_path.read_text(encoding="utf-8")))
    summary["train_s"] = elapsed
    summary["command"] = ["python", *cmd[1:]]
    return summary


# -- stage 6: report -----------------------------------------------------------------------


def plot_curves(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no loss_curves.png")
        return False
    target = summary.get("target", {})
    drafter = summary.get("drafter", {})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    if target.get("curve"):
        ax.plot([r["step"] for r in target["curve"]], [r["loss"] for r in target["curve"]],
                label="train (batch)", lw=0.8)
    if target.get("heldout_curve"):
        ax.plot([r["step"] for r in target["heldout_curve"]],
                [r["heldout_loss"] for r in target["heldout_curve"]], "o-", label="held-out")
    ax.set(title="target (Qwen3.5 architecture)", xlabel="step", ylabel="cross-entropy (nats)")
    if target.get("curve") or target.get("heldout_curve"):
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no target trained in this run", ha="center", va="center",
                transform=ax.transAxes)
    ax = axes[1]
    if drafter.get("loss_curve"):
        ax.plot([r["step"] for r in drafter["loss_curve"]],
                [r["loss"] for r in drafter["loss_curve"]], lw=0.8, label="train loss")
        ax.set(ylabel="loss")
    if drafter.get("heldout_loss_curve"):
        ax.plot([r["step"] for r in drafter["heldout_loss_curve"]],
                [r["heldout_loss"] for r in drafter["heldout_loss_curve"]], "s-", color="C1",
                label="held-out loss")
    if drafter.get("tau_curve"):
        tw = ax.twinx()
        tw.plot([r["step"] for r in drafter["tau_curve"]],
                [r["tau"] for r in drafter["tau_curve"]], "o-", color="C3", label="held-out τ")
        tw.set_ylabel("τ (accepted tokens per step)")
        tw.legend(loc="upper right")
    if not drafter.get("loss_curve") and not drafter.get("tau_curve"):
        ax.text(0.5, 0.5, "no drafter in this run", ha="center", va="center",
                transform=ax.transAxes)
    ax.set(title="DFlash drafter", xlabel="step")
    if drafter.get("loss_curve"):
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def check_file_sizes(out: Path) -> None:
    big = [(p, p.stat().st_size) for p in out.rglob("*") if p.is_file()]
    big = [(p, s) for p, s in big if s > MAX_FILE_BYTES]
    if big:
        p, s = big[0]
        raise RecipeError(f"{str(p)!r} is {s / 2**20:.1f} MiB, over the 16 MiB file limit")


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


# -- install ---------------------------------------------------------------------------------


def shipped_files(directory: Path, names: Sequence[str]) -> list[Path]:
    """The files of a built part that are shipped (weights: single file or index + shards)."""
    files = [directory / n for n in names if (directory / n).is_file()]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        files += [index, *(directory / s for s in shards)]
    elif (directory / "model.safetensors").is_file():
        files.append(directory / "model.safetensors")
    else:
        raise RecipeError(f"{str(directory)!r} holds no model.safetensors (or index)")
    return files


def install(source: Path, dest: Path = PACKAGE_DATA) -> None:
    """Copy a build's shipped files into the package data (``dflash/data/default``)."""
    parts = {
        "target": shipped_files(source / "target", TARGET_FILES),
        "drafter": shipped_files(source / "drafter", DRAFTER_FILES),
    }
    for part, need in (("target", ("config.json", "tokenizer.json", "generation_config.json")),
                       ("drafter", ("config.json",))):
        names = {p.name for p in parts[part]}
        missing = [n for n in need if n not in names]
        if missing:
            raise RecipeError(f"{str(source / part)!r} lacks {', '.join(missing)}")
    total = sum(p.stat().st_size for files in parts.values() for p in files)
    if total > MAX_PAIR_BYTES:
        raise RecipeError(f"the pair is {total / 2**20:.1f} MiB, over the 24 MiB limit")
    for part, files in parts.items():
        target = dest / part
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for f in files:
            shutil.copyfile(f, target / f.name)  # contents only: package files get 0644
    if (source / "summary.json").is_file():
        shutil.copyfile(source / "summary.json", dest / "build_summary.json")
    log(f"installed {total / 2**20:.2f} MiB into {dest}")


# -- driver ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="output directory (created)")
    p.add_argument("--tiny", action="store_true", help="tiny CPU smoke run of every stage")
    p.add_argument("--skip-drafter", action="store_true", help="stop after the target")
    p.add_argument("--only-drafter", action="store_true",
                   help="train only the drafter, for the target in --target-dir")
    p.add_argument("--target-dir", type=Path, default=None,
                   help="--only-drafter: the built target (default: OUT/target)")
    p.add_argument("--install-from", type=Path, default=None,
                   help="copy a finished build (OUT) into dflash/data/default and exit")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--work", type=Path, default=None,
                   help="scratch directory for token files (default: a temporary directory)")
    p.add_argument("--resume", action="store_true",
                   help="continue the drafter stage from its last step checkpoint under "
                   "WORK/tokens/drafter (needs --work; without a checkpoint it starts afresh)")
    p.add_argument("--stdlib", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="target training steps")
    p.add_argument("--drafter-steps", type=int, default=None)
    p.add_argument("--max-train-minutes", type=float, default=None,
                   help="fail after 30 steps when the target's projected training time is "
                   "longer (the step count itself never depends on the clock)")
    p.add_argument("--drafter-extra", default="",
                   help="extra train-drafter arguments, e.g. \"--teacher data\" (recorded)")
    p.add_argument("--include-tests", action="store_true",
                   help="keep the standard library's test directories in the data")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one recipe field (repeatable; recorded in summary.json), "
                   "e.g. --set drafter_batch_size=128")
    return p.parse_args(argv)


def _field_value(name: str, text: str, default: Any) -> Any:
    """``text`` parsed as the type of the recipe field ``name`` (its default's type)."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if default is None:  # the optional limits (max_files, max_file_bytes)
            return None if text.lower() == "none" else int(text)
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(
            type(default), "an integer or none"
        )
        raise RecipeError(f"--set {name}={text}: not {kind}") from None
    return text


#: numeric recipe fields that may be 0 (every other one must be > 0)
_ZERO_OK = frozenset(
    {"seed", "min_lr_ratio", "warmup", "weight_decay", "drafter_warmup",
     "drafter_eval_every", "drafter_save_every"}
)  # fmt: skip


def recipe_from(args: argparse.Namespace) -> Recipe:
    recipe = TINY if args.tiny else Recipe()
    changes: dict[str, Any] = {}
    for name in ("seed", "steps", "drafter_steps"):
        value = getattr(args, name)
        if value is not None:
            least = 0 if name in _ZERO_OK else 1  # the --set rule for integers
            if value < least:
                raise RecipeError(f"--{name.replace('_', '-')} must be >= {least} (got {value})")
            changes[name] = value
    if args.include_tests:
        changes["include_tests"] = True
    fields = asdict(recipe)
    for item in args.set:
        name, eq, text = item.partition("=")
        if not eq or name not in fields:
            known = ", ".join(sorted(fields))
            raise RecipeError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {known}")
        value = _field_value(name, text, fields[name])
        if name == "drafter_teacher" and value not in ("generate", "data"):
            raise RecipeError(f"--set {item}: drafter_teacher is generate or data")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if name in _ZERO_OK and value < 0:
                raise RecipeError(f"--set {item}: must be >= 0")
            if name not in _ZERO_OK and value <= 0:
                raise RecipeError(f"--set {item}: must be > 0")
        changes[name] = value
    return replace(recipe, **changes)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.install_from is not None:
        install(args.install_from)
        return 0
    if args.out is None:
        raise RecipeError("--out is required (or --install-from)")
    if args.skip_drafter and args.only_drafter:
        raise RecipeError("--skip-drafter and --only-drafter exclude each other")
    if args.resume and (args.work is None or args.skip_drafter):
        raise RecipeError("--resume continues the drafter stage in --work: give --work, "
                          "without --skip-drafter")
    try:  # fail before any training when dflash (the parity check, the drafter) cannot run
        import dflash.cli
        import dflash.model
    except ImportError as exc:
        raise RecipeError(
            f"cannot import dflash ({exc}); run from the repository with its dependencies "
            "(pydantic, safetensors, tokenizers) installed, or PYTHONPATH set"
        ) from exc
    if not args.skip_drafter and "train-drafter" not in dflash.cli.COMMANDS:
        raise RecipeError("this dflash has no train-drafter command: pass --skip-drafter")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch

    recipe = recipe_from(args)
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    seed_everything(recipe.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-build-"))
    target_dir = args.target_dir or out / "target"
    summary_path = out / "summary.json"
    previous = target_dir.parent / "summary.json"
    summary: dict[str, Any] = {}
    for path in (previous, summary_path) if args.only_drafter else ():
        if path.is_file():
            summary.update(json.loads(path.read_text(encoding="utf-8")))
    timings: dict[str, float] = summary.get("timings", {})
    t = time.perf_counter()
    corpus = collect_corpus(recipe, args.stdlib)
    timings["data_s"] = time.perf_counter() - t
    manifest = corpus.manifest
    log(f"data: Python {manifest['python_version']}, {manifest['file_count']} files "
        f"({manifest['train_files']} train / {manifest['heldout_files']} held out), "
        f"file list sha256 {manifest['file_list_sha256'][:16]}…")
    if args.only_drafter:
        old = summary.get("data", {}).get("file_list_sha256")
        if old is not None and old != manifest["file_list_sha256"]:
            raise RecipeError(
                f"this interpreter's standard library (file list sha256 "
                f"{manifest['file_list_sha256'][:16]}…) is not the one the target was "
                f"trained on ({old[:16]}…): run the drafter stage with the same Python"
            )
    summary.update(
        {
            "recipe": asdict(recipe),
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "tokenizers": __import__("tokenizers").__version__,
            },
            "data": {k: v for k, v in manifest.items() if k != "heldout_list"},
        }
    )
    write_json(out / "data_manifest.json", manifest)
    if not args.only_drafter:
        t = time.perf_counter()
        tok = train_tokenizer(corpus, recipe)
        train_ids = token_stream(tok, corpus.train)
        heldout_ids = token_stream(tok, corpus.heldout)
        timings["tokenizer_s"] = time.perf_counter() - t
        summary["tokenizer"] = {
            "vocab_size": tok.get_vocab_size(),
            "special_tokens": {s: tok.token_to_id(s) for s in SPECIAL_TOKENS},
            "train_tokens": len(train_ids),
            "heldout_tokens": len(heldout_ids),
            "bytes_per_token_train": manifest["train_bytes"] / len(train_ids),
        }
        log(f"tokenizer: {tok.get_vocab_size()} ids; {len(train_ids):,} train / "
            f"{len(heldout_ids):,} held-out tokens")
        model, info = train_target(
            recipe, train_ids, heldout_ids, tok.get_vocab_size(), device, args.max_train_minutes
        )
        timings["target_train_s"] = info["train_s"]
        save_target(model, tok, target_dir, recipe)
        del model
        t = time.perf_counter()
        info.update(evaluate_saved(target_dir, heldout_ids, recipe, device))
        timings["target_eval_s"] = time.perf_counter() - t
        info["parity"] = check_dflash_parity(target_dir, heldout_ids)
        info["bytes"] = dir_bytes(target_dir)
        info["tokenizer_sha256"] = sha256_hex((target_dir / "tokenizer.json").read_bytes())
        summary["target"] = info
        log(f"target: held-out perplexity {info['heldout_ppl']:.3f} over "
            f"{info['heldout_tokens_scored']:,} tokens; dflash vs transformers max |Δlogit| "
            f"{info['parity']['max_abs_logit_diff']:.2e}")
        if info["parity"]["max_abs_logit_diff"] > 1e-3 or not info["parity"]["same_argmax"]:
            write_json(summary_path, summary)
            raise RecipeError(f"dflash's logits differ from transformers': {info['parity']}")
    if not args.skip_drafter:
        if not (target_dir / "config.json").is_file():
            raise RecipeError(f"no target at {str(target_dir)!r} (build it first)")
        extra = shlex.split(args.drafter_extra)
        drafter = run_drafter(
            recipe, target_dir, corpus, work / "tokens", out / "drafter", device, extra,
            resume=args.resume,
        )
        timings["drafter_train_s"] = drafter["train_s"]
        drafter["bytes"] = dir_bytes(out / "drafter")
        summary["drafter"] = drafter
        log(f"drafter: held-out τ {drafter.get('tau', 'not reported')} (prompt-lookup "
            f"{drafter.get('prompt_lookup_tau', 'not reported')})")
    summary["timings"] = timings
    write_json(summary_path, summary)
    summary["plot"] = plot_curves(summary, out / "loss_curves.png")
    write_json(summary_path, summary)
    check_file_sizes(out)
    log(f"done: {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RecipeError as exc:
        print(f"build_default: error: {exc}", file=sys.stderr)
        sys.exit(2)
