"""DFlash drafter: z-lab's config format, the maths of one proposal, the context cache.

The hand-checked examples recompute a 1-layer, 1-head drafter in plain Python floats from
the written maths (Qwen3 RMSNorm, half-split RoPE at absolute positions, block queries
over [context ; block] keys, argmax of the LM head) and compare with the module.
"""

from __future__ import annotations

import math
from typing import Any, cast

import pytest
import torch

from dflash.model.drafters import DFlashConfig, DFlashDrafter, DraftArgumentError
from dflash.model.drafters.dflash_checkpoint import config_from_hf
from dflash.model.drafters.dflash_config import default_tap_layers
from dflash.model.drafters.dflash_layers import DrafterLayer, inverse_frequencies

V, H = 11, 4


def tiny_config(**changes: object) -> DFlashConfig:
    base = {
        "hidden_size": H,
        "vocab_size": V,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "intermediate_size": 3,
        "rope_theta": 100.0,
        "num_target_layers": 4,
        "mask_token_id": V - 1,
        "target_layer_ids": (1, 2),
        "block_size": 3,
    }
    base.update(changes)
    return DFlashConfig.model_validate(base)


def layer(d: DFlashDrafter, i: int) -> DrafterLayer:
    """``d``'s layer ``i`` (a ModuleList entry, which mypy sees as a plain Module)."""
    return cast(DrafterLayer, d.layers[i])


def make(cfg: DFlashConfig, seed: int = 0) -> DFlashDrafter:
    gen = torch.Generator().manual_seed(100 + seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64)
    drafter = DFlashDrafter.random(cfg, embed, head, seed=seed, dtype=torch.float64)
    with torch.no_grad():  # non-trivial norm weights, so a wrong norm formula shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=torch.float64))
    return drafter


# -- plain-Python reference ----------------------------------------------------------------


def vec(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.tolist()]


def mat(t: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in row] for row in t.tolist()]


def matvec(m: list[list[float]], x: list[float]) -> list[float]:
    return [sum(a * b for a, b in zip(row, x, strict=True)) for row in m]


def rms(x: list[float], w: list[float], eps: float) -> list[float]:
    r = math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [wi * v / r for wi, v in zip(w, x, strict=True)]  # plain weight, not 1 + weight


def rope(x: list[float], pos: int, inv: list[float]) -> list[float]:
    half = len(x) // 2
    out = list(x)
    for i in range(half):  # pairs (i, i + D/2) rotate by pos * inv_freq[i]
        c, s = math.cos(pos * inv[i]), math.sin(pos * inv[i])
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def silu(x: float) -> float:
    return x / (1 + math.exp(-x))


def reference_proposal(
    d: DFlashDrafter, feats: torch.Tensor, last: int
) -> tuple[list[int], list[list[float]], list[list[float]]]:
    """Tokens, final hidden rows and attention weights of a 1-layer, 1-head drafter."""
    cfg = d.config
    sd = {k: v for k, v in d.state_dict().items()}
    eps = cfg.rms_norm_eps
    inv = vec(inverse_frequencies(cfg)[0])
    p = "layers.0."
    n, b = feats.shape[0], cfg.block_size
    ctx = [
        rms(matvec(mat(sd["fc.weight"]), vec(f)), vec(sd["hidden_norm.weight"]), eps) for f in feats
    ]
    embed = mat(d._embed_weight)
    block = [embed[last]] + [embed[cfg.mask_token_id]] * (b - 1)
    xn = [rms(x, vec(sd[p + "input_layernorm.weight"]), eps) for x in block]

    def key(x: list[float], pos: int) -> list[float]:
        k = matvec(mat(sd[p + "self_attn.k_proj.weight"]), x)
        return rope(rms(k, vec(sd[p + "self_attn.k_norm.weight"]), eps), pos, inv)

    keys = [key(c, i) for i, c in enumerate(ctx)] + [key(x, n + j) for j, x in enumerate(xn)]
    vals = [matvec(mat(sd[p + "self_attn.v_proj.weight"]), x) for x in ctx + xn]
    hidden, weights = [], []
    for j, x in enumerate(xn):
        q = matvec(mat(sd[p + "self_attn.q_proj.weight"]), x)
        q = rope(rms(q, vec(sd[p + "self_attn.q_norm.weight"]), eps), n + j, inv)
        scores = [sum(a * c for a, c in zip(q, k, strict=True)) / math.sqrt(len(q)) for k in keys]
        top = max(scores)
        e = [math.exp(s - top) for s in scores]
        w = [v / sum(e) for v in e]  # every key visible (full-attention layer, no mask)
        weights.append(w)
        o = [sum(wi * v[c] for wi, v in zip(w, vals, strict=True)) for c in range(len(q))]
        h1 = [
            a + c
            for a, c in zip(
                block[j], matvec(mat(sd[p + "self_attn.o_proj.weight"]), o), strict=True
            )
        ]
        m = rms(h1, vec(sd[p + "post_attention_layernorm.weight"]), eps)
        gate = matvec(mat(sd[p + "mlp.gate_proj.weight"]), m)
        up = matvec(mat(sd[p + "mlp.up_proj.weight"]), m)
        act = [silu(g) * u for g, u in zip(gate, up, strict=True)]
        h2 = [
            a + c for a, c in zip(h1, matvec(mat(sd[p + "mlp.down_proj.weight"]), act), strict=True)
        ]
        hidden.append(rms(h2, vec(sd["norm.weight"]), eps))
    head = mat(d._lm_head_weight)
    tokens = []
    for h in hidden[1:]:
        logits = matvec(head, h)
        tokens.append(max(range(len(logits)), key=logits.__getitem__))
    return tokens, hidden, weights


