"""Top-p cut: Triton (interpreter) against the torch reference and a float64 oracle, batch
invariance, edge rows, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from kernels_support import needs_interpreter

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.checks import Backend
from dflash.kernels.top_p import top_p_count
from dflash.kernels.top_p_reference import top_p_count_reference
from dflash.kernels.top_p_triton import BLOCK, launch_top_p_count

SENTINEL = -7  # int64 cannot hold NaN: a count the kernel does not write stays -7
SLACK = 1e-5  # float32 sums of up to 9000 terms stay well within this of float64

#: (V, chunk cap): one chunk, exactly one full chunk, a partial second chunk, three chunks,
#: and many small chunks (cuts and early exits deep in the row).
SIZES = [(1, BLOCK), (2, BLOCK), (37, BLOCK), (1000, BLOCK), (4096, BLOCK), (5000, BLOCK),
         (9000, BLOCK), (1000, 64), (5000, 256)]
TOP_PS = [0.3, 0.9, 0.95]


def poisoned(T: int) -> torch.Tensor:
    return torch.full((T,), SENTINEL, dtype=torch.int64)


def sorted_rows(T: int, V: int, seed: int) -> torch.Tensor:
    """``[T, V]`` float32 rows sorted descending: randn at scales 0.5..8, every third row
    with a random ``-inf`` tail (its first entry stays finite)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0])[torch.arange(T) % 5]
    s = (torch.randn(T, V, generator=gen) * scales[:, None]).sort(-1, descending=True).values
    for i in range(0, T, 3):
        k = int(torch.randint(0, V, (1,), generator=gen))
        if k:
            s[i, V - k :] = -math.inf
    return s.contiguous()


def before64(s: torch.Tensor) -> torch.Tensor:
    """The exclusive prefix of ``softmax`` of each row, in float64."""
    d = s.double()
    p = torch.softmax(d, dim=-1)
    return torch.cat((torch.zeros_like(d[:, :1]), torch.cumsum(p, -1)[:, :-1]), dim=-1)


def run_triton(s: torch.Tensor, top_p: float, block: int) -> torch.Tensor:
    if block == BLOCK:
        out = poisoned(s.shape[0])
        got = top_p_count(s, top_p, out=out, backend="triton")
        assert got is out
        return got
    top_p32 = torch.tensor(top_p, dtype=torch.float32).item()  # as the entry point does
    return launch_top_p_count(s, top_p32, out=poisoned(s.shape[0]), block=block)


def assert_oracle(n: torch.Tensor, s: torch.Tensor, top_p: float) -> None:
    """``before64[n - 1] < top_p`` and ``before64[n] >= top_p`` (or ``n = V``), up to SLACK."""
    b = before64(s)
    V = s.shape[1]
    for i, n_i in enumerate(n.tolist()):
        assert 1 <= n_i <= V, f"row {i}: count {n_i} outside [1, {V}]"
        assert b[i, n_i - 1] < top_p + SLACK, f"row {i}: kept entry {n_i - 1} past the mass"
        assert n_i == V or b[i, n_i] >= top_p - SLACK, f"row {i}: entry {n_i} cut too early"


@needs_interpreter
def test_triton_matches_reference() -> None:
    """Equal counts except where float64 puts some ``before_j`` within SLACK of ``top_p``
    (float32 sums in different orders may fall either side there); such rows are rare."""
    rows = excluded = 0
    for V, block in SIZES:
        s = sorted_rows(16, V, seed=V + block)
        b = before64(s)
        for top_p in TOP_PS:
            got = run_triton(s, top_p, block)
            ref = top_p_count_reference(s, top_p, out=poisoned(16))
            near = ((b - top_p).abs() < SLACK).any(-1)
            rows += 16
            excluded += int(near.sum())
            differ = (got != ref) & ~near
            assert not differ.any(), (
                f"V={V} block={block} top_p={top_p}: rows {differ.nonzero().flatten().tolist()}"
                f" triton {got[differ].tolist()} reference {ref[differ].tolist()}"
            )
    assert excluded < 0.05 * rows, f"{excluded} of {rows} rows excluded"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(("V", "block"), SIZES)
def test_counts_match_the_float64_oracle(backend: Backend, V: int, block: int) -> None:
    s = sorted_rows(16, V, seed=V + block + 1)
    for top_p in TOP_PS:
        if backend == "triton":
            n = run_triton(s, top_p, block)
        else:
            n = top_p_count(s, top_p, out=poisoned(16), backend="reference")
        assert_oracle(n, s, top_p)


