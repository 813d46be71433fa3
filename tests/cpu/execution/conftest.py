"""Shared fixtures: the built-in tiny model (float32 and bfloat16) and its cached
target-only greedy continuations (plain one-token-per-forward decoding)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dflash.model import HybridConfig, TargetModel, greedy_generate

# the tiny model's matrices are far too small to share between threads: one thread is
# several times faster, and immune to other load on the machine
torch.set_num_threads(1)

PROMPTS: dict[str, list[int]] = {
    "digits": [3, 14, 15, 92, 65, 35],
    "short": [7],
    "repeat": [11, 12, 11, 12, 11, 12, 11, 12, 40],
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    return PROMPTS


@pytest.fixture(scope="session")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=0)


@pytest.fixture(scope="session")
def tiny_of(tiny: TargetModel) -> Callable[[str], TargetModel]:
    """``tiny_of(dtype_name)``: the tiny model (seed 0) in ``float32`` or ``bfloat16``."""
    models = {"float32": tiny}

    def get(dtype: str) -> TargetModel:
        if dtype not in models:
            config = HybridConfig.tiny_default()
            models[dtype] = TargetModel.seeded(config, seed=0, dtype=DTYPES[dtype])
        return models[dtype]

    return get


@pytest.fixture(scope="session")
def greedy(tiny_of: Callable[[str], TargetModel]) -> Callable[..., list[int]]:
    """``greedy(prompt_name, n, dtype="float32")``: ``greedy_generate`` tokens, cached."""
    cache: dict[tuple[str, int, str], list[int]] = {}

    def get(name: str, n: int, dtype: str = "float32") -> list[int]:
        if (name, n, dtype) not in cache:
            cache[(name, n, dtype)] = greedy_generate(tiny_of(dtype), PROMPTS[name], n)
        return cache[(name, n, dtype)]

    return get
