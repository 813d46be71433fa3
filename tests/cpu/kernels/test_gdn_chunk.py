"""gdn_chunk_prefill: the chunked reference against the token loop, the Triton kernels
(interpreter) against the reference, split calls, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, as64, gdn_inputs, needs_interpreter, rel_rms

import dflash.kernels.gdn_chunk as gdn_chunk_module
import dflash.kernels.gdn_chunk_triton as gdn_chunk_triton_module
from dflash.errors import KernelBoundsError
from dflash.kernels import gdn_verify, gdn_verify_reference
from dflash.kernels.checks import Backend
from dflash.kernels.gdn_chunk import gdn_chunk_prefill
from dflash.kernels.gdn_chunk_reference import gdn_chunk_prefill_reference

Inputs = dict[str, torch.Tensor]
BACKENDS = [pytest.param("triton", marks=needs_interpreter), "reference"]


def prefill_inputs(
    B: int, T: int, HK: int, HV: int, K: int, V: int, dtype: torch.dtype, seed: int,
    decay: str = "normal", l2: bool = True,
) -> Inputs:
    """:func:`gdn_inputs` with the decay regime ``decay`` ("normal": g in about
    (-3, 0); "fast": g in [-20, -5], so a chunk's cumulative decay spans hundreds of
    nats; "slow": g in (-1e-3, 0]). Without ``l2``, k comes unit-norm, as a model that
    normalises outside the kernel gives it (a long recurrence with |k| >> 1 diverges)."""
    i = gdn_inputs(B, T, HK, HV, K, V, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.rand(B, T, HV, generator=gen)
    if decay == "fast":
        i["g"] = -5.0 - 15.0 * u
    elif decay == "slow":
        i["g"] = -1e-3 * u
    if not l2:
        k = i["k"].float()
        i["k"] = (k / k.norm(dim=-1, keepdim=True)).to(dtype)
    return i


def token_loop(i: Inputs, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token prefill (``gdn_verify_reference``, final state only) in the
    state's dtype: returns ``(o, final state)``."""
    state = i["initial_state"].clone()
    o = gdn_verify_reference(i["q"], i["k"], i["v"], i["g"], i["beta"], state,
                             state.unsqueeze(1), None, final_state_only=True,
                             **kw)  # type: ignore[arg-type]
    return o, state


def prefill(i: Inputs, state: torch.Tensor, **kw: object) -> torch.Tensor:
    """gdn_chunk_prefill into a NaN-poisoned ``out`` (unless the caller passes ``out``)."""
    out = kw.pop("out", torch.full_like(i["v"], NAN))
    o = gdn_chunk_prefill(i["q"], i["k"], i["v"], i["g"], i["beta"], state,
                          out=out, **kw)  # type: ignore[arg-type]  # options passed through
    assert o is out, "the result must be the out= tensor"
    return o


# (B, T, HK, HV, K, V, chunk, use_qk_l2norm, decay, input dtype)
REFERENCE_CASES = [
    (1, 1, 1, 1, 16, 16, 16, True, "normal", torch.float64),      # T = 1
    (2, 5, 1, 2, 16, 24, 16, True, "normal", torch.float64),      # T < chunk, GQA
    (1, 16, 2, 2, 16, 16, 16, False, "normal", torch.float64),    # T = chunk, no l2
    (2, 53, 1, 2, 32, 16, 16, True, "fast", torch.float64),       # T = 3 chunks + 5
    (1, 53, 2, 4, 16, 32, 16, True, "slow", torch.float64),
    (1, 197, 1, 2, 32, 32, 64, True, "fast", torch.float64),      # default chunk, 3*64+5
    (1, 53, 1, 2, 16, 16, 16, False, "fast", torch.float32),
    (2, 53, 2, 4, 16, 16, 32, True, "normal", torch.float32),
    (1, 37, 1, 2, 16, 16, 16, True, "slow", torch.bfloat16),
]


