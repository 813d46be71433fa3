"""Randomized soak of the speculative decoder against plain greedy decoding (a long CPU run).

Each episode draws, from ``(--seed, episode index)`` alone: a small hybrid model (2–4 layers
with both layer kinds, hidden 16–48, vocab 32–128, float32 or bfloat16, seeded weights), one
or two CPU shards, a prompt (1–40 tokens, some repetitive), a block size (2–16), a drafter
(synthetic with a random acceptance against the greedy oracle, prompt-lookup, or the seeded
DFlash drafter), a starting rollback mode, and between steps: mode requests, capture storage
rebuilds, injected faults at every rollback phase (failing recoveries included, completed with
``resume``), and verify attempts while poisoned; a quarter of the episodes sample by a
random seeded rule. Every emitted token is compared with :func:`dflash.model.greedy_generate`
of the same model and prompt (plain sampled decoding, :func:`dflash.execution.reference_greedy`,
under a rule); the first difference, or any unexpected exception, stops the run with a
replayable description and exit status 1.

    python scripts/soak.py --steps 100000 --seed 1 --report specs/soak-report.json
    python scripts/soak.py --seed 1 --replay 1234     # one episode again, verbosely

Exit status: 0 target reached without a difference, 1 a difference or an unexpected error,
3 stopped by SIGINT/SIGTERM before the target (the report is written in every case).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import random
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

import torch

from dflash.execution import (
    ExecutionError,
    FaultInjector,
    FaultPhase,
    PoisonedError,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
    reference_greedy,
)
from dflash.execution.policy import parse_mode
from dflash.execution.session import tree_rank_probs
from dflash.model import TargetModel, greedy_generate
from dflash.model.config import HybridConfig
from dflash.model.drafters import Drafter, make_drafter
from dflash.model.drafters.trees import SyntheticTreeDrafter
from dflash.sampling import GREEDY, SamplingParams

MODES = ("replay", "checkpoint", "remap", "recompute")
DRAFTERS = ("synthetic", "prompt-lookup", "dflash")
PATHS = ("fast", "replay", "replay_after_failure")
FAULT_PHASES = tuple(FaultPhase)


# -- one episode's parameters (a pure function of seed and index) ------------------------


@dataclass
class Episode:
    seed: int
    index: int
    config: dict[str, Any]
    dtype: str
    model_seed: int
    split: list[int]
    prompt: list[int]
    block_size: int
    max_new_tokens: int
    drafter: str
    drafter_seed: int
    acceptance: float
    mode: str
    p_mode: float  # per step: probability of a mode request
    p_rebuild: float  # per step: probability of a storage rebuild
    p_fault: float  # per step: probability of arming a fault
    event_seed: int  # seeds the between-steps events
    tree_budget: int | None = None  # tree drafts of at most that many nodes (None: chains)
    sampling: dict[str, Any] | None = None  # the sampling rule's parameters (None: greedy)


def episode_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"dflash-soak/{seed}/{index}")


def draw_config(rng: random.Random) -> HybridConfig:
    n_layers = rng.choice([2, 2, 2, 3, 3, 4])  # small mostly: a step costs a few ms
    kinds = ["linear_attention", "full_attention"] + [
        rng.choice(["linear_attention", "full_attention"]) for _ in range(n_layers - 2)
    ]
    rng.shuffle(kinds)
    hidden = rng.choice([16, 16, 32, 48])
    heads = rng.choice([1, 2, 4])
    head_dim = rng.choice([8, 16])
    hk = rng.choice([1, 2])
    return HybridConfig(
        vocab_size=rng.randint(32, 128),
        hidden_size=hidden,
        intermediate_size=hidden * rng.choice([1, 2, 3]),
        layer_types=tuple(kinds),  # type: ignore[arg-type]  # both literals of LayerType
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
        head_dim=head_dim,
        linear_num_key_heads=hk,
        linear_num_value_heads=hk * rng.choice([1, 2]),
        linear_key_head_dim=rng.choice([8, 16]),
        linear_value_head_dim=rng.choice([8, 16]),
        linear_conv_kernel_dim=rng.randint(2, 4),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=rng.choice([0.25, 0.5, 1.0]),
        tie_word_embeddings=rng.random() < 0.3,
        max_position_embeddings=512,
    )


def draw_prompt(rng: random.Random, vocab: int) -> list[int]:
    n = rng.randint(1, 40)
    kind = rng.random()
    if kind < 0.4 or n < 4:
        return [rng.randrange(vocab) for _ in range(n)]
    if kind < 0.8:  # a short pattern repeated: prompt lookup finds n-grams
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        return (pattern * (n // len(pattern) + 1))[:n]
    alphabet = [rng.randrange(vocab) for _ in range(rng.randint(2, 4))]  # few distinct tokens
    return [rng.choice(alphabet) for _ in range(n)]


def draw_episode(seed: int, index: int) -> Episode:
    rng = episode_rng(seed, index)
    config = draw_config(rng)
    n_layers = config.num_hidden_layers
    if rng.random() < 0.6:
        split = [n_layers]
    else:
        first = rng.randint(1, n_layers - 1)
        split = [first, n_layers - first]
    episode = Episode(
        seed=seed,
        index=index,
        config=config.model_dump(mode="json"),
        dtype=rng.choice(["float32", "bfloat16"]),
        model_seed=rng.randrange(2**31),
        split=split,
        prompt=draw_prompt(rng, config.vocab_size),
        block_size=rng.choice([2, 2, 3, 3, 4, 4, 5, 6, 8, 12, 16]),
        max_new_tokens=rng.randint(8, 64),
        drafter=rng.choice(DRAFTERS),
        drafter_seed=rng.randrange(2**31),
        acceptance=rng.choice([0.0, 0.3, 0.5, 0.7, 0.9, 1.0, rng.random()]),
        mode=rng.choice(MODES),
        p_mode=rng.choice([0.0, 0.05, 0.2]),
        p_rebuild=rng.choice([0.0, 0.05, 0.15]),
        p_fault=rng.choice([0.0, 0.1, 0.3, 0.6]),
        event_seed=rng.randrange(2**31),
    )
    # trees, drawn last so every earlier field of an episode is what it always was: a third
    # of the episodes whose drafter gives per-slot candidates (seeded DFlash) or trees
    # (synthetic, with a rank distribution from its acceptance)
    if episode.drafter in ("synthetic", "dflash") and rng.random() < 1 / 3:
        episode.tree_budget = rng.choice([2, 3, 4, 6, 8, 12, 16])
    # sampling, drawn after the trees for the same reason: a quarter of the episodes draw
    # by a random seeded rule, compared with plain sampled decoding under it
    if rng.random() < 1 / 4:
        episode.sampling = {
            "temperature": rng.choice([0.3, 0.7, 1.0, 1.5]),
            "top_k": rng.choice([0, 0, 3, 20]),
            "top_p": rng.choice([1.0, 1.0, 0.9, 0.5]),
            "min_p": rng.choice([0.0, 0.0, 0.05]),
            "seed": rng.randrange(2**40),
        }
    return episode


# -- faults --------------------------------------------------------------------------------


class ArmedFaults(FaultInjector):
    """Fires each armed ``(step, phase)`` ``times`` times (a recovery may fail repeatedly)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: dict[tuple[int, FaultPhase], int] = {}
        self.shard_of: dict[int, int] = {}  # mid_restore: the shard that fails, per step

    def arm(self, step: int, phase: FaultPhase, times: int = 1, shard: int = 1) -> None:
        self.armed[(step, phase)] = times
        if phase is FaultPhase.MID_RESTORE:
            self.shard_of[step] = shard

    def fire(self, phase: FaultPhase, step: int, shard: int | None = None) -> None:
        left = self.armed.get((step, phase), 0)
        if left <= 0:
            return
        if phase is FaultPhase.MID_RESTORE and shard != self.shard_of.get(step):
            return
        self.armed[(step, phase)] = left - 1
        self.phase, self.steps, self.shard = phase, None, None
        try:
            super().fire(phase, step, shard)
        finally:
            self.phase = None