@needs_interpreter
@pytest.mark.parametrize(("V", "block"), [(5000, BLOCK), (1000, 64), (37, BLOCK)])
def test_rows_are_batch_invariant(V: int, block: int) -> None:
    """A row's count is the same whether it is cut alone or among seven rows."""
    s = sorted_rows(7, V, seed=11)
    for top_p in (0.5, 0.9):
        together = run_triton(s, top_p, block)
        for r in range(7):
            alone = run_triton(s[r : r + 1].contiguous(), top_p, block)
            assert torch.equal(alone[0], together[r]), f"top_p={top_p} row {r}"


@needs_interpreter
@pytest.mark.parametrize(("V", "block"), [(300, BLOCK), (300, 64)])
def test_batch_invariance_at_the_float32_boundary(V: int, block: int) -> None:
    """Sweep ``top_p`` over the float32 values around one ``before_j`` of a row: the count
    flips exactly where ``top_p`` passes the kernel's float32 ``before_j``, so equal counts
    alone and in a batch at every step mean that sum has the same bits in both."""
    s = sorted_rows(7, V, seed=13)
    b = before64(s)
    for r in (1, 4):
        j = int((b[r] < 0.8).sum())  # an entry past the top few, so before_j is a long sum
        centre = torch.tensor(b[r, j].item(), dtype=torch.float32)
        steps = [centre]
        for direction in (math.inf, -math.inf):
            x = centre
            for _ in range(12):
                x = torch.nextafter(x, torch.tensor(direction))
                steps.append(x)
        counts = set()
        for top_p in sorted(float(x) for x in steps):
            together = run_triton(s, top_p, block)[r]
            alone = run_triton(s[r : r + 1].contiguous(), top_p, block)[0]
            assert torch.equal(alone, together), f"row {r} top_p={top_p!r}"
            counts.add(int(alone))
        assert len(counts) >= 2, f"row {r}: the sweep never crossed before_{j}"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_every_row_is_written(backend: Backend) -> None:
    s = sorted_rows(9, 300, seed=5)
    out = poisoned(9)
    got = top_p_count(s, 0.9, out=out, backend=backend)
    assert got is out and got.dtype == torch.int64 and got.shape == (9,)
    assert (got >= 1).all(), got.tolist()
    fresh = top_p_count(s, 0.9, backend=backend)
    assert fresh is not out and torch.equal(fresh, got)


def _edge_cases() -> list[tuple[str, torch.Tensor, float, int]]:
    flat = torch.zeros(1, 5000)
    one = torch.tensor([[3.0] + [-math.inf] * 6])
    pair = torch.tensor([[1.5, 1.5, -math.inf, -math.inf]])
    return [
        ("tiny top_p keeps the first", flat, 1e-30, 1),
        ("top_p that rounds to 0 in float32 keeps the first", flat, 1e-50, 1),
        ("0.99999 on a flat row keeps all", flat, 0.99999, 5000),
        # before_j = j / 5000 < 0.9001 for j <= 4500: the cut lies in the second chunk
        ("cut in a later chunk", flat, 0.9001, 4501),
        ("one finite value then -inf", one, 0.999, 1),
        ("exclusive prefix: before_1 = 0.5 is not < 0.5", pair, 0.5, 1),
        ("exclusive prefix: before_1 = 0.5 < 0.6", pair, 0.6, 2),
        ("V = 1", torch.tensor([[-2.0]]), 0.5, 1),
    ]


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(("name", "s", "top_p", "expect"), _edge_cases())
def test_edge_rows(backend: Backend, name: str, s: torch.Tensor, top_p: float,
                   expect: int) -> None:
    got = top_p_count(s, top_p, out=poisoned(1), backend=backend)
    assert got.tolist() == [expect], name


