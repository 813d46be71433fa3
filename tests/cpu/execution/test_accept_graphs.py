"""The acceptance replayed from a graph, on CPU: the recorder of ``test_remap_graphs``
re-issues every ATen operation and Triton launch of a capture on the capture's very
tensors, as a CUDA graph replays its kernels. A step's acceptance (the sampling rule's
draw at every row, the accepted count or the tree's accepted path) and a plain decode's
draw are such graphs, reading the verify graph's logits where they lie: nothing of a step
may be baked into them but the rule, and a new rule must drop them.

Runs the model's Triton kernels, so it needs ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch
from test_remap_graphs import (  # type: ignore[import-not-found]  # the sibling test module: pytest puts this directory on sys.path
    record_launches,  # noqa: F401  # the fixture, used by name
    recorded_capture,
)

from dflash.execution import RollbackMode, RollbackPolicy, ShardedTarget, SpecDecoder, plan_shards
from dflash.execution.graphs import ShardGraphs
from dflash.execution.oracle import reference_greedy
from dflash.kernels.checks import INTERPRET
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters import SyntheticDrafter
from dflash.model.drafters.trees import SyntheticTreeDrafter
from dflash.sampling import SamplingParams

pytestmark = [
    pytest.mark.skipif(not INTERPRET,
                       reason="the model's Triton kernels on CPU need TRITON_INTERPRET=1"),
    pytest.mark.usefixtures("record_launches"),
]

PROMPT = [11, 12, 11, 12, 11, 12, 11, 12, 40]
BLOCK = 5
#: every filter on: the sort, the cumulative masses and the floors all inside the graph
FILTERED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=3)
WARM = SamplingParams(temperature=1.3, seed=11)


@pytest.fixture(scope="module")
def model() -> TargetModel:
    m = TargetModel.seeded(HybridConfig.tiny_default(), seed=0)
    m.kernel_backend = "triton"
    return m


def _plain(model: TargetModel, sampling: SamplingParams, n: int) -> list[int]:
    return reference_greedy(model, plan_shards(6), PROMPT, n, sampling=sampling, graphs=False)


def _target(model: TargetModel, n: int, draft: int = BLOCK) -> ShardedTarget:
    target = ShardedTarget(model, plan_shards(6, "cpu,cpu", "2,4"),
                           max_len=len(PROMPT) + n + draft + 1, max_draft=draft)
    target.graphs = [ShardGraphs(s.device, capture=recorded_capture) for s in target.shards]
    return target


def _decode(engine: SpecDecoder, n: int) -> list[int]:
    out = [engine.prefill(PROMPT)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n]


def _logits_keys(target: ShardedTarget) -> list[tuple[str, int, bool]]:
    assert target.graphs is not None
    return [k for k in target.graphs[-1].captured_keys if k[0].startswith("logits:")]


@pytest.mark.parametrize("mode", ["checkpoint", "recompute"])
def test_a_graphed_sampled_acceptance_is_plain_sampled_decoding(
    model: TargetModel, mode: RollbackMode
) -> None:
    """Every filter on, the acceptance of each chain step replayed from one graph on the
    last shard: the tokens are plain sampled decoding's, and the rollback enqueued on the
    graph's count restores the right state."""
    n = 30
    want = _plain(model, FILTERED, n)
    target = _target(model, n)
    drafter = SyntheticDrafter(PROMPT + want, 0.8, model.config.vocab_size, seed=3)
    engine = SpecDecoder(target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode),
                         sampling=FILTERED)
    assert _decode(engine, n) == want
    assert _logits_keys(target) == [("logits:chain", BLOCK, False)]
    assert engine.counts["fast"] >= 3 and max(r.accept_n for r in engine.records) > 1
    assert target.graphs is not None and not target.graphs[-1].failures


def test_a_new_rule_on_a_kept_target_drops_the_graphed_acceptance(model: TargetModel) -> None:
    """A second engine on the same target (a server's next request) with another rule
    gets that rule's tokens — the graph of the first rule is dropped, not replayed — and
    an engine with an equal rule keeps it (no new capture)."""
    n = 16
    target = _target(model, n)
    for sampling in (FILTERED, WARM, WARM):
        want = _plain(model, sampling, n)
        drafter = SyntheticDrafter(PROMPT + want, 0.8, model.config.vocab_size, seed=3)
        engine = SpecDecoder(target, drafter, block_size=BLOCK,
                             policy=RollbackPolicy(mode="checkpoint"), sampling=sampling)
        assert target.graphs is not None
        before = target.graphs[-1].captures
        assert _decode(engine, n) == want, sampling
        assert _logits_keys(target) == [("logits:chain", BLOCK, False)]
    assert target.graphs is not None
    assert target.graphs[-1].captures == before  # the third engine: the second's graph


def test_a_graphed_tree_acceptance_is_plain_sampled_decoding(model: TargetModel) -> None:
    """A sampled tree step: the target's draw after every node and the deepest confirmed
    path found inside one graph per tree size, from the tree tables the verify read."""
    n, budget = 24, 7
    want = _plain(model, WARM, n)
    target = _target(model, n, draft=budget)
    drafter = SyntheticTreeDrafter(PROMPT + want, (0.4, 0.3, 0.2), model.config.vocab_size,
                                   seed=5)
    engine = SpecDecoder(target, drafter, block_size=BLOCK, sampling=WARM,
                         policy=RollbackPolicy(mode="checkpoint"), tree_budget=budget)
    assert _decode(engine, n) == want
    keys = _logits_keys(target)
    assert keys and all(k[0] == "logits:tree" for k in keys), keys
    assert max(r.accept_n for r in engine.records) > 1


def test_plain_sampled_decoding_draws_from_a_graph(model: TargetModel) -> None:
    """The oracle's own draws: each decode's token drawn by a graph that reads the decode
    graph's logits, the prefill's eagerly; the same tokens as without graphs."""
    n = 12
    target = ShardedTarget(model, plan_shards(6), max_len=len(PROMPT) + n, max_draft=1)
    target.graphs = [ShardGraphs(s.device, capture=recorded_capture) for s in target.shards]
    got = reference_greedy(model, plan_shards(6), PROMPT, n, sampling=FILTERED, target=target)
    assert got == _plain(model, FILTERED, n)
    assert _logits_keys(target) == [("logits:decode", 1, False)]
    assert target.graphs[-1].replays >= n - 3


def test_a_graph_reading_other_memory_is_forgotten() -> None:
    """``run_reading`` replays a key's graph only while the tensor it reads is the memory
    it was captured on; another tensor runs eagerly (then warms and captures anew)."""
    g = ShardGraphs(torch.device("cpu"), capture=recorded_capture)
    key = ("logits:chain", 3, False)
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])

    def run(reads: torch.Tensor) -> list[float]:
        out: torch.Tensor = g.run_reading(key, torch.ones(3), reads,
                                          lambda x: reads * x + 0.0)
        return out.tolist()

    assert [run(a) for _ in range(3)] == [[1.0, 2.0, 3.0]] * 3
    assert (g.captures, g.replays) == (1, 2)
    a.copy_(torch.tensor([4.0, 5.0, 6.0]))  # the same memory, new values: replayed
    assert run(a) == [4.0, 5.0, 6.0] and g.replays == 3
    assert run(b) == [10.0, 20.0, 30.0]  # other memory: eager, the old graph gone
    assert key not in g.captured_keys and g.replays == 3
    assert run(b) == [10.0, 20.0, 30.0] and (g.captures, g.replays) == (2, 4)  # on b
    assert run(b) == [10.0, 20.0, 30.0] and g.replays == 5