# -- running one episode ---------------------------------------------------------------------


@dataclass
class Tally:
    episodes: int = 0
    steps: int = 0
    tokens: int = 0
    paths: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    poison_events: int = 0
    faults_fired: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in FAULT_PHASES})
    failed_recoveries: int = 0
    resumes: int = 0
    verify_refused: int = 0
    mode_requests: int = 0
    rebuilds: int = 0
    refused_while_poisoned: int = 0
    effective_episodes: int = 0
    by_drafter: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DRAFTERS, 0))
    by_dtype: dict[str, int] = field(default_factory=lambda: {"float32": 0, "bfloat16": 0})
    by_shards: dict[str, int] = field(default_factory=lambda: {"1": 0, "2": 0})
    by_block_size: dict[str, int] = field(default_factory=dict)
    by_tree_budget: dict[str, int] = field(default_factory=dict)  # "chain" or the budget
    accepted_drafts: int = 0
    drafted: int = 0

    def add(self, other: Tally) -> None:
        for name, value in asdict(other).items():
            mine = getattr(self, name)
            if isinstance(value, dict):
                for k, v in value.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, name, mine + value)


class Mismatch(Exception):
    """A token differs from plain greedy, or something unexpected happened."""


def _build(ep: Episode) -> tuple[TargetModel, list[int], SpecDecoder, ArmedFaults]:
    config = HybridConfig.model_validate_json(json.dumps(ep.config))
    dtype = getattr(torch, ep.dtype)
    model = TargetModel.seeded(config, seed=ep.model_seed, dtype=dtype)
    B = ep.block_size
    slots = max(B, ep.tree_budget or 0)  # what a verify may write: a block, or a tree
    rule = GREEDY if ep.sampling is None else SamplingParams(**ep.sampling)
    n = ep.max_new_tokens + slots + 1
    oracle = (  # plain (sampled) decoding: one token per forward
        greedy_generate(model, ep.prompt, n) if rule.greedy
        else reference_greedy(model, plan_shards(config.num_hidden_layers, "cpu"), ep.prompt,
                              n, sampling=rule)
    )
    drafter: Drafter
    if ep.drafter == "synthetic" and ep.tree_budget is not None:
        drafter = cast(Drafter, SyntheticTreeDrafter(
            ep.prompt + oracle, tree_rank_probs(min(max(ep.acceptance, 0.05), 0.95)),
            config.vocab_size, seed=ep.drafter_seed,
        ))
    elif ep.drafter == "synthetic":
        drafter = make_drafter(
            "synthetic",
            model,
            seed=ep.drafter_seed,
            oracle=ep.prompt + oracle,
            acceptance=ep.acceptance,
        )
    else:
        drafter = make_drafter(ep.drafter, model, seed=ep.drafter_seed)
    devices = ",".join(["cpu"] * len(ep.split))
    plan = plan_shards(config.num_hidden_layers, devices, ",".join(map(str, ep.split)))
    target = ShardedTarget(
        model,
        plan,
        max_len=len(ep.prompt) + ep.max_new_tokens + slots + 1,
        max_draft=slots,
    )
    faults = ArmedFaults()
    engine = SpecDecoder(
        target,
        drafter,
        block_size=B,
        policy=RollbackPolicy(mode=parse_mode(ep.mode, source="mode")),
        tree_budget=ep.tree_budget,
        faults=faults,
        sampling=rule,
    )
    return model, oracle, engine, faults


