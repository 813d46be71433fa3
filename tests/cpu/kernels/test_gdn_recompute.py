"""gdn_recompute: the recompute rollback equals the verify's checkpoint slot bit for bit,
and gdn_verify(checkpoints=None) stores no state."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernels_support import NAN, gdn_inputs, nan_slots, needs_interpreter

import dflash.kernels.gdn as gdn_module
import dflash.kernels.gdn_triton as gdn_triton_module
from dflash.errors import KernelBoundsError
from dflash.geometry import require_chain, require_tree
from dflash.kernels import RollbackBoundsError, gdn_recompute, gdn_verify
from dflash.kernels.checks import Backend
from dflash.kernels.tree_paths import reloaded_nodes
from dflash.model.caches import path_window_rows

BACKENDS = [pytest.param("reference"), pytest.param("triton", marks=needs_interpreter)]


@dataclass
class Shard:
    """One shard's verify: per-layer inputs, and what gdn_recompute reads."""

    layers: list[dict[str, torch.Tensor]]  # gdn_inputs per layer (beta in the inputs' dtype)
    state: torch.Tensor     # [L, B, HV, K, V] the pre-verify states
    inputs: torch.Tensor    # [L, B, S, C] q | k | v
    g: torch.Tensor         # [L, B, S, HV] f32
    beta: torch.Tensor      # [L, B, S, HV]
    captured: torch.Tensor  # [L, B, Kc-1+S, C]
    Kc: int


def shard(L: int, B: int, S: int, HK: int, HV: int, K: int, V: int, dtype: torch.dtype,
          seed: int, Kc: int = 4) -> Shard:
    layers = []
    for l in range(L):
        i = gdn_inputs(B, S, HK, HV, K, V, dtype, seed=seed + l)
        layers.append({**i, "beta": i["beta"].to(dtype)})
    rows = [torch.cat([i["q"].reshape(B, S, -1), i["k"].reshape(B, S, -1),
                       i["v"].reshape(B, S, -1)], dim=-1) for i in layers]
    C = 2 * HK * K + HV * V
    gen = torch.Generator().manual_seed(seed + 1000)
    return Shard(
        layers=layers,
        state=torch.stack([i["initial_state"] for i in layers]),
        inputs=torch.stack(rows),
        g=torch.stack([i["g"] for i in layers]),
        beta=torch.stack([i["beta"] for i in layers]),
        captured=torch.randn(L, B, Kc - 1 + S, C, generator=gen).to(dtype),
        Kc=Kc,
    )


def verify_checkpoints(sh: Shard, backend: Backend, l2: bool = True) -> torch.Tensor:
    """gdn_verify over all S tokens of every layer: the checkpoints [L, B, S, HV, K, V]."""
    L, B, HV, K, V = sh.state.shape
    S = sh.inputs.shape[2]
    ckpt = torch.full((L, B, S, HV, K, V), NAN)
    for l, i in enumerate(sh.layers):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], sh.state[l], ckpt[l],
                   require_chain(list(range(-1, S - 1))), use_qk_l2norm=l2,
                   out=torch.full_like(i["v"], NAN), backend=backend)
    assert not ckpt.isnan().any()
    return ckpt


def decode_states(sh: Shard, backend: Backend, l2: bool = True) -> torch.Tensor:
    """Plain decoding: one gdn_verify(T=1, final_state_only) per token, state in place;
    the state after every token, [L, B, S, HV, K, V]."""
    S = sh.inputs.shape[2]
    states = []
    for l, i in enumerate(sh.layers):
        state = sh.state[l].clone()
        after = []
        for t in range(S):
            s = slice(t, t + 1)
            gdn_verify(i["q"][:, s], i["k"][:, s], i["v"][:, s], i["g"][:, s],
                       i["beta"][:, s], state, state.unsqueeze(1), None, final_state_only=True,
                       use_qk_l2norm=l2, out=torch.full_like(i["v"][:, s], NAN),
                       backend=backend)
            after.append(state.clone())
        states.append(torch.stack(after, dim=1))
    return torch.stack(states)


