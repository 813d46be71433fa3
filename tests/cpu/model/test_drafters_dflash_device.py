"""DFlash drafting on the device (static cache, the accepted count as a tensor) against the
host path (the cropped, growing context cache): the same proposals after commits of every
length, with full-attention and sliding-window layers; its argument checks."""

from __future__ import annotations

import random

import pytest
import torch

from dflash.model.drafters import DeviceDrafter, DFlashConfig, DFlashDrafter
from dflash.model.drafters.errors import DraftArgumentError
from dflash.sampling import GREEDY, SamplingParams

H, VOCAB, TARGET_LAYERS, B = 64, 256, 6, 5


def _pair(**changes: object) -> tuple[DFlashDrafter, DFlashDrafter]:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, H, generator=gen)
    head = torch.randn(VOCAB, H, generator=gen) * 0.2
    cfg = DFlashConfig.for_target(
        hidden_size=H, vocab_size=VOCAB, num_target_layers=TARGET_LAYERS,
        num_hidden_layers=2, block_size=B,
    ).model_copy(update=changes)
    return (DFlashDrafter.random(cfg, embed, head, seed=3),
            DFlashDrafter.random(cfg, embed, head, seed=3))


@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.5, top_k=40, seed=5)])
@pytest.mark.parametrize("changes", [
    {},
    {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 4},
    {"layer_types": ("full_attention", "sliding_attention"), "sliding_window": 2,
     "is_causal": False},
])
def test_device_proposals_equal_the_host_path_after_commits_of_every_length(
    changes: dict[str, object], sampling: SamplingParams, window: int | None
) -> None:
    """Greedy, and coupled to a sampling rule (the guesses drawn with the target's noise at
    their absolute positions: the device's position, the host's context length); with a
    context window the device holds a ring of ``reach + B`` rows, whatever the capacity."""
    host, dev = _pair(**changes)
    host.context_window = dev.context_window = window
    assert isinstance(dev, DeviceDrafter)
    host.couple(sampling)
    dev.couple(sampling)
    argmax = _pair(**changes)[0]  # the same drafter, uncoupled
    argmax.context_window = window
    rng = random.Random(1)
    width = host.config.feature_size
    n, total = 7, 7 + 12 * B
    feats = torch.randn(total + B, width, generator=torch.Generator().manual_seed(2))
    context = [rng.randrange(VOCAB - 1) for _ in range(total + B)]
    last = context[n]
    want = host.propose(context[:n], last, B, feats[:n])
    argmax.propose(context[:n], last, B, feats[:n])
    got = dev.start_device(feats[:n], last, capacity=total + 2 * B, block_size=B)
    assert got.dtype == torch.int64 and got.tolist() == want
    ring = dev.on_device._device
    assert ring is not None and ring.kv[0][0].shape[2] == (
        total + 2 * B if dev.context_reach is None else dev.context_reach + B
    )
    differs = 0  # proposals the coupled draw changed from the argmax's
    for step in range(12):
        commit = 1 + step % B  # 1 … B rows committed
        tokens = torch.tensor([rng.randrange(VOCAB - 1) for _ in range(B)])
        last = int(tokens[commit - 1])
        # the verify's rows: the pending token and the guesses; the first `commit` commit
        rows = feats[n : n + B]
        dev.set_device_inputs(rows, torch.tensor([commit]), tokens)
        got = dev.device_step()
        context[n : n + commit] = [context[n], *tokens[: commit - 1].tolist()]
        n += commit
        want = host.propose(context[:n], last, B, rows[:commit])
        assert got.tolist() == want, f"step {step}, commit {commit}"
        differs += want != argmax.propose(context[:n], last, B, rows[:commit])
    assert (differs > 0) != sampling.greedy, differs


def test_device_drafting_arguments_are_named() -> None:
    _, dev = _pair()
    width = dev.config.feature_size
    with pytest.raises(DraftArgumentError, match="start_device\\(\\) first"):
        dev.device_step()
    feats = torch.randn(6, width)
    with pytest.raises(DraftArgumentError, match="'capacity' must be an int >= 11"):
        dev.start_device(feats, 3, capacity=10, block_size=B)
    with pytest.raises(DraftArgumentError, match="'last'"):
        dev.start_device(feats, VOCAB, capacity=32, block_size=B)
    with pytest.raises(DraftArgumentError, match="'features' must have shape"):
        dev.start_device(feats[:, :4], 3, capacity=32, block_size=B)
    dev.start_device(feats, 3, capacity=32, block_size=B)
    one = torch.tensor([1])
    for rows, count, tokens, match in [
        (torch.randn(B + 1, width), one, torch.zeros(B + 1, dtype=torch.long), "1 <= T <= 5"),
        (torch.randn(2, width + 1), one, torch.zeros(2, dtype=torch.long), "'rows' must be"),
        (torch.randn(2, width), one, torch.zeros(3, dtype=torch.long), "'tokens' must be \\[2\\]"),
        (torch.randn(2, width), torch.tensor([1, 1]), torch.zeros(2, dtype=torch.long),
         "'commit_n' \\[1\\]"),
    ]:
        with pytest.raises(DraftArgumentError, match=match):
            dev.set_device_inputs(rows, count, tokens)