def _check(out: list[int], oracle: list[int], where: str) -> None:
    n = min(len(out), len(oracle))
    if len(out) > len(oracle) or out != oracle[:n]:
        first = next((i for i in range(n) if out[i] != oracle[i]), n)
        raise Mismatch(
            f"{where}: token {first} differs from plain greedy: got {out[first : first + 8]} "
            f"want {oracle[first : first + 8]} (emitted {len(out)}, oracle {len(oracle)})"
        )


def run_episode(ep: Episode, log: list[str] | None = None) -> Tally:
    """Run ``ep``; raise :class:`Mismatch` on any difference from plain greedy."""
    tally = Tally(episodes=1)
    _, oracle, engine, faults = _build(ep)
    ev = random.Random(ep.event_seed)
    shards = len(ep.split)
    out = [engine.prefill(ep.prompt)]
    _check(out, oracle, "after prefill")
    attempts = 0
    while len(out) < ep.max_new_tokens:
        attempts += 1
        if attempts > 4 * ep.max_new_tokens + 16:
            raise Mismatch(f"no progress after {attempts} step attempts")
        step = engine.steps_run
        # between steps: mode requests, rebuilds (the target is clean here)
        if ev.random() < ep.p_mode:
            mode = ev.choice(MODES)
            engine.request_mode(mode)
            tally.mode_requests += 1
            if log is not None:
                log.append(f"step {step}: request_mode({mode!r})")
        if ev.random() < ep.p_rebuild:
            engine.rebuild_storage()
            tally.rebuilds += 1
            if log is not None:
                log.append(f"step {step}: rebuild_storage()")
        if ev.random() < ep.p_fault:
            phase = ev.choice(FAULT_PHASES[:-1])  # a fast-rollback phase
            faults.arm(step, phase, shard=ev.randrange(1, shards) if shards > 1 else 1)
            if ev.random() < 0.3:  # the recovery fails too, once or twice
                faults.arm(step, FaultPhase.DURING_RECOVERY, times=ev.choice([1, 1, 2]))
            if log is not None:
                log.append(f"step {step}: armed {phase.value} (+ {faults.armed})")
        status = engine.status
        fired_before = len(faults.fired)
        try:
            emitted = engine.step()
        except PoisonedError as exc:
            if "stays poisoned" not in str(exc):
                raise
            tally.failed_recoveries += 1
            if engine.status is not RollbackStatus.POISONED:
                raise Mismatch(f"step {step}: failed recovery left status {engine.status}") from exc
            if log is not None:
                log.append(f"step {step}: recovery failed, poisoned")
            emitted = _resume(engine, ev, tally, step, log)
        for phase_name in (p.value for _, p in faults.fired[fired_before:]):
            tally.faults_fired[phase_name] += 1
        rec = engine.records[-1]
        if rec.path == "fast" and rec.status_before is not RollbackStatus.EFFECTIVE:
            raise Mismatch(f"step {step}: fast rollback with status {rec.status_before}")
        if status is not RollbackStatus.EFFECTIVE and rec.path != "replay":
            raise Mismatch(f"step {step}: path {rec.path} while status was {status}")
        if log is not None:
            log.append(
                f"step {step}: status {status.value}, path {rec.path}, "
                f"accept_n {rec.accept_n}, emitted {list(emitted)}"
            )
        out.extend(emitted)
        tally.steps += 1
        _check(out, oracle, f"step {step}")
    tally.tokens = len(out)
    for p in PATHS:
        tally.paths[p] = engine.counts[p]
    tally.poison_events = engine.counts["poison_events"]
    tally.effective_episodes = int(any(r.path == "fast" for r in engine.records))
    tally.by_drafter[ep.drafter] = 1
    tally.by_dtype[ep.dtype] = 1
    tally.by_shards[str(shards)] = 1
    tally.by_block_size[str(ep.block_size)] = 1
    tally.by_tree_budget["chain" if ep.tree_budget is None else str(ep.tree_budget)] = 1
    tally.drafted = sum(r.nodes - 1 for r in engine.records)
    tally.accepted_drafts = sum(r.accept_n - 1 for r in engine.records)
    return tally


