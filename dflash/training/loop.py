"""``train_drafter``: train a DFlash drafter for a frozen target (GPU, or CPU for small runs).

Recipe (the DFlash paper's, as SpecForge implements it): teacher sequences (the target's
own greedy responses to data prompts, or raw data), each step a batch of sequences whose
tap features the frozen target computes without gradients, ``anchors`` random anchored
blocks per sequence trained in one forward (:mod:`objective`), position-decayed
cross-entropy, AdamW with linear warm-up then cosine decay to 0, gradient clipping, bf16
autocast on CUDA (float32 master weights), the blocks' attention as plain matmuls and a
float32 softmax, block by block (:func:`dflash.model.drafters.dflash_layers.
blocked_attention`: a deterministic backward; on CUDA torch's deterministic algorithms are
on for the run).

Outputs under ``out``: the drafter in z-lab's format (``config.json`` +
``model.safetensors``), ``train_log.json`` (loss curve; held-out τ and held-out loss per
evaluation), and
``checkpoints/step-NNNNNN/`` (the drafter in z-lab's format plus ``trainer_state.json`` and
``trainer_state.safetensors``: float32 master weights and AdamW moments as plain tensors,
nothing pickled), from which ``resume=True`` continues.  τ is the mean accepted length
per step (bonus token included) of real speculative decoding (:func:`dflash.execution.
generate`) with the drafter on held-out prompts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash.errors import param as named
from dflash.model import TargetModel

if TYPE_CHECKING:
    from dflash.execution import ShardedTarget, ShardPlan
from dflash.model.drafters import (
    DFlash2Config,
    DFlashConfig,
    DFlashDrafter,
    Drafter,
    PromptLookupDrafter,
)
from dflash.model.drafters.dflash_layers import math_attention
from dflash.training.data import (
    DataError,
    Encoder,
    TrainingSet,
    data_set,
    read_documents,
    teacher_set,
    windows,
)
from dflash.training.objective import block_loss, default_gamma, sample_anchors

TEACHER_MODES = ("generate", "data")
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
TEACHER_FILE = "teacher_tokens.npy"


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs (``dflash train-drafter`` fills it from flags)."""

    model: str  # checkpoint directory or a built-in name ("tiny", "nine-b-shape")
    data: tuple[str, ...]
    out: str
    eval_data: tuple[str, ...] = ()
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 6e-4
    warmup: int = 0  # steps; 0: 4 % of the run
    block_size: int = 16
    num_layers: int = 1
    format: str = "dflash"  # "dflash" (z-lab's v1) or "dflash2" (convolutions, selector)
    anchors: int = 32  # anchored blocks per sequence per step
    gamma: float | None = None  # None: default_gamma(block_size)
    teacher: str = "generate"
    teacher_samples: int = 0  # sequences in the teacher pool; 0: min(steps*batch, 4096)
    prompt_len: int = 0  # teacher prompt tokens; 0: seq_len // 4
    teacher_batch: int = 128
    eval_every: int = 0  # 0: 10 evaluations over the run
    eval_prompts: int = 8
    eval_tokens: int = 64
    save_every: int = 0  # 0: every evaluation
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mask_token_id: int | None = None
    target_layers: tuple[int, ...] = ()  # taps (z-lab's target_layer_ids); () = z-lab's default
    seed: int = 0
    device: str = "cpu"
    dtype: str = "bfloat16"  # target dtype and autocast dtype on CUDA; float32 on CPU
    resume: bool = False
    progress: bool = True


@dataclass
class TrainResult:
    out: Path
    steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_loss(self) -> float:
        return self.losses[-1][1] if self.losses else math.nan


