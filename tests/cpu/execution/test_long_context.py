"""Prefill in chunks, prefill that continues, and contexts sized before they are allocated.

- a prompt prefilled in chunks of any size leaves speculative decoding bitwise equal to
  plain decoding prefilled in the same chunks, in every rollback mode, and the greedy
  continuation the same as one whole-prompt prefill's;
- :meth:`ShardedTarget.prefill` hands back the last row's logits only and every tap row;
- a prefill starts at 0 or continues at the committed length, nothing else (refused with
  the caches untouched);
- a conversation's second turn prefills only its new tokens on a kept engine, and its
  tokens are plain decoding's along the same path;
- the memory a context needs is counted exactly before any cache exists, and a context
  that does not fit is refused with the estimate.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

import dflash.execution.memory as memory
from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    ShardedTarget,
    SpecDecoder,
    generate,
    plan_shards,
)
from dflash.execution.memory import InsufficientMemoryError, context_memory
from dflash.execution.oracle import greedy_target, reference_greedy
from dflash.execution.shards import ShardPlan, chunk_bounds
from dflash.model import CacheError, ShardCaches, TargetModel
from dflash.model.drafters import DFlashConfig, DFlashDrafter, Drafter, PromptLookupDrafter

MODES: list[RollbackMode] = ["replay", "checkpoint", "remap", "recompute"]
PROMPT = [(5 * i * i + 3 * i + 7) % 256 for i in range(45)]
NEW_TURN = [(11 * i + 2) % 256 for i in range(13)]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=3)


def _plan() -> ShardPlan:
    return plan_shards(6, "cpu,cpu", "2,4")  # a shard boundary inside every forward


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefills_keep_speculative_decoding_plain_decoding(
    tiny: TargetModel, mode: RollbackMode
) -> None:
    tokens: dict[int | None, list[int]] = {}
    for chunk in (1, 4, 16, 44, None):
        r = generate(tiny, PromptLookupDrafter(), PROMPT, plan=_plan(), max_new_tokens=24,
                     block_size=4, policy=RollbackPolicy(mode=mode), check_parity=True,
                     prefill_chunk=chunk)
        assert r.parity is True, f"chunk {chunk}"
        assert r.timings.prefill_tokens_per_s is not None
        assert r.timings.prefill_tokens_per_s > 0
        tokens[chunk] = r.tokens
    # float32: other chunks round differently, but not enough to move an argmax here
    assert all(t == tokens[None] for t in tokens.values())


@torch.inference_mode()
def test_sharded_prefill_returns_the_last_rows_logits_and_every_tap(tiny: TargetModel) -> None:
    whole = ShardedTarget(tiny, _plan(), max_len=64, max_draft=4, prefill_chunk=None)
    chunked = ShardedTarget(tiny, _plan(), max_len=64, max_draft=4, prefill_chunk=7)
    seen: list[tuple[int, int]] = []
    a, taps_a = whole.prefill(PROMPT, taps=(1, 4))
    b, taps_b = chunked.prefill(PROMPT, taps=(1, 4), on_chunk=lambda d, n: seen.append((d, n)))
    assert a.shape == b.shape == (1, tiny.config.vocab_size)
    assert seen == [(min(k, 45), 45) for k in range(7, 52, 7)]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for layer in (1, 4):
        assert taps_a[layer].shape == taps_b[layer].shape == (1, 45, tiny.config.hidden_size)
        torch.testing.assert_close(taps_a[layer], taps_b[layer], rtol=1e-4, atol=1e-4)
    assert chunked.positions() == [(None, 45), (45, 45)]  # shard 0 holds no attention layer


@torch.inference_mode()
def test_a_prefill_starts_at_zero_or_continues_at_the_committed_length(tiny: TargetModel) -> None:
    caches = tiny.new_caches(max_len=64)
    ids = torch.tensor([PROMPT[:10]])
    tiny(ids, caches, "prefill")
    state = caches.pool.state.clone()
    for start, error, words in ((5, CacheError, "does not match"),
                                (11, CacheError, "does not match"),
                                (-1, ValueError, "'start_pos' must be an int >= 0"),
                                (True, ValueError, "'start_pos' must be an int >= 0")):
        with pytest.raises(error, match=words):
            tiny(torch.tensor([PROMPT[10:20]]), caches, "prefill", start=start)
        assert caches.length == 10 and torch.equal(caches.pool.state, state)
    tiny(torch.tensor([PROMPT[10:20]]), caches, "prefill", start=10)
    assert caches.length == 20 and caches.pool.length == 20
    tiny(torch.tensor([PROMPT[:3]]), caches, "prefill")  # at 0: a new sequence
    assert caches.length == 3 and caches.pool.length == 3


def _plain_along(
    tiny: TargetModel, first: Sequence[int], decoded: Sequence[int], rest: Sequence[int],
    n: int, chunk: int | None,
) -> list[int]:
    """Plain decoding along a conversation's path: ``first`` prefilled, ``decoded`` one
    token per forward, ``rest`` prefilled continuing, then ``n`` greedy tokens."""
    target = greedy_target(tiny, _plan(), len(first) + len(decoded) + len(rest), n,
                           prefill_chunk=chunk)
    target.prefill(list(first))
    pos = len(first)
    for tok in decoded:
        target.forward([tok], "decode", pos)
        pos += 1
    logits, _ = target.prefill(list(rest), pos)
    out = [int(logits[-1].argmax())]
    pos += len(rest)
    while len(out) < n:
        logits, _ = target.forward([out[-1]], "decode", pos)
        pos += 1
        out.append(int(logits[-1].argmax()))
    return out


def _drafter(kind: str, tiny: TargetModel) -> Drafter:
    if kind == "lookup":
        return PromptLookupDrafter()
    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2, block_size=4
    )
    drafter = DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2)
    if kind == "dflash-window":  # the prefills hand it only its last 6 rows' taps
        drafter.context_window = 6
    return drafter


@pytest.mark.parametrize("kind", ["lookup", "dflash", "dflash-window"])
@pytest.mark.parametrize("mode", MODES)
def test_a_second_turn_prefills_only_its_new_tokens(
    tiny: TargetModel, mode: RollbackMode, kind: str
) -> None:
    """(The DFlash drafter's context cache continues too: the last step's committed rows,
    not yet given to it, come before the new turn's.)"""
    chunk = 8
    policy = RollbackPolicy(mode=mode)
    target = ShardedTarget(tiny, _plan(), max_len=256, max_draft=4, prefill_chunk=chunk)
    engine = SpecDecoder(target, _drafter(kind, tiny), block_size=4, policy=policy)
    first = generate(tiny, engine.drafter, PROMPT, plan=_plan(), max_new_tokens=20,
                     block_size=4, policy=policy, target=target, engine=engine,
                     prefill_chunk=chunk)
    assert first.cached_tokens == 0
    held = list(engine.context)  # the prompt and the output committed after it
    assert held[: len(PROMPT)] == PROMPT and len(held) > len(PROMPT)
    turn = held + NEW_TURN
    ran: list[tuple[str, int, int]] = []
    real = target._forward

    def recording(ids, mode_, start, *args):  # type: ignore[no-untyped-def]  # a spy
        ran.append((mode_, start, len(ids)))
        return real(ids, mode_, start, *args)

    target._forward = recording  # type: ignore[method-assign]  # the spy above
    second = generate(tiny, engine.drafter, turn, plan=_plan(), max_new_tokens=16,
                      block_size=4, policy=policy, target=target, engine=engine,
                      prefill_chunk=chunk, reuse=True)
    prefills = [r for r in ran if r[0] == "prefill"]
    edges = [len(held), *range(-(-len(held) // chunk) * chunk, len(turn), chunk), len(turn)]
    assert prefills == [("prefill", lo, hi - lo) for lo, hi in itertools.pairwise(edges)
                        if hi > lo]  # only the new turn, in chunks ending at multiples of 8
    assert second.cached_tokens == len(held)
    plain = _plain_along(tiny, PROMPT, held[len(PROMPT):], NEW_TURN, 16, chunk)
    assert second.tokens == plain  # bitwise: the same forwards as plain decoding's
    fresh = reference_greedy(tiny, _plan(), turn, 16, prefill_chunk=chunk)
    assert second.tokens == fresh  # one whole prefill: other rounding, the same tokens


def test_a_kept_engine_holds_one_generation_s_records(tiny: TargetModel) -> None:
    """A server keeps one engine for every request: its step records are the current
    generation's only (numbered on from the earlier ones), and its lifecycle keeps the
    last :data:`dflash.execution.rollback.HISTORY` transitions, so neither grows with
    the requests served."""
    from dflash.execution.rollback import HISTORY, Lifecycle

    policy = RollbackPolicy(mode="checkpoint")
    target = ShardedTarget(tiny, _plan(), max_len=256, max_draft=4)
    engine = SpecDecoder(target, PromptLookupDrafter(), block_size=4, policy=policy)
    total = 0
    for new in (20, 12, 16):
        result = generate(tiny, engine.drafter, PROMPT, plan=_plan(), max_new_tokens=new,
                          block_size=4, policy=policy, target=target, engine=engine)
        assert len(engine.records) == result.steps > 0
        assert [r.step for r in engine.records] == list(range(total, total + result.steps))
        total += result.steps
        assert engine.steps_run == total
    life = Lifecycle()
    for _ in range(HISTORY + 5):
        life.move("rebuild")
    assert len(life.history) == HISTORY


def test_reuse_starts_over_when_the_prompt_does_not_extend_the_caches(tiny: TargetModel) -> None:
    target = ShardedTarget(tiny, _plan(), max_len=256, max_draft=4)
    engine = SpecDecoder(target, PromptLookupDrafter(), block_size=4)
    engine.prefill(PROMPT)
    other = [*PROMPT[:-1], (PROMPT[-1] + 1) % 256, 9, 9]
    assert engine.reusable(other) == 0
    assert engine.reusable(PROMPT) == 0  # not a proper prefix: nothing new to prefill
    assert engine.reusable([*PROMPT, 1]) == len(PROMPT)
    engine.prefill(other, reuse=True)
    assert engine.reused == 0 and engine.committed == len(other)


def _allocated(caches: ShardCaches) -> tuple[int, int, int]:
    def size(ts: Sequence[torch.Tensor | None]) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    pool = caches.pool
    return (
        size([caches.kv.k, caches.kv.v]),
        size([pool.state, pool.conv, pool.snapshot, pool.live, pool.position, *caches.rope,
              caches.tree.depth, caches.tree.paths]),
        size([*pool.capture_buffers().values(), pool.tree_states]),
    )


@pytest.mark.parametrize(("capture", "trees"), [("states", False), ("inputs", True)])
def test_the_estimate_counts_the_caches_exactly(
    tiny: TargetModel, capture: str, trees: bool
) -> None:
    layers = range(1, 6)
    est = context_memory(tiny.config, layers, max_len=300, max_draft=8, dtype=torch.float32,
                         capture=capture, trees=trees, prefill_chunk=64)  # type: ignore[arg-type]  # a CaptureKind
    real = ShardCaches.for_layers(tiny.config, layers, max_len=300, max_draft=8,
                                  capture=capture, trees=trees)  # type: ignore[arg-type]  # a CaptureKind
    assert (est.kv, est.state, est.capture) == _allocated(real)
    assert est.kv == 2 * 2 * 1 * tiny.config.num_key_value_heads * 300 * tiny.config.head_dim * 4
    small = context_memory(tiny.config, layers, max_len=300, max_draft=8, dtype=torch.float32,
                           capture="states", trees=False, prefill_chunk=16)
    assert 0 < small.workspace < est.workspace  # one chunk's activations, not the prompt's


def test_a_context_that_cannot_fit_is_refused_before_any_cache(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: (10**6, "a test's meminfo"))
    built: list[object] = []
    real = ShardCaches.for_layers

    def counting(*args: object, **kwargs: object) -> ShardCaches:
        if kwargs.get("device") != "meta":
            built.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]  # forwarded as given

    monkeypatch.setattr(ShardCaches, "for_layers", counting)
    with pytest.raises(InsufficientMemoryError) as info:
        ShardedTarget(tiny, _plan(), max_len=4096, max_draft=4)
    text = str(info.value)
    assert "a context of 4096 positions (shard 0, layers 0-1)" in text
    assert "KV " in text and "recurrent state " in text and "prefill workspace" in text
    assert "only 1.0 MB is free (a test's meminfo)" in text
    assert built == []  # refused before any cache was allocated
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # unknown: no check
    ShardedTarget(tiny, _plan(), max_len=64, max_draft=4)


@torch.inference_mode()
def test_a_long_chunk_takes_the_chunk_parallel_recurrence(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From CHUNKED_PREFILL_MIN tokens on a CPU prefill runs the gated delta rule in
    chunk-parallel form; its state and logits stay within float32 rounding of the token
    loop's, and the greedy continuation is the same."""
    import dflash.kernels as kernels
    import dflash.model.layers as layers

    prompt = [(7 * i * i + 5) % 256 for i in range(300)]
    calls: list[int] = []
    real = kernels.gdn_chunk_prefill

    def counting(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(q.shape[1])
        return real(q, *args, **kwargs)  # type: ignore[arg-type]  # forwarded as given

    monkeypatch.setattr(layers, "gdn_chunk_prefill", counting)
    runs = {}
    for chunked in (True, False):
        tiny.chunked_prefill = chunked
        try:
            caches = tiny.new_caches(max_len=320)
            logits, _ = tiny(torch.tensor([prompt]), caches, "prefill")
            runs[chunked] = (logits[0, -1], caches.pool.state.clone(),
                             reference_greedy(tiny, _plan(), prompt, 8, prefill_chunk=None))
        finally:
            tiny.chunked_prefill = True
    assert calls == [300] * 8  # 4 recurrent layers, twice: the oracle's prefill too
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)
    assert runs[True][2] == runs[False][2]


@torch.inference_mode()
def test_the_chunk_parallel_form_takes_the_models_chunk_and_precision(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TargetModel.gdn_chunk`` reaches every chunked GDN call of a prefill (64 and float32
    products unless set); a chunk of 16 and 64 give the same greedy continuation."""
    import dflash.kernels as kernels
    import dflash.model.layers as layers
    from dflash.model.layers import GdnChunking

    prompt = [(7 * i * i + 5) % 256 for i in range(300)]
    seen: list[tuple[object, object]] = []
    real = kernels.gdn_chunk_prefill

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append((kwargs.get("chunk"), kwargs.get("precision")))
        return real(*args, **kwargs)  # type: ignore[arg-type]  # forwarded as given

    monkeypatch.setattr(layers, "gdn_chunk_prefill", recording)
    assert tiny.gdn_chunk is None   # the device's: 64 and float32 on CPU
    continuations = {}
    tiny.chunked_prefill = True
    try:
        for setting in (GdnChunking(16, "tf32"), GdnChunking()):
            tiny.gdn_chunk = setting
            continuations[setting.chunk] = reference_greedy(tiny, _plan(), prompt, 8,
                                                            prefill_chunk=None)
    finally:
        tiny.chunked_prefill = True
        tiny.gdn_chunk = None
    assert seen == [(16, "tf32")] * 4 + [(64, "ieee")] * 4   # 4 recurrent layers each
    assert continuations[16] == continuations[64]


def test_prefills_are_chunk_parallel_by_default_with_each_device_s_settings(
        tiny: TargetModel) -> None:
    """By default a prefill runs the chunk-parallel gated delta rule on every device:
    chunks of 64 in float32 on CPU, 32 with tf32 products on CUDA (the H200's faster
    form); a model's own setting wins on both, and ``chunked_prefill = False`` keeps the
    token loop."""
    from dflash.model.layers import CUDA_GDN_CHUNKING, GdnChunking

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tiny.chunked_prefill is True and tiny.gdn_chunk is None
    assert GdnChunking(32, "tf32") == CUDA_GDN_CHUNKING
    for device, want in ((cpu, GdnChunking(64, "ieee")), (cuda, GdnChunking(32, "tf32"))):
        ops = tiny.ops("prefill", device)
        assert ops.chunked_prefill and ops.gdn_chunk == want
    try:
        tiny.gdn_chunk = GdnChunking(128, "ieee")
        tiny.chunked_prefill = False
        for device in (cpu, cuda):
            ops = tiny.ops("prefill", device)
            assert not ops.chunked_prefill and ops.gdn_chunk == GdnChunking(128, "ieee")
    finally:
        tiny.chunked_prefill = True
        tiny.gdn_chunk = None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"chunk": 8}, "'chunk' must be a power of two in 16 … 128 \\(got 8\\)"),
    ({"chunk": 48}, "\\(got 48\\)"),
    ({"chunk": 256}, "\\(got 256\\)"),
    ({"chunk": True}, "\\(got True\\)"),
    ({"precision": "bf16"}, "'precision' must be one of ieee, tf32 \\(got 'bf16'\\)"),
])
def test_gdn_chunking_refuses_what_the_kernels_cannot_run(kwargs: dict[str, object],
                                                           match: str) -> None:
    from dflash.model.layers import GdnChunking

    with pytest.raises(ValueError, match=match):
        GdnChunking(**kwargs)  # type: ignore[arg-type]  # deliberately ill-typed values


@torch.inference_mode()
def test_a_prefill_that_cannot_run_is_refused_before_its_first_chunk(tiny: TargetModel) -> None:
    from dflash.execution.errors import ContextLengthError, ShardPositionError

    target = ShardedTarget(tiny, _plan(), max_len=48, max_draft=4, prefill_chunk=8)
    target.prefill(PROMPT[:20])
    before = target.positions()
    with pytest.raises(ContextLengthError, match="needs 50 positions; the caches hold 48"):
        target.prefill(PROMPT[:30], 20)
    with pytest.raises(ShardPositionError, match="a prefill at position 12 continues"):
        target.prefill(PROMPT[:3], 12)
    with pytest.raises(ValueError, match="'start' must be an int >= 0"):
        target.prefill(PROMPT[:3], -1)
    assert target.positions() == before  # nothing ran
    target.prefill(PROMPT[20:28], 20)
    assert target.positions() == [(None, 28), (28, 28)]


def test_a_windowed_drafter_gets_only_the_rows_it_reads(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill keeps only the drafter's reach of tap rows; the drafts, and so every
    step, are the ones the whole prompt's rows give."""
    from dflash.execution.drafts import HostDrafts

    runs = []
    for trimmed in (True, False):
        if not trimmed:
            monkeypatch.setattr(HostDrafts, "feature_rows", lambda self: None)
        given: list[int] = []
        real = HostDrafts.start

        def spy(self, features, last, at=0, skipped=0, given=given, real=real):  # type: ignore[no-untyped-def]  # a spy
            given.append(features.shape[0])
            real(self, features, last, at, skipped)

        monkeypatch.setattr(HostDrafts, "start", spy)
        target = ShardedTarget(tiny, _plan(), max_len=128, max_draft=4, prefill_chunk=8)
        engine = SpecDecoder(target, _drafter("dflash-window", tiny), block_size=4)
        r = generate(tiny, engine.drafter, PROMPT, plan=_plan(), max_new_tokens=20,
                     block_size=4, target=target, engine=engine, prefill_chunk=8,
                     check_parity=True)
        assert r.parity is True
        runs.append((given, [rec.draft for rec in engine.records], r.tokens))
        monkeypatch.undo()
    assert runs[0][0] == [6] and runs[1][0] == [len(PROMPT)]
    assert runs[0][1:] == runs[1][1:]


@pytest.mark.parametrize(("start", "n", "chunk", "want"), [
    (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
    (6, 10, 4, [(0, 2), (2, 6), (6, 10)]),
    (8, 3, 4, [(0, 3)]),
    (5, 3, None, [(0, 3)]),
    (3, 1, 1, [(0, 1)]),
])
def test_chunks_end_at_absolute_multiples_of_the_chunk(
    start: int, n: int, chunk: int | None, want: list[tuple[int, int]]
) -> None:
    assert chunk_bounds(start, n, chunk) == want


@torch.inference_mode()
def test_a_prefill_that_continues_at_a_chunk_boundary_is_bitwise_one_prefill(
    tiny: TargetModel,
) -> None:
    """The state at a multiple of the chunk is the same bits however the prefill got there:
    one prefill of the whole prompt equals one that stopped at a boundary and continued."""
    one = ShardedTarget(tiny, _plan(), max_len=64, max_draft=4, prefill_chunk=8)
    two = ShardedTarget(tiny, _plan(), max_len=64, max_draft=4, prefill_chunk=8)
    a, _ = one.prefill(PROMPT)
    two.prefill(PROMPT[:16])
    b, _ = two.prefill(PROMPT[16:], 16)
    assert torch.equal(a, b)
    for x, y in zip(one.shards, two.shards, strict=True):
        assert torch.equal(x.caches.pool.state, y.caches.pool.state)
