"""DFlash2 drafting on the host (``specs/dflash2.md``): the drafter's guesses equal an
independent float64 evaluation of the format's definition (convolutions around each
sublayer, the selector's walk from the anchor), cached or not; a round trip through a
checkpoint keeps them; decoding with it is lossless, greedy in every rollback mode and
sampled with coupled selection; what is not built yet is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash.execution import ROLLBACK_MODES, RollbackMode, RollbackPolicy, generate, plan_shards
from dflash.execution.oracle import reference_greedy
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import (
    DFlash2Config,
    DFlash2Drafter,
    DFlashConfig,
    DFlashDrafter,
    DraftArgumentError,
    DrafterFormatNotBuiltError,
)
from dflash.model.drafters.dflash2_drafter import DFlash2Layer
from dflash.model.drafters.lookup_assisted import LookupAssistedDrafter
from dflash.sampling import SamplingParams

V, H, TARGET_LAYERS = 256, 64, 6
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    torch.set_num_threads(1)
    return TargetModel.tiny_default(seed=0)


def config(**changes: object) -> DFlash2Config:
    base = DFlashConfig.for_target(hidden_size=H, vocab_size=V, num_target_layers=TARGET_LAYERS,
                                   num_hidden_layers=2, block_size=4)
    fields = {**base.model_dump(), "conv_kernel_size": 2, "conv_group_size": 16,
              "selector_rank": 8, "selector_top_k": 6, **changes}
    return DFlash2Config.model_validate(fields)


def drafter(tiny: TargetModel, dtype: torch.dtype | None = None, **changes: object,
            ) -> DFlash2Drafter:
    d = DFlashDrafter.random(config(**changes), tiny.embed_tokens.weight, tiny.lm_head.weight,
                             seed=3, dtype=dtype)
    assert isinstance(d, DFlash2Drafter)
    with torch.no_grad():  # convolutions and selector far from neutral, so they matter
        for layer in d.layers:
            assert isinstance(layer, DFlash2Layer)
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn(conv.base_kernel.shape,
                                                  generator=torch.Generator().manual_seed(5)))
                conv.kernel_projection.weight.mul_(8)
        d.candidate_selector.predecessor_codebook.mul_(3)
    return d


# -- the definition, evaluated independently in float64 ---------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, T, D] at positions [T]: neox (rotate half) rotary over all of D."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def conv(z: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    q, h = z.shape
    out = torch.zeros_like(z)
    g = h // delta.shape[-1]
    for j in range(q):
        for t in range(base.shape[0]):
            if j - t >= 0:
                out[j] += (base[t] + delta[j, t].repeat_interleave(g)) * z[j - t]
    return out


def reference_guesses(d: DFlash2Drafter, features: torch.Tensor, last: int, block: int,
                      ) -> list[int]:
    cfg = d.config
    p = {k: v.double() for k, v in d.state_dict().items()}
    eps, n, D = cfg.rms_norm_eps, features.shape[0], cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    embed, head = d._embed_weight.detach().double(), d._lm_head_weight.detach().double()
    c = rms(features.double() @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    ids = [last] + [cfg.mask_token_id] * (block - 1)
    x = embed[ids] * cfg.input_embedding_scale
    q_pos, k_pos = torch.arange(n, n + block), torch.arange(n + block)
    for i in range(cfg.num_hidden_layers):
        L = f"layers.{i}."

        def around(s: torch.Tensor, name: str, sub: object, L: str = L) -> torch.Tensor:
            kc, ng = cfg.conv_kernel_size, cfg.conv_groups
            delta = (s @ p[L + name + ".kernel_projection.weight"].T).view(-1, 2, kc, ng)
            base = p[L + name + ".base_kernel"]
            y = sub(conv(s, base[0], delta[:, 0]))  # type: ignore[operator]  # a callable
            return conv(y, base[1], delta[:, 1])

        def attention(u: torch.Tensor, L: str = L) -> torch.Tensor:
            rows = torch.cat([c, u])
            q = (u @ p[L + "self_attn.q_proj.weight"].T).view(block, nh, D).transpose(0, 1)
            k = (rows @ p[L + "self_attn.k_proj.weight"].T).view(-1, nkv, D).transpose(0, 1)
            v = (rows @ p[L + "self_attn.v_proj.weight"].T).view(-1, nkv, D).transpose(0, 1)
            q = rope(rms(q, p[L + "self_attn.q_norm.weight"], eps), q_pos, cfg.rope_theta)
            k = rope(rms(k, p[L + "self_attn.k_norm.weight"], eps), k_pos, cfg.rope_theta)
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
            a = torch.softmax(q @ k.transpose(1, 2) / D**0.5, -1) @ v   # every key visible
            out: torch.Tensor = a.transpose(0, 1).reshape(block, nh * D) @ p[
                L + "self_attn.o_proj.weight"].T
            return out

        def mlp(u: torch.Tensor, L: str = L) -> torch.Tensor:
            gate = u @ p[L + "mlp.gate_proj.weight"].T
            out: torch.Tensor = (F.silu(gate) * (u @ p[L + "mlp.up_proj.weight"].T)) @ p[
                L + "mlp.down_proj.weight"].T
            return out

        x = x + around(rms(x, p[L + "input_layernorm.weight"], eps), "attention_conv", attention)
        x = x + around(rms(x, p[L + "post_attention_layernorm.weight"], eps), "mlp_conv", mlp)
    h = rms(x, p["norm.weight"], eps)[1:]
    logits = h @ head.T
    z = logits * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    unary = z if cap is None else cap * torch.tanh(z / cap)
    e = h @ p["candidate_selector.hidden_projection.weight"].T
    A = p["candidate_selector.predecessor_codebook"]
    S = p["candidate_selector.successor_codebook"]
    chosen, prev = [], last
    for j in range(block - 1):
        cands = sorted(range(V), key=lambda v: (-float(logits[j, v]), v))[: cfg.selector_top_k]
        scores = [float(unary[j, c]) + float((A[prev] * e[j] * S[c]).sum()) for c in cands]
        prev = cands[max(range(len(cands)), key=lambda i: (scores[i], -i))]
        chosen.append(prev)
    return chosen


@pytest.mark.parametrize("changes", [{}, {"output_multiplier": 0.4,
                                          "final_logit_softcapping": 3.0,
                                          "input_embedding_scale": 1.5}])
def test_guesses_equal_the_definition(tiny: TargetModel, changes: dict[str, object]) -> None:
    d = drafter(tiny, torch.float64, **changes)
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(9, d.config.feature_size, generator=gen, dtype=torch.float64)
    context = list(range(9))
    want = reference_guesses(d, features, 17, 4)
    assert d.propose(context, 17, 4, features) == want            # the host cache
    assert d.propose_uncached(features, 17, 4) == want             # no cache
    # a step later, the cache extended by two rows
    more = torch.randn(2, d.config.feature_size, generator=gen, dtype=torch.float64)
    both = torch.cat([features, more])
    assert d.propose([*context, 9, 10], 5, 4, more) == reference_guesses(d, both, 5, 4)


def test_the_selector_changes_the_guesses(tiny: TargetModel) -> None:
    """Against each slot's argmax of the same logits (v1's rule), the walk picks others."""
    d = drafter(tiny, torch.float64)
    features = torch.randn(9, d.config.feature_size, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(2))
    hidden = d.uncached_hidden(features, 17, 4)
    argmax = d.logits(hidden[1:]).argmax(-1).tolist()
    assert d.propose_uncached(features, 17, 4) != argmax


def test_a_checkpoint_round_trip_keeps_the_guesses(tiny: TargetModel, tmp_path: Path) -> None:
    d = drafter(tiny)
    d.save_pretrained(tmp_path / "d2")
    back = DFlashDrafter.from_pretrained(tmp_path / "d2", tiny.embed_tokens.weight,
                                         tiny.lm_head.weight, num_target_layers=TARGET_LAYERS,
                                         dtype=torch.float32)
    assert isinstance(back, DFlash2Drafter)
    rounded = drafter(tiny)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float()
                             for k, v in rounded.state_dict().items()})
    features = torch.randn(7, d.config.feature_size)
    assert back.propose(list(range(7)), 3, 4, features) == rounded.propose(
        list(range(7)), 3, 4, features)


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_decoding_with_it_is_lossless(tiny: TargetModel, mode: RollbackMode) -> None:
    d = drafter(tiny)
    result = generate(tiny, d, PROMPT, plan=plan_shards(TARGET_LAYERS, "cpu", None),
                      max_new_tokens=10, block_size=4, policy=RollbackPolicy(mode=mode))
    assert result.tokens == greedy_generate(tiny, PROMPT, 10)
    assert result.drafter == "dflash2"


def test_sampled_decoding_with_coupled_selection_is_lossless(tiny: TargetModel) -> None:
    rule = SamplingParams(temperature=0.9, top_k=40, seed=11)
    plan = plan_shards(TARGET_LAYERS, "cpu", None)
    want = reference_greedy(tiny, plan, PROMPT, 12, sampling=rule)
    d = drafter(tiny)
    got = generate(tiny, d, PROMPT, plan=plan, max_new_tokens=12, block_size=4,
                   policy=RollbackPolicy(mode="checkpoint"), sampling=rule)
    assert got.tokens == want


def test_coupled_guesses_use_the_targets_noise_at_each_guess_position(
    tiny: TargetModel,
) -> None:
    """With the target sampling, guess slot i (1-based) after n committed tokens draws with
    the noise of position n + i: the walk of the same scores from that position."""
    from dflash.model.drafters.dflash2_ops import candidates, selector_walk

    d = drafter(tiny, torch.float64)
    features = torch.randn(9, d.config.feature_size, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(6))
    rule = SamplingParams(temperature=1.3, seed=21)
    d.couple(rule)
    got = d.propose(list(range(9)), 17, 4, features)
    hidden = d.uncached_hidden(features, 17, 4)[1:]
    scores, ids = candidates(d.logits(hidden), d.config.selector_top_k, 1.0, None)
    e = hidden @ d.candidate_selector.hidden_projection.weight.T
    sel = d.candidate_selector
    for start, same in ((10, True), (9, False), (11, False)):
        walk = selector_walk(scores, ids, e, sel.predecessor_codebook, sel.successor_codebook,
                             17, temperature=1.3, seed=21, start=start)
        assert (walk.tolist() == got) == same, start


def test_coupled_guesses_follow_the_seed(tiny: TargetModel) -> None:
    d = drafter(tiny)
    features = torch.randn(9, d.config.feature_size, generator=torch.Generator().manual_seed(4))
    runs: dict[int, list[tuple[int, ...]]] = {}
    for seed in (0, 0, 1, 2, 3):
        d.reset()
        d.couple(SamplingParams(temperature=1.5, seed=seed))
        runs.setdefault(seed, []).append(tuple(d.propose(list(range(9)), 17, 4, features)))
    assert runs[0][0] == runs[0][1]
    assert len({r[0] for r in runs.values()}) > 1


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.5,
                                                                       seed=5)])
def test_the_device_path_equals_the_host_path(tiny: TargetModel,
                                              sampling: SamplingParams) -> None:
    """Drafting on static buffers with the accepted count as a tensor (the device path)
    proposes what the host path proposes, step after step, greedy and coupled."""
    import random

    host, dev = drafter(tiny), drafter(tiny)
    host.couple(sampling)
    dev.couple(sampling)
    B, rng = 4, random.Random(1)
    n, total = 7, 7 + 8 * B
    feats = torch.randn(total + B, host.config.feature_size,
                        generator=torch.Generator().manual_seed(2))
    context = [rng.randrange(V - 1) for _ in range(total + B)]
    last = context[n]
    want = host.propose(context[:n], last, B, feats[:n])
    got = dev.start_device(feats[:n], last, capacity=total + 2 * B, block_size=B)
    assert got.tolist() == want
    for step in range(8):
        commit = 1 + step % B
        tokens = torch.tensor([rng.randrange(V - 1) for _ in range(B)])
        last = int(tokens[commit - 1])
        rows = feats[n : n + B]
        dev.set_device_inputs(rows, torch.tensor([commit]), tokens)
        got = dev.device_step()
        context[n : n + commit] = [context[n], *tokens[: commit - 1].tolist()]
        n += commit
        assert got.tolist() == host.propose(context[:n], last, B, rows[:commit]), step


def test_what_is_not_built_is_refused_by_name(tiny: TargetModel) -> None:
    d = drafter(tiny)
    with pytest.raises(DrafterFormatNotBuiltError, match="depend on the previous slot"):
        d.candidates(4)
    with pytest.raises(DraftArgumentError, match="needs a host proposal first"):
        d.selector_tree(3, 8)
    with pytest.raises(DraftArgumentError, match="a DFlash2Config builds a DFlash2Drafter"):
        DFlashDrafter(config(), tiny.embed_tokens.weight, tiny.lm_head.weight)


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("rule", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)])
def test_tree_decoding_from_the_selector_is_lossless(
    tiny: TargetModel, mode: RollbackMode, rule: SamplingParams
) -> None:
    plan = plan_shards(TARGET_LAYERS, "cpu", None)
    want = reference_greedy(tiny, plan, PROMPT, 12, sampling=rule)
    got = generate(tiny, drafter(tiny), PROMPT, plan=plan, max_new_tokens=12, block_size=4,
                   policy=RollbackPolicy(mode=mode), tree_budget=10, sampling=rule)
    assert got.tokens == want
    assert got.tree_budget == 10 and (got.nodes_per_step or 0) > 4  # trees were verified


@pytest.mark.parametrize("rule", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)])
def test_trees_with_prompt_lookup_are_lossless(tiny: TargetModel, rule: SamplingParams) -> None:
    """Assisted by prompt lookup (a repetitive prompt: copies to find), the selector's tree
    takes the copy as its first branch; decoding stays plain decoding's."""
    plan = plan_shards(TARGET_LAYERS, "cpu", None)
    prompt = PROMPT * 3
    want = reference_greedy(tiny, plan, prompt, 12, sampling=rule)
    got = generate(tiny, LookupAssistedDrafter(drafter(tiny)), prompt, plan=plan,
                   max_new_tokens=12, block_size=4, policy=RollbackPolicy(mode="checkpoint"),
                   tree_budget=10, sampling=rule)
    assert got.tokens == want and got.drafter == "dflash2+lookup"


