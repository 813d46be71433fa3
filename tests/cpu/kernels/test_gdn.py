"""gdn_verify: the Triton kernel (interpreter) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, as64, gdn_inputs, nan_slots, needs_interpreter, rel_rms

import dflash.kernels.gdn_reference as gdn_reference_module
import dflash.kernels.gdn_triton as gdn_triton_module
from dflash.errors import KernelBoundsError
from dflash.geometry import require_chain, require_tree, validate_chain
from dflash.kernels import checks, gdn_verify, gdn_verify_reference
from dflash.kernels.checks import Backend


def chain(T: int) -> object:
    return require_chain(list(range(-1, T - 1)))


def run(inputs: dict[str, torch.Tensor], ckpt: torch.Tensor, geometry: object,
        **kw: object) -> torch.Tensor:
    """gdn_verify into a NaN-poisoned ``out`` (unless the caller passes ``out``)."""
    i = inputs
    out = kw.pop("out", torch.full_like(i["v"], NAN))
    o = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt,
                   geometry, out=out, **kw)  # type: ignore[arg-type]
    assert o is out, "the result must be the out= tensor"
    return o


def reference64(inputs: dict[str, torch.Tensor], S: int, geometry: object,
                **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    i = as64(inputs)
    B, _, HV, V = i["v"].shape
    K = i["q"].shape[3]
    ckpt = nan_slots(B, S, HV, K, V, torch.float64)
    out = torch.full_like(i["v"], NAN)
    o = gdn_verify_reference(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"],
                             ckpt, geometry, out=out, **kw)  # type: ignore[arg-type]
    assert o is out
    return o, ckpt


# (B, T, HK, HV, K, V, use_qk_l2norm, input dtype): odd sizes, grouped heads 1/2/3
CASES = [
    (1, 1, 1, 1, 16, 16, True, torch.float32),
    (2, 3, 2, 4, 32, 16, True, torch.float32),
    (1, 16, 1, 3, 48, 48, False, torch.float32),
    (1, 3, 2, 6, 16, 32, True, torch.bfloat16),
    (1, 3, 1, 2, 16, 40, True, torch.float32),  # V=40: a partial value block
]


@needs_interpreter
@pytest.mark.parametrize(("B", "T", "HK", "HV", "K", "V", "l2", "dtype"), CASES)
def test_triton_matches_float64_reference(
    B: int, T: int, HK: int, HV: int, K: int, V: int, l2: bool, dtype: torch.dtype
) -> None:
    inputs = gdn_inputs(B, T, HK, HV, K, V, dtype, seed=T * 100 + K)
    S = T + 2
    ckpt = nan_slots(B, S, HV, K, V, torch.float32)
    snapshot = torch.full((B, HV, K, V), NAN)
    before = inputs["initial_state"].clone()
    o = run(inputs, ckpt, chain(T), use_qk_l2norm=l2, snapshot=snapshot, backend="triton")
    o_ref, ckpt_ref = reference64(inputs, S, chain(T), use_qk_l2norm=l2)

    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounding
    assert o.dtype == dtype
    assert rel_rms(o, o_ref) <= tol
    for t in range(T):  # every slot written, each close to the float64 state
        assert rel_rms(ckpt[:, t], ckpt_ref[:, t]) <= 1e-5, f"slot {t}"
    assert torch.isnan(ckpt[:, T:]).all(), "slots past T must not be written"
    assert torch.equal(inputs["initial_state"], before), "the live state must not change"
    assert torch.equal(snapshot, before)


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_tree_slots_follow_their_parents(backend: Backend) -> None:
    parents = [-1, 0, 0, 1, 2, 2]
    T = len(parents)
    inputs = gdn_inputs(1, T, 2, 4, 16, 16, torch.float32, seed=7)
    tree = require_tree(parents)
    ckpt = nan_slots(1, T, 4, 16, 16, torch.float32)
    o = run(inputs, ckpt, tree, backend=backend)
    o_ref, ckpt_ref = reference64(inputs, T, tree)
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(ckpt, ckpt_ref) <= 1e-5

    # the path root -> 2 -> 5 run as a chain lands on exactly the same state and outputs
    path = [0, 2, 5]
    sub = {n: (t if n == "initial_state" else t[:, path]) for n, t in inputs.items()}
    ckpt_path = nan_slots(1, 3, 4, 16, 16, torch.float32)
    o_path = run(sub, ckpt_path, chain(3), backend=backend)
    assert torch.equal(ckpt_path[:, 2], ckpt[:, 5])
    assert torch.equal(o_path[:, 2], o[:, 5])


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_checkpoints_equal_sequential_decode_bit_exactly(backend: Backend) -> None:
    T, HV, K, V = 5, 3, 32, 16
    inputs = gdn_inputs(1, T, 1, HV, K, V, torch.bfloat16, seed=11)
    ckpt = nan_slots(1, T, HV, K, V, torch.float32)
    snapshot = torch.full((1, HV, K, V), NAN)
    o = run(inputs, ckpt, chain(T), snapshot=snapshot, backend=backend)
    assert torch.equal(snapshot, inputs["initial_state"])

    state = inputs["initial_state"].clone()
    for t in range(T):  # decode: one token per call, state updated in place
        step = {n: (state if n == "initial_state" else x[:, t : t + 1]) for n, x in inputs.items()}
        o_t = run(step, state.unsqueeze(1), None, final_state_only=True, backend=backend)
        assert torch.equal(state, ckpt[:, t]), f"slot {t} differs from decode"
        assert torch.equal(o_t[:, 0], o[:, t])


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_remap_in_place_equals_out_of_place(backend: Backend) -> None:
    """initial_state may be a slot of the checkpoints it writes (slot remap)."""
    B, T, HV, K, V, S = 2, 3, 2, 16, 32, 4
    first = gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=3)
    bank = nan_slots(B, S, HV, K, V, torch.float32)
    run(first, bank, chain(T), backend=backend)
    n = 2  # accepted tokens: the live state is slot n-1

    second = gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=4)
    outside = {**second, "initial_state": bank[:, n - 1].clone()}
    bank_copy = bank.clone()
    snap_out = torch.full((B, HV, K, V), NAN)
    o_out = run(outside, bank_copy, chain(T), snapshot=snap_out, backend=backend)

    inside = {**second, "initial_state": bank[:, n - 1]}  # a strided view into `bank`
    snap_in = torch.full((B, HV, K, V), NAN)
    o_in = run(inside, bank, chain(T), snapshot=snap_in, backend=backend)
    assert not o_out.isnan().any() and not bank_copy[:, :T].isnan().any()
    assert torch.equal(o_in, o_out)
    assert torch.equal(bank[:, :T], bank_copy[:, :T])
    assert torch.equal(snap_out, outside["initial_state"]) and torch.equal(snap_in, snap_out)


@needs_interpreter
def test_strided_initial_state_and_final_state_only() -> None:
    B, T, HV, K, V = 1, 3, 2, 16, 16
    inputs = gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=5)
    transposed = inputs["initial_state"].transpose(2, 3).contiguous().transpose(2, 3)
    assert not transposed.is_contiguous()
    ckpt = nan_slots(B, 2, HV, K, V, torch.float32)
    o = run({**inputs, "initial_state": transposed}, ckpt, chain(T), final_state_only=True,
            backend="triton")
    o_ref, ckpt_ref = reference64(inputs, T, chain(T))
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(ckpt[:, 0], ckpt_ref[:, T - 1]) <= 1e-5
    assert torch.isnan(ckpt[:, 1]).all()


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_out_none_allocates_the_same_result(backend: Backend) -> None:
    inputs = gdn_inputs(1, 4, 1, 2, 16, 24, torch.bfloat16, seed=8)
    i = inputs
    ckpt_a = nan_slots(1, 4, 2, 16, 24, torch.float32)
    ckpt_b = nan_slots(1, 4, 2, 16, 24, torch.float32)
    into = run(inputs, ckpt_a, chain(4), backend=backend)
    fresh = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt_b,
                       chain(4), backend=backend)
    assert fresh.dtype == torch.bfloat16 and fresh.shape == (1, 4, 2, 24)
    assert not into.isnan().any() and torch.equal(fresh, into)
    assert torch.equal(ckpt_a, ckpt_b)


def test_auto_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(checks, "INTERPRET", False)
    assert checks.use_triton("auto", cpu) is False
    with pytest.raises(ValueError, match="backend='triton' needs CUDA"):
        checks.use_triton("triton", cpu)
    monkeypatch.setattr(checks, "INTERPRET", True)
    assert checks.use_triton("auto", cpu) is True
    assert checks.use_triton("reference", cpu) is False
    with pytest.raises(ValueError, match="'backend'"):
        checks.use_triton("cuda", cpu)


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a kernel ran on refused input")


BAD_GEOMETRY = [
    ([-1, 0, 1], TypeError, "got list"),
    (validate_chain([0, 0, 1]), TypeError, "got Rejection"),
    (None, TypeError, "got None"),
    (require_chain([-1, 0]), ValueError, "n_actual"),
]


@pytest.mark.parametrize(("geometry", "error", "match"), BAD_GEOMETRY)
def test_geometry_refused_before_any_launch(
    geometry: object, error: type[Exception], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gdn_triton_module, "launch_gdn_verify", _never)
    monkeypatch.setattr(gdn_reference_module, "gdn_verify_reference", _never)
    import dflash.kernels.gdn as gdn_module

    monkeypatch.setattr(gdn_module, "gdn_verify_reference", _never)
    inputs = gdn_inputs(1, 3, 1, 1, 16, 16, torch.float32, seed=0)
    ckpt = nan_slots(1, 3, 1, 16, 16, torch.float32)
    out = torch.full_like(inputs["v"], NAN)
    with pytest.raises(error, match=match):
        run(inputs, ckpt, geometry, out=out)
    assert torch.isnan(ckpt).all() and torch.isnan(out).all()


def test_tree_with_final_state_only_refused() -> None:
    inputs = gdn_inputs(1, 3, 1, 1, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="final_state_only"):
        run(inputs, nan_slots(1, 3, 1, 16, 16, torch.float32), require_tree([-1, 0, 0]),
            final_state_only=True)


def test_bad_arguments_are_named() -> None:
    i = gdn_inputs(1, 3, 2, 4, 16, 16, torch.float32, seed=0)
    ck = nan_slots(1, 3, 4, 16, 16, torch.float32)
    geo = chain(3)
    cases: list[tuple[dict[str, object], torch.Tensor, type[Exception], str]] = [
        ({"q": i["q"].tolist()}, ck, TypeError, "'q' must be a torch.Tensor"),
        ({"k": i["k"][:, :2]}, ck, ValueError, "'k' must have shape"),
        ({"v": i["v"][:, :, :3]}, ck, ValueError, "multiple of q's HK=2"),
        ({"v": i["v"].double()}, ck, ValueError, "share a dtype"),
        ({"g": i["g"][..., :1]}, ck, ValueError, "'g' must have shape"),
        ({"initial_state": i["initial_state"].double()}, ck, ValueError,
         "'initial_state' must be torch.float32"),
        ({}, ck[:, :2], ValueError, "S >= T=3"),
        ({}, ck.half(), ValueError, "'checkpoints' must be torch.float32"),
        ({}, ck.to("meta"), ValueError, "'checkpoints' is on meta"),
        ({"q": i["q"][:, :0], "k": i["k"][:, :0], "v": i["v"][:, :0], "g": i["g"][:, :0],
          "beta": i["beta"][:, :0]}, ck, ValueError, "at least one token"),
    ]
    for change, ckpt, error, match in cases:
        with pytest.raises(error, match=match):
            run({**i, **change}, ckpt, geo)  # type: ignore[dict-item]  # bad values on purpose
    with pytest.raises(ValueError, match="'scale'"):
        run(i, ck, geo, scale=float("nan"))
    with pytest.raises(ValueError, match="'snapshot' must have shape"):
        run(i, ck, geo, snapshot=torch.empty(1, 4, 16, 8))
    v = i["v"]  # out must be a contiguous [B, T, HV, V] tensor in v's dtype, v's device
    bad_out: list[tuple[object, type[Exception], str]] = [
        (v.tolist(), TypeError, "'out' must be a torch.Tensor or None"),
        (torch.empty(1, 3, 4, 8), KernelBoundsError, "'out' must have shape v.shape"),
        (torch.empty(1, 3, 4, 16, dtype=torch.bfloat16), KernelBoundsError,
         "'out' must be torch.float32 like the result"),
        (torch.empty(1, 3, 16, 4).transpose(2, 3), KernelBoundsError, "'out' must be contiguous"),
        (torch.empty(1, 3, 4, 16, device="meta"), KernelBoundsError, "'out' is on meta"),
        (v, KernelBoundsError, "'out' must not share memory with 'v'"),
        (ck.view(-1)[: v.numel()].view(v.shape), KernelBoundsError,
         "'out' must not share memory with 'checkpoints'"),
    ]
    for out, error, match in bad_out:
        with pytest.raises(error, match=match):
            run(i, ck, geo, out=out)
    assert torch.isnan(ck).all(), "a refused call writes nothing"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("slot", [-1, 0, 2])
def test_live_slot_read_on_the_device_selects_the_initial_state(
    backend: Backend, slot: int
) -> None:
    """``slot_bank`` + ``live_slot`` (an int64 device tensor): slot ``s >= 0`` starts from
    ``slot_bank[:, s]``, ``-1`` from ``initial_state`` — the same bits as passing that
    state directly, for a verify (bank = the checkpoints it writes) and a decode."""
    B, T, HV, K, V, S = 2, 3, 2, 16, 16, 4
    first = gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=11)
    bank = nan_slots(B, S, HV, K, V, torch.float32)
    run(first, bank, chain(T), backend=backend)
    bank[:, T] = first["initial_state"] * 2  # every slot a real state
    second = gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=12)
    chosen = second["initial_state"] if slot < 0 else bank[:, slot].clone()
    live = torch.tensor([slot])

    want_bank, want_snap = bank.clone(), torch.full((B, HV, K, V), NAN)
    want = run({**second, "initial_state": chosen}, want_bank, chain(T), snapshot=want_snap,
               backend=backend)
    got_snap = torch.full((B, HV, K, V), NAN)
    got = run(second, bank, chain(T), snapshot=got_snap, slot_bank=bank, live_slot=live,
              backend=backend)
    assert not got.isnan().any() and torch.equal(got, want)
    assert torch.equal(bank[:, :T], want_bank[:, :T]) and torch.equal(got_snap, want_snap)

    # a decode: the live state is read from the slot, the new state goes home
    one = gdn_inputs(B, 1, 1, HV, K, V, torch.float32, seed=13)
    home = torch.full((B, HV, K, V), NAN) if slot >= 0 else one["initial_state"].clone()
    start = bank[:, slot].clone() if slot >= 0 else home.clone()
    ref_state = start.clone()
    o_ref = run({**one, "initial_state": ref_state}, ref_state.unsqueeze(1), None,
                final_state_only=True, backend=backend)
    o = run({**one, "initial_state": home}, home.unsqueeze(1), None, final_state_only=True,
            slot_bank=bank, live_slot=live, backend=backend)
    assert torch.equal(o, o_ref) and torch.equal(home, ref_state)


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_live_slot_past_the_bank_is_clamped(backend: Backend) -> None:
    """A live slot past the bank (never set by the pool) reads the last slot, not memory
    beyond the bank."""
    B, T, HV, K, V, S = 1, 2, 2, 16, 16, 3
    i = gdn_inputs(B, T, 1, HV, K, V, torch.float32, seed=14)
    bank = torch.randn(B, S, HV, K, V, generator=torch.Generator().manual_seed(1))
    want = run({**i, "initial_state": bank[:, S - 1].clone()}, nan_slots(B, S, HV, K, V,
               torch.float32), chain(T), backend=backend)
    got = run(i, nan_slots(B, S, HV, K, V, torch.float32), chain(T), slot_bank=bank,
              live_slot=torch.tensor([S + 5]), backend=backend)
    assert torch.equal(got, want)


def test_live_slot_arguments_are_named() -> None:
    i = gdn_inputs(1, 3, 2, 4, 16, 16, torch.float32, seed=0)
    ck = nan_slots(1, 3, 4, 16, 16, torch.float32)
    geo, live = chain(3), torch.tensor([0])
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"slot_bank": ck}, KernelBoundsError, "given together or not at all"),
        ({"live_slot": live}, KernelBoundsError, "given together or not at all"),
        ({"slot_bank": ck, "live_slot": 0}, TypeError, "'live_slot' must be a torch.Tensor"),
        ({"slot_bank": ck, "live_slot": live.int()}, KernelBoundsError,
         "'live_slot' must be a one-element int64 tensor \\(got dtype torch.int32"),
        ({"slot_bank": ck, "live_slot": torch.tensor([0, 1])}, KernelBoundsError,
         "one-element int64 tensor \\(got dtype torch.int64, shape \\(2,\\)"),
        ({"slot_bank": ck[:, :, :2], "live_slot": live}, KernelBoundsError,
         "'slot_bank' must have shape"),
        ({"slot_bank": ck.double(), "live_slot": live}, KernelBoundsError,
         "'slot_bank' must be torch.float32"),
        ({"slot_bank": ck[:, :0], "live_slot": live}, KernelBoundsError, "at least one slot"),
        ({"slot_bank": ck, "live_slot": live.to("meta")}, KernelBoundsError,
         "'live_slot' is on meta"),
    ]
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            run(i, ck, geo, **kw)
    assert torch.isnan(ck).all(), "a refused call writes nothing"
