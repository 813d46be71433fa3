"""GPU: the Qwen3.5-9B-shaped target model with seeded weights, bf16 + Triton kernels.

Checks, on one CUDA device:

1. prefill + decode logits of the bf16 model (Triton kernels) agree with a float32
   reference on the same device (the same bf16-valued weights computed in float32 with
   the torch reference kernels; random weights over 32 layers give ~4-5 % relative RMS
   in bf16 — measured on a CPU model of the same depth — so the bound is 10 %);
2. the float32 model on the Triton kernels agrees with that reference tightly;
3. verify with capture over a chain of ``B`` tokens equals decoding them one at a time,
   bit for bit (M-invariant kernels): logits per slot and every captured F32 checkpoint
   vs the sequential live state;
4. both GPU models agree with the float32 model run on the CPU with the reference kernels.

The numbers are printed (run with ``-s``). Memory: ~36 GB (f32) + ~18 GB (bf16).
Run: ``python -m pytest tests/gpu/test_model.py -q -s``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

# the rest is imported after the CUDA skip
from torch import Tensor

from dflash.geometry import require_chain
from dflash.model import HybridConfig, RecurrentPool, ShardCaches, TargetModel

SEED = 1234
PROMPT_LEN = 32
DECODE_STEPS = 4
DRAFT = 8
BF16_REL_TOL = 1e-1  # relative RMS of logits, bf16 weights/activations vs f32 over 32 layers
# f32, Triton vs torch reference / batched vs sequential: only summation order differs
# (~1e-6 per layer on CPU); a wrong slot or a broken alias gives O(1) errors.
F32_REL_TOL = 1e-3
BF16_CAPTURE_TOL = 5e-2  # captured states, bf16 batched vs sequential (GEMM order differs)

def roll_back(pool: RecurrentPool, mode: str, commit_n: int) -> None:
    """A fast rollback as the engine runs it: the host checks, the device work on the
    count, the host mirrors once the count is known."""
    pool.mark_device_rollback(mode)
    pool.rollback_on_device(mode, torch.tensor([commit_n], device=pool.position.device))
    pool.finish_rollback(mode, commit_n)



def rel(a: Tensor, b: Tensor) -> float:
    """Relative RMS difference ``||a - b|| / ||b||`` in float64."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[TargetModel, TargetModel]]:
    """(float32, bf16) models with the same seeded weights on cuda:0.

    The float32 model holds the bf16 weights exactly (rounded, then widened), so the
    comparison measures the bf16 *computation* (activations, kernels), not weight rounding.
    """
    config = HybridConfig.nine_b_shape()
    f32 = TargetModel.seeded(config, seed=SEED, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        for p in f32.parameters():
            p.copy_(p.to(torch.bfloat16))
    bf16 = TargetModel.seeded(config, seed=SEED, dtype=torch.bfloat16, device="cuda")
    bf16.kernel_backend = "triton"
    yield f32, bf16
    del f32, bf16
    torch.cuda.empty_cache()


def _prompt(vocab: int) -> Tensor:
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    return torch.randint(0, vocab, (1, PROMPT_LEN), generator=gen).cuda()


@torch.inference_mode()
def _prefill_decode(model: TargetModel, prompt: Tensor, tokens: list[int]) -> list[Tensor]:
    caches = model.new_caches(max_len=PROMPT_LEN + len(tokens) + 1, max_draft=1)
    logits, _ = model(prompt, caches, "prefill")
    out = [logits[0, -1].float()]
    for tok in tokens:
        logits, _ = model(torch.tensor([[tok]], device="cuda"), caches, "decode")
        out.append(logits[0, -1].float())
    return out


@torch.inference_mode()
def test_prefill_decode_bf16_and_triton_agree_with_f32_reference(
    models: tuple[TargetModel, TargetModel],
) -> None:
    f32, bf16 = models
    prompt = _prompt(f32.config.vocab_size)
    f32.kernel_backend = "reference"
    ref_caches = f32.new_caches(max_len=PROMPT_LEN + DECODE_STEPS + 1, max_draft=1)
    logits, _ = f32(prompt, ref_caches, "prefill")
    ref, tokens = [logits[0, -1].float()], []
    for _ in range(DECODE_STEPS):
        tokens.append(int(ref[-1].argmax()))
        logits, _ = f32(torch.tensor([[tokens[-1]]], device="cuda"), ref_caches, "decode")
        ref.append(logits[0, -1].float())
    f32.kernel_backend = "triton"
    got_f32 = _prefill_decode(f32, prompt, tokens)
    got_bf16 = _prefill_decode(bf16, prompt, tokens)
    for step, (r, a, b) in enumerate(zip(ref, got_f32, got_bf16, strict=True)):
        what = "prefill" if step == 0 else f"decode {step}"
        print(
            f"{what:>9}: f32-triton rel {rel(a, r):.2e} max|Δ| {float((a - r).abs().max()):.2e}"
            f" | bf16-triton rel {rel(b, r):.2e} max|Δ| {float((b - r).abs().max()):.2e}"
            f" | |ref| rms {float(r.pow(2).mean().sqrt()):.2f}"
            f" | argmax ref {int(r.argmax())} bf16 {int(b.argmax())}"
        )
        assert rel(a, r) <= F32_REL_TOL, f"{what}: f32 Triton vs reference"
        assert rel(b, r) <= BF16_REL_TOL, f"{what}: bf16 vs f32 reference"


def _live_states(caches: ShardCaches) -> list[Tensor]:
    return [caches.pool.live_views(layer)[0].clone() for layer in caches.pool.layer_ids]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@torch.inference_mode()
def test_verify_capture_equals_sequential_decode(
    models: tuple[TargetModel, TargetModel], dtype_name: str
) -> None:
    f32, bf16 = models
    model = f32 if dtype_name == "float32" else bf16
    model.kernel_backend = "triton"
    prompt = _prompt(model.config.vocab_size)
    gen = torch.Generator(device="cpu").manual_seed(SEED + 1)
    draft = torch.randint(0, model.config.vocab_size, (1, DRAFT), generator=gen).cuda()

    seq = model.new_caches(max_len=PROMPT_LEN + DRAFT, max_draft=DRAFT)
    model(prompt, seq, "prefill")
    seq_logits, seq_states = [], []
    for i in range(DRAFT):
        logits, _ = model(draft[:, i : i + 1], seq, "decode")
        seq_logits.append(logits[0, -1].float())
        seq_states.append(_live_states(seq))

    ver = model.new_caches(max_len=PROMPT_LEN + DRAFT, max_draft=DRAFT)
    model(prompt, ver, "prefill")
    before = _live_states(ver)
    ver.pool.checkpoints.fill_(float("nan"))  # an unwritten slot cannot pass
    logits, _ = model(draft, ver, "verify", geometry=require_chain(list(range(-1, DRAFT - 1))))
    torch.cuda.synchronize()

    tol = F32_REL_TOL if dtype_name == "float32" else BF16_CAPTURE_TOL
    logit_errs = [rel(logits[0, i].float(), seq_logits[i]) for i in range(DRAFT)]
    state_errs = [
        max(rel(ver.pool.checkpoints[i, :, s], seq_states[s][i]) for i in range(len(before)))
        for s in range(DRAFT)
    ]
    print(
        f"{dtype_name}: verify vs sequential, per slot: logits rel max {max(logit_errs):.2e}, "
        f"captured state rel max over layers {[f'{e:.1e}' for e in state_errs]}"
    )
    for i, state in enumerate(_live_states(ver)):
        assert torch.equal(state, before[i]), f"verify changed the live state of pool layer {i}"
        assert torch.equal(ver.pool.snapshot[i], before[i]), f"snapshot of pool layer {i}"
    # M-invariant kernels: every verify row is bitwise the one-token decode of that token
    bad_logits = [i for i in range(DRAFT) if not torch.equal(logits[0, i].float(), seq_logits[i])]
    bad_states = [
        (s, i) for s in range(DRAFT) for i in range(len(before))
        if not torch.equal(ver.pool.checkpoints[i, :, s], seq_states[s][i])
    ]
    print(f"{dtype_name}: rows differing bitwise: logits {bad_logits}, states {bad_states[:8]}")
    assert not bad_logits and not bad_states
    assert max(state_errs) <= tol
    assert max(logit_errs) <= (tol if dtype_name == "float32" else BF16_REL_TOL)
    # fast rollback to slot 5 lands on the sequential state after 5 tokens
    roll_back(ver.pool, "checkpoint", 5)
    for i, state in enumerate(_live_states(ver)):
        assert torch.equal(state, ver.pool.checkpoints[i, :, 4])
        assert rel(state, seq_states[4][i]) <= tol


@torch.inference_mode()
def test_remap_then_verify_reads_the_remapped_slot(
    models: tuple[TargetModel, TargetModel],
) -> None:
    """Verify, remap to slot 2 (zero copy), verify again from that aliased slot, remap,
    decode: the same logits as decoding every committed token one at a time (float32)."""
    model = models[0]
    model.kernel_backend = "triton"
    prompt = _prompt(model.config.vocab_size)
    gen = torch.Generator(device="cpu").manual_seed(SEED + 2)
    draft, second = torch.randint(0, model.config.vocab_size, (2, DRAFT), generator=gen).cuda()
    chain = require_chain(list(range(-1, DRAFT - 1)))
    caches = model.new_caches(max_len=PROMPT_LEN + 3 * DRAFT, max_draft=DRAFT)
    model(prompt, caches, "prefill")
    model(draft[None], caches, "verify", geometry=chain)
    roll_back(caches.pool, "remap", 3)
    caches.kv.truncate(PROMPT_LEN + 3)
    logits2, _ = model(second[None], caches, "verify", geometry=chain)
    roll_back(caches.pool, "remap", DRAFT)
    caches.kv.truncate(PROMPT_LEN + 3 + DRAFT)
    final, _ = model(second[None, :1], caches, "decode")

    tokens = [*draft[:3].tolist(), *second.tolist(), int(second[0])]
    ref = _prefill_decode(model, prompt, tokens)  # ref[i]: logits after prompt + tokens[:i]
    errs = [rel(logits2[0, i].float(), ref[4 + i]) for i in range(DRAFT)]
    final_err = rel(final[0, -1].float(), ref[-1])
    print(f"remap + verify from the remapped slot: logits rel max {max(errs):.2e}, "
          f"after second remap {final_err:.2e}")
    assert max(errs) <= F32_REL_TOL and final_err <= F32_REL_TOL


@torch.inference_mode()
def test_gpu_paths_agree_with_the_cpu_reference(
    models: tuple[TargetModel, TargetModel],
) -> None:
    """Prefill + decode of the GPU models against the float32 CPU reference.

    The float32 model (bf16-valued weights) is moved to the CPU and run with the torch
    reference kernels; its greedy tokens drive the decode steps of both GPU models. Runs
    last in this module and moves the model back afterwards.
    """
    f32, bf16 = models
    prompt = _prompt(f32.config.vocab_size)
    cpu = f32.to("cpu")
    cpu.kernel_backend = "reference"
    caches = cpu.new_caches(max_len=PROMPT_LEN + DECODE_STEPS + 1, max_draft=1)
    logits, _ = cpu(prompt.cpu(), caches, "prefill")
    ref, tokens = [logits[0, -1].float()], []
    for _ in range(DECODE_STEPS):
        tokens.append(int(ref[-1].argmax()))
        logits, _ = cpu(torch.tensor([[tokens[-1]]]), caches, "decode")
        ref.append(logits[0, -1].float())
    del caches
    gpu_f32 = cpu.to("cuda")
    gpu_f32.kernel_backend = "triton"
    got_f32 = _prefill_decode(gpu_f32, prompt, tokens)
    got_bf16 = _prefill_decode(bf16, prompt, tokens)
    for step, (r, a, b) in enumerate(zip(ref, got_f32, got_bf16, strict=True)):
        what = "prefill" if step == 0 else f"decode {step}"
        a, b = a.cpu(), b.cpu()
        print(
            f"{what:>9} vs CPU f32 reference: f32-triton rel {rel(a, r):.2e}"
            f" | bf16-triton rel {rel(b, r):.2e} | argmax cpu {int(r.argmax())}"
            f" f32-gpu {int(a.argmax())} bf16-gpu {int(b.argmax())}"
        )
        assert rel(a, r) <= F32_REL_TOL, f"{what}: f32 Triton on GPU vs CPU reference"
        assert rel(b, r) <= BF16_REL_TOL, f"{what}: bf16 on GPU vs CPU reference"
