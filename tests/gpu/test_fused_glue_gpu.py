"""The fused glue on a GPU (skipped without CUDA), at the 9B shape's widths: the residual
add fed into the norm and a head's norm followed by the rotary embedding give the bits of
the launches they replace (bfloat16); the activation product is within a last-bit
difference of the activation's launch then the product's, and every row is the same bits
whatever the row count. A model forward on the fused glue keeps its verify rows bitwise
its decode rows, and the conv that advances its own window leaves the next one. No timing.

Run: ``python -m pytest tests/gpu/test_fused_glue_gpu.py -q``
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.kernels import act_mul, add_rms_norm, rms_norm, rms_norm_rotary
from dflash.model.layers import apply_rotary

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")


def rnd(*shape: int, scale: float = 1.0, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_add_rms_norm_is_the_add_then_the_norm(rows: int) -> None:
    x, r, w = rnd(1, rows, 4096, scale=3, seed=1), rnd(1, rows, 4096, seed=2), \
        rnd(4096, scale=0.2, seed=3)
    out = torch.full_like(x, NAN)
    y, s = add_rms_norm(x, r, w, 1e-6, out=out)
    assert y is out
    assert torch.equal(s, r + x)
    assert torch.equal(y, rms_norm(r + x, w, 1e-6, zero_centred=True))


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_rms_norm_rotary_is_the_norm_then_the_rotation(rows: int) -> None:
    """The 9B's query heads (16 × 256, rotary over 64 channels) read in place from
    ``[query | gate]``, and its key heads (4 × 256)."""
    angles = torch.randn(rows, 64, device="cuda") * 3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    w = rnd(256, scale=0.2, seed=4)
    qg = rnd(1, rows, 16, 512, scale=2, seed=5)
    q = qg[..., :256]
    got = rms_norm_rotary(q, w, 1e-6, cos, sin, out=torch.full(q.shape, NAN, dtype=q.dtype,
                                                                device="cuda"))
    want = apply_rotary(rms_norm(q.contiguous(), w, 1e-6, zero_centred=True), cos, sin)
    assert torch.equal(got, want)
    k = rnd(1, rows, 4, 256, scale=2, seed=6)
    want_k = apply_rotary(rms_norm(k, w, 1e-6, zero_centred=True), cos, sin)
    assert torch.equal(rms_norm_rotary(k, w, 1e-6, cos, sin), want_k)


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_act_mul_rows_and_the_two_launches(act: str) -> None:
    both = rnd(1, 64, 2 * 12288, scale=3, seed=7)
    gate, x = both[..., :12288], both[..., 12288:]
    got = act_mul(gate, x, act)  # type: ignore[arg-type]  # a valid name
    two = (F.silu(gate) if act == "silu" else torch.sigmoid(gate)) * x
    assert (got != two).double().mean() <= 0.01
    for t in (0, 17, 63):
        one = act_mul(gate[:, t : t + 1], x[:, t : t + 1], act)  # type: ignore[arg-type]  # as above
        assert torch.equal(one[0, 0], got[0, t])


@torch.inference_mode()
def test_a_fused_forward_verifies_its_decode_rows() -> None:
    """The 9B shape's first 4 layers (3 recurrent, 1 attention) in bfloat16: a 16-row verify
    gives the bits of 16 one-token decodes."""
    from dflash.execution.engine import chain_of
    from dflash.model import HybridConfig, TargetModel

    nine = HybridConfig.nine_b_shape()
    config = HybridConfig(**{**nine.model_dump(), "layer_types": nine.layer_types[:4]})
    model = TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda")
    prompt = torch.randint(0, config.vocab_size, (1, 64), device="cuda")
    draft = torch.randint(0, config.vocab_size, (1, 16), device="cuda")
    seq = model.new_caches(max_len=128, max_draft=16)
    model(prompt, seq, "prefill")
    rows = [model(draft[:, i : i + 1], seq, "decode")[0][0, -1] for i in range(16)]
    caches = model.new_caches(max_len=128, max_draft=16)
    model(prompt, caches, "prefill")
    logits, _ = model(draft, caches, "verify", geometry=chain_of(16))
    for i in range(16):
        assert torch.equal(logits[0, i], rows[i]), f"row {i}"


def test_conv_advance_rows_leaves_the_next_window() -> None:
    """The 9B's recurrent conv (8,192 channels, kernel 4) on one token, as a decode runs
    it: the call's output and capture as without ``advance_rows``, and the live window
    (a strided view) becomes the capture's rows 1 … 3."""
    from dflash.kernels import causal_conv1d_capture

    x = rnd(1, 1, 8192, seed=8)
    rows = rnd(1, 8192, 3, seed=9).transpose(1, 2)  # strided, as a pool view may be
    weight = rnd(8192, 4, scale=0.5, seed=10)
    kept_cap = torch.full((1, 4, 8192), NAN, dtype=torch.bfloat16, device="cuda")
    want = causal_conv1d_capture(x, rows.clone(), weight, None, kept_cap)
    cap = torch.full((1, 4, 8192), NAN, dtype=torch.bfloat16, device="cuda")
    got = causal_conv1d_capture(x, rows, weight, None, cap, advance_rows=True)
    assert torch.equal(got, want) and torch.equal(cap, kept_cap)
    assert torch.equal(rows, kept_cap[:, 1:4])
