"""Recurrent-state kernels for speculative verification, each beside its torch reference.

- :func:`gdn_verify`: the gated delta rule over ``T`` draft tokens, writing the F32 state
  after every token into checkpoint slots (chain or validated tree geometry).
- :func:`gdn_chunk_prefill`: the gated delta rule over a prompt in chunk-parallel (WY)
  form, updating the state in place (a prefill; not M-invariant).
- :func:`gdn_recompute`: the ``recompute`` rollback: re-run the accepted tokens of a verify
  from the pre-verify state (all layers of a shard, one launch), bit-identical to the
  verify's checkpoint slot.
- :func:`causal_conv1d_capture`: depthwise causal conv1d + SiLU that captures its inputs
  (a chain, or a draft tree's nodes through a :func:`tree_paths` table).
- :func:`tree_paths` / :func:`tree_paths_into`: the root-to-node path table of a validated
  geometry, for tree-aware kernels (``_into``: a static buffer for CUDA graphs);
  :func:`tree_parents_into`: a tree's parents and reloaded nodes, the recurrence's table.
- :func:`rollback_restore`: live state and conv window <- slot ``commit_n - 1`` for all
  recurrent layers of a shard in one launch (``rows_only``: the conv rows alone, for a
  remap whose state stays in its slot).
- :func:`gdn_gates`: Gated DeltaNet's ``beta`` and ``g`` gates in one launch.
- :func:`rms_norm`: zero-centred or gated RMSNorm in one launch (batch-invariant rows);
  :func:`add_rms_norm`: fed by the residual stream's add; :func:`rms_norm_rotary`: a
  head's norm followed by the rotary embedding.
- :func:`act_mul`: ``silu(gate) · up`` or ``x · sigmoid(gate)`` in one launch.
- :func:`linear`: ``x @ weight.T + bias`` whose rows do not depend on the row count M.
- :func:`fp8_linear`: the same with an FP8 (e4m3) weight scaled per 128 × 128 block inside
  the kernel (weight-only: activations stay in their dtype), M-invariant too;
  :func:`quantize_fp8` / :func:`dequantize_fp8`: the per-block format.
- :func:`decode_attention`: causal decode/verify attention against a static KV cache,
  rows independent of the number of query rows, ``start`` read on the device.
- :func:`prefill_attention`: a prefill chunk's causal attention over the cache so far and
  itself (flash-style tiles: never a ``T × T`` or ``T × S`` tensor).
- :func:`gumbel_argmax`: the sampling rule's seeded Gumbel-max draw, one token per row
  (Philox noise keyed by seed, position and token; an optional per-row floor);
  :func:`filter_floors`: the top-k, top-p and min-p filters as that floor (a histogram of
  the 16-bit logits, no sort).

Entry points validate every argument first (a bad value raises
:class:`~dflash.errors.KernelBoundsError`, a ``ValueError``; a non-tensor ``TypeError``),
take an optional ``out=`` for the output they return, then run Triton on CUDA tensors (and on CPU
tensors under ``TRITON_INTERPRET=1``) and the ``*_reference`` twin otherwise; pass
``backend="triton"`` or ``"reference"`` to choose explicitly.
"""

from dflash.kernels.attention import decode_attention
from dflash.kernels.attention_reference import decode_attention_reference
from dflash.kernels.conv import causal_conv1d_capture
from dflash.kernels.conv_reference import causal_conv1d_capture_reference
from dflash.kernels.filter import filter_floors
from dflash.kernels.filter_reference import filter_floors_reference
from dflash.kernels.fp8_linear import dequantize_fp8, fp8_linear, quantize_fp8
from dflash.kernels.fp8_linear_reference import fp8_linear_reference
from dflash.kernels.gates import gdn_gates
from dflash.kernels.gates_reference import gdn_gates_reference
from dflash.kernels.gdn import gdn_recompute, gdn_verify
from dflash.kernels.gdn_chunk import gdn_chunk_prefill
from dflash.kernels.gdn_chunk_reference import gdn_chunk_prefill_reference
from dflash.kernels.gdn_reference import gdn_recompute_reference, gdn_verify_reference
from dflash.kernels.linear import linear
from dflash.kernels.linear_reference import linear_reference
from dflash.kernels.pointwise import act_mul
from dflash.kernels.pointwise_reference import act_mul_reference
from dflash.kernels.prefill_attention import prefill_attention
from dflash.kernels.prefill_attention_reference import prefill_attention_reference
from dflash.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_rotary
from dflash.kernels.rmsnorm_reference import (
    add_rms_norm_reference,
    rms_norm_reference,
    rms_norm_rotary_reference,
    rotary_reference,
)
from dflash.kernels.rollback import RollbackBoundsError, rollback_restore
from dflash.kernels.rollback_reference import rollback_restore_reference
from dflash.kernels.sample import gumbel_argmax
from dflash.kernels.sample_reference import gumbel_argmax_reference
from dflash.kernels.tree_paths import tree_parents_into, tree_paths, tree_paths_into

__all__ = [
    "RollbackBoundsError",
    "act_mul",
    "act_mul_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "causal_conv1d_capture",
    "causal_conv1d_capture_reference",
    "decode_attention",
    "decode_attention_reference",
    "dequantize_fp8",
    "filter_floors",
    "filter_floors_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "gdn_chunk_prefill",
    "gdn_chunk_prefill_reference",
    "gdn_gates",
    "gdn_gates_reference",
    "gdn_recompute",
    "gdn_recompute_reference",
    "gdn_verify",
    "gdn_verify_reference",
    "gumbel_argmax",
    "gumbel_argmax_reference",
    "linear",
    "linear_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "quantize_fp8",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_rotary",
    "rms_norm_rotary_reference",
    "rollback_restore",
    "rollback_restore_reference",
    "rotary_reference",
    "tree_parents_into",
    "tree_paths",
    "tree_paths_into",
]
