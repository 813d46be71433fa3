"""Kernels at the real Qwen3.5 shapes on a GPU (skipped without CUDA).

Run: ``python -m pytest tests/gpu/test_kernels.py -q`` (flash-linear-attention optional).
"""

from __future__ import annotations

import pytest
import torch

from dflash.geometry import require_chain, require_tree
from dflash.kernels import (
    causal_conv1d_capture,
    causal_conv1d_capture_reference,
    gdn_recompute,
    gdn_verify,
    gdn_verify_reference,
    rollback_restore,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")
T, K, V, HK, KC, C = 16, 128, 128, 16, 4, 10240
SHAPES = {"qwen3.5-27b": 48, "qwen3.5-9b": 32}  # HV


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - r).norm() / r.norm())


def gdn_inputs(HV: int, seed: int, T: int = T) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    return {
        "q": rnd(1, T, HK, K).bfloat16(), "k": rnd(1, T, HK, K).bfloat16(),
        "v": rnd(1, T, HV, V).bfloat16(),
        "g": torch.nn.functional.logsigmoid(rnd(1, T, HV) + 2.0),
        "beta": torch.sigmoid(rnd(1, T, HV)),
        "initial_state": rnd(1, HV, K, V) * 0.5,
    }


def chain(n: int) -> object:
    return require_chain(list(range(-1, n - 1)))


def verify(i: dict[str, torch.Tensor], ckpt: torch.Tensor, geometry: object,
           **kw: object) -> torch.Tensor:
    """gdn_verify into a NaN-poisoned ``out``: an output the kernel does not write stays NaN."""
    out = torch.full_like(i["v"], NAN)
    o = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt,
                   geometry, out=out, **kw)  # type: ignore[arg-type]
    assert o is out
    return o


def conv(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
         cap: torch.Tensor) -> torch.Tensor:
    """causal_conv1d_capture into a NaN-poisoned ``out``."""
    out = torch.full_like(x, NAN)
    y = causal_conv1d_capture(x, rows, w, b, cap, out=out)
    assert y is out
    return y


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gdn_verify_matches_float64_reference(shape: str) -> None:
    HV = SHAPES[shape]
    i = gdn_inputs(HV, seed=1)
    ckpt = torch.full((1, T, HV, K, V), NAN, device="cuda")
    snapshot = torch.full((1, HV, K, V), NAN, device="cuda")
    o = verify(i, ckpt, chain(T), snapshot=snapshot, backend="triton")
    i64 = {n: t.double() for n, t in i.items()}
    ckpt64 = torch.full((1, T, HV, K, V), NAN, device="cuda", dtype=torch.float64)
    o64 = gdn_verify_reference(i64["q"], i64["k"], i64["v"], i64["g"], i64["beta"],
                               i64["initial_state"], ckpt64, chain(T))
    assert rel_rms(o, o64) <= 1e-2  # bf16 output rounding
    for t in range(T):
        assert rel_rms(ckpt[:, t], ckpt64[:, t]) <= 2e-3, f"slot {t}"
    assert torch.equal(snapshot, i["initial_state"])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_checkpoints_equal_sequential_decode_bit_exactly(shape: str) -> None:
    HV = SHAPES[shape]
    i = gdn_inputs(HV, seed=2)
    ckpt = torch.full((1, T, HV, K, V), NAN, device="cuda")
    snapshot = torch.full((1, HV, K, V), NAN, device="cuda")
    o = verify(i, ckpt, chain(T), snapshot=snapshot)
    assert torch.equal(snapshot, i["initial_state"])
    state = i["initial_state"].clone()
    for t in range(T):
        step = {n: (state if n == "initial_state" else x[:, t : t + 1]) for n, x in i.items()}
        o_t = verify(step, state.unsqueeze(1), None, final_state_only=True)
        assert torch.equal(state, ckpt[:, t]), f"slot {t}"
        assert torch.equal(o_t[:, 0], o[:, t])


def test_tree_path_equals_chain_bit_exactly() -> None:
    HV, parents = 48, [-1, 0, 0, 1, 2, 2, 3, 5]
    i = gdn_inputs(HV, seed=3, T=len(parents))
    ckpt = torch.full((1, len(parents), HV, K, V), NAN, device="cuda")
    o = verify(i, ckpt, require_tree(parents))
    path = [0, 2, 5, 7]
    sub = {n: (x if n == "initial_state" else x[:, path]) for n, x in i.items()}
    ckpt_path = torch.full((1, 4, HV, K, V), NAN, device="cuda")
    o_path = verify(sub, ckpt_path, chain(4))
    assert not o.isnan().any() and not ckpt.isnan().any()
    for s, slot in enumerate(path):
        assert torch.equal(ckpt_path[:, s], ckpt[:, slot])
        assert torch.equal(o_path[:, s], o[:, slot])