def lr_at(step: int, cfg: TrainConfig, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to 0."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    span = max(1, cfg.steps - warmup)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span)))


def _check(cfg: TrainConfig) -> None:
    positive = {
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "num_layers": cfg.num_layers,
        "anchors": cfg.anchors,
        "eval_prompts": cfg.eval_prompts,
        "eval_tokens": cfg.eval_tokens,
        "teacher_batch": cfg.teacher_batch,
    }
    for name, value in positive.items():
        if value < 1:
            raise DataError(f"{named(name)} must be >= 1 (got {value})")
    for name, value in (
        ("warmup", cfg.warmup),
        ("eval_every", cfg.eval_every),
        ("save_every", cfg.save_every),
        ("teacher_samples", cfg.teacher_samples),
        ("prompt_len", cfg.prompt_len),
    ):
        if value < 0:
            raise DataError(f"{named(name)} must be >= 0 (got {value})")
    if cfg.block_size < 2:
        raise DataError(f"{named('block_size')} must be >= 2 (got {cfg.block_size})")
    if not cfg.lr > 0:
        raise DataError(f"{named('lr')} must be > 0 (got {cfg.lr})")
    if cfg.gamma is not None and not cfg.gamma > 0:
        raise DataError(f"{named('gamma')} must be > 0 (got {cfg.gamma})")
    if cfg.format not in DRAFTER_FORMATS:
        raise DataError(
            f"{named('format')} must be one of {list(DRAFTER_FORMATS)} (got {cfg.format!r})"
        )
    if cfg.teacher not in TEACHER_MODES:
        raise DataError(
            f"{named('teacher')} must be one of {list(TEACHER_MODES)} (got {cfg.teacher!r})"
        )
    if cfg.dtype not in ("bfloat16", "float32"):
        raise DataError(f"{named('dtype')} must be bfloat16 or float32 (got {cfg.dtype!r})")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise DataError(f"{named('device')} {cfg.device!r} is not available (no CUDA)")
    if not (cfg.device == "cpu" or cfg.device.startswith("cuda")):
        raise DataError(f"{named('device')} must be cpu or cuda[:N] (got {cfg.device!r})")
    if not cfg.data:
        raise DataError("'data' must name at least one file or directory")


def load_target(cfg: TrainConfig) -> TargetModel:
    """The frozen target (no gradients, eval mode) on the training device."""
    from dflash.model.catalog import build_model

    dtype = torch.float32 if cfg.device == "cpu" or cfg.dtype == "float32" else torch.bfloat16
    model = build_model(cfg.model, seed=0, dtype=dtype, device=cfg.device)
    return model.eval().requires_grad_(False)


def drafter_config(cfg: TrainConfig, model: TargetModel) -> DFlashConfig:
    """A drafter with the target's attention shape; z-lab's default taps unless given. A
    DFlash2 one (``format="dflash2"``) adds the published drafters' convolution and
    selector settings (:data:`DFLASH2_DEFAULTS`), the group size and rank fitted to small
    targets (a group of 16 channels where it divides the width, rank at most the width)."""
    v1 = _v1_config(cfg, model)
    if cfg.format == "dflash":
        return v1
    h = v1.hidden_size
    group = next(g for g in (DFLASH2_DEFAULTS["conv_group_size"], 8, 4, 2, 1) if h % g == 0)
    return DFlash2Config.model_validate({
        **v1.model_dump(), **DFLASH2_DEFAULTS, "conv_group_size": group,
        "selector_rank": min(DFLASH2_DEFAULTS["selector_rank"], h),
        "selector_top_k": min(DFLASH2_DEFAULTS["selector_top_k"], v1.vocab_size),
    })


#: the drafter formats ``train_drafter`` writes
DRAFTER_FORMATS = ("dflash", "dflash2")
#: a DFlash2 drafter's convolution and selector settings (the published drafters')
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                    "selector_top_k": 16}


def _v1_config(cfg: TrainConfig, model: TargetModel) -> DFlashConfig:
    tc = model.config
    return DFlashConfig.for_target(
        hidden_size=tc.hidden_size,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=tuple(cfg.target_layers) or None,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta,
        max_position_embeddings=tc.max_position_embeddings,
    )


