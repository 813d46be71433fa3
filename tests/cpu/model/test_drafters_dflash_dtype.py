"""The DFlash drafter's product dtype: its weights' own unless ``draft_dtype`` names another,
by the same rule on the host's packed path, the reference path (``run_block``) and the
device path; nothing chosen per machine, so a float32 drafter's host proposals are the
float32 reference's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.execution import RollbackPolicy, generate, plan_shards
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import (
    DFlashConfig,
    DFlashDrafter,
    DraftArgumentError,
    LookupAssistedDrafter,
    make_drafter,
)
from dflash.model.drafters.dflash_layers import ProductLinear

V, H, B = 256, 64, 8


def _drafter(draft_dtype: torch.dtype | None = None) -> DFlashDrafter:
    """A float32 drafter with real products (hidden 64, two layers, vocabulary 256)."""
    cfg = DFlashConfig.for_target(
        hidden_size=H, vocab_size=V, num_target_layers=4, num_hidden_layers=2, block_size=B
    )
    gen = torch.Generator().manual_seed(21)
    embed = torch.randn(V, H, generator=gen)
    head = torch.randn(V, H, generator=gen)
    return DFlashDrafter.random(cfg, embed, head, seed=3, draft_dtype=draft_dtype)


def _steps(width: int) -> Iterator[tuple[list[int], int, torch.Tensor, torch.Tensor]]:
    """Proposals over four contexts, each a fresh prompt then commits of 1-5 rows:
    ``(tokens, n, the rows given this step, the rows of every committed token)``."""
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        feats = torch.randn(68, width, generator=gen)
        tokens = torch.randint(0, V - 1, (69,), generator=gen).tolist()
        n, given = 5, 5
        while n < 60:
            yield tokens, n, feats[n - given : n], feats[:n]
            given = 1 + (n * 7) % 5
            n += given


def _host_and_reference(
    host: DFlashDrafter, reference: DFlashDrafter
) -> list[tuple[list[int], list[int]]]:
    """Per step: ``host``'s cached proposal and ``reference``'s uncached one (``run_block``
    over every committed row, the LM head by ``F.linear``)."""
    return [
        (
            host.propose(tokens[:n], tokens[n], B, rows),
            reference.propose_uncached(every, tokens[n], B),
        )
        for tokens, n, rows, every in _steps(host.config.feature_size)
    ]


def test_a_float32_drafter_proposes_the_float32_reference_tokens_block_for_block() -> None:
    """The packed host path (``DrafterLayer.infer`` on ``[in, out]`` copies, the LM head's
    ``[H, V]`` copy) multiplies in float32 and proposes exactly the reference's tokens in
    every block; bfloat16 products change at least one of these blocks (next test)."""
    d = _drafter()
    pairs = _host_and_reference(d, d)
    assert len(pairs) >= 80
    for i, (host, reference) in enumerate(pairs):
        assert host == reference, f"block {i}"
    assert len({tuple(host) for host, _ in pairs}) > len(pairs) // 2  # context-dependent
    packed = d._layers()[0].packed()
    matrices = (packed.qkv, packed.kv, packed.o, packed.gate_up, packed.down)
    assert {m.dtype for m in matrices} == {torch.float32}
    assert d._head_copy is not None and d._head_copy[1].dtype == torch.float32


def test_draft_dtype_bfloat16_runs_the_products_in_bfloat16() -> None:
    """``draft_dtype=torch.bfloat16`` on float32 weights: the packed matrices, the LM head's
    copy and the modules' products are bfloat16; the host path proposes the bfloat16
    reference's tokens, and the tokens differ from the float32 drafter's in some block.
    Outside drafting (training) the modules multiply the float32 weights as they are."""
    d, f32 = _drafter(torch.bfloat16), _drafter()
    assert d.dtype == torch.float32 and d.draft_dtype == torch.bfloat16
    assert f32.draft_dtype is None
    pairs = _host_and_reference(d, d)
    for i, (host, reference) in enumerate(pairs):
        assert host == reference, f"block {i}"
    float32 = [reference for _, reference in _host_and_reference(f32, f32)]
    assert any(host != want for (host, _), want in zip(pairs, float32, strict=True))
    with torch.no_grad():
        packed = d._layers()[0]._packed
        assert packed is not None
        matrices = (packed.qkv, packed.kv, packed.o, packed.gate_up, packed.down)
        assert {m.dtype for m in matrices} == {torch.bfloat16}
        assert d._head_copy is not None and d._head_copy[1].dtype == torch.bfloat16
        copies = [m._copy for m in d.modules() if isinstance(m, ProductLinear)]
        assert len(copies) == 1 + 2 * 7  # fc, and q/k/v/o/gate/up/down of each layer
        assert all(c is not None and c[1].dtype == torch.bfloat16 for c in copies)
        # the reference path's products in bfloat16 too: close to float32, not its bits
        tokens, n, _, every = next(_steps(d.config.feature_size))
        got, want = d.uncached_hidden(every, tokens[n], B), f32.uncached_hidden(every, tokens[n], B)
        assert got.dtype == torch.float32
        err = float((got - want).norm() / want.norm())
        assert 0.0 < err < 2e-2, err  # bfloat16 keeps 8 significant bits
        x = torch.randn(3, d.config.feature_size)
        assert torch.equal(d.fc(x), F.linear(x, d.fc.weight))  # not drafting: float32
        assert d.logits(got).dtype == torch.float32


def test_the_device_path_multiplies_in_the_draft_dtype() -> None:
    """Drafting on the device (``start_device`` / ``device_step``) follows the same rule:
    with ``draft_dtype=torch.bfloat16`` its guesses are the bfloat16 reference's after
    commits of every length, over four prompts, and differ from the float32 drafter's in
    some step."""
    dev, ref, f32 = _drafter(torch.bfloat16), _drafter(torch.bfloat16), _drafter()
    steps: list[tuple[list[int], list[int], list[int]]] = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        feats = torch.randn(7 + 12 * B, dev.config.feature_size, generator=gen)
        n = 7
        last = int(torch.randint(0, V - 1, (1,), generator=gen))
        got = dev.start_device(feats[:n], last, capacity=7 + 14 * B, block_size=B)
        for step in range(13):
            if step:
                commit = 1 + step % B
                tokens = torch.randint(0, V - 1, (B,), generator=gen)
                last = int(tokens[commit - 1])
                dev.set_device_inputs(feats[n : n + B], torch.tensor([commit]), tokens)
                got = dev.device_step()
                n += commit
            want = ref.propose_uncached(feats[:n], last, B)
            steps.append((got.tolist(), want, f32.propose_uncached(feats[:n], last, B)))
    for i, (guesses, want, _) in enumerate(steps):
        assert guesses == want, f"step {i}"
    assert any(guesses != float32 for guesses, _, float32 in steps)
    assert dev.fc._copy is not None and dev.fc._copy[1].dtype == torch.bfloat16


def test_the_lm_head_copy_follows_the_head() -> None:
    """The LM head's copy in the product dtype is made again when the (shared) head weight
    is changed in place: the next proposal's probabilities are those of the new weight."""
    d = _drafter(torch.bfloat16)
    tokens, n, _, every = next(_steps(d.config.feature_size))
    d.propose(tokens[:n], tokens[n], B, every)
    assert d._head_copy is not None
    first = d._head_copy[1]
    with torch.no_grad():
        d._lm_head_weight.mul_(-1.0)  # every guess's logit changes sign
    d.reset()
    guesses = d.propose(tokens[:n], tokens[n], B, every)
    assert d._head_copy[1] is not first
    assert torch.equal(d._head_copy[1], d._lm_head_weight.T.bfloat16())
    logits = (d.uncached_hidden(every, tokens[n], B)[1:].bfloat16() @ d._head_copy[1]).double()
    probs = torch.softmax(logits, -1)
    confidence = d.confidence()
    assert confidence is not None
    for i, tok in enumerate(guesses):
        assert confidence[i] == pytest.approx(float(probs[i, tok]), rel=5e-2), i