def test_remap_in_place_equals_out_of_place() -> None:
    HV, n = 48, 5
    bank = torch.full((1, T, HV, K, V), NAN, device="cuda")
    verify(gdn_inputs(HV, seed=4), bank, chain(T))
    second = gdn_inputs(HV, seed=5)
    bank_copy = bank.clone()
    o_out = verify({**second, "initial_state": bank[:, n - 1].clone()}, bank_copy, chain(T))
    o_in = verify({**second, "initial_state": bank[:, n - 1]}, bank, chain(T))
    assert not o_out.isnan().any() and not bank_copy.isnan().any()
    assert torch.equal(o_in, o_out) and torch.equal(bank, bank_copy)


def test_conv_capture_matches_reference_and_remaps() -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(1, T, C, generator=gen, device="cuda").bfloat16()
    rows = torch.randn(1, KC - 1, C, generator=gen, device="cuda").bfloat16()
    w = torch.randn(C, KC, generator=gen, device="cuda").bfloat16()
    b = torch.randn(C, generator=gen, device="cuda").bfloat16()
    cap = torch.full((1, KC - 1 + T, C), NAN, device="cuda", dtype=torch.bfloat16)
    y = conv(x, rows, w, b, cap)
    cap64 = torch.full((1, KC - 1 + T, C), NAN, device="cuda", dtype=torch.float64)
    y64 = causal_conv1d_capture_reference(x.double(), rows.double(), w.double(), b.double(), cap64)
    assert rel_rms(y, y64) <= 1e-2
    assert torch.equal(cap, torch.cat([rows, x], 1))
    n, cap_copy = 7, cap.clone()
    y_out = conv(x, cap[:, n : n + KC - 1].clone(), w, b, cap_copy)
    y_in = conv(x, cap[:, n : n + KC - 1], w, b, cap)
    assert not y_out.isnan().any()
    assert torch.equal(y_in, y_out) and torch.equal(cap, cap_copy)


