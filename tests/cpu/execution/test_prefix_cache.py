"""The prefix cache: a prompt that extends a cached one restores the longest cached chunk
boundary and prefills only the rest, and decodes the same bits as a cold run — greedy and
seeded sampling, every rollback mode, speculative and plain, with a windowed drafter — and
the cache stays within its bytes, least recently used out."""

from __future__ import annotations

import pytest
import torch

import dflash
from dflash.errors import UsageError
from dflash.execution.prefix import PrefixCache, PrefixEntry
from dflash.model.caches import CacheSnapshot

CHUNK = 16
TURN_1 = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
TURN_2 = TURN_1 + ")\n    parser.add_argument('--path', default=os.getcwd())\n    args = "


def _runs(cold: dflash.LLM, warm: dflash.LLM, **sampling: float) -> None:
    for prompt in (TURN_1, TURN_2, TURN_2 + "parser.parse_args(argv)\n"):
        a = cold.generate(prompt, max_new_tokens=24, **sampling)  # type: ignore[arg-type]  # the rule's numbers
        b = warm.generate(prompt, max_new_tokens=24, **sampling)  # type: ignore[arg-type]  # as above
        assert b.tokens == a.tokens, prompt
        assert a.cached_tokens == 0
        if prompt != TURN_1:  # every later prompt extends a cached one
            assert b.cached_tokens >= CHUNK and b.cached_tokens % CHUNK == 0
            assert b.cached_tokens < b.prompt_len


@pytest.mark.parametrize("rollback", ["checkpoint", "replay", "recompute"])
def test_a_cached_prefix_decodes_the_cold_bits(rollback: str) -> None:
    cold = dflash.load(prefill_chunk=CHUNK, rollback=rollback)
    warm = dflash.load(prefill_chunk=CHUNK, rollback=rollback, prefix_cache_mb=64)
    _runs(cold, warm)
    _runs(cold, warm, temperature=0.8, seed=3)
    assert warm.prefix_cache is not None and warm.prefix_cache.hits >= 4


def test_plain_decoding_and_a_windowed_drafter_too() -> None:
    _runs(dflash.load(draft=None, prefill_chunk=CHUNK),
          dflash.load(draft=None, prefill_chunk=CHUNK, prefix_cache_mb=64))
    _runs(dflash.load(prefill_chunk=CHUNK, draft_window=20),
          dflash.load(prefill_chunk=CHUNK, draft_window=20, prefix_cache_mb=64))


def test_a_prefix_cache_needs_a_chunk() -> None:
    with pytest.raises(UsageError, match="'prefix_cache_mb'=8 needs a 'prefill_chunk'"):
        dflash.load(prefill_chunk=None, prefix_cache_mb=8)


def _entry(tokens: tuple[int, ...], size: int) -> PrefixEntry:
    blob = torch.zeros(size // 4)
    empty = torch.zeros(0)
    return PrefixEntry(tokens, (CacheSnapshot(len(tokens), blob, empty, empty, empty),), None)


def test_least_recently_used_out_within_the_bytes() -> None:
    cache = PrefixCache(max_bytes=1000, chunk=4)
    a, b, c = (1, 2, 3, 4), (5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9)
    cache.put(_entry(a, 400))
    cache.put(_entry(b, 400))
    assert cache.lookup([*a, 7]) is not None  # a is now the most recently used
    cache.put(_entry(c, 400))  # 1200 > 1000: b, the least recently used, goes
    assert len(cache) == 2 and cache.lookup([*b, 1]) is None
    hit = cache.lookup([*c, 5])
    assert hit is not None and hit.tokens == c  # the longest cached prefix
    assert cache.lookup(list(c)) is not None and cache.lookup(list(c)).tokens == a  # type: ignore[union-attr]  # checked just before
    cache.put(_entry((7, 7, 7, 7), 2000))  # larger than the cache: not kept
    assert len(cache) == 2 and cache.nbytes == 800
    with pytest.raises(ValueError, match="must end at a chunk boundary"):
        cache.put(_entry((1, 2, 3), 4))
    assert not cache.wants(c) and cache.wants((1, 2, 3, 5)) and not cache.wants(())
