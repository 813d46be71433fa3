"""The DFlash drafter assisted by prompt lookup (``dflash+lookup``).

The selection rule and the copies' acceptance estimate are checked on a DFlash drafter
whose proposal is scripted (a subclass: the rule reads only its guesses and
probabilities); ``probabilities`` on a real seeded drafter against its logits in float64;
decoding through the engine on the tiny target and on the shipped pair, lossless, with
copies made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import Tensor

from dflash.commands.settings import DEFAULT_PROMPT
from dflash.execution import RollbackMode, RollbackPolicy, generate, plan_shards, session
from dflash.execution.engine import SpecDecoder, StepRecord
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import (
    DFlashConfig,
    DFlashDrafter,
    DraftArgumentError,
    LookupAssistedDrafter,
    PromptLookupDrafter,
    ScoredDrafter,
    UnknownDrafterSpecError,
    make_drafter,
)

B = 6  # block: five guesses


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    torch.set_num_threads(1)
    return TargetModel.tiny_default(seed=0)


def seeded(tiny: TargetModel, block: int = B) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2,
        block_size=block,
    )  # fmt: skip
    return DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2)


class Scripted(DFlashDrafter):
    """A DFlash drafter whose next proposal is set by the test; ``probabilities`` of a token
    is ``self.others`` unless it is the scripted guess of its slot."""

    def script(self, guesses: Sequence[int], confidence: Sequence[float], others: float) -> None:
        self.guesses, self.scripted, self.others = list(guesses), list(confidence), others
        self.calls: list[tuple[list[int], int, int | None]] = []

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        self.calls.append((list(context), last, None if features is None else features.shape[0]))
        return list(self.guesses)

    def confidence(self) -> list[float] | None:
        return list(self.scripted)

    def probabilities(self, tokens: Sequence[int]) -> list[float]:
        return [c if t == g else self.others
                for t, g, c in zip(tokens, self.guesses, self.scripted, strict=True)]  # fmt: skip


def scripted(tiny: TargetModel) -> Scripted:
    base = seeded(tiny)
    drafter = Scripted(base.config, tiny.embed_tokens.weight, tiny.lm_head.weight)
    drafter.script([9, 9, 9, 9, 9], [0.9, 0.5, 0.4, 0.3, 0.2], 0.05)
    return drafter


def feats(rows: int) -> Tensor:
    """Tap rows (the scripted drafter reads only how many there are)."""
    return torch.zeros(rows, 1)


def test_is_scored_and_labelled(tiny: TargetModel) -> None:
    hybrid = LookupAssistedDrafter(seeded(tiny))
    assert isinstance(hybrid, ScoredDrafter)
    assert hybrid.label == "dflash+lookup"
    assert hybrid.tap_layers == hybrid.dflash.tap_layers
    assert hybrid.confidence() is None and hybrid.copied_drafts == 0


def test_copies_only_when_the_copy_starts_with_the_drafters_first_guess(
    tiny: TargetModel,
) -> None:
    inner = scripted(tiny)
    hybrid = LookupAssistedDrafter(inner)
    # context + [last] ends in 7; 7 occurred at index 1, followed by 20 21 22 23 ...
    context = [5, 7, 20, 21, 22, 23, 24, 6]
    inner.script([20, 1, 2, 3, 4], [0.9, 0.5, 0.4, 0.3, 0.2], 0.05)
    assert hybrid.propose(context, 7, B, feats(len(context))) == [20, 21, 22, 23, 24]
    # guess 0 is the drafter's own (0.9); the others get max(0.05, q = 1/2 before any)
    assert hybrid.confidence() == [0.9, 0.5, 0.5, 0.5, 0.5]
    assert (hybrid.drafts, hybrid.copied_drafts) == (1, 1)
    # the same lookup, but the drafter's first guess differs: its own draft, its own scores
    hybrid.reset()
    inner.script([30, 1, 2, 3, 4], [0.9, 0.5, 0.4, 0.3, 0.2], 0.05)
    assert hybrid.propose(context, 7, B, feats(len(context))) == [30, 1, 2, 3, 4]
    assert hybrid.confidence() == [0.9, 0.5, 0.4, 0.3, 0.2]
    assert hybrid.copied_drafts == 0
    # no earlier occurrence of the suffix at all: the drafter's draft
    hybrid.reset()
    inner.script([40, 1, 2, 3, 4], [0.9, 0.5, 0.4, 0.3, 0.2], 0.05)
    assert hybrid.propose([1, 2, 3], 40, B, feats(3)) == [40, 1, 2, 3, 4]
    assert hybrid.copied_drafts == 0
    # the drafter always proposed first (its cache stays current), with the engine's args
    assert inner.calls[-1] == ([1, 2, 3], 40, 3)


def test_a_copied_draft_keeps_probabilities_above_its_acceptance_estimate(
    tiny: TargetModel,
) -> None:
    inner = scripted(tiny)
    hybrid = LookupAssistedDrafter(inner)
    context = [5, 7, 20, 21, 22, 23, 24, 6]
    inner.script([20, 21, 2, 3, 4], [0.9, 0.95, 0.4, 0.3, 0.2], 0.6)
    hybrid.propose(context, 7, B, feats(len(context)))
    # slot 1 is the drafter's own guess too (0.95); the others' 0.6 beats q = 0.5
    assert hybrid.confidence() == [0.9, 0.95, 0.6, 0.6, 0.6]


def test_counts_the_copies_accepted_and_rejected_guesses(tiny: TargetModel) -> None:
    inner = scripted(tiny)
    hybrid = LookupAssistedDrafter(inner)
    context = [5, 7, 20, 21, 22, 23, 24, 25, 26, 6]
    inner.script([20, 1, 2, 3, 4], [0.9] * 5, 0.05)
    assert hybrid.propose(context, 7, B, feats(len(context))) == [20, 21, 22, 23, 24]
    # the target accepted two guesses (20 21) and then chose 99, not the copy's 22
    grown = [*context, 7, 20, 21]
    inner.script([1, 2, 3, 4, 5], [0.9] * 5, 0.05)
    hybrid.propose(grown, 99, B, feats(3))
    assert (hybrid.accepted, hybrid.rejected) == (2, 1)
    assert hybrid.copy_acceptance == pytest.approx(3 / 5)
    # a draft that was not a copy is not counted
    grown = [*grown, 99, 1]
    hybrid.propose(grown, 50, B, feats(2))
    assert (hybrid.accepted, hybrid.rejected) == (2, 1)


def test_a_guess_past_the_verify_window_counts_neither_way(tiny: TargetModel) -> None:
    inner = scripted(tiny)
    hybrid = LookupAssistedDrafter(inner)
    context = [5, 7, 20, 21, 22, 23, 24, 25, 26, 6]
    inner.script([20, 1, 2, 3, 4], [0.9] * 5, 0.05)
    hybrid.propose(context, 7, B, feats(len(context)))  # copy: 20 21 22 23 24
    # one guess accepted, and the target's next token is the copy's next guess (21): the
    # window stopped before it, so it was right, not rejected
    inner.script([22, 1, 2, 3, 4], [0.9] * 5, 0.05)
    assert hybrid.propose([*context, 7, 20], 21, B, feats(2)) == [22, 23, 24, 25, 26]
    assert (hybrid.accepted, hybrid.rejected) == (1, 0)
    assert hybrid.copied_drafts == 2  # 7 20 21 occurred before: copied again
    # all five guesses of that copy accepted
    hybrid.propose([*context, 7, 20, 21, 22, 23, 24, 25, 26], 6, B, feats(6))
    assert (hybrid.accepted, hybrid.rejected) == (6, 0)
    assert hybrid.copy_acceptance == pytest.approx(7 / 8)


def test_a_new_context_starts_a_new_generation(tiny: TargetModel) -> None:
    inner = scripted(tiny)
    hybrid = LookupAssistedDrafter(inner)
    context = [5, 7, 20, 21, 22, 23, 24, 6]
    inner.script([20, 1, 2, 3, 4], [0.9] * 5, 0.05)
    hybrid.propose(context, 7, B, feats(len(context)))
    hybrid.propose([*context, 7], 50, B, feats(1))  # the first guess rejected
    assert (hybrid.drafts, hybrid.copied_drafts, hybrid.rejected) == (2, 1, 1)
    # every row given again (what the engine does after a prefill): counts start afresh
    hybrid.propose(context, 7, B, feats(len(context)))
    assert (hybrid.drafts, hybrid.copied_drafts, hybrid.accepted, hybrid.rejected) == (1, 1, 0, 0)
    # a context that did not grow from the copied draft: afresh too
    hybrid.propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 11, B, feats(1))
    assert (hybrid.drafts, hybrid.copied_drafts, hybrid.rejected) == (1, 0, 0)
    hybrid.reset()
    assert (hybrid.drafts, hybrid.copied_drafts) == (0, 0) and hybrid.confidence() is None


def test_bad_arguments_are_typed_errors(tiny: TargetModel) -> None:
    with pytest.raises(DraftArgumentError, match="'dflash' must be a DFlashDrafter"):
        LookupAssistedDrafter(PromptLookupDrafter())  # type: ignore[arg-type]  # the error
    with pytest.raises(DraftArgumentError, match="'lookup' must be None or"):
        LookupAssistedDrafter(seeded(tiny), lookup=object())  # type: ignore[arg-type]
    hybrid = LookupAssistedDrafter(seeded(tiny))
    with pytest.raises(DraftArgumentError, match="last"):
        hybrid.propose([1, 2], -1, B, torch.zeros(2, hybrid.dflash.config.feature_size))
    assert hybrid.drafts == 0  # nothing counted for a refused call


def test_probabilities_are_the_softmax_at_the_tokens(tiny: TargetModel) -> None:
    drafter = seeded(tiny)
    with pytest.raises(DraftArgumentError, match="needs a host proposal first"):
        drafter.probabilities([1, 2, 3, 4, 5])
    context = [3, 14, 15, 92, 65, 35]
    caches = tiny.new_caches(max_len=16, max_draft=1)
    with torch.no_grad():
        _, taps = tiny(torch.tensor([context]), caches, "prefill", taps=drafter.tap_layers)
    features = torch.cat([taps[t][0] for t in drafter.tap_layers], dim=-1)
    guesses = drafter.propose(context, 7, B, features)
    others = [10, 20, 30, 40, 50]  # a different token in every slot
    got = drafter.probabilities(others)
    own = drafter.probabilities(guesses)
    hidden = drafter.uncached_hidden(features, 7, B)[1:]
    with torch.no_grad():
        probs = torch.softmax(drafter.logits(hidden).double(), -1)
    for i in range(B - 1):
        assert math.isclose(got[i], float(probs[i, others[i]]), rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(own[i], float(probs[i, guesses[i]]), rel_tol=1e-5, abs_tol=1e-7)
    confidence = drafter.confidence()
    assert confidence is not None and own == pytest.approx(confidence, rel=1e-6)
    with pytest.raises(DraftArgumentError, match="must be 5 token ids"):
        drafter.probabilities(guesses[:-1])
    with pytest.raises(DraftArgumentError, match=r"tokens\[2\]"):
        drafter.probabilities([1, 2, 256, 4, 5])
    drafter.reset()
    with pytest.raises(DraftArgumentError, match="needs a host proposal first"):
        drafter.probabilities(guesses)


def test_registry_names(tiny: TargetModel, tmp_path: Path) -> None:
    hybrid = make_drafter("dflash+lookup", tiny, seed=4)
    plain = make_drafter("dflash", tiny, seed=4)
    assert isinstance(hybrid, LookupAssistedDrafter) and isinstance(plain, DFlashDrafter)
    for (name, a), b in zip(hybrid.dflash.state_dict().items(), plain.state_dict().values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    plain.save_pretrained(tmp_path / "d")
    from_dir = make_drafter(str(tmp_path / "d") + "+lookup", tiny)
    assert isinstance(from_dir, LookupAssistedDrafter)
    plain.save_pretrained(tmp_path / "named+lookup")  # a trailing '/' names the directory
    assert isinstance(make_drafter(str(tmp_path / "named+lookup") + "/", tiny), DFlashDrafter)
    for bad in ("prompt-lookup+lookup", "synthetic+lookup", "+lookup"):
        with pytest.raises(UnknownDrafterSpecError, match="follows a DFlash drafter"):
            make_drafter(bad, tiny)
    with pytest.raises(UnknownDrafterSpecError, match=r"missing\+lookup'.*unknown drafter spec"):
        make_drafter(str(tmp_path / "missing") + "+lookup", tiny)


@pytest.mark.parametrize("mode", ["replay", "checkpoint"])
def test_decoding_with_a_seeded_drafter_is_lossless(tiny: TargetModel, mode: RollbackMode) -> None:
    """The real DFlash drafter inside (whether it copies here is up to its guesses; the
    copies themselves: the Echo test below)."""
    prompt = [3, 14, 15, 92, 65, 35] * 3
    n = 24
    oracle = greedy_generate(tiny, prompt, n)
    hybrid = LookupAssistedDrafter(seeded(tiny, block=4))
    result = generate(
        tiny, hybrid, prompt, plan=plan_shards(6, "cpu", None), max_new_tokens=n,
        block_size=4, policy=RollbackPolicy(mode=mode),
    )  # fmt: skip
    assert result.tokens == oracle
    assert result.drafter == "dflash+lookup"
    assert result.copied_drafts == hybrid.copied_drafts
    assert hybrid.drafts == result.steps


def result_records(
    tiny: TargetModel, drafter: LookupAssistedDrafter, prompt: list[int], n: int
) -> list[StepRecord]:
    """The step records of the same generation, run again on the engine itself."""
    from dflash.execution.run import spec_target

    plan = plan_shards(6, "cpu", None)
    engine = SpecDecoder(spec_target(tiny, plan, len(prompt), n, 4), drafter, block_size=4,
                         policy=RollbackPolicy(mode="checkpoint"))  # fmt: skip
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    return list(engine.records)


class Echo(Scripted):
    """A drafter whose first guess is always prompt lookup's: every step with a match copies."""

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        return PromptLookupDrafter().propose(context, last, block_size)

    def confidence(self) -> list[float] | None:
        return [0.9] * 3

    def probabilities(self, tokens: Sequence[int]) -> list[float]:
        return [0.5] * len(tokens)