def test_backend_choice_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU without the interpreter, "auto" runs the reference and "triton" is refused."""
    monkeypatch.setattr(checks, "INTERPRET", False)
    s = sorted_rows(3, 50, seed=2)
    expect = top_p_count_reference(s, 0.9)
    assert torch.equal(top_p_count(s, 0.9), expect)
    with pytest.raises(KernelBoundsError, match="backend='triton' needs CUDA"):
        top_p_count(s, 0.9, backend="triton")


_SHARED = torch.zeros(4)  # [2, 2] float32 scores and a [2] int64 'out' over one storage


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"sorted_scores": [[1.0]]}, TypeError, "'sorted_scores' must be a torch.Tensor"),
        ({"sorted_scores": torch.ones(3)}, KernelBoundsError,
         r"'sorted_scores' must be a 2-dimensional torch.float32 tensor \(got .*shape \(3,\)"),
        ({"sorted_scores": torch.ones(2, 3, dtype=torch.float64)}, KernelBoundsError,
         "'sorted_scores' must be a 2-dimensional torch.float32 tensor .*float64"),
        ({"sorted_scores": torch.ones(2, 3, dtype=torch.bfloat16)}, KernelBoundsError,
         "'sorted_scores' must be a 2-dimensional torch.float32 tensor .*bfloat16"),
        ({"sorted_scores": torch.ones(0, 3)}, KernelBoundsError,
         r"'sorted_scores' must be \[T, V\] with T >= 1 .*\(0, 3\)"),
        ({"sorted_scores": torch.ones(2, 0)}, KernelBoundsError,
         r"'sorted_scores' must be \[T, V\] .*\(2, 0\)"),
        ({"sorted_scores": torch.ones(3, 2).t()}, KernelBoundsError,
         "'sorted_scores' must be contiguous"),
        ({"top_p": 0.0}, KernelBoundsError, r"'top_p' must be a float in \(0, 1\) \(got 0.0\)"),
        ({"top_p": 0}, KernelBoundsError, r"'top_p' must be a float in \(0, 1\) \(got 0\)"),
        ({"top_p": 1.0}, KernelBoundsError, r"'top_p' .*\(got 1.0\)"),
        ({"top_p": 1.5}, KernelBoundsError, r"'top_p' .*\(got 1.5\)"),
        ({"top_p": -0.1}, KernelBoundsError, r"'top_p' .*\(got -0.1\)"),
        ({"top_p": math.nan}, KernelBoundsError, r"'top_p' .*\(got nan\)"),
        ({"top_p": math.inf}, KernelBoundsError, r"'top_p' .*\(got inf\)"),
        ({"top_p": True}, TypeError, "'top_p' must be a float \\(got bool True\\)"),
        ({"top_p": "0.9"}, TypeError, "'top_p' must be a float \\(got str '0.9'\\)"),
        ({"top_p": torch.tensor(0.9)}, TypeError, "'top_p' must be a float \\(got Tensor"),
        ({"backend": "cuda"}, KernelBoundsError, "'backend' must be"),
        ({"sorted_scores": torch.ones(2, 3, device="meta"), "backend": "triton"},
         KernelBoundsError, "backend='triton' needs CUDA"),
        ({"out": [1, 1]}, TypeError, "'out' must be a torch.Tensor or None"),
        ({"out": torch.zeros(3, dtype=torch.int64)}, KernelBoundsError,
         r"'out' must have shape \[T\] with T from sorted_scores = \(2,\) \(got \(3,\)\)"),
        ({"out": torch.zeros(2, 1, dtype=torch.int64)}, KernelBoundsError,
         "'out' must have shape"),
        ({"out": torch.zeros(2, dtype=torch.int32)}, KernelBoundsError,
         "'out' must be torch.int64 like the result"),
        ({"out": torch.zeros(2)}, KernelBoundsError, "'out' must be torch.int64"),
        ({"out": torch.zeros(2, 2, dtype=torch.int64)[:, 0]}, KernelBoundsError,
         "'out' must be contiguous"),
        ({"out": torch.zeros(2, dtype=torch.int64, device="meta")}, KernelBoundsError,
         "'out' is on meta"),
        ({"sorted_scores": _SHARED.view(2, 2), "out": _SHARED.view(torch.int64)},
         KernelBoundsError, "'out' must not share memory with 'sorted_scores'"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {"sorted_scores": torch.ones(2, 3), "top_p": 0.9,
                               "out": None, "backend": "reference"}
    args.update(kwargs)
    out = args["out"]
    before = None if not isinstance(out, torch.Tensor) or out.is_meta else out.clone()
    with pytest.raises(exc, match=match):
        top_p_count(args["sorted_scores"], args["top_p"],  # type: ignore[arg-type]  # bad values on purpose
                    out=args["out"], backend=args["backend"])  # type: ignore[arg-type]  # as above
    if before is not None:  # a refused call writes nothing
        assert isinstance(out, torch.Tensor) and torch.equal(out, before)
