"""M-invariant linear and attention at the Qwen3.5-9B decode shapes on a GPU (skipped
without CUDA): rows bitwise independent of the row count, close to cuBLAS / SDPA, and
the attention replayed from a CUDA graph with ``start`` changed on the device.

Run: ``python -m pytest tests/gpu/test_minv_kernels.py -q``
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton

from dflash.kernels import decode_attention, linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")
HIDDEN = 4096
#: (N, K) of every projection of the 9B shape: GDN in_proj_qkv / q_proj (gated), in_proj_z
#: / out_proj / o_proj / down's output side, in_proj_a / in_proj_b, k_proj / v_proj,
#: MLP gate / up, MLP down, LM head.
LINEAR_SHAPES = [
    (8192, HIDDEN), (4096, HIDDEN), (32, HIDDEN), (1024, HIDDEN), (12288, HIDDEN),
    (4096, 12288), (248320, HIDDEN),
]
H, HKV, D, CONTEXT, S_MAX = 16, 4, 256, 1024, 2048


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - r).norm() / r.norm())


def _weights(N: int, K: int, dtype: torch.dtype, seed: int, rows: int = 16,
             ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(N, K, generator=gen, device="cuda") / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen, device="cuda").to(dtype)
    return x, w, b


@pytest.mark.parametrize(("N", "K"), LINEAR_SHAPES)
def test_linear_rows_do_not_depend_on_M(N: int, K: int) -> None:
    x, w, _ = _weights(N, K, torch.bfloat16, seed=N + K)
    out16 = torch.full((16, N), NAN, dtype=torch.bfloat16, device="cuda")
    full = linear(x, w, out=out16)
    for M in (1, 3, 4, 7, 16):
        for first in {0, 16 - M}:   # the rows at the front and at the back of the call
            got = linear(x[first : first + M], w)
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."
    ref = x.float() @ w.float().T
    assert rel_rms(full, ref) <= 1e-2
    assert rel_rms(full, F.linear(x, w)) <= 1e-2


@pytest.mark.parametrize(("N", "K"), LINEAR_SHAPES)
def test_linear_wide_rows_do_not_depend_on_M(N: int, K: int) -> None:
    """Verify widths: one program multiplies each weight tile by up to 8 row tiles. Rows of
    1-, 16-, 17-, 64- and 128-row calls (1, 2, 4 or 8 tiles per program) bitwise equal the
    same rows inside a 128-row call and a 200-row call (two row groups), taken at the
    front, the back and an odd offset (so a row sits at another place in its tile)."""
    x, w, _ = _weights(N, K, torch.bfloat16, seed=N + 2 * K, rows=200)
    out = torch.full((200, N), NAN, dtype=torch.bfloat16, device="cuda")
    full = linear(x, w, out=out)
    assert torch.equal(linear(x[:128], w), full[:128])
    assert torch.equal(linear(x[72:], w), full[72:])
    for M in (1, 16, 17, 64, 128):
        for first in {0, 7, 200 - M, 128 - M}:
            got = linear(x[first : first + M], w)
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."
    assert rel_rms(full, x.float() @ w.float().T) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("N", "K"), [(4096, 12288), (12288, HIDDEN), (32, HIDDEN)])
def test_linear_wide_other_dtypes_with_bias(N: int, K: int, dtype: torch.dtype) -> None:
    """Bias and the 16/32-bit paths at 1 … 8 tiles per program, split-K (4096 x 12288,
    32 x 4096) and not (12288 x 4096)."""
    x, w, b = _weights(N, K, dtype, seed=5, rows=130)
    full = linear(x, w, b)
    for M in (1, 17, 33, 64, 100, 128):
        for first in {0, 130 - M}:
            got = linear(x[first : first + M], w, b)
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert rel_rms(full, x.double() @ w.double().T + b.double()) <= tol


class _LaunchRecorder:
    """Stands in for ``linear_kernel``: launches it and records each grid with the
    compiled kernel the launch ran."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple[int, ...], Any]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            compiled = launch(*args, **kwargs)
            self.launches.append((tuple(grid), compiled))
            return compiled

        return run


