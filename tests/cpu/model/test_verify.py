"""Verify with capture equals sequential decoding; every rollback path lands on the same state.

M-invariance, model level: a ``T``-token verify (or replay) computes each token's row
with the same bits as the ``T = 1`` decode of the same state — logits, tap features,
checkpointed recurrent states and captured conv rows — in float32 and bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dflash.geometry import require_chain
from dflash.kernels.checks import INTERPRET
from dflash.model import CacheError, HybridConfig, RecurrentPool, ShardCaches, TargetModel
from dflash.model.caches import CaptureKind, NoSuchBufferError, capture_kind
from dflash.model.layers import Ops

torch.set_num_threads(1)  # tiny matrices: one thread is faster and immune to machine load

PROMPT = [5, 17, 200, 3, 99, 42, 7]
DRAFT = [11, 250, 64, 9, 123, 31]  # B = 6, d[0] is the pending token
B = len(DRAFT)


@pytest.fixture(scope="module")
def model() -> TargetModel:
    return TargetModel.tiny_default(seed=3)


def _ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens])


def _prefilled(model: TargetModel, capture: CaptureKind = "states") -> ShardCaches:
    caches = model.new_caches(max_len=64, max_draft=8, capture=capture)
    model(_ids(PROMPT), caches, "prefill")
    return caches


def _live(caches: ShardCaches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in caches.pool.layer_ids:
        state, conv = caches.pool.live_views(layer)
        out.append((state.clone(), conv.clone()))
    return out


@torch.inference_mode()
def _sequential(
    model: TargetModel, tokens: list[int]
) -> tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Logits [T, vocab] of decoding ``tokens`` one at a time after PROMPT, and the live states."""
    caches = _prefilled(model)
    logits, states = [], []
    for tok in tokens:
        out, _ = model(_ids([tok]), caches, "decode")
        logits.append(out[0, -1])
        states.append(_live(caches))
    return torch.stack(logits), states