def recompute(sh: Shard, commit_n: int | torch.Tensor, *, in_place: bool, backend: Backend,
              l2: bool = True) -> dict[str, torch.Tensor]:
    """gdn_recompute into NaN-poisoned outputs; returns the state reached, the conv rows,
    the snapshot and the state argument after the call."""
    L, B = sh.state.shape[:2]
    state = sh.state.clone()
    rows = torch.full((L, B, sh.Kc - 1, sh.inputs.shape[3]), NAN, dtype=sh.captured.dtype)
    snapshot = torch.full_like(state, NAN)
    out = None if in_place else torch.full_like(state, NAN)
    gdn_recompute(state, sh.inputs, sh.g, sh.beta, rows, sh.captured, commit_n, out=out,
                  snapshot=snapshot, use_qk_l2norm=l2, backend=backend)
    return {"result": state if out is None else out, "conv_rows": rows,
            "snapshot": snapshot, "state": state}


def check(sh: Shard, got: dict[str, torch.Tensor], n: int, want: torch.Tensor,
          in_place: bool) -> None:
    assert torch.equal(got["result"], want), f"n={n}: not the checkpoint slot's bits"
    assert torch.equal(got["conv_rows"], sh.captured[:, :, n : n + sh.Kc - 1]), f"n={n}"
    assert torch.equal(got["snapshot"], sh.state), f"n={n}: snapshot"
    if not in_place:
        assert torch.equal(got["state"], sh.state), f"n={n}: the state argument changed"


