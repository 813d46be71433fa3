"""DFlash2 against z-lab's reference implementation, from files it wrote.

``tests/fixtures/dflash2_reference/`` (made by ``scripts/dflash2_reference_fixture.py``
from z-lab's ``dflash/model.py``, DFlash2 revision): a tiny random Hugging Face Qwen3.5
target, a tiny random DFlash2 drafter saved by the reference's own ``save_pretrained``
(float32, its codebooks under ``….weight``; a full bidirectional layer and a bidirectional
window of 12), and the reference's greedy float32 run: every step's drafted block.

dflash loads both directories as they are and, float32 and greedy:

* proposes, at every recorded step (the same committed tokens, the same anchor, the same
  block length), exactly the reference's block, from its host cache and without it;
* decodes speculatively (:func:`dflash.execution.generate`) in every rollback mode to the
  reference's output, which is plain greedy decoding, its drafter proposing the
  reference's blocks step after step along the way.

Neither transformers nor the reference is imported: only the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.execution import ROLLBACK_MODES, RollbackMode, RollbackPolicy, generate, plan_shards
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import DFlash2Drafter, DFlashDrafter
from dflash.model.drafters.base import stack_tap_features

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "dflash2_reference"


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURE / "reference_blocks.json").read_text("utf-8"))
    return data


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_pretrained(FIXTURE / "target", dtype=torch.float32)


def load_drafter(target: TargetModel) -> DFlash2Drafter:
    d = DFlashDrafter.from_pretrained(
        FIXTURE / "drafter", target.embed_tokens.weight, target.lm_head.weight,
        num_target_layers=target.config.num_hidden_layers, dtype=torch.float32,
    )
    assert isinstance(d, DFlash2Drafter)
    return d


def test_the_fixture_is_what_it_claims(record: dict[str, Any]) -> None:
    prompt, out = record["prompt"], record["output_ids"]
    assert record["dtype"] == "float32" and record["temperature"] == 0.0
    assert out[:len(prompt)] == prompt
    assert len(out) == len(prompt) + record["max_new_tokens"]
    assert out == record["plain_greedy_ids"]
    # the steps tile the output: each commits its accepted guesses and a correction
    start = len(prompt)
    for step in record["steps"]:
        assert step["start"] == start and step["anchor"] == out[start]
        assert len(step["drafts"]) == step["block_size"] - 1
        start += step["accepted"] + 1
    assert start >= len(out) - 1
    # not a degenerate run: varied guesses, and some accepted
    assert len({t for s in record["steps"] for t in s["drafts"]}) > 10
    assert any(s["accepted"] for s in record["steps"])


@torch.inference_mode()
def test_every_block_equals_the_references(target: TargetModel,
                                           record: dict[str, Any]) -> None:
    d = load_drafter(target)
    assert d.config.block_size == record["block_size"]
    out = record["output_ids"]
    # the committed tokens' tap rows: one causal prefill of the whole output
    caches = target.new_caches(max_len=len(out))
    _, taps = target(torch.tensor([out]), caches, "prefill", taps=d.tap_layers)
    rows = stack_tap_features(taps, d.tap_layers)  # [len(out), taps * H]
    d.reset()
    given = 0
    mismatches = []
    for i, step in enumerate(record["steps"]):
        start, anchor, block = step["start"], step["anchor"], step["block_size"]
        cached = d.propose(out[:start], anchor, block, rows[given:start])
        given = start
        uncached = d.propose_uncached(rows[:start], anchor, block)
        if cached != step["drafts"] or uncached != step["drafts"]:
            mismatches.append((i, start, step["drafts"], cached, uncached))
    assert not mismatches, f"{len(mismatches)} of {len(record['steps'])} blocks differ " \
        f"(step, start, reference, cached, uncached): {mismatches[:5]}"


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_speculative_decoding_follows_the_reference(
    target: TargetModel, record: dict[str, Any], mode: RollbackMode,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = load_drafter(target)
    proposed: list[tuple[int, int, int, list[int]]] = []
    own = d.propose

    def recording(context: list[int], last: int, block_size: int,
                  features: torch.Tensor | None) -> list[int]:
        guesses = own(context, last, block_size, features)
        proposed.append((len(context), last, block_size, guesses))
        return guesses

    monkeypatch.setattr(d, "propose", recording)
    prompt, n = record["prompt"], record["max_new_tokens"]
    result = generate(target, d, prompt, plan=plan_shards(target.config.num_hidden_layers,
                                                          "cpu", None),
                      max_new_tokens=n, block_size=record["block_size"],
                      policy=RollbackPolicy(mode=mode))
    want = record["output_ids"][len(prompt):]
    assert result.tokens == want
    assert greedy_generate(target, prompt, n) == want
    # step after step the engine drafted the reference's block (same start, anchor,
    # guesses) wherever it ran a block of the reference's length
    steps = [(s["start"], s["anchor"], s["block_size"], s["drafts"]) for s in record["steps"]]
    full = [s for s in steps if s[2] == record["block_size"]]
    assert [p for p in proposed if p[2] == record["block_size"]][:len(full)] == full