def _resume(
    engine: SpecDecoder, ev: random.Random, tally: Tally, step: int, log: list[str] | None
) -> list[int]:
    """Complete a step whose recovery failed: verify and requests must refuse first."""
    forwards = engine.target_forwards
    if ev.random() < 0.5:
        try:
            engine.step()
        except PoisonedError as exc:
            if "verify refused" not in str(exc):
                raise
            tally.verify_refused += 1
        else:
            raise Mismatch(f"step {step}: a poisoned target ran a verify")
        if engine.target_forwards != forwards:
            raise Mismatch(f"step {step}: a forward ran while poisoned")
    if ev.random() < 0.3:
        try:
            if ev.random() < 0.5:
                engine.request_mode(ev.choice(MODES))
            else:
                engine.rebuild_storage()
        except ExecutionError as exc:
            if "clean target" not in str(exc):
                raise
            tally.refused_while_poisoned += 1
        else:
            raise Mismatch(f"step {step}: a poisoned target accepted a request")
    for _ in range(4):  # a recovery armed to fail twice fails the first resume too
        try:
            emitted = engine.resume()
        except PoisonedError as exc:
            if "stays poisoned" not in str(exc):
                raise
            tally.failed_recoveries += 1
            continue
        tally.resumes += 1
        if log is not None:
            log.append(f"step {step}: resumed")
        return emitted
    raise Mismatch(f"step {step}: resume() kept failing")


# -- workers, report, main -------------------------------------------------------------------


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)


def work(seed: int, index: int) -> tuple[int, Tally | None, str | None]:
    ep = draw_episode(seed, index)
    try:
        return index, run_episode(ep), None
    except Exception as exc:  # any failure is a finding: describe it, replayably
        kind = "MISMATCH" if isinstance(exc, Mismatch) else f"UNEXPECTED {type(exc).__name__}"
        desc = {
            "finding": f"{kind}: {exc}",
            "replay": f"python scripts/soak.py --seed {seed} --replay {index}",
            "episode": asdict(ep),
            "traceback": traceback.format_exc(),
        }
        return index, None, json.dumps(desc, indent=1)


_STOP: list[str] = []


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _STOP.append(signal.Signals(signum).name)


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "absent"
    out["platform"] = platform.platform()
    try:
        import subprocess

        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dflash", "scripts/soak.py"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        out["git"] = rev + ("+uncommitted changes" if dirty else "")
    except OSError:
        out["git"] = "unknown"
    return out