def test_linear_wide_call_reads_the_weight_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64-row (and a 128-row) call of the (12288, 4096) weight launches one row group:
    ``cdiv(N, BLOCK_N) * split`` programs, not one per 16-row tile; 200 rows take two.
    Every width compiles without register spills, and within shared memory for two
    programs per SM."""
    from dflash.kernels import linear_triton

    N, K = 12288, HIDDEN
    cfg = linear_triton.linear_config(N, K, torch.bfloat16)
    n_tiles = triton.cdiv(N, cfg.block_n)
    recorder = _LaunchRecorder(linear_triton.linear_kernel)
    monkeypatch.setattr(linear_triton, "linear_kernel", recorder)
    x, w, _ = _weights(N, K, torch.bfloat16, seed=6, rows=200)
    linear_triton.wide_row_tiles(x.device, torch.bfloat16)   # its self-test, before counting
    for M, groups in ((1, 1), (17, 1), (64, 1), (128, 1), (200, 2)):
        recorder.launches.clear()
        linear(x[:M], w)
        assert [g for g, _ in recorder.launches] == [(groups, n_tiles, cfg.split_k)], f"M={M}"
        compiled = recorder.launches[0][1]
        assert compiled.n_spills == 0, f"M={M}: {compiled.n_spills} spills"
        # two programs per 228 KB H200 SM, each with 1 KB reserved by the hardware
        assert compiled.metadata.shared <= 113 * 1024, f"M={M}: {compiled.metadata.shared} B"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wide_row_tiles_pass_their_self_test_here(dtype: torch.dtype) -> None:
    """On this GPU the wide row tiles give the 16-row tiles' bits (their guard passes),
    so verifies of 17 … 128 rows run one MMA per weight tile; the rows-do-not-depend-on-M
    tests above then compare wide calls with 1-row calls."""
    from dflash.kernels import linear_triton

    assert linear_triton.wide_rows_hold(torch.device("cuda"), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("N", "K"), [(4096, 12288), (1024, HIDDEN)])
def test_linear_other_dtypes_with_bias(N: int, K: int, dtype: torch.dtype) -> None:
    x, w, b = _weights(N, K, dtype, seed=3)
    full = linear(x, w, b)
    for M in (1, 4, 16):
        assert torch.equal(linear(x[:M], w, b), full[:M]), f"M={M}"
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert rel_rms(full, x.double() @ w.double().T + b.double()) <= tol


def _attention_inputs(T: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=gen, device="cuda").bfloat16()
    k = torch.randn(1, HKV, S_MAX, D, generator=gen, device="cuda").bfloat16()
    v = torch.randn(1, HKV, S_MAX, D, generator=gen, device="cuda").bfloat16()
    return q, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    T = q.shape[1]
    L = start + T
    kk = k[:, :, :L].repeat_interleave(H // HKV, dim=1)
    vv = v[:, :, :L].repeat_interleave(H // HKV, dim=1)
    pos = start + torch.arange(T, device="cuda")
    mask = torch.arange(L, device="cuda")[None, :] <= pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask)
    return o.transpose(1, 2)


def test_attention_rows_do_not_depend_on_T() -> None:
    q, k, v = _attention_inputs(16, seed=1)
    k[:, :, CONTEXT + 16 :] = NAN   # unwritten rows: never read
    v[:, :, CONTEXT + 16 :] = NAN
    start = torch.tensor([CONTEXT], device="cuda")
    alone = [decode_attention(q[:, t : t + 1], k, v, start + t)[:, 0] for t in range(16)]
    for T in range(1, 17):
        out = torch.full((1, T, H, D), NAN, dtype=torch.bfloat16, device="cuda")
        got = decode_attention(q[:, :T], k, v, start, out=out)
        for t in range(T):
            assert torch.equal(got[:, t], alone[t]), f"T={T} row {t}"
        assert rel_rms(got, _sdpa(q[:, :T], k, v, CONTEXT)) <= 1e-2


def test_attention_rows_depend_on_neither_warps_nor_row_tiles() -> None:
    """A 16-row verify's rows (four 16-row tiles of a 4-head group) equal one-row decodes
    at the default warps, whatever warps and row tiles the verify's programs take: the
    softmax's row sum goes through the MMA, not a cross-warp sum."""
    from dflash.kernels.attention_triton import launch_decode_attention

    q, k, v = _attention_inputs(16, seed=3)
    start = torch.tensor([CONTEXT], device="cuda")
    alone = torch.cat([decode_attention(q[:, t : t + 1], k, v, start + t) for t in range(16)], 1)
    for warps in (4, 8):
        for tiles in (1, 2, 4):
            out = torch.full_like(q, NAN)
            launch_decode_attention(q, k, v, start, D**-0.5, out, num_warps=warps,
                                    row_tiles=tiles)
            assert torch.equal(out, alone), f"warps {warps}, row tiles {tiles}"


def test_attention_graph_replay_reads_start_on_the_device() -> None:
    q, k, v = _attention_inputs(16, seed=2)
    start = torch.tensor([CONTEXT], device="cuda")
    out = torch.full((1, 16, H, D), NAN, dtype=torch.bfloat16, device="cuda")
    decode_attention(q, k, v, start, out=out)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, start, out=out)
    for s in (CONTEXT, 7, 300, S_MAX - 16):
        start.fill_(s)
        out.fill_(NAN)
        graph.replay()
        assert torch.equal(out, decode_attention(q, k, v, start)), f"start={s}"
        assert rel_rms(out, _sdpa(q, k, v, s)) <= 1e-2


