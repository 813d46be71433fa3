"""The built-in default model: seeded, file-free; greedy_generate's contract."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dflash.model import HybridConfig, TargetModel, greedy_generate

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a shared CI box
    yield
    torch.set_num_threads(before)


def test_tiny_default_layout() -> None:
    cfg = HybridConfig.tiny_default()
    assert len(cfg.attention_layer_ids) >= 1 and len(cfg.recurrent_layer_ids) >= 3
    assert cfg.vocab_size <= 512 and cfg.hidden_size <= 128


def test_seeded_weights_are_deterministic() -> None:
    a, b, c = TargetModel.tiny_default(0), TargetModel.tiny_default(0), TargetModel.tiny_default(1)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.numel() > 4:
            assert not torch.equal(pa, pc), name


def test_greedy_64_tokens_are_reproducible_and_not_degenerate(one_thread: None) -> None:
    # (how fast the default runs is reported by `dflash generate`, not asserted here)
    tokens = greedy_generate(TargetModel.tiny_default(0), PROMPT, 64)
    assert len(tokens) == 64 and all(0 <= t < 256 for t in tokens)
    assert len(set(tokens)) >= 8, f"degenerate output {tokens}"
    assert tokens == greedy_generate(TargetModel.tiny_default(0), PROMPT, 64)


def test_greedy_generate_rejects_bad_input() -> None:
    model = TargetModel.tiny_default(0)
    with pytest.raises(ValueError, match="'prompt' must hold at least one token"):
        greedy_generate(model, [], 3)
    with pytest.raises(ValueError, match=r"'prompt' entry 1 must be a token id in \[0, 256\) "
                       r"\(got 256\)"):
        greedy_generate(model, [1, 256], 3)
    with pytest.raises(ValueError, match=r"'n' must be >= 0 \(got -1\)"):
        greedy_generate(model, [1], -1)
    assert greedy_generate(model, [1], 0) == []


def test_nine_b_shape_parameter_count() -> None:
    with torch.device("meta"):
        model = TargetModel(HybridConfig.nine_b_shape())
    total = sum(p.numel() for p in model.parameters())
    assert 8.9e9 < total < 9.0e9, total  # 8.95e9: the text model of Qwen3.5-9B