def test_one_proposal_matches_the_hand_computed_maths() -> None:
    d = make(tiny_config())
    feats = torch.randn(
        5, d.config.feature_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    tokens, hidden, _ = reference_proposal(d, feats, last=4)
    assert d.propose([1, 2, 3, 4, 5], 4, 3, feats) == tokens
    got = d.uncached_hidden(feats, 4, 3)
    torch.testing.assert_close(
        got, torch.tensor(hidden, dtype=torch.float64), rtol=1e-5, atol=1e-5
    )  # cos/sin tables are float32


def test_positions_matter_context_at_0_to_n_minus_1_block_from_n() -> None:
    """Shifting every position changes the result (RoPE is relative only for q·k, but the
    context keys and block queries sit at different offsets, so a wrong offset shows)."""
    d = make(tiny_config())
    feats = torch.randn(
        4, d.config.feature_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    _, hidden, _ = reference_proposal(d, feats, last=2)
    ref = torch.tensor(hidden, dtype=torch.float64)
    ctx = d.project_context(feats[None])
    n, b = 4, 3
    x = d.embed(d.block_ids(2, b))
    for ctx_shift, q_shift in ((0, 1), (1, 0)):  # off by one on either side
        pos = torch.arange(n)[None] + ctx_shift
        kv = d.context_kv(ctx, pos)
        out = d.run_block(x, torch.arange(n, n + b)[None] + q_shift, kv, pos)[0]
        assert not torch.allclose(out, ref, atol=1e-6)
    pos = torch.arange(n)[None]
    out = d.run_block(x, torch.arange(n, n + b)[None], d.context_kv(ctx, pos), pos)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # cos/sin tables are float32


@pytest.mark.parametrize(
    ("layer_type", "is_causal", "window", "expected"),
    [
        # block queries at positions 3, 4, 5 over keys at positions 0..5
        ("full_attention", None, None, [[1, 1, 1, 1, 1, 1]] * 3),
        (
            "sliding_attention",
            None,
            2,
            [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]],
        ),
        ("sliding_attention", None, 9, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1] * 6]),
        (
            "sliding_attention",
            False,
            2,
            [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]],
        ),
    ],
)
def test_attention_pattern_with_uniform_weights(
    layer_type: str, is_causal: bool | None, window: int | None, expected: list[list[int]]
) -> None:
    """With zero queries every visible key gets weight 1/|visible| (computed by hand), so
    the output is the mean of the visible values: this pins down the mask semantics."""
    cfg = tiny_config(layer_types=(layer_type,), sliding_window=window, is_causal=is_causal)
    d = make(cfg)
    with torch.no_grad():
        layer(d, 0).self_attn.q_proj.weight.zero_()
    attn = layer(d, 0).self_attn
    gen = torch.Generator().manual_seed(9)
    ctx_rows = torch.randn(1, 3, H, generator=gen, dtype=torch.float64)
    blk_rows = torch.randn(1, 3, H, generator=gen, dtype=torch.float64)
    ctx_pos, q_pos = torch.arange(3)[None], torch.arange(3, 6)[None]
    cos_c, sin_c = d.rotary(ctx_pos, torch.float64)
    k_ctx, v_ctx = attn.keys_values(ctx_rows, cos_c, sin_c)
    cos_q, sin_q = d.rotary(q_pos, torch.float64)
    from dflash.model.drafters.dflash_layers import visibility

    k_pos = torch.cat([ctx_pos, q_pos], 1)
    vis = visibility(q_pos, k_pos, causal=cfg.layer_causal(0), window=cfg.layer_window(0))
    out = attn(blk_rows, k_ctx, v_ctx, cos_q, sin_q, vis)
    values = torch.cat([v_ctx[0, 0], attn.v_proj(blk_rows)[0]], 0)  # [6, D]
    for j, row in enumerate(expected):
        w = torch.tensor(row, dtype=torch.float64) / sum(row)  # the hand-computed weights
        want = attn.o_proj(w @ values)
        torch.testing.assert_close(
            out[0, j], want, rtol=1e-5, atol=1e-5
        )  # cos/sin tables are float32


