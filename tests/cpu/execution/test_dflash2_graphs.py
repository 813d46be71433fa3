"""A DFlash2 drafter's device step replayed from a recorded graph on the CPU (the recorder
of ``test_remap_graphs``: every ATen operation of the capture re-issued on replay, as a
CUDA graph replays its kernels): what the engine's ``ShardGraphs`` replays proposes what
the host path proposes, step after step, greedy and coupled — nothing of a step is baked
into the graph but its static buffers."""

from __future__ import annotations

import random

import pytest
import torch
from test_remap_graphs import (  # type: ignore[import-not-found]  # the sibling test module: pytest puts this directory on sys.path
    recorded_capture,
)

from dflash.execution.graphs import ShardGraphs
from dflash.model.drafters import DFlash2Config, DFlash2Drafter, DFlashConfig, DFlashDrafter
from dflash.sampling import SamplingParams

V, H, B = 128, 64, 4


def _drafter(embed: torch.Tensor, head: torch.Tensor) -> DFlash2Drafter:
    base = DFlashConfig.for_target(hidden_size=H, vocab_size=V, num_target_layers=6,
                                   num_hidden_layers=2, block_size=B)
    cfg = DFlash2Config.model_validate({**base.model_dump(), "conv_kernel_size": 2,
                                        "conv_group_size": 16, "selector_rank": 8,
                                        "selector_top_k": 6})
    d = DFlashDrafter.random(cfg, embed, head, seed=3)
    assert isinstance(d, DFlash2Drafter)
    return d


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.2,
                                                                       seed=9)])
def test_the_replayed_device_step_equals_the_host_path(sampling: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    embed, head = torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen) * 0.2
    host, dev = _drafter(embed, head), _drafter(embed, head)
    host.couple(sampling)
    dev.couple(sampling)
    rng = random.Random(1)
    n, total = 9, 9 + 8 * B
    feats = torch.randn(total + B, host.config.feature_size, generator=gen)
    context = [rng.randrange(V - 1) for _ in range(total + B)]
    last = context[n]
    want = host.propose(context[:n], last, B, feats[:n])
    assert dev.start_device(feats[:n], last, capacity=total + 2 * B,
                            block_size=B).tolist() == want
    graphs = ShardGraphs(torch.device("cpu"), capture=recorded_capture)
    for step in range(8):   # step 0 eager (warm), step 1 captured, then replayed
        commit = 1 + step % B
        toks = torch.tensor([rng.randrange(V - 1) for _ in range(B)])
        last = int(toks[commit - 1])
        dev.set_device_inputs(feats[n : n + B], torch.tensor([commit]), toks)
        out = graphs.run_static(("draft", B, False), dev.device_step)
        context[n : n + commit] = [context[n], *toks[: commit - 1].tolist()]
        new_rows = feats[n : n + commit]
        n += commit
        assert out.tolist() == host.propose(context[:n], last, B, new_rows), step
    assert graphs.failures == [] and graphs.captures == 1 and graphs.replays == 7