def test_linear_graph_replay() -> None:
    x, w, b = _weights(4096, 12288, torch.bfloat16, seed=4)
    out = torch.full((4, 4096), NAN, dtype=torch.bfloat16, device="cuda")
    xs = x[:4].clone()
    linear(xs, w, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(xs, w, b, out=out)
    xs.copy_(x[4:8])
    out.fill_(NAN)
    graph.replay()
    assert torch.equal(out, linear(x[4:8], w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_gates_on_the_gpu_match_the_reference_and_are_row_invariant(
    dtype: torch.dtype,
) -> None:
    """The 9B shape's HV = 32 gates, read as column slices of the grouped projection."""
    from dflash.kernels import gdn_gates, gdn_gates_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = (torch.randn(16, 12352, device="cuda", generator=gen) * 12).to(dtype)
    a, b = buf[:, -32:], buf[:, -64:-32]
    A_log = torch.randn(32, device="cuda", generator=gen).to(dtype)
    dt_bias = (torch.randn(32, device="cuda", generator=gen) * 4).to(dtype)
    beta_out = torch.full((16, 32), NAN, dtype=dtype, device="cuda")
    g_out = torch.full((16, 32), NAN, dtype=torch.float32, device="cuda")
    beta, g = gdn_gates(a, b, A_log, dt_bias, beta_out=beta_out, g_out=g_out)
    want_beta, want_g = gdn_gates_reference(a.double(), b.double(), A_log.double(),
                                            dt_bias.double())
    assert not beta.isnan().any() and not g.isnan().any()
    torch.testing.assert_close(g.double(), want_g, rtol=1e-5, atol=0)
    assert rel_rms(beta, want_beta) <= (1e-6 if dtype == torch.float32 else 1e-2)
    for r in (0, 7, 15):
        one_beta, one_g = gdn_gates(a[r : r + 1], b[r : r + 1], A_log, dt_bias)
        assert torch.equal(one_beta[0], beta[r]) and torch.equal(one_g[0], g[r])


def _tree_table(parents: list[int]) -> torch.Tensor:
    """The int32 [T, T] root-to-node path table of ``parents`` on the GPU, -1 padded."""
    T = len(parents)
    table = torch.full((T, T), -1, dtype=torch.int32)
    for t in range(T):
        path = [t]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        table[t, : len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
    return table.cuda()


def test_attention_tree_rows_equal_plain_decoding_and_replay_from_a_graph() -> None:
    """A 16-node draft tree at the 9B attention shape (keys at rows CONTEXT + slot): node
    t's row equals the T = 1 chain call at CONTEXT + depth(t) on the cache plain decoding
    holds (its path's keys at contiguous rows) bit for bit; a captured tree call replayed
    with another table and start equals the eager call."""
    parents = [-1, 0, 1, 2, 3, 1, 5, 0, 7, 2, 4, 10, 11, 0, 13, 6]
    T = len(parents)
    paths = _tree_table(parents)
    q, k, v = _attention_inputs(T, seed=3)
    k[:, :, CONTEXT + T :] = NAN   # unwritten rows: never read
    v[:, :, CONTEXT + T :] = NAN
    start = torch.tensor([CONTEXT], device="cuda")
    out = torch.full((1, T, H, D), NAN, dtype=torch.bfloat16, device="cuda")
    got = decode_attention(q, k, v, start, paths=paths, out=out)
    for t in range(T):
        rows = CONTEXT + paths[t][paths[t] >= 0].long()
        n = CONTEXT + rows.numel()
        plain_k, plain_v = k.clone(), v.clone()
        plain_k[:, :, CONTEXT:n] = k[:, :, rows]
        plain_v[:, :, CONTEXT:n] = v[:, :, rows]
        plain_k[:, :, n:] = NAN
        plain_v[:, :, n:] = NAN
        alone = decode_attention(q[:, t : t + 1], plain_k, plain_v, start + rows.numel() - 1)
        assert torch.equal(got[:, t], alone[:, 0]), f"node {t}"

    table = paths.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, start, paths=table, out=out)
    for s, other in ((CONTEXT, [-1, *range(T - 1)]), (7, [-1] + [0] * (T - 1))):
        start.fill_(s)
        table.copy_(_tree_table(other))
        out.fill_(NAN)
        graph.replay()
        assert torch.equal(out, decode_attention(q, k, v, start, paths=table)), f"start={s}"
    start.fill_(CONTEXT)
    table.copy_(_tree_table([-1, *range(T - 1)]))
    graph.replay()
    assert torch.equal(out, decode_attention(q, k, v, start)), "chain table vs no table"


@pytest.mark.parametrize(("N", "K"), [(4096, HIDDEN), (1024, HIDDEN), (4096, 12288), (32, HIDDEN)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_k_reduced_in_the_kernel_is_the_reduction_pass(
    N: int, K: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last split to finish adds the partials inside the kernel: bitwise the separate
    reduction pass's result, over 50 back-to-back launches (any order of arrival), at 1,
    16 and 64 rows, with a bias; every arrival counter is back at 0 after them."""
    from dflash.kernels import linear_triton as lt
    x, w, b = _weights(N, K, dtype, seed=N + K, rows=64)
    for rows in (1, 16, 64):
        assert lt.linear_launch(rows, N, K, dtype).split > 1
        monkeypatch.setattr(lt, "SPLIT_FIXUP", False)
        want = linear(x[:rows], w, b)
        monkeypatch.setattr(lt, "SPLIT_FIXUP", True)
        outs = [linear(x[:rows], w, b) for _ in range(50)]
        torch.cuda.synchronize()
        for got in outs:
            assert torch.equal(got, want)
    assert not lt._COUNTERS[x.device].any()
