"""Lossless decoding with the DFlash drafter in every rollback mode, through the engine.

The engine passes the tap features of the tokens committed since the previous proposal
(all prompt rows after the prefill, then each step's ``commit_n`` rows); the drafter's
cached context must then equal the features of the whole committed context, which the
test checks against one target prefill over the final committed tokens.
"""

from __future__ import annotations

import pytest
import torch

from dflash.execution import ROLLBACK_MODES, RollbackMode, RollbackPolicy, generate, plan_shards
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import DFlashConfig, DFlashDrafter, stack_tap_features

PROMPT = [3, 14, 15, 92, 65, 35]
N = 10


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    torch.set_num_threads(1)
    return TargetModel.tiny_default(seed=0)


@pytest.fixture(scope="module")
def oracle(tiny: TargetModel) -> list[int]:
    return greedy_generate(tiny, PROMPT, N)


def drafter_for(tiny: TargetModel, **changes: object) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2, block_size=4
    ).model_copy(update=changes)
    return DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2)


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("block", [2, 4])
def test_every_mode_is_lossless(
    tiny: TargetModel, oracle: list[int], mode: RollbackMode, block: int
) -> None:
    drafter = drafter_for(tiny)
    result = generate(
        tiny,
        drafter,
        PROMPT,
        plan=plan_shards(6, "cpu", None),
        max_new_tokens=N,
        block_size=block,
        policy=RollbackPolicy(mode=mode),
    )
    assert result.tokens == oracle
    # the cache holds exactly the committed context, and matches the target's features
    committed = PROMPT + result.tokens[: drafter.cached_length - len(PROMPT)]
    assert drafter.cached_length == len(committed) and drafter.host._tokens == committed
    caches = tiny.new_caches(max_len=64, max_draft=1)
    with torch.no_grad():
        _, taps = tiny(torch.tensor([committed]), caches, "prefill", taps=drafter.tap_layers)
    feats = stack_tap_features(taps, drafter.tap_layers)
    last = result.tokens[len(committed) - len(PROMPT)]
    torch.testing.assert_close(
        drafter.host._draft_hidden(last, block),
        drafter.uncached_hidden(feats, last, block),
        rtol=1e-4,
        atol=1e-4,
    )


def test_sliding_window_drafter_is_lossless(tiny: TargetModel, oracle: list[int]) -> None:
    drafter = drafter_for(
        tiny, layer_types=("sliding_attention", "full_attention"), sliding_window=4
    )
    result = generate(
        tiny,
        drafter,
        PROMPT,
        plan=plan_shards(6, "cpu", None),
        max_new_tokens=N,
        block_size=4,
        policy=RollbackPolicy(mode="remap"),
    )
    assert result.tokens == oracle