# (L, B, S, HK, HV, K, V, input dtype, use_qk_l2norm, accepted counts to recompute):
# grouped heads 1/2/3, partial key (K=20, 48) and value (V=24, 40) blocks
CASES = [
    (1, 1, 1, 1, 1, 16, 16, torch.float32, True, [1]),
    (2, 2, 4, 2, 4, 32, 16, torch.float32, True, [1, 3, 4]),
    (1, 1, 16, 1, 3, 48, 32, torch.float32, False, list(range(1, 17))),
    (1, 2, 3, 2, 6, 16, 32, torch.bfloat16, True, [2, 3]),
    (3, 1, 5, 1, 2, 20, 24, torch.bfloat16, True, [1, 4]),
    (1, 1, 3, 1, 2, 16, 40, torch.float32, True, [2]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("L", "B", "S", "HK", "HV", "K", "V", "dtype", "l2", "ns"), CASES)
def test_recompute_equals_checkpoint_slot_and_decode(
    backend: Backend, L: int, B: int, S: int, HK: int, HV: int, K: int, V: int,
    dtype: torch.dtype, l2: bool, ns: list[int],
) -> None:
    sh = shard(L, B, S, HK, HV, K, V, dtype, seed=S * 10 + K)
    ckpt = verify_checkpoints(sh, backend, l2)
    decoded = decode_states(sh, backend, l2)
    assert torch.equal(ckpt, decoded), "verify checkpoints differ from plain decoding"
    for n in ns:
        # out of place with a host count; in place with a device count
        check(sh, recompute(sh, n, in_place=False, backend=backend, l2=l2), n,
              ckpt[:, :, n - 1], in_place=False)
        check(sh, recompute(sh, torch.tensor([n]), in_place=True, backend=backend, l2=l2), n,
              decoded[:, :, n - 1], in_place=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("given", "used"), [(0, 1), (-3, 1), (9, 4)])
def test_device_count_out_of_range_is_clamped(backend: Backend, given: int, used: int) -> None:
    """A device count outside 1..S (the caller checks the value it reads back) is clamped:
    0 recomputes one token, S+5 all S, and nothing is read past the captured inputs."""
    sh = shard(2, 1, 4, 1, 2, 16, 16, torch.float32, seed=3)
    ckpt = verify_checkpoints(sh, backend)
    got = recompute(sh, torch.tensor([given]), in_place=True, backend=backend)
    check(sh, got, used, ckpt[:, :, used - 1], in_place=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_pool_views(backend: Backend) -> None:
    """Every tensor a view of a larger pool along its leading dims (every other layer, one
    batch row of two; state and snapshot with transposed [K, V] tiles): same bits as dense
    tensors, and nothing outside the views written."""
    L, B, S, HK, HV, K, V = 2, 1, 3, 1, 2, 16, 24
    sh = shard(L, B, S, HK, HV, K, V, torch.bfloat16, seed=21)
    want = recompute(sh, 2, in_place=False, backend=backend)

    def pooled(t: torch.Tensor, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        pool = torch.full((2 * L, 2 * B, *t.shape[2:]), fill, dtype=t.dtype)
        view = pool[::2, 1:]
        view.copy_(t)
        return pool, view

    tiles = torch.full((2 * L, B, HV, V, K), NAN).transpose(3, 4)  # [.., K, V], V-major
    state = tiles[::2]
    state.copy_(sh.state)
    snap_pool = torch.full((2 * L, B, HV, V, K), NAN).transpose(3, 4)
    _, inputs = pooled(sh.inputs)
    _, g = pooled(sh.g)
    _, beta = pooled(sh.beta)
    _, captured = pooled(sh.captured)
    rows_pool, rows = pooled(torch.full_like(want["conv_rows"], NAN), NAN)
    gdn_recompute(state, inputs, g, beta, rows, captured, torch.tensor([2]),
                  snapshot=snap_pool[1::2], backend=backend)
    assert torch.equal(state, want["result"]) and torch.equal(rows, want["conv_rows"])
    assert torch.equal(snap_pool[1::2], sh.state)
    assert tiles[1::2].isnan().all() and snap_pool[::2].isnan().all()
    assert rows_pool[1::2].isnan().all() and rows_pool[:, :1].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_without_checkpoints_writes_no_state(backend: Backend) -> None:
    """checkpoints=None: the same o as a verify with checkpoints, the snapshot when asked,
    and no state written (the live state, the slot bank and a NaN snapshot not passed
    stay as they were)."""
    B, T, HK, HV, K, V = 2, 4, 1, 2, 16, 24
    i = gdn_inputs(B, T, HK, HV, K, V, torch.bfloat16, seed=31)
    chain = require_chain(list(range(-1, T - 1)))
    ckpt = nan_slots(B, T, HV, K, V, torch.float32)
    want = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt,
                      chain, backend=backend)
    before = i["initial_state"].clone()
    for snap in (None, torch.full((B, HV, K, V), NAN)):
        out = torch.full_like(i["v"], NAN)
        got = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], None,
                         chain, snapshot=snap, out=out, backend=backend)
        assert got is out and torch.equal(got, want)
        assert torch.equal(i["initial_state"], before), "the live state was written"
        if snap is not None:
            assert torch.equal(snap, before)

    # with a slot bank read on the device: the bank is only read
    bank = ckpt.clone()
    want_bank = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], bank[:, 1].clone(),
                           nan_slots(B, T, HV, K, V, torch.float32), chain, backend=backend)
    unused = torch.full((B, HV, K, V), NAN)
    got = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], unused, None, chain,
                     slot_bank=bank, live_slot=torch.tensor([1]), backend=backend)
    assert torch.equal(got, want_bank) and torch.equal(bank, ckpt)
    assert unused.isnan().all()