def test_copied_drafts_through_the_engine_are_lossless_and_counted(tiny: TargetModel) -> None:
    prompt = [3, 14, 15, 92, 65, 35] * 3
    n = 24
    base = seeded(tiny, block=4)
    hybrid = LookupAssistedDrafter(Echo(base.config, tiny.embed_tokens.weight, tiny.lm_head.weight))
    result = generate(
        tiny, hybrid, prompt, plan=plan_shards(6, "cpu", None), max_new_tokens=n,
        block_size=4, policy=RollbackPolicy(mode="checkpoint"),
    )  # fmt: skip
    assert result.tokens == greedy_generate(tiny, prompt, n)
    assert result.copied_drafts == hybrid.copied_drafts
    # the steps whose suffix occurred before: each copied (the drafter always agrees)
    context, matched = list(prompt), 0
    for step, record in enumerate(result_records(tiny, hybrid, prompt, n)):
        found = PromptLookupDrafter().lookup(context, record.draft[0], 4)
        if found.ngram:
            matched += 1
            assert list(record.draft[1:]) == list(found.tokens), step
        context += list(record.draft[: record.accept_n])
    assert matched >= 1
    assert result.copied_drafts == matched


@pytest.mark.slow
def test_the_shipped_pair_copies_and_stays_lossless() -> None:
    """``--draft dflash+lookup`` with the default target: the shipped drafter, assisted;
    on a Python prompt whose continuation repeats it copies and equals plain greedy."""
    from dflash.data import default_dir

    if not (default_dir("drafter") / "model.safetensors").is_file():
        pytest.skip("the default pair is not installed")
    model = session.build_model("default", seed=0, dtype=torch.float32, device="cpu")
    prompt = session.encode_prompt(
        "default", model.config.vocab_size, text=DEFAULT_PROMPT, ids=None, length=None, seed=0
    )
    plan = plan_shards(model.config.num_hidden_layers, "cpu", None)
    drafter, _ = session.build_drafter(
        "dflash+lookup", model, prompt, plan=plan, acceptance=0.8, seed=0,
        max_new_tokens=96, block_size=16, model_spec="default",
    )  # fmt: skip
    assert isinstance(drafter, LookupAssistedDrafter)
    shipped = cast(DFlashDrafter, make_drafter(str(default_dir("drafter")), model))
    for (name, a), b in zip(drafter.dflash.state_dict().items(),
                            shipped.state_dict().values(), strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    result = generate(
        model, drafter, prompt, plan=plan, max_new_tokens=96, block_size=16,
        policy=RollbackPolicy(mode="checkpoint"), check_parity=True,
    )  # fmt: skip
    assert result.parity is True
    assert result.copied_drafts is not None and result.copied_drafts > 0


def test_revise_applies_the_rule_to_the_devices_guesses(tiny: TargetModel) -> None:
    hybrid = LookupAssistedDrafter(seeded(tiny))
    context = [5, 7, 20, 21, 22, 23, 24, 6]
    assert hybrid.revise(context, 7, [20, 1, 2, 3, 4]) == [20, 21, 22, 23, 24]
    assert (hybrid.drafts, hybrid.copied_drafts) == (1, 1)
    assert hybrid.confidence() is None  # device drafts carry no probabilities
    # the next read: two guesses accepted, then the target's 99: counted as with propose
    guesses = [1, 2, 3, 4, 5]
    assert hybrid.revise([*context, 7, 20, 21], 99, guesses) == guesses
    assert (hybrid.drafts, hybrid.copied_drafts, hybrid.accepted, hybrid.rejected) == (2, 1, 2, 1)
    # the device's first guess is not the copy's: its guesses stand
    assert hybrid.revise([*context, 7, 20, 21, 99, 1], 7, [33, 1, 2, 3, 4]) == [33, 1, 2, 3, 4]
    with pytest.raises(DraftArgumentError, match="block_size"):
        hybrid.revise(context, 7, [])
    with pytest.raises(DraftArgumentError, match="last"):
        hybrid.revise(context, -2, guesses)
    with pytest.raises(DraftArgumentError, match="context"):
        hybrid.revise("abc", 7, guesses)  # type: ignore[arg-type]  # the error
    assert hybrid.drafts == 3  # refused calls count nothing