def replay(seed: int, index: int) -> int:
    torch.set_num_threads(1)
    ep = draw_episode(seed, index)
    print(json.dumps(asdict(ep)))
    log: list[str] = []
    try:
        tally = run_episode(ep, log)
    except Exception:
        print("\n".join(log))
        traceback.print_exc()
        return 1
    print("\n".join(log))
    print(json.dumps(asdict(tally)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100_000, help="total decode steps to reach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, choices=(1, 2))
    ap.add_argument("--report", type=Path, default=None, help="JSON report file")
    ap.add_argument("--progress", type=float, default=30.0, help="seconds between lines")
    ap.add_argument("--replay", type=int, default=None, help="run one episode verbosely")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1 (got {args.steps})")
    if args.replay is not None:
        return replay(args.seed, args.replay)

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    total = Tally()
    finding: str | None = None
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    last_line = t0
    next_index = 0
    command = "python scripts/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)

    def report(state: str) -> dict[str, Any]:
        elapsed = time.monotonic() - t0
        return {
            "state": state,
            "command": command,
            "parameters": {"steps": args.steps, "seed": args.seed, "jobs": args.jobs},
            "started_utc": started,
            "seconds": round(elapsed, 1),
            "ms_per_step": round(1000 * elapsed * args.jobs / max(total.steps, 1), 2),
            "tokens_different": 0 if finding is None else None,
            "finding": None if finding is None else json.loads(finding),
            "counts": asdict(total),
            "versions": versions(),
            "randomized": (
                "HybridConfig 2-4 layers (both kinds), hidden 16/32/48, vocab 32-128, "
                "float32/bfloat16, 1 or 2 CPU shards; prompts 1-40 tokens (random, "
                "repeated pattern, small alphabet); B 2-16; drafters synthetic (random "
                "acceptance vs the greedy oracle) / prompt-lookup / seeded dflash; start "
                "mode replay/checkpoint/remap; request_mode and rebuild_storage between "
                "steps; faults at every phase incl. failing recoveries + resume; oracle "
                "dflash.model.greedy_generate, or plain sampled decoding for the quarter of "
                "episodes drawn by a random seeded rule (temperature, top-k, top-p, min-p), "
                "every emitted token compared"
            ),
        }

    ctx = mp.get_context("fork")
    pool = ctx.Pool(args.jobs, initializer=_worker_init) if args.jobs > 1 else None
    pending: list[Any] = []
    if pool is None:
        _worker_init_main()
    try:
        while finding is None and not _STOP and total.steps < args.steps:
            if pool is None:
                results = [work(args.seed, next_index)]
                next_index += 1
            else:
                while len(pending) < 2 * args.jobs:
                    pending.append(pool.apply_async(work, (args.seed, next_index)))
                    next_index += 1
                done = [p for p in pending if p.ready()]
                if not done:
                    time.sleep(0.02)
                    continue
                pending = [p for p in pending if not p.ready()]
                results = [p.get() for p in done]
            for _index, tally, problem in results:
                if problem is not None:
                    finding = problem
                    break
                assert tally is not None
                total.add(tally)
            now = time.monotonic()
            if now - last_line >= args.progress:
                last_line = now
                rate = total.steps / (now - t0)
                print(
                    f"[soak] {now - t0:7.0f}s  steps {total.steps}/{args.steps}  "
                    f"episodes {total.episodes}  tokens {total.tokens}  paths {total.paths}  "
                    f"poison {total.poison_events}  {rate:.0f} steps/s",
                    flush=True,
                )
                write_report(args.report, report("running"))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    if finding is not None:
        write_report(args.report, report("mismatch"))
        print(finding, file=sys.stderr)
        print("[soak] FAILED: a token differs or an unexpected error; see above", flush=True)
        return 1
    state = "complete" if total.steps >= args.steps else f"stopped by {_STOP[0]}"
    write_report(args.report, report(state))
    print(
        f"[soak] {state}: {total.steps} steps, {total.episodes} episodes, {total.tokens} "
        f"tokens, 0 different; paths {total.paths}, poison events {total.poison_events}; "
        f"{time.monotonic() - t0:.0f}s",
        flush=True,
    )
    return 0 if total.steps >= args.steps else 3


def _worker_init_main() -> None:
    torch.set_num_threads(1)


if __name__ == "__main__":
    sys.exit(main())