def test_new_buffers_bump_the_version() -> None:
    _, dev = _pair()
    feats = torch.randn(4, dev.config.feature_size)
    dev.start_device(feats, 1, capacity=32, block_size=B)
    v = dev.device_buffers_version
    dev.start_device(feats, 1, capacity=20, block_size=B)  # fits: the same buffers
    assert dev.device_buffers_version == v
    dev.start_device(feats, 1, capacity=64, block_size=B)  # larger: new buffers
    assert dev.device_buffers_version == v + 1
    rule = SamplingParams(temperature=0.7, seed=1)
    dev.couple(rule)  # the captured steps hold the rule: they must be dropped
    assert dev.device_buffers_version == v + 2
    dev.couple(rule)  # the same rule: kept
    assert dev.device_buffers_version == v + 2
    dev.couple(GREEDY)
    assert dev.device_buffers_version == v + 3


def test_a_deleted_drafter_is_freed_at_once_and_its_parts_say_so() -> None:
    """The drafting parts hold their drafter weakly: deleting a drafter that drafted on the
    host and on the device frees it without the garbage collector (no reference cycle),
    and a part kept past it refuses with ``ReferenceError``."""
    import gc
    import weakref

    host, dev = _pair()
    feats = torch.randn(4, dev.config.feature_size)
    host.propose([1, 2, 3, 4], 5, B, feats)
    dev.start_device(feats, 1, capacity=32, block_size=B)
    parts, gone = (dev.host, dev.on_device), weakref.ref(dev)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del dev
        assert gone() is None  # freed by reference counting alone
    finally:
        if was_enabled:
            gc.enable()
    for part in parts:
        with pytest.raises(ReferenceError, match=r"DFlash drafter of this \w+ is gone"):
            _ = part.drafter


# -- device proposals with each slot's candidates (tree steps) -------------------------------


def test_ranked_top_k_is_a_stable_sorts_first_k() -> None:
    """Each row's k largest by value descending, equal values by ascending id — what a
    stable descending sort puts first — on rows full of ties."""
    from dflash.model.drafters.dflash_products import ranked_top_k

    gen = torch.Generator().manual_seed(4)
    values = torch.randint(0, 6, (9, 50), generator=gen).double()
    for k in (1, 3, 8, 50):
        want = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ranked_top_k(values, k), want), k


def test_device_candidates_are_the_host_proposals_candidates() -> None:
    """With ``use_device_candidates(k)`` each device proposal carries, after its guesses,
    every slot's ``k`` best tokens and their log-probabilities: the host proposal's
    :meth:`candidates`, at the start and after commits of every length — the same tokens
    in the same order, the log-probabilities to float32 rounding (the host's LM head
    product is its packed copy's, the device's the drafter's own: their last bits may
    differ)."""
    from dflash.model.drafters.dflash_device import split_candidates

    host, dev = _pair()
    k = 6
    version = dev.device_buffers_version
    dev.use_device_candidates(k)
    assert dev.device_buffers_version == version + 1  # captured steps return another layout
    dev.use_device_candidates(k)
    assert dev.device_buffers_version == version + 1
    rng = random.Random(3)
    width = host.config.feature_size
    n, total = 6, 6 + 8 * B
    feats = torch.randn(total + B, width, generator=torch.Generator().manual_seed(5))
    context = [rng.randrange(VOCAB - 1) for _ in range(total + B)]
    last = context[n]
    want = host.propose(context[:n], last, B, feats[:n])
    got = dev.start_device(feats[:n], last, capacity=total + 2 * B, block_size=B)
    assert tuple(got.shape) == ((B - 1) * (1 + 2 * k),)
    guesses, candidates = split_candidates(got.tolist(), B - 1, k)
    assert guesses == want
    _same_candidates(candidates, host.candidates(k))
    for step in range(8):
        commit = 1 + step % B
        tokens = torch.tensor([rng.randrange(VOCAB - 1) for _ in range(B)])
        last = int(tokens[commit - 1])
        rows = feats[n : n + B]
        dev.set_device_inputs(rows, torch.tensor([commit]), tokens)
        guesses, candidates = split_candidates(dev.device_step().tolist(), B - 1, k)
        context[n : n + commit] = [context[n], *tokens[: commit - 1].tolist()]
        n += commit
        assert guesses == host.propose(context[:n], last, B, rows[:commit]), step
        _same_candidates(candidates, host.candidates(k))
        assert all(lp <= 0.0 for slot in candidates for _, lp in slot)
    dev.use_device_candidates(0)  # the guesses alone again
    dev.set_device_inputs(feats[n : n + B], torch.tensor([1]), tokens)
    assert tuple(dev.device_step().shape) == (B - 1,)


def _same_candidates(got: list[list[tuple[int, float]]],
                     want: list[list[tuple[int, float]]]) -> None:
    assert [[t for t, _ in slot] for slot in got] == [[t for t, _ in slot] for slot in want]
    lps = torch.tensor([[lp for _, lp in slot] for slot in got], dtype=torch.float64)
    ref = torch.tensor([[lp for _, lp in slot] for slot in want], dtype=torch.float64)
    assert torch.allclose(lps, ref, rtol=0, atol=1e-5), (lps - ref).abs().max()


def test_device_candidate_arguments_are_named() -> None:
    from dflash.model.drafters.dflash_device import split_candidates

    _, dev = _pair()
    for bad in (-1, VOCAB + 1, 2.0, True):
        with pytest.raises(DraftArgumentError, match=rf"'k' must be an int in \[0, {VOCAB}\]"):
            dev.use_device_candidates(bad)  # type: ignore[arg-type]  # bad values on purpose
    with pytest.raises(DraftArgumentError, match=r"4 slots with 2 candidates each is 20 values"):
        split_candidates([1] * 19, 4, 2)
