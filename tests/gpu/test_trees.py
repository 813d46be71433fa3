"""Tree steps on a GPU at the 9B widths (skipped without CUDA): every tree step's emitted
tokens are plain greedy decoding's, bit for bit, in the fast modes and on replay, and
graphs (the chain gate step) mix with eager tree verifies.

Run: ``python -m pytest tests/gpu/test_trees.py -q -s``
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
    reference_greedy,
)
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters.trees import SyntheticTreeDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK, BUDGET, N = 8, 24, 96
RANKS = (0.5, 0.2, 0.1, 0.05)


@pytest.fixture(scope="module")
def model() -> TargetModel:
    nine = HybridConfig.nine_b_shape()  # its first 8 layers: 3 recurrent + 1 attention, twice
    config = HybridConfig(**{**nine.model_dump(), "layer_types": nine.layer_types[:8]})
    return TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay", "recompute"])
@torch.inference_mode()
def test_tree_steps_are_plain_greedy(model: TargetModel, mode: RollbackMode) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(200)]
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    oracle = reference_greedy(model, plan, prompt, N + BUDGET)
    target = ShardedTarget(model, plan, max_len=len(prompt) + N + BUDGET + 1, max_draft=BUDGET)
    drafter = SyntheticTreeDrafter(prompt + oracle, RANKS, model.config.vocab_size, seed=3)
    engine = SpecDecoder(
        target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode),
        tree_budget=BUDGET,
    )
    out = [engine.prefill(prompt)]
    while len(out) < N:
        out.extend(engine.step())
    assert out[:N] == oracle[:N]
    trees = engine.records[1:]
    commit = sum(r.accept_n for r in trees) / len(trees)
    print(f"\n{mode}: {len(trees)} tree steps, {BUDGET}-node trees, average commit {commit:.2f}")
    assert commit > 1.5
    if mode != "replay":
        assert engine.status is RollbackStatus.EFFECTIVE and engine.counts["fast"] == len(trees)


#: the model shapes a wide verify is checked at: their first 8 layers
WIDE_SHAPES = {"9b": HybridConfig.nine_b_shape, "27b": HybridConfig.twenty_seven_b_shape}


@pytest.mark.parametrize("shape", sorted(WIDE_SHAPES))
@pytest.mark.parametrize("kind", ["chain", "tree"])
@torch.inference_mode()
def test_wide_verify_rows_are_one_token_decoding(shape: str, kind: str) -> None:
    """A verify of 64 rows after a 1,024-token prompt (a chain, or a best-first tree): every
    row's logits are, bit for bit, those of one-token decoding of its path — at the 9B and
    27B widths (eager forwards, the target's own kernels)."""
    full = WIDE_SHAPES[shape]()
    config = HybridConfig(**{**full.model_dump(), "layer_types": full.layer_types[:8]})
    model = TargetModel.seeded(config, seed=1, dtype=torch.bfloat16, device="cuda:0")
    rng = random.Random(9)
    prompt = [rng.randrange(config.vocab_size) for _ in range(1024)]
    T = 64
    tokens = [rng.randrange(config.vocab_size) for _ in range(T)]
    if kind == "chain":
        parents = list(range(-1, T - 1))
    else:  # four children per node, breadth first: siblings side by side, paths 3 deep
        parents = [-1] + [(u - 1) // 4 for u in range(1, T)]
    from dflash.geometry import require_chain, require_tree

    geometry = require_chain(parents) if kind == "chain" else require_tree(parents)
    caches = model.new_caches(max_len=1024 + T + 1, max_draft=T)
    model(torch.tensor([prompt], device="cuda:0"), caches, "prefill")
    logits, _ = model(torch.tensor([tokens], device="cuda:0"), caches, "verify",
                      geometry=geometry)
    bad = []
    for u in range(T):
        path = [u]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        if kind == "chain" and u not in (0, 1, 15, 16, 17, 31, 32, 47, 63):
            continue  # a chain's rows: tile edges and ends (each decode costs a prefill)
        plain = model.new_caches(max_len=1024 + T + 1, max_draft=1)
        model(torch.tensor([prompt], device="cuda:0"), plain, "prefill")
        for s in path:
            want, _ = model(torch.tensor([[tokens[s]]], device="cuda:0"), plain, "decode")
        if not torch.equal(logits[0, u], want[0, -1]):
            diff = (logits[0, u].float() - want[0, -1].float()).abs().max().item()
            bad.append((u, len(path), diff))
    assert not bad, f"{shape} {kind}: rows differ from decoding (node, depth, max diff): {bad}"


@pytest.mark.parametrize("shape", sorted(WIDE_SHAPES))
@torch.inference_mode()
def test_a_chain_shaped_tree_is_the_chain_verify_layer_by_layer(shape: str) -> None:
    """A tree whose nodes form a chain goes through the tree code (positions from depths,
    K/V by slot, ancestor paths in attention and conv, parents in the recurrence), yet is
    the chain: every layer's output equals the chain verify's bit for bit, and so does
    each tree kernel against its chain form at these widths."""
    from dflash.geometry import require_chain, require_tree
    from dflash.kernels import causal_conv1d_capture, decode_attention, gdn_verify, tree_paths

    full = WIDE_SHAPES[shape]()
    config = HybridConfig(**{**full.model_dump(), "layer_types": full.layer_types[:8]})
    model = TargetModel.seeded(config, seed=2, dtype=torch.bfloat16, device="cuda:0")
    rng = random.Random(4)
    prompt = [rng.randrange(config.vocab_size) for _ in range(300)]
    T = 16
    tokens = torch.tensor([[rng.randrange(config.vocab_size) for _ in range(T)]], device="cuda")
    outs = {}
    for kind, geometry in (("chain", require_chain(range(-1, T - 1))),
                           ("tree", require_tree(range(-1, T - 1)))):
        caches = model.new_caches(max_len=400, max_draft=T)
        model(torch.tensor([prompt], device="cuda:0"), caches, "prefill")
        logits, taps = model(tokens, caches, "verify", geometry=geometry, taps=range(8))
        outs[kind] = (logits, taps)
    problems = [
        f"layer {i} ({config.layer_types[i]})" for i in range(8)
        if not torch.equal(outs["chain"][1][i], outs["tree"][1][i])
    ]
    if not torch.equal(outs["chain"][0], outs["tree"][0]):
        problems.append("logits")

    # the kernels alone, at this shape's widths
    gen = torch.Generator(device="cuda").manual_seed(0)
    paths = tree_paths(require_tree(range(-1, T - 1)), "cuda")
    C, kc = config.conv_dim, config.linear_conv_kernel_dim
    x = torch.randn(1, T, C, device="cuda", generator=gen).bfloat16()
    rows = torch.randn(1, kc - 1, C, device="cuda", generator=gen).bfloat16()
    w = torch.randn(C, kc, device="cuda", generator=gen).bfloat16()
    cap = torch.empty(1, kc - 1 + T, C, device="cuda", dtype=torch.bfloat16)
    a = causal_conv1d_capture(x, rows, w, None, cap.clone())
    b = causal_conv1d_capture(x, rows, w, None, cap.clone(), paths=paths)
    if not torch.equal(a, b):
        problems.append("conv")
    H, HKV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(1, T, H, D, device="cuda", generator=gen).bfloat16()
    kv = [torch.randn(1, HKV, 400, D, device="cuda", generator=gen).bfloat16() for _ in "kv"]
    start = torch.tensor([300], device="cuda")
    a = decode_attention(q, kv[0], kv[1], start)
    b = decode_attention(q, kv[0], kv[1], start, paths=paths)
    if not torch.equal(a, b):
        problems.append(f"attention (max diff {(a.float() - b.float()).abs().max().item()})")
    HV, HK = config.linear_num_value_heads, config.linear_num_key_heads
    K, V = config.linear_key_head_dim, config.linear_value_head_dim
    args = (torch.randn(1, T, HK, K, device="cuda", generator=gen).bfloat16(),
            torch.randn(1, T, HK, K, device="cuda", generator=gen).bfloat16(),
            torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16(),
            -torch.rand(1, T, HV, device="cuda", generator=gen),
            torch.rand(1, T, HV, device="cuda", generator=gen).bfloat16(),
            torch.randn(1, HV, K, V, device="cuda", generator=gen))
    ck = [torch.zeros(1, T, HV, K, V, device="cuda") for _ in "ab"]
    a = gdn_verify(*args, ck[0], require_chain(range(-1, T - 1)))
    b = gdn_verify(*args, ck[1], require_tree(range(-1, T - 1)))
    if not (torch.equal(a, b) and torch.equal(ck[0], ck[1])):
        problems.append("gdn")
    assert not problems, f"{shape}: the chain-shaped tree differs from the chain at {problems}"
