"""A DFlash2 drafter's device step on a GPU (skipped without CUDA): captured in a CUDA graph
(no host read inside it) and replayed step after step, it proposes what the host path
proposes, greedy and coupled to a sampling rule.

Run: ``python -m pytest tests/gpu/test_dflash2_gpu.py -q``
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash.execution.graphs import ShardGraphs
from dflash.model.drafters import DFlash2Config, DFlash2Drafter, DFlashConfig, DFlashDrafter
from dflash.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
V, H, B = 512, 128, 4


def _drafter(embed: torch.Tensor, head: torch.Tensor) -> DFlash2Drafter:
    base = DFlashConfig.for_target(hidden_size=H, vocab_size=V, num_target_layers=8,
                                   num_hidden_layers=2, block_size=B)
    cfg = DFlash2Config.model_validate({**base.model_dump(), "conv_kernel_size": 2,
                                        "conv_group_size": 16, "selector_rank": 16,
                                        "selector_top_k": 8})
    d = DFlashDrafter.random(cfg, embed, head, seed=3, dtype=torch.float32)
    assert isinstance(d, DFlash2Drafter)
    return d


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.2,
                                                                       seed=9)])
def test_the_captured_device_step_equals_the_host_path(sampling: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=gen).cuda()
    head = (torch.randn(V, H, generator=gen) * 0.2).cuda()
    host, dev = _drafter(embed, head), _drafter(embed, head)
    host.couple(sampling)
    dev.couple(sampling)
    rng = random.Random(1)
    n, total = 9, 9 + 8 * B
    feats = torch.randn(total + B, host.config.feature_size, generator=gen).cuda()
    context = [rng.randrange(V - 1) for _ in range(total + B)]
    last = context[n]
    want = host.propose(context[:n], last, B, feats[:n])
    assert dev.start_device(feats[:n], last, capacity=total + 2 * B, block_size=B).tolist() \
        == want
    graphs = ShardGraphs(torch.device("cuda"))   # as the engine runs the drafter's step
    for step in range(8):   # step 0 eager (warm), step 1 captured, then replayed
        commit = 1 + step % B
        toks = torch.tensor([rng.randrange(V - 1) for _ in range(B)])
        last = int(toks[commit - 1])
        dev.set_device_inputs(feats[n : n + B], torch.tensor([commit], device="cuda"),
                              toks.cuda())
        out = graphs.run_static(("draft", B, False), dev.device_step)
        context[n : n + commit] = [context[n], *toks[: commit - 1].tolist()]
        new_rows = feats[n : n + commit]
        n += commit
        assert out.tolist() == host.propose(context[:n], last, B, new_rows), step
    assert graphs.failures == [] and graphs.captures == 1 and graphs.replays == 7