# -- config format -------------------------------------------------------------------------


def test_default_taps_follow_z_labs_rule() -> None:
    assert default_tap_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab/Qwen3-8B-DFlash-b16
    assert default_tap_layers(64, 5) == (1, 16, 31, 46, 61)  # z-lab/Qwen3.5-27B-DFlash
    assert default_tap_layers(6, 1) == (3,)
    assert default_tap_layers(6, 2) == (1, 3)


def test_saved_config_is_a_qwen3_config(tmp_path: object) -> None:
    from pathlib import Path

    from transformers import Qwen3Config

    root = Path(str(tmp_path))
    cfg = tiny_config(layer_types=("sliding_attention",), sliding_window=8)
    make(cfg).save_pretrained(root)
    hf = Qwen3Config.from_pretrained(root)
    assert hf.model_type == "qwen3" and hf.architectures == ["DFlashDraftModel"]
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads) == (H, 1, 1)
    assert (hf.num_key_value_heads, hf.head_dim, hf.intermediate_size) == (1, 4, 3)
    assert hf.vocab_size == V and hf.block_size == 3 and hf.num_target_layers == 4
    assert hf.dflash_config == {"mask_token_id": V - 1, "target_layer_ids": [1, 2]}
    assert hf.layer_types == ["sliding_attention"] and hf.sliding_window == 8
    rope = hf.rope_parameters
    assert rope is not None and rope["rope_theta"] == 100.0
    import json

    raw = json.loads((root / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16"
    assert config_from_hf(raw) == cfg  # the format round-trips


def test_z_lab_config_without_taps_gets_the_default_taps() -> None:
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "num_target_layers": 36,
        "block_size": 16,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669},
    }
    cfg = config_from_hf(raw)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.mask_token_id == 151669
    assert cfg.layer_causal(0) is False and cfg.layer_window(0) is None