def test_verify_without_checkpoints_refusals() -> None:
    i = gdn_inputs(1, 3, 1, 2, 16, 16, torch.float32, seed=0)
    state = i["initial_state"].clone()
    out = torch.full_like(i["v"], NAN)
    with pytest.raises(KernelBoundsError, match=r"branching tree .* needs 'tree_states'"):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], state, None,
                   require_tree([-1, 0, 0]), out=out)
    scratch = torch.full((1, 3, 2, 16, 16), NAN)
    with pytest.raises(KernelBoundsError, match=r"'tree_states' is the scratch .* \(pass one"):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], state, scratch.clone(),
                   require_tree([-1, 0, 0]), out=out, tree_states=scratch)
    with pytest.raises(KernelBoundsError, match=r"'tree_states' must have shape"):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], state, None,
                   require_tree([-1, 0, 0]), out=out, tree_states=scratch[:, :2])
    with pytest.raises(KernelBoundsError, match=r"'tree_states' must be torch.float32"):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], state, None,
                   require_tree([-1, 0, 0]), out=out, tree_states=scratch.double())
    with pytest.raises(KernelBoundsError, match=r"'tree_states' must not share memory"):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], scratch[:, 0], None,
                   require_tree([-1, 0, 0]), out=out, tree_states=scratch)
    with pytest.raises(KernelBoundsError, match=r"'checkpoints' is None.*final_state_only"):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], state, None, None,
                   final_state_only=True, out=out)
    assert torch.equal(state, i["initial_state"]) and out.isnan().all()


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a kernel ran on refused input")


L0, B0, S0, HK0, HV0, K0, V0 = 2, 1, 4, 1, 2, 16, 16