def _features(
    model: TargetModel, ids: torch.Tensor, taps: Sequence[int], caches: Any
) -> torch.Tensor:
    """[N, S, len(taps)*H] tap hidden states of the frozen target (no gradients)."""
    with torch.no_grad():
        _, tapped = model(ids, caches, "prefill", taps=taps)
    return torch.cat([tapped[t] for t in taps], dim=-1)


def _eval_target(
    model: TargetModel, prompts: Sequence[list[int]], tokens: int, block_size: int
) -> tuple[ShardPlan, ShardedTarget]:
    """One target for every held-out prompt (its CUDA graphs are captured once), verifying
    every draft whole: τ at a block size is measured without CPU verify windows."""
    from dflash.execution import plan_shards
    from dflash.execution.run import spec_target

    plan = plan_shards(model.config.num_hidden_layers, str(model.embed_tokens.weight.device))
    longest = max((len(p) for p in prompts), default=1)
    return plan, spec_target(model, plan, longest, tokens, block_size)


def evaluate(
    model: TargetModel, drafter: DFlashDrafter, prompts: Sequence[list[int]], tokens: int
) -> dict[str, float]:
    """τ (mean accepted length per step, bonus included) of real speculative decoding."""

    def fresh() -> Drafter:
        drafter.reset()
        return drafter

    return speculative_scores(model, fresh, prompts, tokens, drafter.config.block_size)


def prompt_lookup_tau(
    model: TargetModel, prompts: Sequence[list[int]], tokens: int, block_size: int
) -> float:
    """:func:`evaluate`'s τ for prompt-lookup drafting of ``block_size``-token blocks."""
    return speculative_scores(model, PromptLookupDrafter, prompts, tokens, block_size)["tau"]


def speculative_scores(
    model: TargetModel,
    new_drafter: Callable[[], Drafter],
    prompts: Sequence[list[int]],
    tokens: int,
    block_size: int,
) -> dict[str, float]:
    """τ, acceptance rate and steps of real speculative decoding of ``tokens`` tokens after
    each prompt, ``new_drafter()`` drafting each one (every draft verified whole)."""
    from dflash.execution import generate

    plan, target = _eval_target(model, prompts, tokens, block_size)
    steps = accepted = 0
    for prompt in prompts:
        r = generate(
            model, new_drafter(), prompt, plan=plan, max_new_tokens=tokens,
            block_size=block_size, target=target, verify_window="full",
        )
        steps += r.steps
        accepted += r.accepted_tokens
    return {
        "tau": (accepted + steps) / steps if steps else 0.0,
        "acceptance_rate": accepted / (steps * (block_size - 1)) if steps else 0.0,
        "steps": float(steps),
    }


@torch.no_grad()
def heldout_loss(
    model: TargetModel,
    drafter: DFlashDrafter,
    held: TrainingSet,
    *,
    anchors: int,
    gamma: float,
    batch: int,
    seed: int,
) -> dict[str, float]:
    """The training objective on held-out sequences, same anchors every evaluation.

    The training loss alone cannot tell learning from memorising the teacher pool; this is
    the number that can (its anchors come from ``seed``, so evaluations compare)."""
    total = weight = right = counted = 0.0
    seq_len = held.tokens.shape[1]
    b = drafter.config.block_size
    gen = torch.Generator().manual_seed(seed)
    caches: dict[int, Any] = {}
    for lo in range(0, held.tokens.shape[0], batch):
        ids = torch.as_tensor(held.tokens[lo : lo + batch], device=drafter.device)
        rows = ids.shape[0]
        if rows not in caches:
            caches[rows] = model.new_caches(max_len=seq_len, max_draft=1, batch=rows)
        picked = sample_anchors(held.label_start, seq_len, b, anchors, rows, gen)
        feats = _features(model, ids, drafter.config.target_layer_ids, caches[rows])
        result = block_loss(drafter, ids, feats, picked, gamma)
        total += float(result.loss) * rows
        weight += rows
        right += result.accuracy * result.tokens
        counted += result.tokens
    return {"heldout_loss": total / weight, "heldout_accuracy": right / max(counted, 1.0)}


