"""GPU: the library API on CUDA — ``dflash.load`` with the default pair on ``cuda:0`` (CUDA
graphs, the DFlash drafter drafting on the device): ``generate`` and ``stream`` give plain
greedy decoding's tokens, the kept engine rolls back fast from the second call's first step,
and a stop string ends the decode."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import dflash  # noqa: E402 - after the CUDA skip, as the module needs torch
from dflash.execution import RollbackStatus  # noqa: E402 - as above

PROMPT = "import os\n\n\ndef read_lines(path):\n"
N = 96


def test_load_on_cuda_generates_streams_and_stops_as_plain_greedy() -> None:
    plain = dflash.load(device="cuda:0", dtype="bfloat16", draft=None)
    oracle = plain.generate(PROMPT, max_new_tokens=N)
    del plain
    llm = dflash.load(device="cuda:0", dtype="bfloat16")
    first = llm.generate(PROMPT, max_new_tokens=N)
    assert first.tokens == oracle.tokens and first.text == oracle.text
    second = llm.generate(PROMPT, max_new_tokens=N)  # the kept engine: fast from step one
    assert second.tokens == oracle.tokens
    assert second.rollback.status_at_start == RollbackStatus.EFFECTIVE
    assert second.rollback.replay == 0 and second.rollback.fast == second.steps
    stream = llm.stream(PROMPT, max_new_tokens=N)
    assert "".join(stream) == oracle.text and stream.result.tokens == oracle.tokens
    assert oracle.text is not None and len(oracle.text) > 20
    stop = oracle.text[10:14]
    cut = llm.generate(PROMPT, max_new_tokens=N, stop=stop)
    assert cut.stop_reason == "stop" and cut.text == oracle.text[: oracle.text.find(stop)]
    assert cut.steps < second.steps
    print(f"\ndflash.load on cuda:0: {second.steps} steps, {second.avg_commit:.2f} a step, "
          f"{second.timings.tokens_per_s:.1f} tok/s (second call)")


@pytest.mark.parametrize("budget", [16, 64])
def test_default_pair_trees_draft_on_the_device_and_are_plain_greedy(budget: int) -> None:
    """Trees on the default pair with CUDA graphs: the DFlash drafter drafts each tree's
    candidates on the device (read back with the step's tokens); every token is plain
    greedy's, and a tree commits more per step than one token."""
    from dflash.execution.drafts import DeviceDrafts

    plain = dflash.load(device="cuda:0", dtype="bfloat16", draft=None)
    oracle = plain.generate(PROMPT, max_new_tokens=N)
    del plain
    llm = dflash.load(device="cuda:0", dtype="bfloat16", tree_budget=budget)
    first = llm.generate(PROMPT, max_new_tokens=N)
    assert first.tokens == oracle.tokens
    assert llm.engine is not None and isinstance(llm.engine.drafts, DeviceDrafts)
    second = llm.generate(PROMPT, max_new_tokens=N)
    assert second.tokens == oracle.tokens and second.avg_commit > 1.5
    print(f"\ndefault pair, trees of {budget}: {second.steps} steps, "
          f"{second.avg_commit:.2f} a step, {second.timings.tokens_per_s:.1f} tok/s")