def _moe_config() -> HybridConfig:
    """The tiny shape with sparse mixture-of-experts MLPs in layers 1 (recurrent) and 2."""
    base = HybridConfig.tiny_default().model_dump()
    return HybridConfig(
        **{
            **base,
            "sparse_layer_ids": (1, 2),
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        }
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16", "moe-bfloat16"])
def typed_model(request: pytest.FixtureRequest) -> Iterator[TargetModel]:
    name = str(request.param)
    dtype = torch.float32 if name == "float32" else torch.bfloat16
    config = _moe_config() if name.startswith("moe") else HybridConfig.tiny_default()
    yield TargetModel.seeded(config, seed=3, dtype=dtype)


LONG_DRAFT = [11, 250, 64, 9, 123, 31, 0, 255, 7, 7, 7, 42, 1, 2, 3, 99, 18]  # T = 17


@torch.inference_mode()
def _decode_rows(
    model: TargetModel, tokens: list[int], taps: tuple[int, ...]
) -> tuple[
    list[torch.Tensor], list[dict[int, torch.Tensor]], list[list[tuple[torch.Tensor, torch.Tensor]]]
]:
    caches = model.new_caches(max_len=64, max_draft=len(tokens))
    model(_ids(PROMPT), caches, "prefill")
    logits: list[torch.Tensor] = []
    tapped: list[dict[int, torch.Tensor]] = []
    states: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for tok in tokens:
        out, t = model(_ids([tok]), caches, "decode", taps=taps)
        logits.append(out[0, 0])
        tapped.append({k: v[0, 0] for k, v in t.items()})
        states.append(_live(caches))
    return logits, tapped, states


@torch.inference_mode()
def test_verify_rows_are_bitwise_the_decode_rows(typed_model: TargetModel) -> None:
    """Row ``t`` of one 17-token verify == the ``t``-th one-token decode, bit for bit."""
    model, taps = typed_model, (1, 2, 4)
    want_logits, want_taps, want_states = _decode_rows(model, LONG_DRAFT, taps)
    t = len(LONG_DRAFT)
    caches = model.new_caches(max_len=64, max_draft=t)
    model(_ids(PROMPT), caches, "prefill")
    pool = caches.pool
    pool.checkpoints.fill_(float("nan"))  # an unwritten slot cannot pass
    pool.captured.fill_(float("nan"))
    logits, got_taps = model(
        _ids(LONG_DRAFT), caches, "verify", geometry=require_chain(list(range(-1, t - 1))),
        taps=taps,
    )
    kc = model.config.linear_conv_kernel_dim
    for s in range(t):
        assert torch.equal(logits[0, s], want_logits[s]), f"logits row {s}"
        for k in taps:
            assert torch.equal(got_taps[k][0, s], want_taps[s][k]), f"tap {k} row {s}"
        for i in range(len(pool.layer_ids)):
            state, conv = want_states[s][i]
            assert torch.equal(pool.checkpoints[i, :, s], state), f"state slot {s} layer {i}"
            assert torch.equal(pool.captured[i, :, s + 1 : s + kc], conv), f"conv slot {s}"


@torch.inference_mode()
def test_replay_rows_and_state_are_bitwise_the_decode_ones(typed_model: TargetModel) -> None:
    model = typed_model
    want_logits, _, want_states = _decode_rows(model, LONG_DRAFT[:9], ())
    caches = model.new_caches(max_len=64, max_draft=9)
    model(_ids(PROMPT), caches, "prefill")
    logits, _ = model(_ids(LONG_DRAFT[:9]), caches, "replay")
    for s in range(9):
        assert torch.equal(logits[0, s], want_logits[s]), f"logits row {s}"
    for got, want in zip(_live(caches), want_states[-1], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_each_token_runs_on_position_tiles_on_cpu_only() -> None:
    """A CPU row's bits may depend on the call's shape (BLAS blockings, scalar vector-loop
    tails), so invariant CPU forwards evaluate on 16-row tiles where position p is always row
    p mod 16; prefill and CUDA forwards call the function once."""
    seen: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def record(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(x.shape), x.clone()))
        return x * 2 + y

    x, y = torch.randn(1, 5, 3), torch.randn(1, 5, 3)
    cpu = torch.device("cpu")
    out = Ops(invariant=True, backend="reference", device=cpu, start=14).each_token(record, x, y)
    assert [shape for shape, _ in seen] == [(1, 16, 3)] * 2 and torch.equal(out, x * 2 + y)
    first, second = seen[0][1], seen[1][1]  # positions 14, 15 | 16, 17, 18
    assert torch.equal(first[0, 14:], x[0, :2]) and not first[0, :14].any()
    assert torch.equal(second[0, :3], x[0, 2:]) and not second[0, 3:].any()
    seen.clear()
    at_17 = Ops(invariant=True, backend="reference", device=cpu, start=17)
    one = at_17.each_token(record, x[:, 1:2], y[:, 1:2])
    assert [shape for shape, _ in seen] == [(1, 16, 3)] and torch.equal(seen[0][1][0, 1], x[0, 1])
    assert torch.equal(one, out[:, 1:2])
    seen.clear()
    Ops(invariant=False, backend="reference", device=cpu).each_token(record, x, y)
    assert [shape for shape, _ in seen] == [(1, 5, 3)]
    with pytest.raises(ValueError, match="position of its row 0"):
        Ops(invariant=True, backend="reference", device=cpu)
    assert Ops(invariant=True, backend="auto", device=torch.device("cuda")).tiles is None


@torch.inference_mode()
def test_verify_equals_sequential_decode(model: TargetModel) -> None:
    ref_logits, ref_states = _sequential(model, DRAFT)
    caches = _prefilled(model)
    before = _live(caches)
    pool = caches.pool
    pool.checkpoints.fill_(float("nan"))  # an unwritten slot cannot pass
    pool.snapshot.fill_(float("nan"))
    logits, _ = model(_ids(DRAFT), caches, "verify", geometry=require_chain(list(range(-1, B - 1))))
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=1e-5)
    kc = model.config.linear_conv_kernel_dim
    for i, layer in enumerate(pool.layer_ids):
        torch.testing.assert_close(pool.snapshot[i], before[i][0], rtol=0, atol=0)
        torch.testing.assert_close(pool.state[i], before[i][0], rtol=0, atol=0)  # live untouched
        torch.testing.assert_close(pool.conv[i], before[i][1], rtol=0, atol=0)
        for s in range(B):
            state_s, conv_s = ref_states[s][i]
            torch.testing.assert_close(pool.checkpoints[i, :, s], state_s, rtol=1e-5, atol=1e-6)
            got_conv = pool.captured[i, :, s + 1 : s + kc]
            torch.testing.assert_close(got_conv, conv_s, rtol=1e-4, atol=1e-5)
        assert layer == model.config.recurrent_layer_ids[i]
    assert caches.kv.length == len(PROMPT) + B and pool.length == len(PROMPT)