def _eval_drafter(trained: DFlashDrafter, model: TargetModel) -> DFlashDrafter:
    """A copy in the target's dtype, rounded through bf16 as the saved checkpoint is."""
    embed, head = model.embed_tokens.weight, model.head_weight()
    copy = DFlashDrafter.random(trained.config, embed, head, seed=0)
    with torch.no_grad():
        for name, param in copy.state_dict().items():
            param.copy_(trained.state_dict()[name].to(torch.bfloat16))
    return copy


class _Progress:
    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = enabled and stream.isatty()
        self.every = max(1, total // 20)

    def update(self, step: int, loss: float, tok_s: float, lr: float) -> None:
        if not self.enabled:
            return
        text = f"step {step}/{self.total}  loss {loss:.4f}  {tok_s:,.0f} tokens/s  lr {lr:.2e}"
        if self.tty:
            width = 30
            filled = width * step // max(1, self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}   ")
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(f"dflash train-drafter: {text}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + f"dflash train-drafter: {text}\n")
            self.stream.flush()


def _save_state(
    directory: Path,
    drafter: DFlashDrafter,
    opt: torch.optim.AdamW,
    step: int,
    log: dict[str, Any],
) -> None:
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    drafter.save_pretrained(tmp)
    tensors: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in drafter.named_parameters()}
    for name, param in drafter.named_parameters():
        tensors[f"param.{name}"] = param.detach().float().cpu().contiguous()
    for group in opt.param_groups:
        for param in group["params"]:
            state = opt.state.get(param)
            if not state:
                continue
            name = names[id(param)]
            tensors[f"exp_avg.{name}"] = state["exp_avg"].detach().float().cpu().contiguous()
            tensors[f"exp_avg_sq.{name}"] = state["exp_avg_sq"].detach().float().cpu().contiguous()
            tensors[f"step.{name}"] = torch.as_tensor(float(state["step"])).reshape(1)
    save_file(tensors, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps({"step": step, "log": log}, indent=2) + "\n")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def _load_state(
    directory: Path, drafter: DFlashDrafter, opt: torch.optim.AdamW
) -> tuple[int, dict[str, Any]]:
    meta = json.loads((directory / STATE_JSON).read_text())
    tensors = load_file(str(directory / STATE_TENSORS))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            param.copy_(tensors[f"param.{name}"])
    for name, param in drafter.named_parameters():
        if f"exp_avg.{name}" in tensors:
            opt.state[param] = {
                "step": torch.tensor(float(tensors[f"step.{name}"][0])),
                "exp_avg": tensors[f"exp_avg.{name}"].to(param.device),
                "exp_avg_sq": tensors[f"exp_avg_sq.{name}"].to(param.device),
            }
    return int(meta["step"]), dict(meta["log"])


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step-[0-9]*"))
    found = [p for p in found if not p.name.endswith(".tmp") and (p / STATE_JSON).is_file()]
    return found[-1] if found else None


HELDOUT_SEQUENCES = 256  # held-out sequences for the held-out loss (at most)


def _prompt_len(cfg: TrainConfig) -> int:
    """Teacher prompt tokens (and held-out prompt tokens): ``prompt_len`` or a quarter."""
    return cfg.prompt_len or max(1, cfg.seq_len // 4)


def _sequences(
    cfg: TrainConfig, model: TargetModel, docs: list[np.ndarray], count: int, seed: int
) -> TrainingSet:
    """``count`` sequences of ``docs`` as ``cfg.teacher`` makes them: the target's greedy
    responses to data prompts, or raw data windows."""
    if cfg.teacher == "data":
        return data_set(docs, seq_len=cfg.seq_len, count=count, seed=seed)
    return teacher_set(
        model,
        docs,
        seq_len=cfg.seq_len,
        prompt_len=_prompt_len(cfg),
        count=count,
        seed=seed,
        batch=cfg.teacher_batch,
    )


def _heldout_set(cfg: TrainConfig, model: TargetModel, eval_docs: list[np.ndarray]) -> TrainingSet:
    """Held-out sequences made the way the training set is."""
    count = min(HELDOUT_SEQUENCES, max(cfg.batch_size, cfg.eval_prompts * 16))
    return _sequences(cfg, model, eval_docs, count, cfg.seed + 2)


def _training_set(
    cfg: TrainConfig,
    model: TargetModel,
    docs: list[np.ndarray],
    out: Path,
    note: Callable[[str], None],
) -> TrainingSet:
    meta_path = out / (TEACHER_FILE + ".json")
    if cfg.resume and (out / TEACHER_FILE).is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return TrainingSet(
            np.load(out / TEACHER_FILE, allow_pickle=False), int(meta["label_start"])
        )
    count = cfg.teacher_samples or min(cfg.steps * cfg.batch_size, 4096)
    t0 = time.perf_counter()
    made = _sequences(cfg, model, docs, count, cfg.seed)
    if cfg.teacher != "data":
        note(
            f"generated {count} teacher responses of {cfg.seq_len - _prompt_len(cfg)} tokens "
            f"in {time.perf_counter() - t0:.1f} s"
        )
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / TEACHER_FILE, made.tokens, allow_pickle=False)
    meta_path.write_text(json.dumps({"label_start": made.label_start}) + "\n")
    return made


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    """torch's deterministic algorithms (warn-only) inside the block when ``enabled``;
    the previous setting afterwards."""
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if enabled:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def train_drafter(cfg: TrainConfig, *, stream: TextIO | None = None) -> TrainResult:
    """Train a DFlash drafter as the module doc describes; returns the curves.

    On CUDA, sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless it is set (cuBLAS is
    deterministic only with a fixed workspace; it takes effect when this process has not
    used cuBLAS yet, else torch warns once that a product was not deterministic)."""
    _check(cfg)
    if cfg.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    out = Path(cfg.out)
    progress = _Progress(cfg.steps, stream or sys.stderr, cfg.progress)
    torch.manual_seed(cfg.seed)
    model = load_target(cfg)
    model_dir = Path(cfg.model) if Path(cfg.model).is_dir() else None
    encoder = Encoder(model_dir, model.config.vocab_size)
    docs = read_documents(cfg.data, encoder, model.config.vocab_size)
    if cfg.eval_data:
        eval_docs = read_documents(cfg.eval_data, encoder, model.config.vocab_size)
    else:  # hold out the last document(s), about a tenth of the tokens
        if len(docs) >= 2:
            eval_docs, docs = docs[-max(1, len(docs) // 10) :], docs[: -max(1, len(docs) // 10)]
        else:
            cut = int(docs[0].size * 0.9)
            eval_docs, docs = [docs[0][cut:]], [docs[0][:cut]]
    held = _heldout_set(cfg, model, eval_docs)
    eval_prompts = [
        list(map(int, w))
        for w in windows(eval_docs, _prompt_len(cfg), cfg.eval_prompts, cfg.seed + 1)
    ]
    config = drafter_config(cfg, model)
    embed, head = model.embed_tokens.weight, model.head_weight()
    drafter = DFlashDrafter.random(config, embed, head, cfg.seed, dtype=torch.float32)
    drafter.train().requires_grad_(True)
    opt = torch.optim.AdamW(
        drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    warmup = cfg.warmup or max(1, cfg.steps // 25)
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    save_every = cfg.save_every or eval_every
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    log: dict[str, Any] = {
        "config": asdict(cfg),
        "drafter": config.to_hf_dict(),
        "gamma": gamma,
        "loss": [],
        "eval": [],
    }
    start = 0
    if cfg.resume:
        last = latest_checkpoint(out)
        if last is None:
            raise DataError(f"--resume: no checkpoint under {str(out / 'checkpoints')!r}")
        start, log = _load_state(last, drafter, opt)
        log.setdefault("resumed_at", []).append(start)
        progress.note(f"resumed from {last} (step {start})")
    t0 = time.perf_counter()
    train = _training_set(cfg, model, docs, out, progress.note)
    timing = log.setdefault("seconds", {"teacher": 0.0, "train": 0.0, "eval": 0.0})
    timing["teacher"] += time.perf_counter() - t0
    if "prompt_lookup_tau" not in log:
        log["prompt_lookup_tau"] = prompt_lookup_tau(
            model, eval_prompts, cfg.eval_tokens, cfg.block_size
        )
    caches = model.new_caches(max_len=cfg.seq_len, max_draft=1, batch=cfg.batch_size)
    cuda = cfg.device.startswith("cuda")
    autocast = torch.autocast(
        "cuda", dtype=torch.bfloat16, enabled=cuda and cfg.dtype == "bfloat16"
    )
    # the blocks' attention is plain matmuls (a deterministic backward; any SDPA call in the
    # step runs on the math backend), and on CUDA torch's deterministic algorithms are on
    # for the run (warning on any op without)
    with _deterministic(cuda):
        t_last, tokens_since = time.perf_counter(), 0
        for step in range(start, cfg.steps):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            rows = torch.randint(0, train.tokens.shape[0], (cfg.batch_size,), generator=gen)
            ids = torch.as_tensor(train.tokens[rows.numpy()], device=cfg.device)
            anchors = sample_anchors(
                train.label_start, cfg.seq_len, cfg.block_size, cfg.anchors, cfg.batch_size, gen
            )
            feats = _features(model, ids, config.target_layer_ids, caches)
            lr = lr_at(step, cfg, warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            with autocast, math_attention():
                result = block_loss(drafter, ids, feats, anchors, gamma)
            opt.zero_grad(set_to_none=True)
            result.loss.backward()  # type: ignore[no-untyped-call]  # torch's stub is untyped
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            opt.step()
            loss = float(result.loss.detach())
            log["loss"].append([step + 1, loss, result.accuracy])
            tokens_since += cfg.batch_size * cfg.seq_len
            now = time.perf_counter()
            progress.update(step + 1, loss, tokens_since / max(now - t_last, 1e-9), lr)
            timing["train"] += now - t_last
            if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
                t_eval = time.perf_counter()
                drafter.eval()
                copy = _eval_drafter(drafter, model)
                scores = evaluate(model, copy, eval_prompts, cfg.eval_tokens)
                scores.update(
                    heldout_loss(
                        model, copy, held, anchors=cfg.anchors, gamma=gamma,
                        batch=cfg.batch_size, seed=cfg.seed + 3,
                    )
                )
                drafter.train()
                timing["eval"] += time.perf_counter() - t_eval
                log["eval"].append({"step": step + 1, "loss": loss, **scores})
                progress.note(
                    f"step {step + 1}: held-out tau {scores['tau']:.3f} "
                    f"(prompt-lookup {log['prompt_lookup_tau']:.3f}), held-out loss "
                    f"{scores['heldout_loss']:.4f} (training {loss:.4f})"
                )
            if (step + 1) % save_every == 0 or step + 1 == cfg.steps:
                ckpt = out / "checkpoints" / f"step-{step + 1:06d}"
                _save_state(ckpt, drafter, opt, step + 1, log)
                for old in sorted((out / "checkpoints").glob("step-[0-9]*"))[:-2]:
                    shutil.rmtree(old)
            t_last, tokens_since = time.perf_counter(), 0
    drafter.eval().requires_grad_(False)
    drafter.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return TrainResult(
        out, cfg.steps, [(int(s), float(v)) for s, v, _ in log["loss"]], list(log["eval"])
    )
