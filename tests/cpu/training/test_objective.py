"""The batched training forward is the inference forward, anchor by anchor."""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch

from dflash.model.drafters import DFlashConfig, DFlashDrafter
from dflash.training import block_forward, block_loss, default_gamma, slot_weights
from dflash.training.objective import sample_anchors

V, H = 23, 8


def drafter(**changes: object) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        hidden_size=H, vocab_size=V, num_target_layers=4, num_hidden_layers=2, block_size=4
    ).model_copy(update=changes)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    head = torch.randn(V, H, generator=gen, dtype=torch.float64)
    return DFlashDrafter.random(cfg, embed, head, seed=1, dtype=torch.float64)


@pytest.mark.parametrize(
    "changes", [{}, {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}]
)
def test_each_training_block_equals_the_inference_proposal(changes: dict[str, object]) -> None:
    d = drafter(**changes)
    gen = torch.Generator().manual_seed(2)
    n, s = 2, 14
    ids = torch.randint(0, V - 1, (n, s), generator=gen)
    feats = torch.randn(n, s, d.config.feature_size, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[1, 4, 9, 10], [2, 3, 6, 10]])
    hidden = block_forward(d, ids, feats, anchors).reshape(n, 4, 4, H)
    for row in range(n):
        for j, a in enumerate(anchors[row].tolist()):
            want = d.uncached_hidden(feats[row, :a], int(ids[row, a]), 4)  # context < anchor
            torch.testing.assert_close(hidden[row, j], want, rtol=1e-9, atol=1e-9)


def test_slot_weights_decay_from_the_first_guess() -> None:
    w = slot_weights(5, 2.0, torch.device("cpu"))
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_loss_is_the_weighted_cross_entropy() -> None:
    d = drafter()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V - 1, (1, 9), generator=gen)
    feats = torch.randn(1, 9, d.config.feature_size, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[2, 5]])
    got = block_loss(d, ids, feats, anchors, gamma=3.0)
    logits = d.logits(block_forward(d, ids, feats, anchors))[0]  # [8, V]
    total = weight = 0.0
    for j, a in enumerate((2, 5)):
        for k in range(1, 4):
            w = math.exp(-(k - 1) / 3.0)
            ce = -torch.log_softmax(logits[4 * j + k], -1)[ids[0, a + k]]
            total, weight = total + w * float(ce), weight + w
    assert float(got.loss) == pytest.approx(total / weight, rel=1e-6)  # float32 CE
    assert got.tokens == 6


def test_anchors_are_distinct_sorted_and_leave_room_for_the_block() -> None:
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(3, 20, 4, 50, 6, gen)
    assert a.shape == (6, 14)  # every candidate 3..16
    assert all(row == list(range(3, 17)) for row in a.tolist())
    b = sample_anchors(3, 20, 4, 5, 6, gen)
    assert b.shape == (6, 5) and int(b.min()) >= 3 and int(b.max()) <= 16
    assert all(len(set(r)) == 5 and r == sorted(r) for r in b.tolist())
    with pytest.raises(ValueError, match="no anchor fits"):
        sample_anchors(18, 20, 4, 5, 1, gen)


@pytest.mark.parametrize(
    "changes",
    [
        {"num_attention_heads": 4, "num_key_value_heads": 2},  # grouped queries
        {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3},
        {"is_causal": True},
    ],
)
def test_blocked_training_attention_equals_the_dense_mask_with_its_gradients(
    changes: dict[str, object],
) -> None:
    d = drafter(**changes).train().requires_grad_(True)
    gen = torch.Generator().manual_seed(5)
    n, s = 2, 16
    ids = torch.randint(0, V - 1, (n, s), generator=gen)
    feats = torch.randn(n, s, d.config.feature_size, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[1, 4, 9, 11], [0, 3, 6, 12]])
    probe = torch.randn(n, 16, H, generator=gen, dtype=torch.float64)
    grads = []
    for dense in (False, True):
        d.zero_grad(set_to_none=True)
        out = block_forward(d, ids, feats, anchors, dense=dense)
        (out * probe).sum().backward()  # type: ignore[no-untyped-call]  # torch's stub is untyped
        # every parameter has a gradient after backward(): the cast says so to mypy
        grads.append((
            out.detach(), {k: cast(torch.Tensor, p.grad).clone() for k, p in d.named_parameters()}
        ))
    (got, got_g), (want, want_g) = grads
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-9, atol=1e-10, msg=name)


def test_blocked_attention_refuses_rows_that_are_not_whole_blocks() -> None:
    d = drafter()
    x = torch.zeros(1, 6, H, dtype=torch.float64)
    pos = torch.arange(6)[None]
    kv = d.context_kv(torch.zeros(1, 3, H, dtype=torch.float64), torch.arange(3)[None])
    with pytest.raises(ValueError, match="6 query rows are not whole blocks of 4"):
        d.run_blocks(x, pos, kv, torch.arange(3)[None], torch.ones(1, 6, 3, dtype=torch.bool), 4)