def test_rope_parameters_style_and_yarn() -> None:
    cfg = tiny_config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    )
    inv, scale = inverse_frequencies(cfg)
    base = 1.0 / (100.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert float(inv[0]) == pytest.approx(float(base[0]))  # fastest pair extrapolated
    # by hand: correction dims floor(-0.50) -> 0 and ceil(1.01) = 2, so pair 1 sits half-way
    # on the ramp: 0.5 * (0.1 / 4) + 0.5 * 0.1 = 0.0625
    assert float(inv[1]) == pytest.approx(0.5 * float(base[1]) / 4.0 + 0.5 * float(base[1]))


# -- the context cache ---------------------------------------------------------------------


def run_steps(
    d: DFlashDrafter, feats: torch.Tensor, tokens: list[int], commits: list[int], block: int
) -> list[tuple[list[int], list[int]]]:
    out, n = [], commits[0]
    given = d.propose(tokens[:n], tokens[n], block, feats[:n])
    out.append((given, d.propose_uncached(feats[:n], tokens[n], block)))
    for c in commits[1:]:
        new = feats[n : n + c]
        n += c
        out.append(
            (
                d.propose(tokens[:n], tokens[n], block, new),
                d.propose_uncached(feats[:n], tokens[n], block),
            )
        )
    return out


@pytest.mark.parametrize(
    "changes",
    [{}, {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}],
)
def test_cached_and_uncached_context_give_the_same_drafts(changes: dict[str, object]) -> None:
    cfg = tiny_config(num_hidden_layers=2, vocab_size=V, **changes)
    d = make(cfg, seed=1)
    gen = torch.Generator().manual_seed(7)
    total = 40
    feats = torch.randn(total, cfg.feature_size, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, V - 1, (total + 1,), generator=gen).tolist()
    commits = [5, 1, 3, 2, 1, 4, 3, 1, 2, 3, 1, 4]
    drafts = run_steps(d, feats, tokens, commits, cfg.block_size)
    assert all(cached == uncached for cached, uncached in drafts)
    assert len({tuple(c) for c, _ in drafts}) > 1, "drafts do not depend on the context"
    n = sum(commits)
    torch.testing.assert_close(
        d.host._draft_hidden(tokens[n], 3), d.uncached_hidden(feats[:n], tokens[n], 3)
    )


def test_the_inference_layers_equal_the_reference_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_draft_hidden`` (every key visible: :meth:`DrafterLayer.infer`, block keys written
    into the cache's scratch rows) equals ``run_block`` over the whole context, with grouped
    queries and across a growth of the cache buffers (62 cached rows + a 3-row block > 64)."""
    from dflash.model.drafters.dflash_layers import DrafterLayer

    calls: list[int] = []
    real = DrafterLayer.infer

    def counted(self: DrafterLayer, *args: Any) -> torch.Tensor:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(DrafterLayer, "infer", counted)
    cfg = tiny_config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    d = make(cfg, seed=4)
    gen = torch.Generator().manual_seed(9)
    feats = torch.randn(70, cfg.feature_size, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V - 1, (71,), generator=gen).tolist()
    drafts = run_steps(d, feats, tokens, [30, 20, 12, 1, 4], cfg.block_size)
    assert all(cached == uncached for cached, uncached in drafts)
    assert d.host._cache[0][0].shape[2] >= 70  # grown past the first 64 rows
    for n in (67, 65):  # a shorter context again: the scratch rows are rewritten
        d.propose(tokens[:n], tokens[n], 3, feats[n - 1 : n])
        torch.testing.assert_close(
            d.host._draft_hidden(tokens[n], 3), d.uncached_hidden(feats[:n], tokens[n], 3),
            rtol=1e-12, atol=1e-12,
        )
    assert len(calls) == 2 * 9  # the cached proposals ran the inference layers (2 per call)


def _hidden_pair(d: DFlashDrafter, seed: int, n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached proposal's hidden states after a fresh context of ``n`` rows, and the
    reference's (``uncached_hidden``) for the same rows."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, d.config.feature_size, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V - 1, (n + 1,), generator=gen).tolist()
    d.reset()
    d.propose(tokens[:n], tokens[n], 3, feats)
    return d.host._draft_hidden(tokens[n], 3), d.uncached_hidden(feats, tokens[n], 3)


def test_inference_layers_with_biases_equal_the_reference_block() -> None:
    """The packed q/k/v and o biases (``attention_bias``) enter as the modules' biases do,
    in the block's rows and in the context's keys/values."""
    cfg = tiny_config(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, attention_bias=True
    )
    d = make(cfg, seed=5)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        biases = [p for name, p in d.named_parameters() if name.endswith("proj.bias")]
        assert len(biases) == 2 * 4  # q, k, v, o in each layer
        for p in biases:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    got, ref = _hidden_pair(d, seed=1)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_packed_weights_follow_changed_parameters() -> None:
    """A weight changed in place after a proposal (an optimizer step, ``load_state_dict``)
    or replaced is seen by the next proposal: the packed copies are made again."""
    cfg = tiny_config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    d = make(cfg, seed=6)
    _hidden_pair(d, seed=2)  # packs every layer
    with torch.no_grad():
        layer(d, 1).mlp.down_proj.weight.mul_(-2.0)  # the block's rows
        layer(d, 0).self_attn.k_proj.weight.add_(0.3)  # the context's keys
    got, ref = _hidden_pair(d, seed=2)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    d.load_state_dict(make(cfg, seed=7).state_dict())
    got, ref = _hidden_pair(d, seed=2)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    o_proj = layer(d, 0).self_attn.o_proj
    o_proj.weight.data = torch.randn(o_proj.weight.shape, dtype=torch.float64)  # replaced
    got, ref = _hidden_pair(d, seed=2)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_a_drafter_made_under_inference_mode_proposes() -> None:
    """Inference-mode parameters have no version counter; the packed copies key on their
    storage alone, and the proposals equal the reference's."""
    cfg = tiny_config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    with torch.inference_mode():
        d = make(cfg, seed=8)
        assert next(d.parameters()).is_inference()
        got, ref = _hidden_pair(d, seed=4)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_context_rows_are_projected_once() -> None:
    """Cost: each committed row goes through fc (and K/V) once, never the whole context."""
    d = make(tiny_config(), seed=2)
    feats = torch.randn(30, d.config.feature_size, dtype=torch.float64)
    tokens = list(range(31))
    tokens = [t % (V - 1) for t in tokens]
    n = 6
    d.propose(tokens[:n], tokens[n], 3, feats[:n])
    for c in (2, 1, 3, 4):
        d.propose(tokens[: n + c], tokens[n + c], 3, feats[n : n + c])
        n += c
    assert d.rows_projected == n == d.cached_length


def test_shorter_or_new_context_crops_the_cache() -> None:
    d, fresh = make(tiny_config(), seed=3), make(tiny_config(), seed=3)
    feats = torch.randn(12, d.config.feature_size, dtype=torch.float64)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    d.propose(toks[:10], toks[10], 3, feats[:10])
    # a shorter context whose last rows are given again (a re-proposal)
    assert d.propose(toks[:7], toks[7], 3, feats[5:7]) == fresh.propose(
        toks[:7], toks[7], 3, feats[:7]
    )
    # a new prompt: all of its rows given, the cache starts over
    other = torch.randn(4, d.config.feature_size, dtype=torch.float64)
    assert d.propose([9, 9, 9, 9], 1, 3, other) == d.propose_uncached(other, 1, 3)
    assert d.cached_length == 4


def test_missing_or_inconsistent_rows_are_refused() -> None:
    d = make(tiny_config())
    feats = torch.randn(8, d.config.feature_size, dtype=torch.float64)
    with pytest.raises(
        DraftArgumentError, match=r"needs the first 4 tokens cached, but it holds 0"
    ):
        d.propose([1, 2, 3, 4, 5, 6], 1, 3, feats[:2])
    d.propose([1, 2, 3, 4], 1, 3, feats[:4])
    with pytest.raises(DraftArgumentError, match=r"differs from the cached context at position 2"):
        d.propose([1, 2, 7, 4, 5], 1, 3, feats[4:5])
    d.reset()
    assert d.cached_length == 0


def test_bad_features_and_arguments() -> None:
    d = make(tiny_config())
    width = d.config.feature_size
    with pytest.raises(DraftArgumentError, match=r"'features' is required .*\(got None\)"):
        d.propose([1, 2], 1, 3, None)
    with pytest.raises(DraftArgumentError, match=rf"shape \[T, {width}\] \(got \[2, 5\]\)"):
        d.propose([1, 2], 1, 3, torch.zeros(2, 5))
    with pytest.raises(DraftArgumentError, match=r"3 rows, more than the 2 context tokens"):
        d.propose([1, 2], 1, 3, torch.zeros(3, width))
    with pytest.raises(DraftArgumentError, match=r"floating point"):
        d.propose([1, 2], 1, 3, torch.zeros(2, width, dtype=torch.long))
    with pytest.raises(DraftArgumentError, match=r"'last' must be < vocab_size"):
        d.propose([1, 2], V, 3, torch.zeros(2, width))
    with pytest.raises(DraftArgumentError, match=r"'block_size' must be an int >= 2"):
        d.propose([1, 2], 1, 1, torch.zeros(2, width))


def test_empty_context_drafts_from_the_block_alone() -> None:
    d = make(tiny_config())
    out = d.propose([], 2, 3, torch.zeros(0, d.config.feature_size, dtype=torch.float64))
    assert len(out) == 2 and out == d.propose_uncached(
        torch.zeros(0, d.config.feature_size, dtype=torch.float64), 2, 3
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "must be a multiple of"),
        ({"head_dim": 3}, "must be even"),
        ({"target_layer_ids": (1, 1)}, "must be distinct"),
        ({"target_layer_ids": (4,)}, r"must be in \[0, num_target_layers=4\) \(got 4\)"),
        ({"layer_types": ("sliding_attention",)}, "'sliding_window' is required"),
        ({"layer_types": ("full_attention",) * 2}, "must have num_hidden_layers=1 entries"),
        ({"rope_scaling": {"rope_type": "ntk"}}, "rope_type must be one of"),
    ],
)
def test_bad_configs_are_rejected(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**changes)


def test_confidence_is_the_softmax_probability_of_each_guess() -> None:
    d = make(tiny_config(block_size=4), seed=4)
    feats = torch.randn(7, d.config.feature_size, dtype=torch.float64) * 3
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert d.confidence() is None  # nothing proposed yet
    guesses = d.propose(tokens[:7], tokens[7], 4, feats)
    hidden = d.uncached_hidden(feats, tokens[7], 4)
    probs = torch.softmax(d.logits(hidden[1:]).double(), dim=-1)  # [3, V]
    assert guesses == probs.argmax(-1).tolist() == d.propose_uncached(feats, tokens[7], 4)
    got = d.confidence()
    assert got is not None and len(got) == 3
    assert got == pytest.approx([float(probs[i, g]) for i, g in enumerate(guesses)], rel=1e-12)
    got[0] = -1.0  # a copy: the caller cannot change the drafter's record
    assert d.confidence() != got
    d.reset()
    assert d.confidence() is None

