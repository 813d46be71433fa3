"""GPU: CUDA-graph replay of the decode, verify and replay forwards, against eager and
against plain greedy decoding.

1. graphs vs eager, every rollback mode, one GPU: the same tokens, and after every step
   the same bytes in every cache tensor (KV, live state, conv window, checkpoint slots,
   captured conv rows, snapshot); the graphs were really captured and replayed;
2. ``rebuild_storage`` mid-run: graphs are captured again on the new storage, tokens stay
   greedy;
3. a fault injected at every rollback phase (two shards on one GPU, graphs on): only
   greedy tokens, fast rollback continues; a failing recovery poisons, ``resume`` recovers;
4. KV capacity exhaustion: a clear error before any forward (graph or not) runs;
5. the 9B-shaped seeded bf16 model, 1,024-token prompt, 1,024 generated tokens: plain greedy
   (graphed) and every mode give one SHA-256; float16 and float32 on an 8-layer model of
   the same widths (256-token prompt, 256 tokens).

Memory: ~18 GB (9B bf16) + ~9 GB (8-layer f32). Prints a summary (run with ``-s``).
Run: ``python -m pytest tests/gpu/test_graphs.py -q -s``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

# the rest is imported after the CUDA skip
from dflash.execution import (
    ROLLBACK_MODES,
    ExecutionError,
    FaultInjector,
    FaultPhase,
    PoisonedError,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    generate,
    plan_shards,
    reference_greedy,
    token_sha256,
)
from dflash.model import HybridConfig, TargetModel, greedy_generate
from dflash.model.drafters import SyntheticDrafter

BLOCK = 16
ACCEPTANCE = 0.6
LONG_PROMPT, LONG_TOKENS = 1024, 1024
SMALL_PROMPT, SMALL_TOKENS = 256, 256
ROWS: list[str] = []


@pytest.fixture(scope="module")
def model() -> Iterator[TargetModel]:
    m = TargetModel.seeded(
        HybridConfig.nine_b_shape(), seed=0, dtype=torch.bfloat16, device="cuda:0"
    )
    yield m
    del m
    torch.cuda.empty_cache()


def _prompt(vocab: int, n: int, seed: int = 1234) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _engine(
    model: TargetModel,
    prompt: list[int],
    oracle: list[int],
    mode: RollbackMode,
    *,
    graphs: bool,
    devices: str = "cuda:0",
    split: str | None = None,
    max_new: int = 96,
    faults: FaultInjector | None = None,
) -> SpecDecoder:
    plan = plan_shards(model.config.num_hidden_layers, devices, split)
    target = ShardedTarget(
        model, plan, max_len=len(prompt) + max_new + BLOCK + 1, max_draft=BLOCK, graphs=graphs
    )
    drafter = SyntheticDrafter(prompt + oracle, ACCEPTANCE, model.config.vocab_size, seed=7)
    return SpecDecoder(
        target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode), faults=faults
    )


def _storage(engine: SpecDecoder) -> list[tuple[str, torch.Tensor]]:
    out = []
    for s in engine.target.shards:
        kv, pool = s.caches.kv, s.caches.pool
        for name in ("k", "v"):
            out.append((f"shard {s.index} kv.{name}", getattr(kv, name)))
        for name in ("state", "conv", "snapshot", "position", "live"):
            out.append((f"shard {s.index} pool.{name}", getattr(pool, name)))
        for name, buffer in pool.capture_buffers().items():  # this mode's capture kind
            out.append((f"shard {s.index} pool.{name}", buffer))
    return out


def _graph_stats(engine: SpecDecoder) -> tuple[int, int, list[str]]:
    graphs = engine.target.graphs
    assert graphs is not None, engine.target.graphs_off_reason
    return (
        sum(g.captures for g in graphs),
        sum(g.replays for g in graphs),
        [f for g in graphs for f in g.failures],
    )


@torch.inference_mode()
def test_graphs_equal_eager_tokens_and_storage_in_every_mode(model: TargetModel) -> None:
    prompt = _prompt(model.config.vocab_size, 128)
    n = 64
    oracle = reference_greedy(model, plan_shards(32, "cuda:0"), prompt, n + BLOCK)
    eager_oracle = reference_greedy(model, plan_shards(32, "cuda:0"), prompt, n, graphs=False)
    assert eager_oracle == oracle[:n], "graphed plain greedy differs from eager plain greedy"
    assert greedy_generate(model, prompt, 16) == oracle[:16], "one-shard greedy_generate"
    for mode in ROLLBACK_MODES:
        eager = _engine(model, prompt, oracle, mode, graphs=False)
        graphed = _engine(model, prompt, oracle, mode, graphs=True)
        out_e, out_g = [eager.prefill(prompt)], [graphed.prefill(prompt)]
        step = 0
        while len(out_g) < n:
            out_e.extend(eager.step())
            out_g.extend(graphed.step())
            assert out_g == out_e, f"{mode}: tokens differ at step {step}"
            for (name, a), (_, b) in zip(_storage(eager), _storage(graphed), strict=True):
                torch.testing.assert_close(
                    b, a, rtol=0, atol=0, equal_nan=True, msg=f"{mode} step {step}: {name}"
                )
            step += 1
        assert out_g[:n] == oracle[:n], f"{mode}: not plain greedy"
        captures, replays, failures = _graph_stats(graphed)
        ROWS.append(f"graphs vs eager {mode}: {step} steps, {captures} captures, "
                    f"{replays} replays, failures {failures}")
        assert not failures, failures
        assert captures >= 1 and replays >= step - 3, (captures, replays, step)
        if mode != "replay":
            assert graphed.counts["fast"] == step - 1  # only the gate step replays
            graphs = graphed.target.graphs
            assert graphs is not None
            assert (f"rollback:{mode}", 1, False) in graphs[0].captured_keys, (
                graphs[0].captured_keys
            )
        print("\n" + ROWS[-1])


@torch.inference_mode()
def test_graphs_are_captured_again_after_rebuild_storage(model: TargetModel) -> None:
    prompt = _prompt(model.config.vocab_size, 64, seed=5)
    oracle = reference_greedy(model, plan_shards(32, "cuda:0"), prompt, 80 + BLOCK)
    for mode in ("checkpoint", "remap", "recompute"):
        engine = _engine(model, prompt, oracle, mode, graphs=True)
        out = [engine.prefill(prompt)]
        while len(out) < 32:
            out.extend(engine.step())
        before, _, _ = _graph_stats(engine)
        engine.rebuild_storage()
        assert engine.gate.report.verdict == "not_run"
        while len(out) < 80:
            out.extend(engine.step())
        after, _, failures = _graph_stats(engine)
        assert out[:80] == oracle[:80], mode
        assert after > before and not failures, (before, after, failures)
        assert engine.status is RollbackStatus.EFFECTIVE


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "recompute"])
@pytest.mark.parametrize("phase", [p for p in FaultPhase if p is not FaultPhase.DURING_RECOVERY])
@torch.inference_mode()
def test_fault_at_every_phase_with_graphs_emits_only_greedy_tokens(
    model: TargetModel, mode: RollbackMode, phase: FaultPhase
) -> None:
    prompt = _prompt(model.config.vocab_size, 32, seed=9)
    n = 40
    oracle = reference_greedy(model, plan_shards(32, "cuda:0"), prompt, n + BLOCK)
    faults = FaultInjector(phase=phase, steps=frozenset({2, 4}), shard=1)
    engine = _engine(
        model, prompt, oracle, mode, graphs=True, devices="cuda:0,cuda:0", split="16,16",
        max_new=n, faults=faults,
    )
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    assert out[:n] == oracle[:n]
    assert [s for s, _ in faults.fired] == [2, 4]
    paths = [r.path for r in engine.records]
    assert paths[2] == paths[4] == "replay_after_failure", paths
    assert engine.counts["poison_events"] == (0 if phase is FaultPhase.BEFORE_RESTORE else 2)
    assert engine.status is RollbackStatus.EFFECTIVE
    assert not _graph_stats(engine)[2]


@torch.inference_mode()
def test_failed_recovery_with_graphs_poisons_then_resume_recovers(model: TargetModel) -> None:
    prompt = _prompt(model.config.vocab_size, 32, seed=11)
    n = 40
    oracle = reference_greedy(model, plan_shards(32, "cuda:0"), prompt, n + BLOCK)

    class Twice(FaultInjector):
        """The fast rollback of step 2 fails, and so does its recovery."""

        def fire(self, phase: FaultPhase, step: int, shard: int | None = None) -> None:
            wanted = {(FaultPhase.AFTER_RESTORE, 2), (FaultPhase.DURING_RECOVERY, 2)}
            if (phase, step) in wanted and (step, phase) not in self.fired:
                self.phase = phase
                super().fire(phase, step, shard)

    engine = _engine(model, prompt, oracle, "checkpoint", graphs=True, max_new=n, faults=Twice())
    out = [engine.prefill(prompt)]
    out.extend(engine.step())
    out.extend(engine.step())
    with pytest.raises(PoisonedError, match="stays poisoned"):
        engine.step()
    assert engine.status is RollbackStatus.POISONED
    forwards = engine.target_forwards
    with pytest.raises(PoisonedError, match="verify refused"):
        engine.step()
    assert engine.target_forwards == forwards  # no forward ran while poisoned
    out.extend(engine.resume())
    while len(out) < n:
        out.extend(engine.step())
    assert out[:n] == oracle[:n]


@torch.inference_mode()
def test_kv_capacity_exhaustion_is_refused_before_any_replay(model: TargetModel) -> None:
    prompt = _prompt(model.config.vocab_size, 32, seed=13)
    oracle = reference_greedy(model, plan_shards(32, "cuda:0"), prompt, 64)
    plan = plan_shards(32, "cuda:0")
    target = ShardedTarget(model, plan, max_len=len(prompt) + 40, max_draft=BLOCK, graphs=True)
    drafter = SyntheticDrafter(prompt + oracle, 0.0, model.config.vocab_size, seed=1)
    engine = SpecDecoder(target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode="remap"))
    out = [engine.prefill(prompt)]
    with pytest.raises(ExecutionError, match="KV cache capacity exhausted"):
        while True:  # each step commits one token; the 26th verify would pass max_len
            out.extend(engine.step())
    assert engine.committed + BLOCK > target.max_len >= engine.committed
    assert engine.life.phase.value == "clean"
    assert out == oracle[: len(out)]
    torch.cuda.synchronize()  # no replay went out of bounds (that would fault here)


def _all_modes_sha(
    model: TargetModel, prompt_len: int, n: int, label: str
) -> None:
    prompt = _prompt(model.config.vocab_size, prompt_len)
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    oracle = reference_greedy(model, plan, prompt, n + BLOCK)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    want = token_sha256(oracle[:n])
    distinct = len(set(oracle[:n]))
    ROWS.append(f"{label} plain greedy: sha {want} ({distinct} distinct tokens), "
                f"{(n + BLOCK) / wall:.1f} tok/s incl. prefill and captures")
    print("\n" + ROWS[-1])
    drafter = SyntheticDrafter(prompt + oracle, ACCEPTANCE, model.config.vocab_size, seed=7)
    for mode in ROLLBACK_MODES:
        r = generate(
            model, drafter, prompt, plan=plan, max_new_tokens=n, block_size=BLOCK,
            policy=RollbackPolicy(mode=mode),
        )
        pairs = zip(r.tokens, oracle, strict=False)
        diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        ROWS.append(f"{label} {mode}: sha {r.sha256} steps {r.steps} accept "
                    f"{r.acceptance_rate:.3f} {r.timings.tokens_per_s:.1f} tok/s "
                    f"fast/replay/fail {r.rollback.fast}/{r.rollback.replay}/"
                    f"{r.rollback.replay_after_failure} first difference {diff}")
        print(ROWS[-1])
        assert r.sha256 == want, f"{label} {mode}: first difference at token {diff}"
        assert r.rollback.replay_after_failure == 0


def test_nine_b_bf16_1024_tokens_every_mode_is_plain_greedy(model: TargetModel) -> None:
    _all_modes_sha(model, LONG_PROMPT, LONG_TOKENS, "9B bf16")


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_smaller_shape_float16_float32_every_mode_is_plain_greedy(dtype_name: str) -> None:
    nine = HybridConfig.nine_b_shape()
    layout = nine.layer_types[:8]  # 3 recurrent + 1 attention, twice
    config = HybridConfig(**{**nine.model_dump(), "layer_types": layout})
    dtype = {"float16": torch.float16, "float32": torch.float32}[dtype_name]
    m = TargetModel.seeded(config, seed=0, dtype=dtype, device="cuda:0")
    try:
        _all_modes_sha(m, SMALL_PROMPT, SMALL_TOKENS, f"8-layer {dtype_name}")
    finally:
        del m
        torch.cuda.empty_cache()
    print("\n".join(["", "summary:", *ROWS]))


# -- remap with commits of several lengths (one verify graph reads every live slot) -----


def _eight_layer_bf16() -> TargetModel:
    nine = HybridConfig.nine_b_shape()
    config = HybridConfig(**{**nine.model_dump(), "layer_types": nine.layer_types[:8]})
    return TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")


def _random_dflash(m: TargetModel, seed: int, draft_dtype: torch.dtype | None = None) -> Any:
    """A seeded 2-layer DFlash drafter of block ``BLOCK`` for ``m``."""
    from dflash.model.drafters import DFlashConfig, DFlashDrafter

    cfg = DFlashConfig.for_target(
        hidden_size=m.config.hidden_size, vocab_size=m.config.vocab_size, num_target_layers=8,
        num_hidden_layers=2, block_size=BLOCK,
    )
    return DFlashDrafter.random(cfg, m.embed_tokens.weight, m.lm_head.weight, seed=seed,
                                draft_dtype=draft_dtype)


def _decode(
    m: TargetModel,
    drafter: Any,
    plan: Any,
    prompt: list[int],
    n: int,
    mode: RollbackMode,
    graphs: bool,
) -> tuple[list[int], SpecDecoder, ShardedTarget]:
    """``n`` tokens of speculative decoding on a fresh target: (tokens, engine, target)."""
    target = ShardedTarget(m, plan, max_len=len(prompt) + n + BLOCK + 1, max_draft=BLOCK,
                           graphs=graphs)
    engine = SpecDecoder(target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode))
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n], engine, target


@torch.inference_mode()
def test_gdn_verify_reading_a_slot_it_writes_equals_reading_a_copy() -> None:
    """After a remap the verify's initial state is checkpoint slot ``j`` of the very tensor
    the launch writes (slots 0..T-1): every output must equal a launch from a copy."""
    from dflash.execution.engine import chain_of
    from dflash.kernels import gdn_verify

    nine = HybridConfig.nine_b_shape()
    hk, hv = nine.linear_num_key_heads, nine.linear_num_value_heads
    kd, vd = nine.linear_key_head_dim, nine.linear_value_head_dim
    gen = torch.Generator(device="cuda:0").manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda:0").to(dtype)

    T = S = BLOCK
    q, k, v = rand(1, T, hk, kd), rand(1, T, hk, kd), rand(1, T, hv, vd)
    g = -torch.rand(1, T, hv, generator=gen, device="cuda:0")
    beta = torch.rand(1, T, hv, generator=gen, device="cuda:0")
    base = rand(1, S, hv, kd, vd, dtype=torch.float32)
    for j in range(S):
        aliased = base.clone()
        snap_a = torch.full((1, hv, kd, vd), float("nan"), device="cuda:0")
        o_a = gdn_verify(q, k, v, g, beta, aliased[:, j], aliased, chain_of(T), snapshot=snap_a)
        separate = base.clone()
        snap_s = torch.full_like(snap_a, float("nan"))
        o_s = gdn_verify(q, k, v, g, beta, base[:, j].clone(), separate, chain_of(T),
                         snapshot=snap_s)
        torch.cuda.synchronize()
        for name, a, b in (("o", o_a, o_s), ("checkpoints", aliased, separate),
                           ("snapshot", snap_a, snap_s)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"slot {j}: {name}")


@pytest.mark.parametrize("drafter_name", ["synthetic", "prompt-lookup"])
@torch.inference_mode()
def test_remap_with_varied_commits_graphs_and_eager_are_plain_greedy(drafter_name: str) -> None:
    """An 8-layer bf16 model of the 9B widths, remap with commits of many lengths, graphs
    off and on in lockstep against plain greedy; on a failure the message says which side
    left greedy first, at which step, from which live slot, and whether the live states of
    the two sides still agreed."""
    from dflash.model.drafters import PromptLookupDrafter

    m = _eight_layer_bf16()
    try:
        vocab = m.config.vocab_size
        base = _prompt(vocab, 16, seed=21)
        prompt = (base * 4)[:64]  # repetitive: prompt lookup finds long matches
        n = 192
        plan = plan_shards(8, "cuda:0")
        oracle = reference_greedy(m, plan, prompt, n + BLOCK)

        def engine(model: TargetModel, graphs: bool) -> SpecDecoder:
            target = ShardedTarget(model, plan, max_len=len(prompt) + n + BLOCK + 1,
                                   max_draft=BLOCK, graphs=graphs)
            drafter = (SyntheticDrafter(prompt + oracle, 0.32, vocab, seed=7)
                       if drafter_name == "synthetic" else PromptLookupDrafter())
            return SpecDecoder(target, drafter, block_size=BLOCK,
                               policy=RollbackPolicy(mode="remap"))

        eager, graphed = engine(m, False), engine(m, True)
        out_e, out_g = [eager.prefill(prompt)], [graphed.prefill(prompt)]
        log: list[str] = []
        step = 0
        while len(out_e) < n and len(out_g) < n:
            slot_before = graphed.target.shards[0].caches.pool.live_slot
            out_e.extend(eager.step())
            out_g.extend(graphed.step())
            pe, pg = eager.target.shards[0].caches.pool, graphed.target.shards[0].caches.pool
            same_live = all(
                torch.equal(a, b)
                for layer in pe.layer_ids
                for a, b in zip(pe.live_views(layer), pg.live_views(layer), strict=True)
            )
            ok_e = out_e == oracle[: len(out_e)]
            ok_g = out_g == oracle[: len(out_g)]
            log.append(f"step {step}: live slot before {slot_before}, commits "
                       f"{eager.records[-1].accept_n}/{graphed.records[-1].accept_n}, greedy "
                       f"eager {ok_e} graphs {ok_g}, live states equal {same_live}")
            if not (ok_e and ok_g and same_live):
                break
            step += 1
        captures, replays, failures = _graph_stats(graphed)
        slots = sorted({r.accept_n - 1 for r in graphed.records})
        summary = (f"remap {drafter_name}: {step} steps, slots {slots}, {captures} captures, "
                   f"{replays} replays, failures {failures}")
        ROWS.append(summary)
        print("\n" + summary)
        assert out_e[:n] == oracle[:n] and out_g[:n] == oracle[:n], "\n".join(log[-4:])
        assert not failures, summary
        if drafter_name == "synthetic":
            assert len(slots) >= 3, summary  # several live slots ...
        graphs = graphed.target.graphs
        assert graphs is not None
        keys = graphs[0].captured_keys
        verify_keys = [k for k in keys if k[0] == "verify"]
        assert verify_keys == [("verify", BLOCK, True)], keys  # ... one verify graph
        assert ("rollback:remap", 1, False) in keys, keys
    finally:
        del m
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_dflash_drafting_on_the_device_in_graphs_is_plain_greedy() -> None:
    """The DFlash drafter drafts on the device inside the first shard's graphs (its step
    captured, enqueued before the step's one sync) on an 8-layer bf16 model split in two
    shards: tokens are plain greedy's in every mode, the drafter's graph really replays,
    and its drafts agree with the host path's (reported: bf16 attention over a padded,
    masked context may round differently from the cropped one)."""
    m = _eight_layer_bf16()
    try:
        drafter = _random_dflash(m, seed=1)
        prompt, n = _prompt(m.config.vocab_size, 128, seed=31), 96
        plan = plan_shards(8, "cuda:0,cuda:0", "4,4")
        oracle = reference_greedy(m, plan, prompt, n + BLOCK)
        for mode in ROLLBACK_MODES:
            drafts = []
            for graphs in (False, True):
                out, engine, target = _decode(m, drafter, plan, prompt, n, mode, graphs)
                assert out[:n] == oracle[:n], f"{mode} graphs={graphs}"
                drafts.append([r.draft for r in engine.records])
                if graphs:
                    assert engine.device_drafter is not None
                    g = target.graphs
                    assert g is not None
                    assert ("draft", BLOCK, False) in g[0].captured_keys, (
                        g[0].captured_keys, g[0].failures
                    )
                    assert not [f for x in g for f in x.failures]
            same = sum(a == b for a, b in zip(drafts[0], drafts[1], strict=False))
            ROWS.append(f"dflash on device {mode}: {same}/{len(drafts[1])} drafts equal the "
                        f"host path's")
            print("\n" + ROWS[-1])
    finally:
        del m
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_a_draft_dtype_changes_the_device_drafts_only() -> None:
    """``draft_dtype=float32`` for a bf16 drafter, drafting on the device inside graphs:
    its products run in float32 (its weight copies), its device drafts differ from the
    bf16 drafter's somewhere, and the tokens are plain greedy's in every mode."""
    m = _eight_layer_bf16()
    try:
        prompt, n = _prompt(m.config.vocab_size, 128, seed=41), 96
        plan = plan_shards(8, "cuda:0")
        oracle = reference_greedy(m, plan, prompt, n + BLOCK)
        drafts: dict[object, list[tuple[int, ...]]] = {}
        for draft_dtype in (None, torch.float32):
            drafter = _random_dflash(m, seed=1, draft_dtype=draft_dtype)
            for mode in ROLLBACK_MODES:
                out, engine, _ = _decode(m, drafter, plan, prompt, n, mode, True)
                assert out[:n] == oracle[:n], f"{mode} draft_dtype={draft_dtype}"
                assert engine.device_drafter is drafter
                drafts.setdefault(draft_dtype, []).extend(r.draft for r in engine.records)
            assert drafter.draft_dtype == draft_dtype
        assert drafts[None] != drafts[torch.float32]  # the products really changed
        ROWS.append(f"draft_dtype float32 on a bf16 drafter: {len(drafts[torch.float32])} "
                    "steps, every mode plain greedy")
        print("\n" + ROWS[-1])
    finally:
        del m
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_lookup_assisted_dflash_on_cuda_is_plain_greedy() -> None:
    """``dflash+lookup`` on CUDA, every mode: eager (host proposals) and with graphs (the
    DFlash drafter drafts on the device, the host revises its guesses after each step's
    read); tokens are plain greedy's, every step's draft went through the rule."""
    from dflash.model.drafters import LookupAssistedDrafter

    m = _eight_layer_bf16()
    try:
        hybrid = LookupAssistedDrafter(_random_dflash(m, seed=1))
        prompt, n = _prompt(m.config.vocab_size, 32, seed=37) * 4, 96
        plan = plan_shards(8, "cuda:0")
        oracle = reference_greedy(m, plan, prompt, n + BLOCK)
        for mode in ROLLBACK_MODES:
            for graphs in (False, True):
                out, engine, _ = _decode(m, hybrid, plan, prompt, n, mode, graphs)
                assert out[:n] == oracle[:n], f"{mode} graphs={graphs}"
                assert (engine.device_drafter is hybrid) == graphs
                assert hybrid.drafts == len(engine.records)
                ROWS.append(f"dflash+lookup {mode} graphs={graphs}: {len(engine.records)} "
                            f"steps, {hybrid.copied_drafts} copied")
                print("\n" + ROWS[-1])
    finally:
        del m
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_the_default_pair_copies_on_the_device_and_stays_plain_greedy() -> None:
    """The shipped pair in bf16 with graphs, the main job's prompt, 256 tokens: the host
    revises the device's drafts into copies (the continuation repeats), and the tokens are
    plain greedy's in every mode."""
    from dflash.commands.settings import DEFAULT_PROMPT
    from dflash.data import default_dir
    from dflash.execution import session
    from dflash.model.drafters import LookupAssistedDrafter

    if not (default_dir("drafter") / "model.safetensors").is_file():
        pytest.skip("the default pair is not installed")
    m = session.build_model("default", seed=0, dtype=torch.bfloat16, device="cuda:0")
    prompt = session.encode_prompt(
        "default", m.config.vocab_size, text=DEFAULT_PROMPT, ids=None, length=None, seed=0
    )
    plan = plan_shards(m.config.num_hidden_layers, "cuda:0")
    n = 256
    drafter, _ = session.build_drafter(
        "dflash+lookup", m, prompt, plan=plan, acceptance=0.8, seed=0, max_new_tokens=n,
        block_size=BLOCK, model_spec="default",
    )
    assert isinstance(drafter, LookupAssistedDrafter)
    oracle = reference_greedy(m, plan, prompt, n)
    for mode in ROLLBACK_MODES:
        r = generate(m, drafter, prompt, plan=plan, max_new_tokens=n, block_size=BLOCK,
                     policy=RollbackPolicy(mode=mode), graphs=True)
        assert r.tokens == oracle[:n], mode
        assert r.copied_drafts is not None and r.copied_drafts > 0, mode
        ROWS.append(f"default pair, dflash+lookup, graphs, {mode}: {r.steps} steps, "
                    f"{r.copied_drafts} copied, commit {r.avg_commit:.2f}")
        print("\n" + ROWS[-1])
