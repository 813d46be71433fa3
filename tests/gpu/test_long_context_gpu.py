"""GPU: chunked and continuing prefills on the device (bf16, CUDA graphs, the DFlash drafter
drafting on the device).

- every rollback mode after a prefill in chunks equals plain decoding prefilled in the
  same chunks, and a second turn on the kept engine prefills only its new tokens (the
  device drafter's context continues too) with plain decoding's tokens along that path;
- the chunk-parallel recurrence (Triton) against the token loop on a whole prompt:
  logits within bf16 rounding, the same greedy continuation.

Run: ``python -m pytest tests/gpu/test_long_context_gpu.py -q -s``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from dflash.execution import (  # noqa: E402 - after the CUDA skip, as the module needs torch
    ROLLBACK_MODES,
    RollbackMode,
    RollbackPolicy,
    ShardedTarget,
    SpecDecoder,
    generate,
    plan_shards,
)
from dflash.execution.drafts import DeviceDrafts  # noqa: E402 - as above
from dflash.execution.oracle import greedy_target  # noqa: E402 - as above
from dflash.model import HybridConfig, TargetModel  # noqa: E402 - as above
from dflash.model.drafters import DFlashConfig, DFlashDrafter  # noqa: E402 - as above

CHUNK = 96
PROMPT = [(5 * i * i + 3 * i + 7) % 256 for i in range(700)]
NEW_TURN = [(11 * i + 2) % 256 for i in range(150)]


@pytest.fixture(scope="module")
def model() -> TargetModel:
    return TargetModel.seeded(HybridConfig.tiny_default(), seed=4, dtype=torch.bfloat16,
                              device="cuda:0")


def _drafter(model: TargetModel) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2, block_size=8
    )
    return DFlashDrafter.random(cfg, model.embed_tokens.weight, model.lm_head.weight, seed=2)


def _plain_along(model: TargetModel, decoded: list[int], n: int) -> list[int]:
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    target = greedy_target(model, plan, len(PROMPT) + len(decoded) + len(NEW_TURN), n,
                           prefill_chunk=CHUNK)
    target.prefill(PROMPT)
    pos = len(PROMPT)
    for tok in decoded:
        target.forward([tok], "decode", pos)
        pos += 1
    logits, _ = target.prefill(NEW_TURN, pos)
    out = [int(logits[-1].argmax())]
    pos += len(NEW_TURN)
    while len(out) < n:
        logits, _ = target.forward([out[-1]], "decode", pos)
        pos += 1
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_chunked_then_continuing_prefills_on_the_device(model: TargetModel, mode: RollbackMode
                                                        ) -> None:
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    policy = RollbackPolicy(mode=mode)
    target = ShardedTarget(model, plan, max_len=1200, max_draft=8, prefill_chunk=CHUNK)
    engine = SpecDecoder(target, _drafter(model), block_size=8, policy=policy)
    assert isinstance(engine.drafts, DeviceDrafts)
    first = generate(model, engine.drafter, PROMPT, plan=plan, max_new_tokens=64, block_size=8,
                     policy=policy, target=target, engine=engine, prefill_chunk=CHUNK,
                     check_parity=True)
    assert first.parity is True
    held = list(engine.context)
    second = generate(model, engine.drafter, held + NEW_TURN, plan=plan, max_new_tokens=48,
                      block_size=8, policy=policy, target=target, engine=engine,
                      prefill_chunk=CHUNK, reuse=True)
    assert second.cached_tokens == len(held)
    assert second.tokens == _plain_along(model, held[len(PROMPT):], 48)
    print(f"{mode}: first {first.acceptance_rate:.2f}, second {second.acceptance_rate:.2f} "
          f"acceptance; reused {second.cached_tokens} tokens")


def test_the_chunk_parallel_recurrence_on_the_device(model: TargetModel) -> None:
    ids = torch.tensor([PROMPT], device="cuda:0")
    out = {}
    for chunked in (True, False):
        model.chunked_prefill = chunked
        try:
            with torch.inference_mode():
                caches = model.new_caches(max_len=len(PROMPT) + 1)
                logits, _ = model(ids, caches, "prefill")
                out[chunked] = (logits[0, -1].float(), caches.pool.state.clone())
        finally:
            model.chunked_prefill = True
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0.05, atol=0.05)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0.02, atol=0.02)
    assert int(out[True][0].argmax()) == int(out[False][0].argmax())