def _bad() -> list[tuple[dict[str, object], type[Exception], str]]:
    f = torch.float32
    base = torch.full((2 * L0, B0, HV0, K0, V0), NAN)
    return [
        ({"state": "s"}, TypeError, "'state' must be a torch.Tensor"),
        ({"state": torch.zeros(B0, HV0, K0, V0)}, KernelBoundsError, "'state' must have 5"),
        ({"state": torch.zeros(L0, B0, HV0, K0, V0, dtype=torch.float64)}, KernelBoundsError,
         "'state' must be torch.float32"),
        ({"state": torch.zeros(L0, 0, HV0, K0, V0)}, KernelBoundsError, "no empty dimension"),
        ({"inputs": lambda a: a["inputs"][:1]}, KernelBoundsError, "'inputs' must have shape"),
        ({"inputs": lambda a: a["inputs"][:, :, :0]}, KernelBoundsError, "at least one token"),
        ({"inputs": lambda a: a["inputs"].double(), "beta": lambda a: a["beta"].double()},
         KernelBoundsError, "'inputs' must be float16, bfloat16 or float32"),
        ({"inputs": lambda a: a["inputs"][..., :-1], "captured": lambda a: a["captured"][..., :-1],
          "conv_rows": lambda a: a["conv_rows"][..., :-1]}, KernelBoundsError,
         "C=63 must be 2\\*HK\\*K \\+ HV\\*V .* HV=2, for V=16, K=16 .* = 0.96875"),
        # C = 2*3*K + HV*V: HK=3 does not divide HV=2
        ({"inputs": lambda a: torch.zeros(L0, B0, S0, 6 * K0 + HV0 * V0)}, KernelBoundsError,
         "C=128 .*\\(got HK = \\(C - HV\\*V\\) / \\(2\\*K\\) = 3\\)"),
        ({"g": lambda a: a["g"][..., :1]}, KernelBoundsError, "'g' must have shape"),
        ({"g": lambda a: a["g"].bfloat16()}, KernelBoundsError, "'g' must be torch.float32"),
        ({"beta": lambda a: a["beta"].half()}, KernelBoundsError, "'beta' must be torch.float32"),
        ({"captured": lambda a: a["captured"][:, :, :S0]}, KernelBoundsError, "Kc >= 2"),
        ({"captured": lambda a: a["captured"][..., :8]}, KernelBoundsError,
         "'captured' must have shape"),
        ({"conv_rows": lambda a: a["conv_rows"][:, :, :2]}, KernelBoundsError,
         "'conv_rows' must have shape"),
        ({"conv_rows": lambda a: a["conv_rows"].half()}, KernelBoundsError,
         "'conv_rows' must be torch.float32"),
        ({"commit_n": 0}, RollbackBoundsError, "1 <= commit_n <= S=4 \\(got 0\\)"),
        ({"commit_n": S0 + 1}, RollbackBoundsError, "\\(got 5\\)"),
        ({"commit_n": True}, RollbackBoundsError, "\\(got True\\)"),
        ({"commit_n": 2.0}, RollbackBoundsError, "\\(got 2.0\\)"),
        ({"commit_n": torch.tensor([2]).int()}, RollbackBoundsError, "dtype torch.int32"),
        ({"commit_n": torch.tensor([1, 2])}, RollbackBoundsError, "shape \\(2,\\)"),
        ({"commit_n": torch.tensor([2], device="meta")}, KernelBoundsError,
         "'commit_n' is on meta"),
        ({"snapshot": torch.zeros(L0, B0, HV0, K0, 8)}, KernelBoundsError,
         "'snapshot' must have shape"),
        ({"snapshot": torch.zeros(L0, B0, HV0, K0, V0).half()}, KernelBoundsError,
         "'snapshot' must be torch.float32"),
        ({"snapshot": lambda a: a["state"][:]}, KernelBoundsError,
         "'snapshot' must not share memory with 'state'"),
        ({"out": torch.zeros(L0, B0, HV0, K0, V0, dtype=f, device="meta")}, KernelBoundsError,
         "'out' is on meta"),
        ({"out": torch.zeros(L0, B0, HV0, K0, 8)}, KernelBoundsError, "'out' must have shape"),
        ({"out": lambda a: a["snapshot"]}, KernelBoundsError,
         "'out' must not share memory with 'snapshot'"),
        ({"state": base[:L0], "out": base[L0:]}, KernelBoundsError,
         "'out' must not share memory with 'state'"),
        ({"conv_rows": lambda a: a["captured"][:, :, :3]}, KernelBoundsError,
         "'conv_rows' must not share memory with 'captured'"),
        ({"backend": "cuda"}, KernelBoundsError, "'backend'"),
        ({"path": [0, 1]}, TypeError, "'path' must be a torch.Tensor"),
        ({"path": torch.tensor([0, 1]).int()}, KernelBoundsError,
         "'path' must be a one-dimensional int64 tensor \\(got dtype torch.int32"),
        ({"path": torch.tensor([[0, 1]])}, KernelBoundsError, "shape \\(1, 2\\)"),
        ({"path": torch.zeros(0, dtype=torch.int64)}, KernelBoundsError,
         "'path' must hold 1 .. S=4 rows \\(got 0\\)"),
        ({"path": torch.zeros(S0 + 1, dtype=torch.int64)}, KernelBoundsError, "\\(got 5\\)"),
        ({"path": torch.tensor([0])}, RollbackBoundsError, "'commit_n'=2 exceeds the path's 1"),
        ({"path": torch.tensor([0, S0])}, KernelBoundsError,
         "'path' rows must be in \\[0, S=4\\) \\(got \\[4\\]\\)"),
        ({"path": torch.tensor([0, -1])}, KernelBoundsError, "\\(got \\[-1\\]\\)"),
        ({"path": torch.tensor([0, 1], device="meta")}, KernelBoundsError, "'path' is on meta"),
    ]