@pytest.mark.parametrize(
    ("B", "T", "HK", "HV", "K", "V", "chunk", "l2", "decay", "dtype"), REFERENCE_CASES
)
def test_reference_matches_the_token_loop(
    B: int, T: int, HK: int, HV: int, K: int, V: int, chunk: int, l2: bool, decay: str,
    dtype: torch.dtype,
) -> None:
    i = prefill_inputs(B, T, HK, HV, K, V, dtype, seed=T * 10 + K, decay=decay, l2=l2)
    if dtype == torch.float64:
        i = as64(i)
    want_o, want_state = token_loop(as64(i), use_qk_l2norm=l2)

    state = i["initial_state"].clone()  # float64 maths for float64 inputs, else float32
    o = gdn_chunk_prefill_reference(i["q"], i["k"], i["v"], i["g"], i["beta"], state,
                                    use_qk_l2norm=l2, chunk=chunk)
    assert o.dtype == dtype and o.shape == (B, T, HV, V)
    o_tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 5e-3)  # bf16: rounding
    assert rel_rms(o, want_o) <= o_tol
    assert rel_rms(state, want_state) <= (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("chunk", [16, 32, 128])
def test_reference_chunk_size_does_not_change_the_result(chunk: int) -> None:
    i = as64(prefill_inputs(1, 70, 1, 2, 16, 16, torch.float64, seed=3))
    want_o, want_state = token_loop(i)
    state = i["initial_state"].clone()
    o = gdn_chunk_prefill_reference(i["q"], i["k"], i["v"], i["g"], i["beta"], state,
                                    chunk=chunk, scale=0.3)
    o_scaled, _ = token_loop(i, scale=0.3)
    assert rel_rms(o, o_scaled) <= 1e-10 and rel_rms(state, want_state) <= 1e-10
    assert rel_rms(o, want_o) > 1e-3, "the scale must reach the output"


# (B, T, HK, HV, K, V, chunk, use_qk_l2norm, decay, input dtype)
TRITON_CASES = [
    (1, 1, 1, 1, 16, 16, 16, True, "normal", torch.float32),
    (2, 53, 1, 2, 24, 40, 16, True, "fast", torch.float32),   # K, V not powers of two
    (1, 32, 2, 4, 16, 16, 32, False, "slow", torch.float32),  # T = chunk
    (1, 70, 1, 2, 32, 16, 64, True, "normal", torch.float16),
    (1, 21, 1, 2, 16, 16, 16, True, "normal", torch.bfloat16),
    (1, 20, 1, 2, 128, 32, 16, True, "normal", torch.float32),  # the model's K = 128
]


@needs_interpreter
@pytest.mark.parametrize(
    ("B", "T", "HK", "HV", "K", "V", "chunk", "l2", "decay", "dtype"), TRITON_CASES
)
def test_triton_matches_the_reference(
    B: int, T: int, HK: int, HV: int, K: int, V: int, chunk: int, l2: bool, decay: str,
    dtype: torch.dtype,
) -> None:
    i = prefill_inputs(B, T, HK, HV, K, V, dtype, seed=T * 10 + K, decay=decay, l2=l2)
    # the state is slot 1 of a NaN pool: the kernel must touch that slot and nothing else
    pool = torch.full((B, 3, HV, K, V), NAN)
    pool[:, 1] = i["initial_state"]
    state = pool[:, 1]
    o = prefill(i, state, use_qk_l2norm=l2, chunk=chunk, backend="triton")

    want_state = i["initial_state"].clone()
    want_o = gdn_chunk_prefill_reference(  # float32 o: the same values before rounding
        i["q"].float(), i["k"].float(), i["v"].float(), i["g"], i["beta"], want_state,
        use_qk_l2norm=l2, chunk=chunk,
    )
    assert o.dtype == dtype
    assert rel_rms(o, want_o) <= (1e-5 if dtype == torch.float32 else 5e-3)
    assert rel_rms(state, want_state) <= 1e-5
    assert torch.isnan(pool[:, 0]).all() and torch.isnan(pool[:, 2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_state_is_updated_in_place(backend: Backend) -> None:
    i = prefill_inputs(1, 19, 1, 2, 16, 32, torch.float32, seed=9)
    state = i["initial_state"].transpose(2, 3).contiguous().transpose(2, 3)
    assert not state.is_contiguous()
    o = prefill(i, state, chunk=16, backend=backend)
    want_o, want_state = token_loop(as64(i))
    assert rel_rms(o, want_o) <= 1e-5 and rel_rms(state, want_state) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_calls_with_the_state_carried_equal_one_call(backend: Backend) -> None:
    T, cut = 45, 19  # a cut inside a chunk of 16
    i = prefill_inputs(2, T, 1, 2, 16, 16, torch.float32, seed=21)
    whole = i["initial_state"].clone()
    o = prefill(i, whole, chunk=16, backend=backend)

    parts = i["initial_state"].clone()
    first = {n: t[:, :cut] for n, t in i.items() if n != "initial_state"}
    second = {n: t[:, cut:] for n, t in i.items() if n != "initial_state"}
    o1 = prefill(first, parts, chunk=16, backend=backend)
    o2 = prefill(second, parts, chunk=16, backend=backend)
    assert rel_rms(torch.cat((o1, o2), dim=1), o) <= 1e-5
    assert rel_rms(parts, whole) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_the_token_prefill_of_gdn_verify(backend: Backend) -> None:
    """The documented equivalence, on the same backend: a token-by-token prefill through
    ``gdn_verify(..., final_state_only=True)`` with the state updated in place."""
    i = prefill_inputs(1, 37, 2, 4, 16, 16, torch.bfloat16, seed=5)
    token_state = i["initial_state"].clone()
    want = gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], token_state,
                      token_state.unsqueeze(1), None, final_state_only=True, backend=backend)
    state = i["initial_state"].clone()
    o = prefill(i, state, chunk=16, backend=backend)
    assert rel_rms(o, want) <= 1e-2  # both rounded to bfloat16
    assert rel_rms(state, token_state) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_none_allocates_the_same_result_deterministically(backend: Backend) -> None:
    i = prefill_inputs(1, 24, 1, 2, 16, 24, torch.bfloat16, seed=8)
    s_into, s_fresh = i["initial_state"].clone(), i["initial_state"].clone()
    into = prefill(i, s_into, chunk=16, backend=backend)
    fresh = gdn_chunk_prefill(i["q"], i["k"], i["v"], i["g"], i["beta"], s_fresh, chunk=16,
                              backend=backend)
    assert fresh.dtype == torch.bfloat16 and fresh.shape == (1, 24, 2, 24)
    assert not into.isnan().any() and torch.equal(fresh, into)
    assert torch.equal(s_into, s_fresh)


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a kernel ran on refused input")


def test_bad_arguments_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn_chunk_module, "gdn_chunk_prefill_reference", _never)
    monkeypatch.setattr(gdn_chunk_triton_module, "launch_gdn_chunk_prefill", _never)
    i = prefill_inputs(1, 3, 2, 4, 16, 16, torch.float32, seed=0)
    state = torch.full((1, 4, 16, 16), NAN)
    empty: dict[str, object] = {n: t[:, :0] for n, t in i.items() if n != "initial_state"}
    pool = torch.zeros(192 + 1024)  # one buffer holding both a v and a state
    # (tensors replaced, keyword arguments, error, message)
    Case = tuple[dict[str, object], dict[str, object], type[Exception], str]
    cases: list[Case] = [
        ({"q": i["q"].tolist()}, {}, TypeError, "'q' must be a torch.Tensor"),
        ({"q": i["q"][0]}, {}, KernelBoundsError, "'q' must have 4 dimensions"),
        ({"k": i["k"][:, :2]}, {}, KernelBoundsError, "'k' must have shape"),
        ({"v": i["v"][:, :, :3]}, {}, KernelBoundsError, "multiple of q's HK=2"),
        ({"v": i["v"][:, :2]}, {}, KernelBoundsError, "'v' must have shape"),
        ({"v": i["v"].double()}, {}, KernelBoundsError, "share a dtype"),
        ({"g": i["g"][..., :1]}, {}, KernelBoundsError, "'g' must have shape"),
        ({"g": i["g"].long()}, {}, KernelBoundsError, "'g' must be a floating tensor"),
        ({"beta": i["beta"][:, :2]}, {}, KernelBoundsError, "'beta' must have shape"),
        ({"state": state.double()}, {}, KernelBoundsError, "'state' must be torch.float32"),
        ({"state": state[:, :2]}, {}, KernelBoundsError, "'state' must have shape"),
        ({"state": state.to("meta")}, {}, KernelBoundsError, "'state' is on meta"),
        ({"g": i["g"].to("meta")}, {}, KernelBoundsError, "'g' is on meta"),
        ({"v": pool[:192].view(1, 3, 4, 16), "state": pool[192:].view(1, 4, 16, 16)}, {},
         KernelBoundsError, "'state' must not share memory with 'v'"),
        (empty, {}, KernelBoundsError, "at least one token"),
        ({}, {"chunk": 48}, KernelBoundsError, r"'chunk' must be a power of two >= 16 \(got 48\)"),
        ({}, {"chunk": 8}, KernelBoundsError, r"power of two >= 16 \(got 8\)"),
        ({}, {"chunk": 0}, KernelBoundsError, r"power of two >= 16 \(got 0\)"),
        ({}, {"chunk": 16.0}, TypeError, "'chunk' must be an int"),
        ({}, {"chunk": True}, TypeError, "'chunk' must be an int"),
        ({}, {"scale": float("inf")}, KernelBoundsError, "'scale' must be a finite number"),
        ({}, {"use_qk_l2norm": "yes"}, TypeError, "'use_qk_l2norm' must be a bool"),
        ({}, {"backend": "cuda"}, KernelBoundsError, "'backend'"),
        ({}, {"precision": "bf16"}, KernelBoundsError,
         r"'precision' must be one of ieee, tf32 \(got 'bf16'\)"),
    ]
    v = i["v"]  # out must be a contiguous [B, T, HV, V] tensor in v's dtype, v's device
    bad_out: list[tuple[object, type[Exception], str]] = [
        (v.tolist(), TypeError, "'out' must be a torch.Tensor or None"),
        (torch.empty(1, 3, 4, 8), KernelBoundsError, "'out' must have shape v.shape"),
        (torch.empty(1, 3, 4, 16, dtype=torch.bfloat16), KernelBoundsError,
         "'out' must be torch.float32 like the result"),
        (torch.empty(1, 3, 16, 4).transpose(2, 3), KernelBoundsError, "'out' must be contiguous"),
        (torch.empty(1, 3, 4, 16, device="meta"), KernelBoundsError, "'out' is on meta"),
        (v, KernelBoundsError, "'out' must not share memory with 'v'"),
        (state.view(-1)[: v.numel()].view(v.shape), KernelBoundsError,
         "'out' must not share memory with 'state'"),
    ]
    cases += [({}, {"out": out}, error, match) for out, error, match in bad_out]
    for tensors, kw, error, match in cases:
        args = {**i, **tensors}
        with pytest.raises(error, match=match):
            prefill(args, args.get("state", state), **kw)  # type: ignore[arg-type]  # bad values on purpose
    assert torch.isnan(state).all(), "a refused call writes nothing"


@needs_interpreter
def test_triton_limits_are_named() -> None:
    i = prefill_inputs(1, 3, 1, 1, 16, 16, torch.float32, seed=0)
    with pytest.raises(KernelBoundsError, match=r"'chunk' must be <= 128 for Triton \(got 256"):
        prefill(i, i["initial_state"].clone(), chunk=256, backend="triton")
    wide = prefill_inputs(1, 3, 1, 1, 272, 16, torch.float32, seed=0)
    with pytest.raises(KernelBoundsError, match="K must be <= 256 for Triton"):
        prefill(wide, wide["initial_state"].clone(), backend="triton")
    state = i["initial_state"].clone()  # the reference has neither limit
    o = prefill(i, state, chunk=256, backend="reference")
    want_o, want_state = token_loop(as64(i))
    assert rel_rms(o, want_o) <= 1e-5 and rel_rms(state, want_state) <= 1e-5