def test_trees_from_the_command_line(tiny: TargetModel, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--tree-budget`` with a DFlash2 directory, alone or assisted by prompt lookup,
    decodes trees with parity checked."""
    from dflash.cli import main

    base = DFlashConfig.for_target(hidden_size=tiny.config.hidden_size,
                                   vocab_size=tiny.config.vocab_size,
                                   num_target_layers=tiny.config.num_hidden_layers,
                                   num_hidden_layers=1, block_size=4)
    cfg = DFlash2Config.model_validate({**base.model_dump(), "conv_kernel_size": 2,
                                        "conv_group_size": 16, "selector_rank": 4,
                                        "selector_top_k": 3})
    DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight,
                         seed=1).save_pretrained(tmp_path / "d2")
    args = ["generate", "--model", "tiny", "--devices", "cpu", "--prompt-len", "8",
            "--max-new-tokens", "6", "--no-progress", "--json", "--check-parity",
            "--tree-budget", "8"]
    for spec, label in ((str(tmp_path / "d2"), "dflash2"),
                        (str(tmp_path / "d2") + "+lookup", "dflash2+lookup")):
        assert main([*args, "--draft", spec]) == 0
        out = capsys.readouterr().out
        assert f'"drafter":"{label}"' in out and '"parity":true' in out
        assert '"tree_budget":8' in out
