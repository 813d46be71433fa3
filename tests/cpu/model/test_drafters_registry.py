"""make_drafter: every spec, typed errors, and the seam with the real target model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import (
    DRAFTER_NAMES,
    DFlashDrafter,
    DraftArgumentError,
    Drafter,
    PromptLookupDrafter,
    SyntheticDrafter,
    UnknownDrafterSpecError,
    make_drafter,
    stack_tap_features,
)

V, H, LAYERS = 40, 16, 8


class StandInTarget(nn.Module):
    """Just the parts of a target a drafter uses."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(V, H, generator=gen))
            self.lm_head.weight.copy_(torch.randn(V, H, generator=gen))
        self.layers = nn.ModuleList(nn.Identity() for _ in range(LAYERS))

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight


@pytest.fixture(scope="module")
def target() -> StandInTarget:
    return StandInTarget()


def test_every_name_builds_a_drafter(target: StandInTarget) -> None:
    oracle = list(range(30))
    built = {name: make_drafter(name, target, oracle=oracle) for name in DRAFTER_NAMES}
    assert isinstance(built["dflash"], DFlashDrafter)
    assert isinstance(built["prompt-lookup"], PromptLookupDrafter)
    assert isinstance(built["synthetic"], SyntheticDrafter)
    for name, drafter in built.items():
        assert isinstance(drafter, Drafter)
        assert drafter.label == name
        width = len(drafter.tap_layers) * H
        features = torch.randn(4, width) if drafter.tap_layers else None
        for block_size in (2, 4, 16):
            assert (
                len(drafter.propose(oracle[:4], oracle[4], block_size, features)) == block_size - 1
            )


def test_default_dflash_drafter_fits_the_target(target: StandInTarget) -> None:
    drafter = make_drafter("dflash", target, seed=3)
    assert isinstance(drafter, DFlashDrafter)
    assert drafter.tap_layers and all(0 <= t < LAYERS for t in drafter.tap_layers)
    assert drafter.config.hidden_size == H and drafter.config.vocab_size == V
    again = make_drafter("dflash", target, seed=3)
    features = torch.randn(5, drafter.config.feature_size)
    assert drafter.propose(list(range(5)), 1, 8, features) == again.propose(
        list(range(5)), 1, 8, features
    )


def test_directory_spec_loads_a_checkpoint(target: StandInTarget, tmp_path: Path) -> None:
    saved = make_drafter("dflash", target, seed=5)
    assert isinstance(saved, DFlashDrafter)
    with torch.no_grad():  # checkpoints are bf16: weights that survive the round trip
        for p in saved.parameters():
            p.copy_(p.to(torch.bfloat16))
    saved.save_pretrained(tmp_path / "ckpt")
    loaded = make_drafter(str(tmp_path / "ckpt"), target)
    assert isinstance(loaded, DFlashDrafter)
    state = loaded.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in saved.state_dict().items())
    features = torch.randn(6, saved.config.feature_size, generator=torch.Generator().manual_seed(0))
    assert loaded.propose([1] * 6, 2, 16, features) == saved.propose([1] * 6, 2, 16, features)


def test_synthetic_spec_takes_a_probability_or_a_profile(target: StandInTarget) -> None:
    oracle = list(range(30))
    constant = make_drafter("synthetic", target, oracle=oracle, acceptance=1.0)
    assert constant.propose(oracle[:3], 3, 5, None) == [4, 5, 6, 7]
    shaped = make_drafter("synthetic", target, oracle=oracle, acceptance=[1.0, 0.0])
    out = shaped.propose(oracle[:3], 3, 3, None)
    assert out[0] == 4 and out[1] != 5
    with pytest.raises(DraftArgumentError, match="'oracle' is required for spec 'synthetic'"):
        make_drafter("synthetic", target)


@pytest.mark.parametrize("spec", ["eagle", "", "/no/such/dir", "Synthetic"])
def test_unknown_spec_is_named(target: StandInTarget, spec: str) -> None:
    with pytest.raises(UnknownDrafterSpecError, match=re.escape(repr(spec))):
        make_drafter(spec, target)


def test_non_string_spec(target: StandInTarget) -> None:
    with pytest.raises(
        UnknownDrafterSpecError, match=r"'draft' must be a non-empty string \(got 3\)"
    ):
        make_drafter(3, target)  # type: ignore[arg-type]  # deliberately bad


def test_seam_with_the_built_in_target() -> None:
    """Target prefill taps -> stack_tap_features -> DFlash proposal; greedy oracle -> synthetic."""
    model = TargetModel.tiny_default()
    drafter = make_drafter("dflash", model, seed=0)
    prompt = [3, 14, 15, 92, 65, 35]
    caches = model.new_caches(max_len=32)
    with torch.no_grad():
        logits, taps = model.forward(
            torch.tensor([prompt]), caches, "prefill", taps=drafter.tap_layers
        )
    features = stack_tap_features(taps, drafter.tap_layers)
    assert features.shape == (len(prompt), len(drafter.tap_layers) * model.config.hidden_size)
    last = int(logits[0, -1].argmax())
    proposal = drafter.propose(prompt, last, 8, features)
    assert len(proposal) == 7 and all(0 <= t < model.config.vocab_size for t in proposal)

    oracle = prompt + greedy_generate(model, prompt, 6)
    assert oracle[len(prompt)] == last
    synthetic = make_drafter("synthetic", model, oracle=oracle, acceptance=1.0)
    assert synthetic.propose(prompt, last, 6, None) == oracle[len(prompt) + 1 :]