@pytest.mark.parametrize(("change", "error", "match"), _bad())
def test_refused_before_any_launch(
    change: dict[str, object], error: type[Exception], match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gdn_triton_module, "launch_gdn_recompute", _never)
    monkeypatch.setattr(gdn_module, "gdn_recompute_reference", _never)
    sh = shard(L0, B0, S0, HK0, HV0, K0, V0, torch.float32, seed=0)
    args: dict[str, object] = {
        "state": sh.state.clone(), "inputs": sh.inputs, "g": sh.g, "beta": sh.beta,
        "conv_rows": torch.full((L0, B0, sh.Kc - 1, sh.inputs.shape[3]), NAN),
        "captured": sh.captured, "commit_n": 2, "out": torch.full_like(sh.state, NAN),
        "snapshot": torch.full_like(sh.state, NAN),
    }
    tensors = {n: t for n, t in args.items() if isinstance(t, torch.Tensor)}
    saved = {n: t.clone() for n, t in tensors.items()}
    resolved = {n: (v(args) if callable(v) else v) for n, v in change.items()}
    call = {**args, **resolved}
    with pytest.raises(error, match=match):
        gdn_recompute(**call)  # type: ignore[arg-type]  # bad values on purpose
    for n, t in saved.items():  # nothing written: every tensor as it was (NaN where poisoned)
        assert torch.equal(t.nan_to_num(7.0), tensors[n].nan_to_num(7.0)), n


@needs_interpreter
def test_triton_layout_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn_triton_module, "launch_gdn_recompute", _never)
    sh = shard(L0, B0, S0, HK0, HV0, K0, V0, torch.float32, seed=0)
    rows = torch.full((L0, B0, sh.Kc - 1, sh.inputs.shape[3]), NAN)
    strided = torch.zeros(L0, B0, S0, 2 * sh.inputs.shape[3])[..., ::2]
    with pytest.raises(KernelBoundsError, match="'inputs' must have a unit-stride last"):
        gdn_recompute(sh.state, strided, sh.g, sh.beta, rows, sh.captured, 1, backend="triton")
    with pytest.raises(KernelBoundsError, match="'conv_rows' must be contiguous after"):
        gdn_recompute(sh.state, sh.inputs, sh.g, sh.beta, rows.transpose(2, 3).contiguous()
                      .transpose(2, 3), sh.captured, 1, backend="triton")
    assert rows.isnan().all()


def test_out_the_same_view_as_state_is_in_place() -> None:
    """``out`` viewing exactly ``state``'s elements is the in-place call, not an overlap."""
    sh = shard(1, 1, 3, 1, 2, 16, 16, torch.float32, seed=41)
    want = recompute(sh, 2, in_place=True, backend="reference")
    state = sh.state.clone()
    rows = torch.full_like(want["conv_rows"], NAN)
    gdn_recompute(state, sh.inputs, sh.g, sh.beta, rows, sh.captured, 2, out=state[:],
                  backend="reference")
    assert torch.equal(state, want["result"])


# -- trees: a verify without checkpoints, and the recompute along the accepted path ---------

#: trees over S = 7 slots: depth-first (a node's first child right after it), best-first
#: (siblings before grandchildren) and a chain written as a tree
TREES = {
    "depth-first": [-1, 0, 1, 2, 1, 0, 5],
    "best-first": [-1, 0, 0, 1, 2, 1, 3],
    "chain": [-1, 0, 1, 2, 3, 4, 5],
}


def tree_checkpoints(sh: Shard, parents: list[int], backend: Backend) -> torch.Tensor:
    """A tree verify of every layer with checkpoints: the node states [L, B, S, HV, K, V]."""
    L, B, HV, K, V = sh.state.shape
    ckpt = torch.full((L, B, len(parents), HV, K, V), NAN)
    for l, i in enumerate(sh.layers):
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], sh.state[l], ckpt[l],
                   require_tree(parents), backend=backend)
    assert not ckpt.isnan().any()
    return ckpt


def root_path(parents: list[int], u: int) -> list[int]:
    path = [u]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TREES))
