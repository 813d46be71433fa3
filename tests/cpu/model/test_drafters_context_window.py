"""The DFlash drafter's context window (``--draft-window``): a block sees only the last
``W`` committed positions — rows older than that change nothing, on the host (cached and
uncached) and on the device (a ring of ``reach + B`` rows) — its reach combined with
sliding-window layers, its checks, and decoding with it still lossless."""

from __future__ import annotations

import pytest
import torch

from dflash.execution import ROLLBACK_MODES, RollbackMode, RollbackPolicy, generate, plan_shards
from dflash.execution.session import SessionError, set_draft_window
from dflash.model import TargetModel
from dflash.model.drafters import DFlashConfig, DFlashDrafter, PromptLookupDrafter
from dflash.model.drafters.errors import DraftArgumentError

H, VOCAB, B, N = 64, 256, 4, 20


def _drafter(**changes: object) -> DFlashDrafter:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, H, generator=gen)
    head = torch.randn(VOCAB, H, generator=gen) * 0.2
    cfg = DFlashConfig.for_target(
        hidden_size=H, vocab_size=VOCAB, num_target_layers=6, num_hidden_layers=2,
        block_size=B,
    ).model_copy(update=changes)
    return DFlashDrafter.random(cfg, embed, head, seed=3)


def _features(changed_row: int | None, width: int) -> torch.Tensor:
    feats = torch.randn(N, width, generator=torch.Generator().manual_seed(1))
    if changed_row is not None:
        feats[changed_row] += 1.0
    return feats


@pytest.mark.parametrize("window", [1, 6])
def test_rows_before_the_window_change_nothing(window: int) -> None:
    d = _drafter()
    d.context_window = window
    context = list(range(1, N + 1))
    hidden, cached, device = {}, {}, {}
    for row in (None, N - window - 1, 0, N - window):
        feats = _features(row, d.config.feature_size)
        hidden[row] = d.host.uncached_hidden(feats, 7, B)
        d.host.reset()
        cached[row] = d.propose(context, 7, B, feats)
        device[row] = d.start_device(feats, 7, capacity=N + 2 * B, block_size=B).tolist()
    for old in (N - window - 1, 0):  # outside the window: the same bits
        assert torch.equal(hidden[old], hidden[None])
        assert cached[old] == cached[None] and device[old] == device[None]
    assert not torch.equal(hidden[N - window], hidden[None])  # inside: seen
    assert device[None] == cached[None]


def test_the_reach_combines_the_window_and_sliding_layers() -> None:
    d = _drafter()
    assert d.context_reach is None
    d.context_window = 7
    assert d.context_reach == 7
    sliding = _drafter(layer_types=("sliding_attention", "sliding_attention"), sliding_window=5)
    assert sliding.context_reach == 4  # the first query at n sees keys n - 4 …
    sliding.context_window = 2
    assert sliding.context_reach == 2
    mixed = _drafter(layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    assert mixed.context_reach is None  # a full-attention layer sees everything
    for bad in (0, -3, True, 2.5, "4"):
        with pytest.raises(DraftArgumentError, match="'context_window' must be an int >= 1"):
            d.context_window = bad  # type: ignore[assignment]  # the wrong values
    assert d.context_window == 7


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_decoding_with_a_window_is_lossless(mode: RollbackMode) -> None:
    tiny = TargetModel.tiny_default(seed=0)
    cfg = DFlashConfig.for_target(hidden_size=64, vocab_size=256, num_target_layers=6,
                                  num_hidden_layers=2, block_size=4)
    drafter = DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2)
    set_draft_window(drafter, 8)
    prompt = [(3 * i * i + 1) % 256 for i in range(40)]
    r = generate(tiny, drafter, prompt, plan=plan_shards(6, "cpu"), max_new_tokens=24,
                 block_size=4, policy=RollbackPolicy(mode=mode), check_parity=True)
    assert r.parity is True and drafter.context_window == 8


def test_a_window_needs_a_dflash_drafter() -> None:
    with pytest.raises(SessionError, match="'draft_window'=8 applies to DFlash drafters"):
        set_draft_window(PromptLookupDrafter(), 8)
    with pytest.raises(SessionError, match="'context_window' must be an int >= 1"):
        set_draft_window(_drafter(), 0)


def test_rows_outside_the_reach_may_come_without_features() -> None:
    """A long prompt's prefill hands a windowed drafter only its last ``reach`` rows: the
    host and the device draft what they draft from every row; fewer rows than the reach
    cannot skip any."""
    d = _drafter()
    d.context_window = 6
    feats = _features(None, d.config.feature_size)
    context = list(range(1, N + 1))
    whole = d.propose(context, 7, B, feats)
    d.host.reset()
    assert d.propose(context, 7, B, feats[-6:]) == whole
    on_device = d.start_device(feats, 7, capacity=N + 2 * B, block_size=B).tolist()
    skipping = d.start_device(feats[-6:], 7, capacity=N + 2 * B, block_size=B,
                              skipped=N - 6).tolist()
    assert skipping == on_device == whole
    with pytest.raises(DraftArgumentError, match="'skipped' must be 0, or an int >= 0 when"):
        d.start_device(feats[-5:], 7, capacity=N + 2 * B, block_size=B, skipped=N - 5)
    d.context_window = None
    with pytest.raises(DraftArgumentError, match="drafter's reach \\(None\\)"):
        d.start_device(feats[-6:], 7, capacity=N + 2 * B, block_size=B, skipped=N - 6)
