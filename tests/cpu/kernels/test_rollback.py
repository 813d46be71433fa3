"""rollback_restore: one launch for all layers (and the conv rows alone, for a remap)."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, gdn_inputs, needs_interpreter

import dflash.kernels.rollback_triton as rollback_triton_module
from dflash.geometry import require_chain
from dflash.kernels import (
    RollbackBoundsError,
    causal_conv1d_capture,
    gdn_verify,
    rollback_restore,
    rollback_restore_reference,
)
from dflash.kernels.checks import Backend


def banks(L: int, B: int, S: int, HV: int, K: int, V: int, Kc: int, C: int,
          seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "states": torch.full((L, B, HV, K, V), NAN),
        "conv_rows": torch.full((L, B, Kc - 1, C), NAN, dtype=torch.bfloat16),
        "checkpoints": torch.randn(L, B, S, HV, K, V, generator=gen),
        "captured": torch.randn(L, B, Kc - 1 + S, C, generator=gen).to(torch.bfloat16),
    }


def restore(b: dict[str, torch.Tensor], commit_n: object, **kw: object) -> None:
    rollback_restore(b["states"], b["conv_rows"], b["checkpoints"], b["captured"],
                     commit_n, **kw)  # type: ignore[arg-type]


@needs_interpreter
@pytest.mark.parametrize(("HV", "K", "V"), [(2, 16, 16), (6, 32, 32)])  # 1 and 2 chunks
@pytest.mark.parametrize("commit_n", [1, 3, 5])
def test_triton_restore_is_bit_exact(HV: int, K: int, V: int, commit_n: int) -> None:
    L, B, S, Kc, C = 3, 2, 5, 4, 40
    b = banks(L, B, S, HV, K, V, Kc, C, seed=commit_n)
    ref = {n: t.clone() for n, t in b.items()}
    restore(b, commit_n, backend="triton")
    rollback_restore_reference(ref["states"], ref["conv_rows"], ref["checkpoints"],
                               ref["captured"], commit_n)
    assert torch.equal(b["states"], b["checkpoints"][:, :, commit_n - 1])
    assert torch.equal(b["conv_rows"], b["captured"][:, :, commit_n : commit_n + Kc - 1])
    assert torch.equal(b["states"], ref["states"])
    assert torch.equal(b["conv_rows"], ref["conv_rows"])


@needs_interpreter
def test_strided_layer_and_batch_views() -> None:
    """Pools may hold the banks inside larger buffers: only the inner block must be dense."""
    big = banks(4, 2, 5, 2, 16, 16, 4, 24, seed=1)
    b = {n: t[::2] for n, t in big.items()}  # every other layer: strided along L
    restore(b, 2, backend="triton")
    assert torch.equal(b["states"], b["checkpoints"][:, :, 1])
    assert torch.equal(b["conv_rows"], b["captured"][:, :, 2:5])
    assert torch.isnan(big["states"][1::2]).all(), "layers outside the view untouched"


@needs_interpreter
def test_non_dense_inner_block_refused_for_triton() -> None:
    b = banks(2, 1, 3, 2, 16, 16, 4, 24, seed=0)
    b["states"] = b["states"].transpose(3, 4)
    with pytest.raises(RollbackBoundsError, match="'states' must be contiguous"):
        restore(b, 1, backend="triton")


BAD = [
    ({}, 0, "1 <= commit_n <= S=4 \\(got 0\\)"),
    ({}, 5, "got 5"),
    ({}, True, "must be an int or a one-element int64 tensor \\(got True\\)"),
    ({}, 2.0, "must be an int or a one-element int64 tensor \\(got 2.0\\)"),
    ({}, torch.tensor([2]).int(), "one int64 element \\(got dtype torch.int32"),
    ({}, torch.tensor([1, 2]), "one int64 element \\(got dtype torch.int64, shape \\(2,\\)"),
    ({}, torch.tensor([2], device="meta"), "'commit_n' is on meta"),
    ({"checkpoints": None}, 1, "'checkpoints' storage is missing"),
    ({"captured": None}, 1, "'captured' storage is missing"),
    ({"states": None}, 1, "'states' storage is missing"),
    ({"checkpoints": "slots"}, 1, "'checkpoints' must be a torch.Tensor"),
    ({"checkpoints": lambda b: b["checkpoints"].half()}, 1, "'checkpoints' must be torch.float32"),
    ({"states": lambda b: b["states"].double()}, 1, "'states' must be torch.float32"),
    ({"states": lambda b: b["states"][:, :, :1]}, 1, "'states' must have shape"),
    ({"conv_rows": lambda b: b["conv_rows"][:, :, :2]}, 1, "disagree on Kc-1: 'conv_rows' has 2"),
    ({"captured": lambda b: b["captured"][:, :, :6]}, 1, "'captured' has 6 = Kc-1\\+S rows"),
    ({"conv_rows": lambda b: b["conv_rows"][:, :, :, :8]}, 1, "'conv_rows' must have shape"),
    ({"conv_rows": lambda b: b["conv_rows"].float()}, 1, "'conv_rows' dtype"),
    ({"captured": lambda b: b["captured"][:1]}, 1, "'captured' must have \\[L, B\\]"),
    ({"captured": lambda b: b["captured"][:, :, :4]}, 1, "Kc >= 2"),
    ({"states": lambda b: b["states"].to("meta")}, 1, "'states' is on meta"),
    ({"checkpoints": lambda b: b["checkpoints"][0]}, 1, "'checkpoints' must have 6 dimensions"),
]


@pytest.mark.parametrize(("change", "commit_n", "match"), BAD)
def test_bounds_refused_before_launch(
    change: dict[str, object], commit_n: object, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("launched on refused input")

    monkeypatch.setattr(rollback_triton_module, "launch_rollback_restore", never)
    b = banks(2, 1, 4, 2, 16, 16, 4, 24, seed=0)
    bad = {n: (v(b) if callable(v) else v) for n, v in change.items()}
    with pytest.raises(RollbackBoundsError, match=match) as info:
        restore({**b, **bad}, commit_n)  # type: ignore[dict-item]  # bad values on purpose
    assert isinstance(info.value, ValueError)
    assert torch.isnan(b["states"]).all() and torch.isnan(b["conv_rows"].float()).all()


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("rows_only", [False, True])
@pytest.mark.parametrize("commit_n", [1, 3, 4])
def test_device_commit_count_matches_host_int(
    backend: Backend, rows_only: bool, commit_n: int
) -> None:
    """A one-element int64 ``commit_n`` read by the kernel restores exactly what the host int
    does; ``rows_only`` copies the conv rows and leaves the states untouched."""
    L, B, S, HV, K, V, Kc, C = 3, 2, 4, 2, 16, 16, 4, 24
    dev = banks(L, B, S, HV, K, V, Kc, C, seed=commit_n)
    host = {n: t.clone() for n, t in dev.items()}
    restore(dev, torch.tensor([commit_n]), rows_only=rows_only, backend=backend)
    restore(host, commit_n, rows_only=rows_only, backend=backend)
    assert torch.equal(dev["conv_rows"], dev["captured"][:, :, commit_n : commit_n + Kc - 1])
    assert torch.equal(dev["conv_rows"], host["conv_rows"])
    if rows_only:
        assert torch.isnan(dev["states"]).all() and torch.isnan(host["states"]).all()
    else:
        assert torch.equal(dev["states"], dev["checkpoints"][:, :, commit_n - 1])
        assert torch.equal(dev["states"], host["states"])


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(("given", "used"), [(0, 1), (-3, 1), (9, 4)])
def test_device_commit_count_out_of_range_is_clamped(
    backend: Backend, given: int, used: int
) -> None:
    """A device count outside 1..S (never produced by the step; the caller checks the value
    it reads back) is clamped, so the copy stays inside the banks."""
    b = banks(2, 1, 4, 2, 16, 16, 4, 24, seed=3)
    restore(b, torch.tensor([given]), backend=backend)
    assert torch.equal(b["states"], b["checkpoints"][:, :, used - 1])
    assert torch.equal(b["conv_rows"], b["captured"][:, :, used : used + 3])


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_restore_and_remap_continue_exactly_like_decode(backend: Backend) -> None:
    """verify T tokens, accept n: restore, remap and token-by-token decode agree bit for bit."""
    L, B, HV, K, V, Kc, C, T, n = 2, 1, 2, 16, 16, 4, 24, 4, 2
    gen = torch.Generator().manual_seed(5)
    state0 = torch.randn(L, B, HV, K, V, generator=gen)
    rows0 = torch.randn(L, B, Kc - 1, C, generator=gen)
    weight = torch.randn(C, Kc, generator=gen)
    xs = torch.randn(L, B, T, C, generator=gen)
    ins = [gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=20 + l) for l in range(L)]

    ckpt = torch.full((L, B, T, HV, K, V), NAN)
    cap = torch.full((L, B, Kc - 1 + T, C), NAN)
    o = torch.full((L, B, T, HV, V), NAN)  # every output NaN-poisoned
    y = torch.full((L, B, T, C), NAN)
    for l in range(L):
        i = ins[l]
        gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], state0[l], ckpt[l],
                   require_chain(list(range(-1, T - 1))), out=o[l], backend=backend)
        causal_conv1d_capture(xs[l], rows0[l], weight, None, cap[l], out=y[l], backend=backend)

    live, live_rows = torch.full_like(state0, NAN), torch.full_like(rows0, NAN)
    rollback_restore(live, live_rows, ckpt, cap, n, backend=backend)
    remap_state, remap_rows = ckpt[:, :, n - 1], cap[:, :, n : n + Kc - 1]  # a remap's views

    dec, dec_rows = state0.clone(), rows0.clone()
    for l in range(L):
        i = ins[l]
        for t in range(n):
            s = slice(t, t + 1)
            o_t = torch.full((B, 1, HV, V), NAN)
            gdn_verify(i["q"][:, s], i["k"][:, s], i["v"][:, s], i["g"][:, s], i["beta"][:, s],
                       dec[l], dec[l].unsqueeze(1), None, final_state_only=True, out=o_t,
                       backend=backend)
            step, y_t = torch.full((B, Kc, C), NAN), torch.full((B, 1, C), NAN)
            causal_conv1d_capture(xs[l][:, s], dec_rows[l], weight, None, step, out=y_t,
                                  backend=backend)
            dec_rows[l] = step[:, 1:]
            assert torch.equal(o_t, o[l][:, s]) and torch.equal(y_t, y[l][:, s]), f"token {t}"
    assert not dec.isnan().any() and not dec_rows.isnan().any()
    assert torch.equal(live, dec) and torch.equal(remap_state, dec)
    assert torch.equal(live_rows, dec_rows) and torch.equal(remap_rows, dec_rows)