def test_tree_verify_without_checkpoints(backend: Backend, name: str) -> None:
    """A tree verified with ``checkpoints=None`` and ``tree_states``: the same outputs as
    with checkpoints, the live state only read, and (Triton) only the nodes a node starts
    from without following them in its walk written to the scratch — here the trunk's
    branch points, a chain none."""
    parents = TREES[name]
    B, T, HK, HV, K, V = 2, len(parents), 1, 2, 16, 24
    i = gdn_inputs(B, T, HK, HV, K, V, torch.bfloat16, seed=5)
    ckpt = nan_slots(B, T, HV, K, V, torch.float32)
    want = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt,
                      require_tree(parents), backend=backend)
    before = i["initial_state"].clone()
    scratch = nan_slots(B, T + 1, HV, K, V, torch.float32)
    out = torch.full_like(i["v"], NAN)
    got = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], None,
                     require_tree(parents), out=out, tree_states=scratch, backend=backend)
    assert got is out and torch.equal(got, want)
    assert torch.equal(i["initial_state"], before), "the live state was written"
    kept = [u for u, flag in enumerate(reloaded_nodes(tuple(parents))) if flag]
    # the trunk nodes a subtree hangs from (tree_walks: trunks 0-1-2-3, 0-1-3-6, the chain)
    assert kept == {"depth-first": [0, 1], "best-first": [0, 1], "chain": []}[name]
    for u in range(T + 1):
        if backend == "triton" and u in kept:
            assert torch.equal(scratch[:, u], ckpt[:, u]), f"node {u}"
        else:
            assert scratch[:, u].isnan().all(), f"slot {u} written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_along_a_tree_path_equals_the_node_checkpoint(
    backend: Backend, name: str, dtype: torch.dtype
) -> None:
    """For every node of the tree, the recompute along its root path gives the verify's
    checkpoint of that node bit for bit, the conv window along the path, and the snapshot:
    with a host count and an exact path, and with a device count and a padded path."""
    parents = TREES[name]
    S = len(parents)
    sh = shard(2, 2, S, 1, 2, 16, 24, dtype, seed=17)
    ckpt = tree_checkpoints(sh, parents, backend)
    L, B = sh.state.shape[:2]
    for u in range(S):
        path = root_path(parents, u)
        window = path_window_rows(path, sh.Kc - 1)
        padded = path + [S - 1] * (S - len(path))  # rows past the count are not read
        for n, rows in ((len(path), path), (torch.tensor([len(path)]), padded)):
            state = sh.state.clone()
            conv = torch.full((L, B, sh.Kc - 1, sh.inputs.shape[3]), NAN, dtype=sh.captured.dtype)
            snap = torch.full_like(state, NAN)
            gdn_recompute(state, sh.inputs, sh.g, sh.beta, conv, sh.captured, n,
                          snapshot=snap, path=torch.tensor(rows), backend=backend)
            assert torch.equal(state, ckpt[:, :, u]), f"node {u}: not its checkpoint's bits"
            assert torch.equal(conv, sh.captured[:, :, window]), f"node {u}: conv window"
            assert torch.equal(snap, sh.state), f"node {u}: snapshot"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_device_count_past_the_path_is_clamped_to_it(backend: Backend) -> None:
    """A device count larger than the path recomputes the whole path (never a row past it)."""
    parents = TREES["best-first"]
    sh = shard(1, 1, len(parents), 1, 2, 16, 16, torch.float32, seed=3)
    ckpt = tree_checkpoints(sh, parents, backend)
    path = root_path(parents, 6)  # [0, 1, 3, 6]
    state = sh.state.clone()
    conv = torch.full((1, 1, sh.Kc - 1, sh.inputs.shape[3]), NAN)
    gdn_recompute(state, sh.inputs, sh.g, sh.beta, conv, sh.captured, torch.tensor([9]),
                  path=torch.tensor(path), backend=backend)
    assert torch.equal(state, ckpt[:, :, 6])
    assert torch.equal(conv, sh.captured[:, :, path_window_rows(path, sh.Kc - 1)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(TREES))
def test_a_tree_table_walks_the_same_tree(backend: Backend, name: str) -> None:
    """``tree_table`` (filled by tree_parents_into, as a graph's static buffer): the same
    outputs and node states as the verify that uploads its own table — with checkpoints,
    and without them (the reloaded nodes in the scratch)."""
    from dflash.kernels import tree_parents_into

    parents = TREES[name]
    B, T, HK, HV, K, V = 1, len(parents), 1, 2, 16, 16
    i = gdn_inputs(B, T, HK, HV, K, V, torch.float32, seed=8)
    tree = require_tree(parents)
    table = tree_parents_into(tree, torch.full((2 * T + T * T + 4,), 99, dtype=torch.int32))
    want_ck = nan_slots(B, T, HV, K, V, torch.float32)
    want = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], want_ck,
                      tree, backend=backend)
    got_ck = nan_slots(B, T, HV, K, V, torch.float32)
    got = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], got_ck,
                     tree, tree_table=table, backend=backend)
    assert torch.equal(got, want) and torch.equal(got_ck, want_ck)
    got = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], None,
                     tree, tree_table=table, tree_states=nan_slots(B, T, HV, K, V, torch.float32),
                     backend=backend)
    assert torch.equal(got, want)


