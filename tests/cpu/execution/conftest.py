"""Shared fixtures: the built-in tiny model and its cached target-only greedy continuations."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dflash.model import TargetModel, greedy_generate

PROMPTS: dict[str, list[int]] = {
    "digits": [3, 14, 15, 92, 65, 35],
    "short": [7],
    "repeat": [11, 12, 11, 12, 11, 12, 11, 12, 40],
}


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    return PROMPTS


@pytest.fixture(scope="session")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=0)


@pytest.fixture(scope="session")
def greedy(tiny: TargetModel) -> Callable[[str, int], list[int]]:
    """``greedy(prompt_name, n)``: target-only greedy tokens (``greedy_generate``), cached."""
    cache: dict[tuple[str, int], list[int]] = {}

    def get(name: str, n: int) -> list[int]:
        if (name, n) not in cache:
            cache[(name, n)] = greedy_generate(tiny, PROMPTS[name], n)
        return cache[(name, n)]

    return get
