"""Write the DFlash2 reference fixture (``tests/fixtures/dflash2_reference/``).

A tiny random Hugging Face Qwen3.5 target (``target/``), a tiny random DFlash2 drafter
saved by z-lab's reference implementation's own ``save_pretrained`` (``drafter/``), and the
reference's greedy float32 speculative run on a fixed prompt, every step's drafted block
recorded (``reference_blocks.json``). ``tests/cpu/model/test_dflash2_reference.py`` replays
it against dflash.

The reference is not part of this repository: pass the path of z-lab's ``dflash/model.py``
(the DFlash2 revision) with ``--reference``; it is imported from there, unmodified::

    .venv/bin/python scripts/dflash2_reference_fixture.py \\
        --reference /tmp/zlab_ref/zlab_dflash_model.py

Needs ``transformers`` (Qwen3.5 and Qwen3 modules). Everything is seeded: running it again
writes the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "dflash2_reference"

PROMPT = [3, 77, 12, 101, 5, 64, 9, 33, 120, 2, 50, 200, 17, 143]
MAX_NEW_TOKENS = 40
SEED = 1234
FAVOURED, FAVOUR = 8, 2.5

VOCAB, HIDDEN = 256, 64
TARGET_FIELDS: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
}
DRAFTER_FIELDS: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    # a full bidirectional layer, then a bidirectional window shorter than the run
    "layer_types": ["full_attention", "sliding_attention"],
    "use_sliding_window": True,
    "max_window_layers": 1,
    "sliding_window": 12,
    "is_causal": False,
    "num_target_layers": 4,
    "architectures": ["DFlash2DraftModel"],
    "dflash_config": {
        "mask_token_id": 255,
        "target_layer_ids": [0, 1, 2],  # not the last layer: specs/dflash2.md §9
        "block_size": 6,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 6,
    },
}


def load_reference(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("zlab_dflash_reference", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import the reference from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def patch_past_recording(keep: int) -> None:
    """The reference calls ``DynamicCache.activate_past_recording()`` without arguments.
    In transformers 5.25 that leaves ``recurrent_states_to_keep`` None, which Qwen3.5's
    gated delta net cannot use (``min(None, seq_len)``), so no rollback of a linear-attention
    layer could work: default it to ``keep`` states (a block's), enough to crop a verify
    back to any accepted length. Only the default changes; an explicit value is passed on."""
    original = transformers.DynamicCache.activate_past_recording

    def activate_past_recording(self: Any, **kwargs: Any) -> None:
        kwargs.setdefault("recurrent_states_to_keep", keep)
        original(self, **kwargs)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated

    transformers.DynamicCache.activate_past_recording = activate_past_recording  # type: ignore[method-assign]  # the patch described above


def randomize_target(model: torch.nn.Module, seed: int) -> None:
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


def randomize_drafter(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn (the reference leaves ``base_kernel`` uninitialised): norms
    near 1, convolutions near the identity with strong dynamic parts, codebooks of unit
    scale so the selector's bilinear term moves the choice."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("base_kernel"):
                value = 0.4 * noise
                value[:, 0] += 1.0
                p.copy_(value)
            elif "codebook" in name:
                p.copy_(noise)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(noise * fan_in**-0.5)


@torch.inference_mode()
def plain_greedy(target: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True,
                        help="z-lab's dflash/model.py (DFlash2 revision)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    ref = load_reference(args.reference)
    patch_past_recording(int(DRAFTER_FIELDS["dflash_config"]["block_size"]))
    torch.manual_seed(SEED)
    torch.set_num_threads(1)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    # -- the target --------------------------------------------------------------------
    tconfig = transformers.Qwen3_5TextConfig(**TARGET_FIELDS)
    tconfig._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        target = transformers.Qwen3_5ForCausalLM(tconfig).eval()  # type: ignore[no-untyped-call]  # unannotated
    randomize_target(target, SEED)
    with torch.no_grad():  # a few favoured tokens, so some guesses are accepted
        target.lm_head.weight[:FAVOURED] *= FAVOUR
    target.save_pretrained(out / "target")

    # -- the drafter, written by the reference ----------------------------------------
    dconfig = transformers.Qwen3Config(**DRAFTER_FIELDS)
    with torch.random.fork_rng():
        torch.manual_seed(SEED + 1)
        drafter = ref.DFlash2DraftModel(dconfig).eval()
    randomize_drafter(drafter, SEED + 1)
    drafter.save_pretrained(out / "drafter")
    # and read back the way the reference reads a checkpoint: the run below uses that
    drafter = ref.DFlash2DraftModel.from_pretrained(out / "drafter",
                                                    dtype=torch.float32).eval()

    # -- the reference's run, every drafted block recorded ------------------------------
    steps: list[dict[str, Any]] = []
    original_propose = drafter.propose

    def recording_propose(hidden: torch.Tensor, anchor_ids: torch.Tensor, head: Any,
                          temperature: float) -> Any:
        tokens, indices, probs = original_propose(hidden, anchor_ids, head, temperature)
        steps.append({"anchor": int(anchor_ids[0]), "block_size": int(hidden.shape[1]) + 1,
                      "drafts": [int(t) for t in tokens[0]]})
        return tokens, indices, probs

    drafter.propose = recording_propose
    ids = ref.dflash_generate(drafter, target, torch.tensor([PROMPT]), MAX_NEW_TOKENS,
                              stop_token_ids=None, temperature=0.0)
    output = [int(t) for t in ids[0]]
    greedy = plain_greedy(target, PROMPT, MAX_NEW_TOKENS)
    # each step's acceptance from the output (its ``return_stats`` needs CUDA): the block's
    # first id is the committed token at ``start``; its guesses are accepted up to the
    # first that differs from the output, which there holds the target's correction
    max_length = len(PROMPT) + MAX_NEW_TOKENS
    start = len(PROMPT)
    for step in steps:
        if output[start] != step["anchor"]:
            raise SystemExit(f"step at {start}: anchor {step['anchor']} != {output[start]}")
        accepted = 0
        for guess, got in zip(step["drafts"], output[start + 1:], strict=False):
            if guess != got:
                break
            accepted += 1
        step["start"] = start
        step["accepted"] = accepted
        start += min(accepted + 1, max_length - start - 1)
    if start + 1 < max_length or len(output) != max_length:
        raise SystemExit(f"the recorded steps end at {start}, the output at {len(output)}")

    record = {
        "source": "z-lab/dflash dflash/model.py @ 10129599dffb338ff38cfd235a53ca6d3667b4dd",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "temperature": 0.0,
        "prompt": PROMPT,
        "max_new_tokens": MAX_NEW_TOKENS,
        "block_size": int(drafter.block_size),
        "steps": steps,
        "output_ids": output,
        "plain_greedy_ids": greedy,
        "reference_equals_plain_greedy": output == greedy,
    }
    (out / "reference_blocks.json").write_text(json.dumps(record, indent=1) + "\n",
                                               encoding="utf-8")
    total = 0
    for f in sorted(out.rglob("*")):
        if f.is_file():
            size = f.stat().st_size
            total += size
            digest = hashlib.sha256(f.read_bytes()).hexdigest()[:12]
            print(f"{f.relative_to(out)}: {size} bytes sha256 {digest}")
    print(f"total {total} bytes; {len(steps)} steps; accepted per step "
          f"{[s['accepted'] for s in steps]}; reference == plain greedy: {output == greedy}")



if __name__ == "__main__":
    main()
