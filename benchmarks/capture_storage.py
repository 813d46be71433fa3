"""Capture storage per rollback mode: exact bytes, by buffer, for the model shapes.

A verify captures, per recurrent layer, what its rollback mode needs
(:class:`dflash.model.caches.RecurrentPool`): ``checkpoint`` / ``remap`` / ``replay`` the
F32 state after every draft token (``checkpoints``), ``recompute`` the recurrence's
per-token inputs (``inputs``: the conv outputs, ``g``, ``beta``); every mode keeps the
conv input rows (``captured``) and one F32 pre-verify state per layer (``snapshot``, the
fail-closed path's way back). The pools are built on the ``meta`` device, so the bytes are
the allocator's exact request and nothing is allocated: this runs anywhere in a second.

    python3 benchmarks/capture_storage.py [--block-size 16 64] [--json FILE]

Prints one table (bytes per mode, the recompute/checkpoint ratio with and without the
snapshot) and, with ``--json``, writes every number.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash.model.caches import RecurrentPool
from dflash.model.catalog import model_config

SHAPES = ("nine-b-shape", "twenty-seven-b-shape")


def storage(shape: str, block: int, capture: str) -> dict[str, int]:
    """Capture bytes by buffer for one shard holding every layer of ``shape`` (bf16)."""
    cfg = model_config(shape)
    pool = RecurrentPool(
        tuple(cfg.recurrent_layer_ids), block, batch=1,
        num_v_heads=cfg.linear_num_value_heads, key_dim=cfg.linear_key_head_dim,
        value_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel_dim,
        conv_dim=cfg.conv_dim, dtype=torch.bfloat16, device="meta",
        capture="inputs" if capture == "inputs" else "states",
    )
    return pool.capture_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        for block in args.block_size:
            states = storage(shape, block, "states")
            inputs = storage(shape, block, "inputs")
            total_s, total_i = sum(states.values()), sum(inputs.values())
            per_token_s = total_s - states["snapshot"]
            per_token_i = total_i - inputs["snapshot"]
            rows.append({
                "shape": shape, "block_size": block,
                "checkpoint": states, "recompute": inputs,
                "checkpoint_bytes": total_s, "recompute_bytes": total_i,
                "ratio": total_i / total_s,
                "ratio_without_snapshot": per_token_i / per_token_s,
            })
    print(f"{'shape':<22}{'block':>6}{'checkpoint MB':>15}{'recompute MB':>14}"
          f"{'snapshot MB':>13}{'ratio':>8}{'w/o snap':>10}")
    for r in rows:
        print(f"{r['shape']:<22}{r['block_size']:>6}{r['checkpoint_bytes'] / 1e6:>15.1f}"
              f"{r['recompute_bytes'] / 1e6:>14.1f}{r['recompute']['snapshot'] / 1e6:>13.1f}"
              f"{'1/' + format(1 / r['ratio'], '.1f'):>8}"
              f"{'1/' + format(1 / r['ratio_without_snapshot'], '.1f'):>10}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