@pytest.mark.parametrize("commit_n", [1, 7, 16])
def test_rollback_48_layers_bit_exact(commit_n: int) -> None:
    L, HV, S = 48, 48, T
    gen = torch.Generator(device="cuda").manual_seed(commit_n)
    ckpt = torch.randn(L, 1, S, HV, K, V, generator=gen, device="cuda")
    cap = torch.randn(L, 1, KC - 1 + S, C, generator=gen, device="cuda").bfloat16()
    states = torch.full((L, 1, HV, K, V), NAN, device="cuda")
    rows = torch.full((L, 1, KC - 1, C), NAN, device="cuda", dtype=torch.bfloat16)
    rollback_restore(states, rows, ckpt, cap, commit_n)
    want_state, want_rows = ckpt[:, :, commit_n - 1], cap[:, :, commit_n : commit_n + KC - 1]
    assert torch.equal(states, want_state) and torch.equal(rows, want_rows)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_agrees_with_fla_fused_recurrent(shape: str) -> None:
    fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla not installed")
    fused_recurrent_gated_delta_rule = fla_gdr.fused_recurrent_gated_delta_rule

    HV = SHAPES[shape]
    i = gdn_inputs(HV, seed=8)
    ckpt = torch.full((1, T, HV, K, V), NAN, device="cuda")
    o = verify(i, ckpt, chain(T))
    o_fla, final_fla = fused_recurrent_gated_delta_rule(
        i["q"], i["k"], i["v"], g=i["g"], beta=i["beta"], scale=K**-0.5,
        initial_state=i["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_rms(o, o_fla) <= 1e-2
    assert rel_rms(ckpt[:, T - 1], final_fla) <= 1e-4


@pytest.mark.parametrize("shape", list(SHAPES))
def test_recompute_equals_checkpoints_bit_exactly_in_one_graphed_launch(shape: str) -> None:
    """``gdn_recompute`` over 4 layers at the real widths: for every accepted count, the
    recomputed states are the verify's checkpoint slots bit for bit (the same per-token
    arithmetic), the conv rows the captured window, the snapshot the pre-verify state —
    with the count read on the device, replayed from one CUDA graph for every count."""
    HV, L, S = SHAPES[shape], 4, T
    c = 2 * HK * K + HV * V
    layers = [gdn_inputs(HV, seed=40 + layer) for layer in range(L)]
    ckpts = torch.full((L, 1, S, HV, K, V), NAN, device="cuda")
    inputs = torch.full((L, 1, S, c), NAN, device="cuda", dtype=torch.bfloat16)
    g = torch.full((L, 1, S, HV), NAN, device="cuda")
    beta = torch.full((L, 1, S, HV), NAN, device="cuda", dtype=torch.bfloat16)
    for layer, i in enumerate(layers):
        i["beta"] = i["beta"].bfloat16()  # as the model's gates give it: in the model dtype
        verify(i, ckpts[layer], chain(S))
        inputs[layer, :, :, : HK * K] = i["q"].reshape(1, S, HK * K)
        inputs[layer, :, :, HK * K : 2 * HK * K] = i["k"].reshape(1, S, HK * K)
        inputs[layer, :, :, 2 * HK * K :] = i["v"].reshape(1, S, HV * V)
        g[layer], beta[layer] = i["g"], i["beta"]
    pre = torch.stack([i["initial_state"] for i in layers])  # [L, 1, HV, K, V]
    captured = torch.randn(L, 1, KC - 1 + S, c, device="cuda").bfloat16()
    state = torch.full_like(pre, NAN)
    rows = torch.full((L, 1, KC - 1, c), NAN, device="cuda", dtype=torch.bfloat16)
    snapshot = torch.full_like(pre, NAN)
    count = torch.ones(1, dtype=torch.int64, device="cuda")

    def rollback() -> None:
        state.copy_(pre)
        gdn_recompute(state, inputs, g, beta, rows, captured, count, snapshot=snapshot)

    rollback()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rollback()
    for n in range(1, S + 1):
        count.fill_(n)
        state.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(state, ckpts[:, :, n - 1]), f"{shape}: n={n}"
        assert torch.equal(rows, captured[:, :, n : n + KC - 1]), f"{shape}: rows n={n}"
        assert torch.equal(snapshot, pre)


#: a best-first tree of 16 nodes: siblings before grandchildren, a node's children apart
TREE16 = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 5, 7, 9, 9, 12, 8]


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_recompute_equals_tree_checkpoints_in_one_graphed_launch(shape: str) -> None:
    """A tree verified without checkpoints (only the reloaded nodes' states in a one-layer
    scratch) gives the checkpointed verify's outputs; ``gdn_recompute`` along each node's
    path — path and count in static device buffers, one CUDA graph for every node — gives
    that node's checkpoint bit for bit and the conv window along its path."""
    from dflash.model.caches import path_window_rows

    HV, L, S = SHAPES[shape], 2, len(TREE16)
    tree = require_tree(TREE16)
    c = 2 * HK * K + HV * V
    layers = [gdn_inputs(HV, seed=70 + layer, T=S) for layer in range(L)]
    ckpts = torch.full((L, 1, S, HV, K, V), NAN, device="cuda")
    inputs = torch.full((L, 1, S, c), NAN, device="cuda", dtype=torch.bfloat16)
    g = torch.full((L, 1, S, HV), NAN, device="cuda")
    beta = torch.full((L, 1, S, HV), NAN, device="cuda", dtype=torch.bfloat16)
    scratch = torch.full((1, S, HV, K, V), NAN, device="cuda")
    for layer, i in enumerate(layers):
        i["beta"] = i["beta"].bfloat16()
        want = verify(i, ckpts[layer], tree)
        got = verify(i, None, tree, tree_states=scratch)  # type: ignore[arg-type]
        assert torch.equal(got, want), f"{shape}: layer {layer} outputs"
        inputs[layer, :, :, : HK * K] = i["q"].reshape(1, S, HK * K)
        inputs[layer, :, :, HK * K : 2 * HK * K] = i["k"].reshape(1, S, HK * K)
        inputs[layer, :, :, 2 * HK * K :] = i["v"].reshape(1, S, HV * V)
        g[layer], beta[layer] = i["g"], i["beta"]
    pre = torch.stack([i["initial_state"] for i in layers])
    captured = torch.randn(L, 1, KC - 1 + S, c, device="cuda").bfloat16()
    state = torch.full_like(pre, NAN)
    rows = torch.full((L, 1, KC - 1, c), NAN, device="cuda", dtype=torch.bfloat16)
    count = torch.ones(1, dtype=torch.int64, device="cuda")
    path = torch.zeros(S, dtype=torch.int64, device="cuda")

    def rollback() -> None:
        state.copy_(pre)
        gdn_recompute(state, inputs, g, beta, rows, captured, count, path=path)

    rollback()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rollback()
    for u in range(S):
        nodes = [u]
        while TREE16[nodes[-1]] >= 0:
            nodes.append(TREE16[nodes[-1]])
        nodes.reverse()
        path.copy_(torch.tensor(nodes + [S - 1] * (S - len(nodes))))
        count.fill_(len(nodes))
        state.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(state, ckpts[:, :, u]), f"{shape}: node {u}"
        window = path_window_rows(nodes, KC - 1)
        assert torch.equal(rows, captured[:, :, window]), f"{shape}: rows of node {u}"