def test_tree_table_refusals() -> None:
    i = gdn_inputs(1, 3, 1, 2, 16, 16, torch.float32, seed=0)
    ck = nan_slots(1, 3, 2, 16, 16, torch.float32)
    args = (i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ck)
    table = torch.zeros(15, dtype=torch.int32)
    with pytest.raises(KernelBoundsError, match="'tree_table' belongs to a tree verify"):
        gdn_verify(*args, require_chain([-1, 0, 1]), tree_table=table)
    for bad, match in ((table.long(), "1-dimensional torch.int32"),
                       (table[:14], r"at least 2\*T \+ T\*T=15"),
                       (torch.zeros(30, dtype=torch.int32)[::2], "contiguous")):
        with pytest.raises(KernelBoundsError, match=match):
            gdn_verify(*args, require_tree([-1, 0, 0]), tree_table=bad)
    assert ck.isnan().all()


@needs_interpreter
@pytest.mark.parametrize("seed", range(8))
def test_every_node_of_a_random_tree_equals_the_chain_along_its_path(seed: int) -> None:
    """The tree recurrence in two launches (the trunk, then every subtree off it from its
    trunk parent's state, ``tree_walks``) gives every node the output and state of a
    chain verify over that node's root path, bit for bit, with checkpoints and without
    them (the reloaded nodes in the scratch): random trees of 1 … 23 nodes, bushy and
    deep, NaN-poisoned outputs."""
    import random

    from dflash.kernels.tree_paths import tree_walks

    rng = random.Random(seed)
    T = 1 + seed * 3
    parents = [-1] + [rng.randrange(s) if rng.random() < 0.5 else s - 1 for s in range(1, T)]
    B, HK, HV, K, V = 1, 1, 2, 16, 24
    i = gdn_inputs(B, T, HK, HV, K, V, torch.bfloat16, seed=40 + seed)
    ckpt = nan_slots(B, T, HV, K, V, torch.float32)
    out = torch.full_like(i["v"], NAN)
    got = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt,
                     require_tree(parents), out=out, backend="triton")
    scratch = nan_slots(B, T, HV, K, V, torch.float32)
    bare = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], None,
                      require_tree(parents), tree_states=scratch, backend="triton")
    assert torch.equal(bare, got)
    walks = tree_walks(parents)
    assert len(walks) > 1 or T < 4 or all(p == s - 1 for s, p in enumerate(parents))
    for u in range(T):
        path = root_path(parents, u)
        rows = torch.tensor(path)
        chain = {key: i[key].index_select(1, rows) for key in ("q", "k", "v", "g", "beta")}
        c_ckpt = nan_slots(B, len(path), HV, K, V, torch.float32)
        c_out = gdn_verify(chain["q"], chain["k"], chain["v"], chain["g"], chain["beta"],
                           i["initial_state"], c_ckpt, require_chain(
                               [-1, *range(len(path) - 1)]), backend="triton")
        assert torch.equal(got[:, u], c_out[:, -1]), f"node {u} output, path {path}"
        assert torch.equal(ckpt[:, u], c_ckpt[:, -1]), f"node {u} state, path {path}"
