"""Parity with transformers: save a small random HF model, load it with dflash, compare.

float32 on CPU; prefill logits and 32 decode steps within 1e-4 (max abs), identical greedy
tokens, across head groupings, layer layouts, tied/untied heads and both model families
(and the Qwen3.5 multimodal wrapper, whose vision weights must be ignored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.model import TargetModel, greedy_generate

transformers = pytest.importorskip("transformers")

PROMPT = [3, 77, 12, 101, 5, 64, 9, 33, 120, 2, 50]
STEPS = 32
TOL = 1e-4

_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA 4/2, GDN HK=2 < HV=4, every 2nd layer attention, untied head
    "qwen3_5_gqa_interval": ("Qwen3_5ForCausalLM", {
        **_COMMON, "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }),
    # MQA 4/1, GDN HK=HV=2 with K != V, explicit layout starting with attention, tied head
    "qwen3_5_mqa_layout_tied": ("Qwen3_5ForCausalLM", {
        **_COMMON, "num_hidden_layers": 5,
        "layer_types": ["full_attention", "linear_attention", "linear_attention",
                        "full_attention", "linear_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                            "partial_rotary_factor": 0.5},
    }),
    # Qwen3-Next (fused in_proj_qkvz / in_proj_ba), dense MLPs, GDN HK=1 < HV=3
    "qwen3_next_dense": ("Qwen3NextForCausalLM", {
        **_COMMON, "num_hidden_layers": 4, "full_attention_interval": 4,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 1, "linear_num_value_heads": 3,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 0,
    }),
    # Qwen3-Next with mixture-of-experts MLPs in layers 0 and 2 (dense in 1 and 3)
    "qwen3_next_moe": ("Qwen3NextForCausalLM", {
        **_COMMON, "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 6,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "mlp_only_layers": [1, 3],
    }),
}


def _randomize(model: Any, seed: int) -> None:
    """Weights at a scale where mistakes show (HF's 0.02 init gives near-constant logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * noise)
            elif "norm" in name:
                p.add_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(noise * fan_in**-0.5)


def _hf_model(kind: str, fields: dict[str, Any], seed: int) -> Any:
    if kind == "Qwen3_5ForCausalLM":
        config = transformers.Qwen3_5TextConfig(**fields)
    elif kind == "Qwen3NextForCausalLM":
        config = transformers.Qwen3NextConfig(**fields)
    else:
        text = transformers.Qwen3_5TextConfig(**fields)
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                  "out_hidden_size": fields["hidden_size"], "patch_size": 2,
                  "num_position_embeddings": 16}
        config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)
    config._attn_implementation = "eager"
    # transformers draws some initial values (e.g. A_log) from the global RNG: seed it so
    # the model, and therefore the comparison, is the same whatever ran before
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = getattr(transformers, kind)(config).eval()
    _randomize(model, seed)
    return model


@torch.inference_mode()
def _hf_greedy(model: Any) -> tuple[list[torch.Tensor], list[int]]:
    """HF logits for the prompt's last position and STEPS decode steps; its greedy tokens."""
    out = model(input_ids=torch.tensor([PROMPT]), use_cache=True)
    logits, tokens = [out.logits[0, -1]], []
    for _ in range(STEPS):
        tokens.append(int(logits[-1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits, tokens


def _check_against_hf(tmp_path: Path, kind: str, fields: dict[str, Any], seed: int) -> TargetModel:
    hf = _hf_model(kind, fields, seed)
    hf.save_pretrained(tmp_path)
    ours = TargetModel.from_pretrained(tmp_path)
    hf_logits, hf_tokens = _hf_greedy(hf)
    caches = ours.new_caches(max_len=len(PROMPT) + STEPS + 1)
    with torch.inference_mode():
        prefill, _ = ours(torch.tensor([PROMPT]), caches, "prefill")
        diffs = [float((prefill[0, -1] - hf_logits[0]).abs().max())]
        for step, tok in enumerate(hf_tokens):
            out, _ = ours(torch.tensor([[tok]]), caches, "decode")
            diffs.append(float((out[0, -1] - hf_logits[step + 1]).abs().max()))
    print(f"{kind} seed={seed}: max |Δlogits| prefill {diffs[0]:.2e}, decode {max(diffs[1:]):.2e}")
    assert diffs[0] <= TOL, f"prefill logits differ by {diffs[0]}"
    assert max(diffs[1:]) <= TOL, f"decode logits differ by up to {max(diffs[1:])}"
    assert greedy_generate(ours, PROMPT, STEPS) == hf_tokens
    return ours


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, case: str) -> None:
    kind, fields = CASES[case]
    _check_against_hf(tmp_path, kind, fields, seed=len(case))


def test_multimodal_wrapper_loads_text_model_and_ignores_vision(tmp_path: Path) -> None:
    _, fields = CASES["qwen3_5_gqa_interval"]
    ours = _check_against_hf(tmp_path, "Qwen3_5ForConditionalGeneration", fields, seed=7)
    assert ours.load_report is not None
    assert ours.load_report.ignored.get("model.visual.*", 0) > 0


LONG_PROMPT = [(7 * i * i + 3 * i + 1) % 128 for i in range(37)]


@torch.inference_mode()
@pytest.mark.parametrize("case", ["qwen3_5_gqa_interval", "qwen3_next_dense"])
def test_chunked_prefills_of_every_chunk_size_match_transformers(
    tmp_path: Path, case: str
) -> None:
    """A prompt prefilled in chunks of every size 1 … len (each chunk continues the caches
    at the committed length: boundaries everywhere, in the middle of conv windows and of
    attention tiles) gives transformers' logits at every chunk's last token, and the
    greedy continuation transformers computes after it."""
    kind, fields = CASES[case]
    hf = _hf_model(kind, fields, seed=11)
    hf.save_pretrained(tmp_path)
    ours = TargetModel.from_pretrained(tmp_path)
    n = len(LONG_PROMPT)
    hf_rows = hf(input_ids=torch.tensor([LONG_PROMPT])).logits[0]  # [n, vocab]
    hf_tokens = _hf_continuation(hf, LONG_PROMPT, 8)
    worst = 0.0
    for chunk in range(1, n + 1):
        caches = ours.new_caches(max_len=n + 8)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            got, _ = ours(torch.tensor([LONG_PROMPT[lo:hi]]), caches, "prefill", start=lo)
            diff = float((got[0] - hf_rows[lo:hi]).abs().max())
            worst = max(worst, diff)
            assert diff <= TOL, f"chunk {chunk}: rows {lo}..{hi - 1} differ by {diff}"
        tokens = [int(got[0, -1].argmax())]
        for _ in range(7):
            out, _ = ours(torch.tensor([[tokens[-1]]]), caches, "decode")
            tokens.append(int(out[0, -1].argmax()))
        assert tokens == hf_tokens, f"chunk {chunk}: greedy continuation differs"
    print(f"{case}: chunked prefills, max |Δlogits| {worst:.2e}")


@torch.inference_mode()
def _hf_continuation(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (full recomputation each step)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