class _StandInTarget(nn.Module):
    """Just the parts of a target a drafter uses."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Embedding(40, 16)
        self.lm_head = nn.Linear(16, 40, bias=False)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(40, 16, generator=gen))
            self.lm_head.weight.copy_(torch.randn(40, 16, generator=gen))
        self.layers = nn.ModuleList(nn.Identity() for _ in range(8))

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight


def test_make_drafter_passes_draft_dtype_through(tmp_path: Path) -> None:
    target = _StandInTarget()
    built = make_drafter("dflash", target, seed=1, draft_dtype=torch.bfloat16)
    assert isinstance(built, DFlashDrafter) and built.draft_dtype == torch.bfloat16
    assert isinstance(default := make_drafter("dflash", target), DFlashDrafter)
    assert default.draft_dtype is None
    assisted = make_drafter("dflash+lookup", target, draft_dtype=torch.float64)
    assert isinstance(assisted, LookupAssistedDrafter)
    assert assisted.dflash.draft_dtype == torch.float64
    built.save_pretrained(tmp_path / "drafter")
    loaded = make_drafter(str(tmp_path / "drafter"), target, draft_dtype=torch.float16)
    assert isinstance(loaded, DFlashDrafter) and loaded.draft_dtype == torch.float16
    assert loaded.dtype == torch.float32  # the parameters keep their own dtype
    features = torch.randn(4, loaded.config.feature_size)
    assert len(loaded.propose([1, 2, 3, 4], 5, 4, features)) == 3


@pytest.mark.parametrize(
    "bad", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, "bfloat16", 16]
)
def test_a_bad_draft_dtype_is_refused_by_name(bad: object, tmp_path: Path) -> None:
    target = _StandInTarget()
    shown = f"(got {bad!r})"
    cfg = _drafter().config
    embed, head = torch.zeros(V, H), torch.zeros(V, H)
    with pytest.raises(DraftArgumentError, match="'draft_dtype' must be") as caught:
        DFlashDrafter(cfg, embed, head, draft_dtype=bad)  # type: ignore[arg-type]  # the bad value on purpose
    assert shown in str(caught.value)
    with pytest.raises(DraftArgumentError, match="'draft_dtype' must be"):
        DFlashDrafter.random(cfg, embed, head, seed=0, draft_dtype=bad)  # type: ignore[arg-type]  # on purpose
    with pytest.raises(DraftArgumentError, match="'draft_dtype' must be"):  # before any file
        DFlashDrafter.from_pretrained(tmp_path / "absent", embed, head, draft_dtype=bad)  # type: ignore[arg-type]  # on purpose
    for spec in ("dflash", "dflash+lookup", "prompt-lookup"):
        with pytest.raises(DraftArgumentError, match="'draft_dtype' must be"):
            make_drafter(spec, target, draft_dtype=bad)  # type: ignore[arg-type]  # on purpose


def test_a_bfloat16_draft_dtype_stays_lossless() -> None:
    """Only guesses come out of the drafter: with bfloat16 products the engine's output is
    still the target's greedy output."""
    torch.set_num_threads(1)
    tiny = TargetModel.tiny_default(seed=0)
    prompt = [3, 14, 15, 92, 65, 35]
    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2, block_size=4
    )
    drafter = DFlashDrafter.random(
        cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2, draft_dtype=torch.bfloat16
    )
    result = generate(
        tiny, drafter, prompt, plan=plan_shards(6, "cpu", None), max_new_tokens=12,
        block_size=4, policy=RollbackPolicy(mode="checkpoint"),
    )
    assert result.tokens == greedy_generate(tiny, prompt, 12)
    assert drafter._head_copy is not None and drafter._head_copy[1].dtype == torch.bfloat16