def _verify(model: TargetModel, caches: ShardCaches, draft: list[int]) -> torch.Tensor:
    geometry = require_chain(list(range(-1, len(draft) - 1)))
    logits: torch.Tensor
    logits, _ = model(_ids(draft), caches, "verify", geometry=geometry)
    return logits[0]


def roll_back(pool: RecurrentPool, mode: str, commit_n: int) -> None:
    """A fast rollback as the engine runs it: the host checks, the device work on the
    count, the host mirrors once the count is known."""
    pool.mark_device_rollback(mode)
    pool.rollback_on_device(mode, torch.tensor([commit_n], device=pool.position.device))
    pool.finish_rollback(mode, commit_n)


def _rollback(
    model: TargetModel, caches: ShardCaches, path: str, commit_n: int, draft: list[int]
) -> None:
    start = caches.pool.length
    if path in ("checkpoint", "remap", "recompute"):
        roll_back(caches.pool, path, commit_n)
    else:  # legacy: snapshot + replay of the accepted tokens
        caches.pool.restore_pre_verify()
        caches.kv.truncate(start)
        model(_ids(draft[:commit_n]), caches, "replay")
    caches.kv.truncate(start + commit_n)


@pytest.mark.parametrize("path", ["checkpoint", "remap", "recompute", "replay"])
@torch.inference_mode()
def test_rollback_then_continue_matches_sequential(model: TargetModel, path: str) -> None:
    """Two verify/rollback rounds (commit 3 then 2), then decode: same logits as sequential."""
    second = [77, 1, 2, 3]
    caches = _prefilled(model, capture_kind(path))
    _verify(model, caches, DRAFT)
    _rollback(model, caches, path, 3, DRAFT)
    assert caches.length == len(PROMPT) + 3
    if path == "remap":
        assert caches.pool.live_slot == 2
    logits2 = _verify(model, caches, second)  # after a remap this reads slot 2 (alias-safe)
    _rollback(model, caches, path, 2, second)
    final, _ = model(_ids([200]), caches, "decode")
    ref_verify, _ = _sequential(model, DRAFT[:3] + second)
    ref_final, _ = _sequential(model, DRAFT[:3] + second[:2] + [200])
    torch.testing.assert_close(logits2, ref_verify[3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final[0, -1], ref_final[-1], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_full_accept_and_snapshot_after_remap(model: TargetModel) -> None:
    caches = _prefilled(model)
    _verify(model, caches, DRAFT)
    roll_back(caches.pool, "remap", B)  # every draft slot accepted
    caches.kv.truncate(len(PROMPT) + B)
    live = _live(caches)
    _verify(model, caches, [4, 5])
    caches.pool.restore_pre_verify()  # undo the second verify: back to the remapped state
    caches.kv.truncate(len(PROMPT) + B)
    assert caches.pool.live_slot is None and caches.length == len(PROMPT) + B
    for got, want in zip(_live(caches), live, strict=True):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@torch.inference_mode()
def test_misuse_is_rejected_before_any_change(model: TargetModel) -> None:
    caches = _prefilled(model)
    with pytest.raises(TypeError, match="needs a validated ChainGeometry"):
        model(_ids(DRAFT), caches, "verify", geometry=[-1, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="n_actual=3 slots but 'hidden' has T=6"):
        model(_ids(DRAFT), caches, "verify", geometry=require_chain([-1, 0, 1]))
    with pytest.raises(ValueError, match=r"'ids' must lie in \[0, 256\) \(got min 0, max 999\)"):
        model(_ids([0, 999]), caches, "replay")
    with pytest.raises(ValueError, match="'decode' takes exactly one token"):
        model(_ids([1, 2]), caches, "decode")
    with pytest.raises(CacheError, match="exceeds 'max_draft'=8"):
        _verify(model, caches, list(range(9)))
    with pytest.raises(CacheError, match="no completed verify"):
        caches.pool.mark_device_rollback("checkpoint")
    with pytest.raises(CacheError, match="no verify to undo"):
        caches.pool.restore_pre_verify()
    _verify(model, caches, DRAFT)
    with pytest.raises(CacheError, match="needs a rollback of the last verify"):
        model(_ids([1]), caches, "decode")
    with pytest.raises(CacheError, match="without an enqueued device rollback"):
        caches.pool.finish_rollback("checkpoint", 2)
    caches.pool.mark_device_rollback("checkpoint")
    with pytest.raises(CacheError, match="no completed verify"):  # one rollback per verify
        caches.pool.mark_device_rollback("checkpoint")
    with pytest.raises(CacheError, match=r"must be in \[1, verified slots=6\] \(got 7\)"):
        caches.pool.finish_rollback("checkpoint", 7)
    with pytest.raises(CacheError, match=r"\(got 0\)"):
        caches.pool.finish_rollback("remap", 0)
    with pytest.raises(CacheError, match="needs a rollback of the last verify"):
        model(_ids([1]), caches, "decode")  # still enqueued: the forward refuses
    caches.pool.restore_pre_verify()
    caches.kv.truncate(len(PROMPT))
    _verify(model, caches, DRAFT)
    roll_back(caches.pool, "checkpoint", 2)
    with pytest.raises(CacheError, match="'start_pos'=13 does not match the recurrent length 9"):
        model(_ids([1]), caches, "decode")  # KV not truncated to the recurrent length


@torch.inference_mode()
def test_partial_verify_cannot_be_restored_from_checkpoints(model: TargetModel) -> None:
    caches = _prefilled(model)
    hidden = model.embed_tokens(_ids(DRAFT))
    chain = require_chain(list(range(-1, B - 1)))
    model.run_layers(hidden, [0, 1, 2], caches, len(PROMPT), "verify", chain)  # not 3..5
    assert caches.pool.verified_layers == (0, 1)
    with pytest.raises(CacheError, match=r"did not run recurrent layers \[3, 4\]"):
        caches.pool.mark_device_rollback("checkpoint")
    caches.pool.restore_pre_verify()
    caches.kv.truncate(len(PROMPT))
    logits, _ = model(_ids([9]), caches, "decode")
    ref, _ = _sequential(model, [9])
    torch.testing.assert_close(logits[0, -1], ref[0], rtol=1e-5, atol=1e-5)


def test_checkpoint_bytes_formula() -> None:
    cfg = HybridConfig.tiny_default()
    caches = ShardCaches.for_layers(cfg, range(0, 4), max_len=32, max_draft=5, batch=2)
    L = len([i for i in range(4) if cfg.layer_types[i] == "linear_attention"])
    hv, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kc, c = cfg.linear_conv_kernel_dim, cfg.conv_dim
    expected = 4 * L * 2 * 5 * hv * k * v + 4 * L * 2 * (kc - 1 + 5) * c + 4 * L * 2 * hv * k * v
    assert caches.checkpoint_bytes == expected
    assert caches.pool.layer_ids == (0, 1, 3) and caches.kv.layer_ids == (2,)


@pytest.mark.skipif(not INTERPRET, reason="the Triton path on CPU needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_triton_path_remap_matches_reference(model: TargetModel) -> None:
    """The model on the Triton kernels (interpreter): verify, remap, verify again from the
    aliased slot, remap, decode — same logits as the reference sequential decode."""
    path = "remap"
    triton_model = TargetModel.tiny_default(seed=3)
    triton_model.kernel_backend = "triton"
    caches = _prefilled(triton_model)
    first = _verify(triton_model, caches, DRAFT[:4])
    _rollback(triton_model, caches, path, 2, DRAFT)
    second = _verify(triton_model, caches, [77, 1, 2])
    _rollback(triton_model, caches, path, 3, [77, 1, 2])
    final, _ = triton_model(_ids([200]), caches, "decode")
    ref, _ = _sequential(model, [*DRAFT[:2], 77, 1, 2, 200])
    ref_first, _ = _sequential(model, DRAFT[:4])
    torch.testing.assert_close(first, ref_first, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second, ref[2:5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final[0, -1], ref[5], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_taps_are_layer_outputs_and_match_across_modes(model: TargetModel) -> None:
    """A tap is the output of its layer: split runs reproduce it; verify taps equal the
    taps of sequential decoding slot by slot."""
    full = model.new_caches(max_len=16, max_draft=8)
    _, taps = model(_ids(PROMPT), full, "prefill", taps=(1, 4))
    assert sorted(taps) == [1, 4]
    first = model.new_caches(max_len=16, max_draft=8, layer_ids=range(0, 2))
    hidden, got = model.run_layers(model.embed_tokens(_ids(PROMPT)), [0, 1], first, 0,
                                   "prefill", taps=(1, 4))
    assert list(got) == [1] and torch.equal(got[1], hidden)
    torch.testing.assert_close(hidden, taps[1], rtol=0, atol=0)

    caches, seq = _prefilled(model), _prefilled(model)
    chain = require_chain(list(range(-1, B - 1)))
    _, vtaps = model(_ids(DRAFT), caches, "verify", geometry=chain, taps=(4,))
    for i, tok in enumerate(DRAFT):
        _, stap = model(_ids([tok]), seq, "decode", taps=(4,))
        torch.testing.assert_close(vtaps[4][:, i], stap[4][:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the Triton path on CPU needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_triton_path_verify_rows_are_bitwise_the_decode_rows() -> None:
    """The model on the Triton kernels (interpreter): M-invariant like the references."""
    triton_model = TargetModel.tiny_default(seed=3)
    triton_model.kernel_backend = "triton"
    draft = DRAFT[:5]
    want, _, states = _decode_rows(triton_model, draft, ())
    caches = triton_model.new_caches(max_len=64, max_draft=5)
    triton_model(_ids(PROMPT), caches, "prefill")
    logits = _verify(triton_model, caches, draft)
    for s in range(5):
        assert torch.equal(logits[s], want[s]), f"logits row {s}"
        for i in range(len(caches.pool.layer_ids)):
            assert torch.equal(caches.pool.checkpoints[i, :, s], states[s][i][0])


# -- recompute: the verify captures the recurrence's inputs, the rollback re-runs it --------


@torch.inference_mode()
def test_recompute_rollback_is_bitwise_the_decode_state(typed_model: TargetModel) -> None:
    """After a verify of 17 tokens, the state a recompute rollback of ``n`` tokens gives
    (into scratch, and then live) is the one-token decoding state after ``n`` tokens, bit
    for bit, and the verify wrote no per-token state."""
    model = typed_model
    _, _, want_states = _decode_rows(model, LONG_DRAFT, ())
    t = len(LONG_DRAFT)
    caches = model.new_caches(max_len=64, max_draft=t, capture="inputs")
    model(_ids(PROMPT), caches, "prefill")
    pool = caches.pool
    assert getattr(pool, "checkpoints", None) is None and pool.capture == "inputs"
    for buffer in pool.capture_buffers().values():
        buffer.fill_(float("nan"))  # an unwritten input cannot pass
    pool.snapshot.fill_(float("nan"))
    before = pool.state.clone()
    logits = _verify(model, caches, LONG_DRAFT)
    assert torch.isnan(pool.snapshot).all()  # the verify writes no state at all
    assert torch.equal(pool.state, before)
    for n in (1, 2, 9, t):
        state, conv = pool.recomputed_copy(n)
        for i in range(len(pool.layer_ids)):
            want_state, want_conv = want_states[n - 1][i]
            assert torch.equal(state[i], want_state), f"n={n} layer {i}"
            assert torch.equal(conv[i], want_conv), f"n={n} conv {i}"
    assert torch.equal(pool.state, before)  # recomputed_copy leaves the pool as it is
    roll_back(pool, "recompute", 5)
    caches.kv.truncate(len(PROMPT) + 5)
    assert torch.equal(pool.snapshot, before)  # the pre-verify state, for the way back
    for i in range(len(pool.layer_ids)):
        state, conv = pool.live_views(pool.layer_ids[i])
        assert torch.equal(state, want_states[4][i][0]) and torch.equal(conv, want_states[4][i][1])
    decoded, _ = model(_ids([LONG_DRAFT[5]]), caches, "decode")
    assert torch.isfinite(logits).all() and torch.isfinite(decoded).all()


@pytest.mark.skipif(not INTERPRET, reason="the Triton path on CPU needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_triton_path_recompute_is_bitwise_the_decode_state() -> None:
    """On the Triton kernels (interpreter): the recompute kernel reproduces the verify
    kernel's per-token states bit for bit."""
    triton_model = TargetModel.tiny_default(seed=3)
    triton_model.kernel_backend = "triton"
    draft = DRAFT[:5]
    _, _, states = _decode_rows(triton_model, draft, ())
    caches = _prefilled(triton_model, "inputs")
    assert caches.pool.kernel_backend == "triton"
    _verify(triton_model, caches, draft)
    roll_back(caches.pool, "recompute", 3)
    for i, layer in enumerate(caches.pool.layer_ids):
        state, conv = caches.pool.live_views(layer)
        assert torch.equal(state, states[2][i][0]) and torch.equal(conv, states[2][i][1])


@torch.inference_mode()
def test_a_rollback_needs_the_storage_of_its_mode(model: TargetModel) -> None:
    cases: tuple[tuple[CaptureKind, str], ...] = (
        ("states", "recompute"), ("inputs", "checkpoint"), ("inputs", "remap"),
    )
    for capture, wrong in cases:
        caches = _prefilled(model, capture)
        _verify(model, caches, DRAFT)
        with pytest.raises(CacheError, match=f"a '{wrong}' rollback needs"):
            caches.pool.mark_device_rollback(wrong)
        with pytest.raises(CacheError, match="'mode' must be one of"):
            caches.pool.mark_device_rollback("replay")
        caches.pool.restore_pre_verify()  # nothing was changed: the way back works
        assert caches.pool.length == len(PROMPT)
    with pytest.raises(CacheError, match="needs a pool that captures inputs"):
        _prefilled(model).pool.recomputed_copy(1)
    with pytest.raises(NoSuchBufferError, match="captures inputs has no 'checkpoints' buffer"):
        _ = _prefilled(model, "inputs").pool.checkpoints
    assert getattr(_prefilled(model).pool, "g", None) is None  # absent, to getattr too


@pytest.mark.parametrize("stage", ["open", "enqueued", "rolled"])
@torch.inference_mode()
def test_recompute_restore_pre_verify_at_every_stage(model: TargetModel, stage: str) -> None:
    """The fail-closed way back from a recompute rollback at any stage gives the
    pre-verify state and window, bit for bit."""
    caches = _prefilled(model, "inputs")
    pool = caches.pool
    before = _live(caches)
    _verify(model, caches, DRAFT)
    if stage != "open":
        pool.mark_device_rollback("recompute")
        pool.rollback_on_device("recompute", torch.tensor([4]))
        if stage == "rolled":
            pool.finish_rollback("recompute", 4)
        assert not torch.equal(pool.state[0], before[0][0])  # it did change the state
    pool.restore_pre_verify()
    caches.kv.truncate(len(PROMPT))
    assert pool.length == len(PROMPT) and pool.position.tolist() == [len(PROMPT)]
    for (s0, c0), (s1, c1) in zip(before, _live(caches), strict=True):
        assert torch.equal(s0, s1) and torch.equal(c0, c1)


def test_recompute_capture_bytes_formula() -> None:
    """An inputs-capturing pool holds the conv outputs and gates per token, the conv rows
    and the snapshot: a fraction of the checkpoint slots' bytes."""
    cfg = HybridConfig.tiny_default()
    states = ShardCaches.for_layers(cfg, range(0, 4), max_len=32, max_draft=5, batch=2)
    inputs = ShardCaches.for_layers(
        cfg, range(0, 4), max_len=32, max_draft=5, batch=2, capture="inputs"
    )
    L = 3
    hv, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kc, c = cfg.linear_conv_kernel_dim, cfg.conv_dim
    expected = {
        "inputs": 4 * L * 2 * 5 * c, "g": 4 * L * 2 * 5 * hv, "beta": 4 * L * 2 * 5 * hv,
        "captured": 4 * L * 2 * (kc - 1 + 5) * c, "snapshot": 4 * L * 2 * hv * k * v,
    }
    assert inputs.pool.capture_bytes == expected
    assert inputs.checkpoint_bytes == sum(expected.values()) < states.checkpoint_bytes
    assert set(states.pool.capture_bytes) == {"checkpoints", "captured", "snapshot"}


@torch.inference_mode()
def test_recompute_on_a_shard_without_recurrent_layers(model: TargetModel) -> None:
    """A shard holding only attention layers has an empty pool: its recompute rollback (and
    the gate's recomputed copy) run no kernel and move only the position."""
    attn = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"][:1]
    caches = model.new_caches(max_len=32, max_draft=8, layer_ids=attn, capture="inputs")
    pool = caches.pool
    assert pool.layer_ids == ()
    hidden = model.embed_tokens(_ids(PROMPT))
    model.run_layers(hidden, attn, caches, 0, "prefill")
    chain = require_chain(list(range(-1, 2)))
    model.run_layers(model.embed_tokens(_ids(DRAFT[:3])), attn, caches, len(PROMPT), "verify",
                     chain)
    state, conv = pool.recomputed_copy(2)
    assert state.numel() == 0 and conv.numel() == 0
    roll_back(pool, "recompute", 2)
    assert pool.length == len(PROMPT) + 2 and pool.position.tolist() == [len(PROMPT) + 2]
