"""causal_conv1d_capture: the Triton kernel (interpreter) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.geometry import require_chain, require_tree
from dflash.kernels import (
    causal_conv1d_capture,
    causal_conv1d_capture_reference,
    tree_paths,
    tree_paths_into,
)
from dflash.kernels.checks import INTERPRET, Backend


def conv_inputs(B: int, T: int, C: int, Kc: int, dtype: torch.dtype, bias: bool,
                seed: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(B, T, C, generator=gen).to(dtype),
        "conv_rows": torch.randn(B, Kc - 1, C, generator=gen).to(dtype),
        "weight": torch.randn(C, Kc, generator=gen).to(dtype),
        "bias": torch.randn(C, generator=gen).to(dtype) if bias else None,
    }


def run(i: dict[str, torch.Tensor | None], captured: torch.Tensor, **kw: object) -> torch.Tensor:
    """causal_conv1d_capture into a NaN-poisoned ``out`` (unless the caller passes ``out``)."""
    x = i["x"]
    out = kw.pop("out", torch.full_like(x, NAN) if isinstance(x, torch.Tensor) else None)
    y = causal_conv1d_capture(x, i["conv_rows"], i["weight"], i["bias"], captured,  # type: ignore[arg-type]
                              out=out, **kw)  # type: ignore[arg-type]
    assert y is out, "the result must be the out= tensor"
    return y


# (B, T, C, Kc, bias, activation, dtype)
CASES = [
    (1, 1, 16, 4, True, "silu", torch.float32),
    (2, 3, 48, 4, False, None, torch.float32),
    (1, 16, 200, 3, True, "silu", torch.bfloat16),  # two channel blocks, the second partial
    (1, 5, 32, 2, True, "silu", torch.float32),
]


@needs_interpreter
@pytest.mark.parametrize(("B", "T", "C", "Kc", "bias", "act", "dtype"), CASES)
def test_triton_matches_float64_reference(
    B: int, T: int, C: int, Kc: int, bias: bool, act: str | None, dtype: torch.dtype
) -> None:
    i = conv_inputs(B, T, C, Kc, dtype, bias, seed=T + C)
    S = T + 2
    captured = torch.full((B, Kc - 1 + S, C), NAN, dtype=dtype)
    y = run(i, captured, activation=act, backend="triton")

    i64 = {n: (None if t is None else t.double()) for n, t in i.items()}
    cap64 = torch.full((B, Kc - 1 + S, C), NAN, dtype=torch.float64)
    y_ref = causal_conv1d_capture_reference(i64["x"], i64["conv_rows"], i64["weight"],  # type: ignore[arg-type]
                                            i64["bias"], cap64, activation=act,
                                            out=torch.full((B, T, C), NAN, dtype=torch.float64))
    assert torch.equal(cap64[:, : Kc - 1 + T].to(dtype), captured[:, : Kc - 1 + T])
    assert y.dtype == dtype
    assert rel_rms(y, y_ref) <= (1e-6 if dtype == torch.float32 else 1e-2)
    xin = torch.cat([i["conv_rows"], i["x"]], dim=1)  # type: ignore[list-item]
    assert torch.equal(captured[:, : Kc - 1 + T], xin), "the capture is an exact copy"
    assert torch.isnan(captured[:, Kc - 1 + T :].float()).all(), "rows past T untouched"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_verify_equals_token_by_token_decode(backend: Backend) -> None:
    """The window after n tokens, captured[:, n:n+Kc-1], continues the conv exactly."""
    B, T, C, Kc = 1, 4, 24, 4
    i = conv_inputs(B, T, C, Kc, torch.float32, True, seed=9)
    captured = torch.full((B, Kc - 1 + T, C), NAN)
    y = run(i, captured, backend=backend)
    rows = i["conv_rows"].clone()  # type: ignore[union-attr]
    for t in range(T):
        step_cap = torch.full((B, Kc, C), NAN)
        y_t = run({**i, "x": i["x"][:, t : t + 1], "conv_rows": rows},  # type: ignore[index]
                  step_cap, backend=backend)
        assert torch.equal(y_t[:, 0], y[:, t])
        rows = step_cap[:, 1:].clone()
        assert torch.equal(rows, captured[:, t + 1 : t + Kc]), f"window after {t + 1} tokens"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_remap_in_place_equals_out_of_place(backend: Backend) -> None:
    B, T, C, Kc, S = 2, 3, 40, 4, 4
    first = conv_inputs(B, T, C, Kc, torch.float32, True, seed=1)
    bank = torch.full((B, Kc - 1 + S, C), NAN)
    run(first, bank, backend=backend)
    n = 2
    second = conv_inputs(B, T, C, Kc, torch.float32, True, seed=2)
    bank_copy = bank.clone()
    y_out = run({**second, "conv_rows": bank[:, n : n + Kc - 1].clone()}, bank_copy,
                backend=backend)
    y_in = run({**second, "conv_rows": bank[:, n : n + Kc - 1]}, bank, backend=backend)
    assert torch.equal(y_in, y_out)
    assert torch.equal(bank[:, : Kc - 1 + T], bank_copy[:, : Kc - 1 + T])


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(("T", "Kc", "C", "strided"), [(1, 4, 24, False), (2, 4, 200, True),
                                                       (5, 3, 16, False), (1, 2, 8, True)])
def test_advance_rows_leaves_the_next_window(
    backend: Backend, T: int, Kc: int, C: int, strided: bool
) -> None:
    """``advance_rows``: the call's ``y`` and capture unchanged, and ``conv_rows`` (also a
    strided view) holds the window after the ``T`` tokens, ``captured[:, T : T+Kc-1]``,
    also when ``T < Kc - 1`` (part of the old window stays)."""
    i = conv_inputs(1, T, C, Kc, torch.bfloat16, True, seed=T * 7 + Kc)
    rows = i["conv_rows"]
    assert rows is not None
    if strided:
        rows = rows.transpose(1, 2).contiguous().transpose(1, 2)
    kept = torch.full((1, Kc - 1 + T, C), NAN, dtype=torch.bfloat16)
    y_kept = run({**i, "conv_rows": rows.clone()}, kept, backend=backend)
    cap = torch.full((1, Kc - 1 + T, C), NAN, dtype=torch.bfloat16)
    y = run({**i, "conv_rows": rows}, cap, advance_rows=True, backend=backend)
    assert torch.equal(y, y_kept) and torch.equal(cap, kept)
    assert torch.equal(rows, kept[:, T : T + Kc - 1])


def test_advance_rows_is_refused_where_it_cannot_hold() -> None:
    """A tree (its window follows the accepted path), ``conv_rows`` inside ``captured``
    (the window would overwrite the capture), a non-bool: refused, nothing written."""
    i = conv_inputs(1, 2, 16, 4, torch.float32, True, seed=3)
    cap = torch.full((1, 6, 16), NAN)
    with pytest.raises(KernelBoundsError, match="'advance_rows' needs a chain"):
        run(i, cap, advance_rows=True,
            paths=tree_paths(require_tree([-1, 0]), "cpu"), backend="reference")
    with pytest.raises(KernelBoundsError, match="'conv_rows' must not share memory"):
        run({**i, "conv_rows": cap[:, :3]}, cap, advance_rows=True, backend="reference")
    with pytest.raises(TypeError, match="'advance_rows' must be a bool"):
        run(i, cap, advance_rows=1, backend="reference")
    assert cap.isnan().all()


@needs_interpreter
def test_strided_conv_rows() -> None:
    B, T, C, Kc = 1, 3, 16, 4
    i = conv_inputs(B, T, C, Kc, torch.float32, False, seed=4)
    strided = i["conv_rows"].transpose(1, 2).contiguous().transpose(1, 2)  # type: ignore[union-attr]
    assert not strided.is_contiguous()
    a = torch.full((B, Kc - 1 + T, C), NAN)
    b = torch.full((B, Kc - 1 + T, C), NAN)
    y_strided = run({**i, "conv_rows": strided}, a, backend="triton")
    y_plain = run(i, b, backend="reference")
    assert rel_rms(y_strided, y_plain) <= 1e-6
    assert torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_out_none_allocates_the_same_result(backend: Backend) -> None:
    i = conv_inputs(1, 5, 24, 4, torch.bfloat16, True, seed=6)
    cap_a = torch.full((1, 8, 24), NAN, dtype=torch.bfloat16)
    cap_b = torch.full((1, 8, 24), NAN, dtype=torch.bfloat16)
    into = run(i, cap_a, backend=backend)
    fresh = causal_conv1d_capture(i["x"], i["conv_rows"], i["weight"], i["bias"], cap_b,  # type: ignore[arg-type]
                                  backend=backend)
    assert fresh.dtype == torch.bfloat16 and fresh.shape == (1, 5, 24)
    assert not into.isnan().any() and torch.equal(fresh, into)
    assert torch.equal(cap_a, cap_b)


def test_bad_arguments_are_named() -> None:
    i = conv_inputs(1, 3, 16, 4, torch.float32, True, seed=0)
    cap = torch.full((1, 6, 16), NAN)
    rows, weight, bias = i["conv_rows"], i["weight"], i["bias"]
    assert rows is not None and weight is not None and bias is not None
    cases: list[tuple[dict[str, object], torch.Tensor, object, type[Exception], str]] = [
        ({"x": "x"}, cap, "silu", TypeError, "'x' must be a torch.Tensor"),
        ({"conv_rows": rows[:, :2]}, cap, "silu", ValueError, "'conv_rows' must have"),
        ({"conv_rows": rows.half()}, cap, "silu", ValueError,
         "'conv_rows' must be torch.float32"),
        ({"weight": weight[:, :1]}, cap, "silu", ValueError, "Kc must be >= 2"),
        ({"bias": bias[:3]}, cap, "silu", ValueError, "'bias' must have shape"),
        ({}, cap[:, :5], "silu", ValueError, "needs Kc-1\\+T=6 rows"),
        ({}, cap.double(), "silu", ValueError, "'captured' must be torch.float32"),
        ({}, cap.transpose(1, 2).contiguous().transpose(1, 2), "silu", ValueError,
         "contiguous along channels"),
        ({}, cap, "gelu", ValueError, "'activation'"),
        ({}, cap.to("meta"), "silu", ValueError, "'captured' is on meta"),
    ]
    for change, captured, act, error, match in cases:
        with pytest.raises(error, match=match):
            run({**i, **change}, captured, activation=act)  # type: ignore[dict-item]  # bad values on purpose
    x = i["x"]
    assert x is not None
    bad_out: list[tuple[object, type[Exception], str]] = [
        (x.tolist(), TypeError, "'out' must be a torch.Tensor or None"),
        (torch.empty(1, 2, 16), KernelBoundsError, "'out' must have shape x.shape"),
        (torch.empty(1, 3, 16, dtype=torch.float64), KernelBoundsError,
         "'out' must be torch.float32 like the result"),
        (torch.empty(1, 16, 3).transpose(1, 2), KernelBoundsError, "'out' must be contiguous"),
        (torch.empty(1, 3, 16, device="meta"), KernelBoundsError, "'out' is on meta"),
        (x, KernelBoundsError, "'out' must not share memory with 'x'"),
        (cap[:, :3], KernelBoundsError, "'out' must not share memory with 'captured'"),
    ]
    for out, error, match in bad_out:
        with pytest.raises(error, match=match):
            run(i, cap, out=out)
    assert torch.isnan(cap).all(), "a refused call writes nothing"


# Draft trees for paths=: depths below and above Kc-1, siblings at several levels.
TREES = {
    "chain": (-1, 0, 1, 2, 3, 4),
    "star": (-1, 0, 0, 0, 0, 0),
    "deep": (-1, 0, 1, 2, 3, 4, 1, 6, 0, 8, 2, 10),  # depths 0..5, branches at 0, 1, 2
    # 41 nodes (several token blocks), paths longer than one block of table columns
    "long": (*range(-1, 35), 33, 10, 36, 0, 37),
}
BACKENDS = [pytest.param("triton", marks=needs_interpreter), "reference"]


def root_path(parents: tuple[int, ...], t: int) -> list[int]:
    """Slots root..t, walked up the parent array (independent of tree_paths)."""
    path = [t]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]


# (tree, Kc, C, dtype, bias, activation)
TREE_CASES = [
    ("deep", 4, 37, torch.float32, True, "silu"),
    ("deep", 2, 5, torch.bfloat16, False, None),
    ("deep", 3, 133, torch.bfloat16, True, "silu"),  # two channel blocks, the second partial
    ("star", 3, 37, torch.bfloat16, True, "silu"),
    ("chain", 4, 9, torch.float32, True, "silu"),
    ("long", 4, 9, torch.float32, True, "silu"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tree", "Kc", "C", "dtype", "bias", "act"), TREE_CASES)
def test_tree_node_equals_decoding_along_its_path(
    backend: Backend, tree: str, Kc: int, C: int, dtype: torch.dtype, bias: bool,
    act: str | None,
) -> None:
    """Row t of a tree call is the last row of a chain call over x[path_t] (the window
    plain decoding along that path sees), bit for bit; the capture is by slot."""
    parents = TREES[tree]
    T = len(parents)
    i = conv_inputs(1, T, C, Kc, dtype, bias, seed=Kc * C)
    x = i["x"]
    assert x is not None
    captured = torch.full((1, Kc - 1 + T + 1, C), NAN, dtype=dtype)
    y = run(i, captured, activation=act, paths=tree_paths(require_tree(parents), "cpu"),
            backend=backend)
    for t in range(T):
        path = root_path(parents, t)
        step_cap = torch.full((1, Kc - 1 + len(path), C), NAN, dtype=dtype)
        y_path = run({**i, "x": x[:, path]}, step_cap, activation=act, backend=backend)
        assert torch.equal(y[0, t], y_path[0, -1]), f"node {t} (path {path})"
    chain_cap = torch.full_like(captured, NAN)
    run(i, chain_cap, activation=act, backend=backend)
    assert torch.equal(captured[:, : Kc - 1 + T], chain_cap[:, : Kc - 1 + T]), "by slot"
    assert torch.isnan(captured[:, Kc - 1 + T :].float()).all(), "rows past T untouched"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Kc", [2, 4])
def test_chain_paths_equal_no_paths(backend: Backend, Kc: int) -> None:
    T, C = 7, 19
    i = conv_inputs(1, T, C, Kc, torch.bfloat16, True, seed=Kc)
    chain = tuple(range(-1, T - 1))
    cap_a = torch.full((1, Kc - 1 + T, C), NAN, dtype=torch.bfloat16)
    cap_b = torch.full_like(cap_a, NAN)
    y_plain = run(i, cap_a, backend=backend)
    for geometry in (require_chain(chain), require_tree(chain)):
        y_paths = run(i, cap_b, paths=tree_paths(geometry, "cpu"), backend=backend)
        assert torch.equal(y_paths, y_plain) and torch.equal(cap_b, cap_a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_from_a_static_buffer_and_remapped_rows(backend: Backend) -> None:
    """paths as a [T, T] view of a [Tmax, Tmax] buffer (CUDA-graph style), and conv_rows
    a view of captured itself: the same result as a fresh table and separate rows."""
    parents, Kc, C = TREES["deep"], 4, 24
    T = len(parents)
    geometry = require_tree(parents)
    buf = torch.full((16, 16), 5, dtype=torch.int32)
    tree_paths_into(geometry, buf)
    i = conv_inputs(1, T, C, Kc, torch.float32, True, seed=11)
    rows = i["conv_rows"]
    assert rows is not None
    bank = torch.full((1, Kc - 1 + T, C), NAN)
    bank[:, 2 : 2 + Kc - 1] = rows
    bank_copy = bank.clone()
    y_fresh = run({**i, "conv_rows": bank[:, 2 : 2 + Kc - 1].clone()}, bank_copy,
                  paths=tree_paths(geometry, "cpu"), backend=backend)
    y_view = run({**i, "conv_rows": bank[:, 2 : 2 + Kc - 1]}, bank, paths=buf[:T, :T],
                 backend=backend)
    assert torch.equal(y_view, y_fresh) and torch.equal(bank, bank_copy)


@needs_interpreter
def test_triton_tree_matches_float64_reference() -> None:
    parents, Kc, C = TREES["long"], 3, 21
    T = len(parents)
    paths = tree_paths(require_tree(parents), "cpu")
    i = conv_inputs(1, T, C, Kc, torch.float32, True, seed=5)
    y = run(i, torch.full((1, Kc - 1 + T, C), NAN), paths=paths, backend="triton")
    i64 = {n: (None if t is None else t.double()) for n, t in i.items()}
    y_ref = run(i64, torch.full((1, Kc - 1 + T, C), NAN, dtype=torch.float64), paths=paths,
                backend="reference")
    assert rel_rms(y, y_ref) <= 1e-6


def test_bad_paths_are_refused_before_any_write() -> None:
    parents = TREES["deep"]
    T, C, Kc = len(parents), 8, 3
    i = conv_inputs(1, T, C, Kc, torch.float32, True, seed=0)
    good = tree_paths(require_tree(parents), "cpu")
    cap = torch.full((1, Kc - 1 + T, C), NAN)
    out = torch.full((1, T, C), NAN)
    x, rows = i["x"], i["conv_rows"]
    assert x is not None and rows is not None
    backends: list[Backend] = ["reference", "triton"] if INTERPRET else ["reference"]
    cases: list[tuple[dict[str, object], object, type[Exception], str]] = [
        ({}, good.tolist(), TypeError, "'paths' must be a torch.Tensor or None .*got list"),
        ({}, good.long(), KernelBoundsError, "'paths' must be torch.int32 .*torch.int64"),
        ({}, good[:, :-1], KernelBoundsError, "'paths' must have shape \\[T, T\\]"),
        ({}, good.to("meta"), KernelBoundsError, "'paths' is on meta"),
        ({"x": x.expand(2, T, C), "conv_rows": rows.expand(2, Kc - 1, C)}, good,
         KernelBoundsError, "'paths' needs batch size B=1 .*B=2"),
    ]
    for backend in backends:
        for change, paths, error, match in cases:
            b_cap = cap if "x" not in change else torch.full((2, Kc - 1 + T, C), NAN)
            b_out = out if "x" not in change else torch.full((2, T, C), NAN)
            with pytest.raises(error, match=match):
                run({**i, **change}, b_cap, out=b_out, paths=paths,  # type: ignore[dict-item]  # bad values on purpose
                    backend=backend)
            assert torch.isnan(b_cap).all() and torch.isnan(b_out).all(), "nothing written"


def malformed(edit: dict[tuple[int, int], int]) -> torch.Tensor:
    table = tree_paths(require_tree(TREES["deep"]), "cpu")
    for (t, d), v in edit.items():
        table[t, d] = v
    return table


# (edit to the deep tree's table, the row the message names)
MALFORMED = [
    ({(0, 0): 1}, 0),                    # root row must be [0, -1, ...]
    ({(0, 1): 0}, 0),
    ({(3, 0): 1}, 3),                    # a path must start at the root
    ({(3, 3): -1}, 3),                   # a path must end at its own slot
    ({(3, 3): 4}, 3),
    ({(4, 2): -1}, 4),                   # no hole inside a path
    ({(7, 1): 8}, 7),                    # a prefix that is not the parent's path
    ({(2, 1): 5, (2, 2): 2}, 2),         # a forward slot
    ({(1, 1): -1, (1, 0): -1}, 1),       # an empty row
    ({(5, 5): 5, (5, 4): -3}, 5),        # entries below -1
    ({(9, 3): 4}, 9),                    # entries after the path must be -1
]


@pytest.mark.parametrize(("edit", "row"), MALFORMED)
def test_reference_refuses_malformed_table_naming_the_row(
    edit: dict[tuple[int, int], int], row: int
) -> None:
    T, C, Kc = len(TREES["deep"]), 8, 3
    i = conv_inputs(1, T, C, Kc, torch.float32, True, seed=0)
    cap = torch.full((1, Kc - 1 + T, C), NAN)
    out = torch.full((1, T, C), NAN)
    with pytest.raises(KernelBoundsError, match=f"'paths' row {row} must be a root-to-node path"):
        run(i, cap, out=out, paths=malformed(edit), backend="reference")
    assert torch.isnan(cap).all() and torch.isnan(out).all(), "nothing written"
