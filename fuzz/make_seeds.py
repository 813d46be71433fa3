"""Writes the committed seed corpus ``fuzz/seeds/`` (``python -m fuzz.make_seeds``).

One seed per reference case of the design plus inputs that reach every reject reason
under each container kind; names say what each seed is.
"""

from __future__ import annotations

import struct
from pathlib import Path

from fuzz.oracle import CONTAINERS

SEEDS_DIR = Path(__file__).resolve().parent / "seeds"

# name -> (parents, n_actual byte: 0xFF None, 0xFE / 0xFC too large (0xFC pads the entries
# to that length), 0xFD negative)
CASES: dict[str, tuple[list[int], int]] = {
    "single_root": ([-1], 1),
    "pure_chain": ([-1, 0, 1, 2, 3, 4], 6),
    "malformed_root": ([0, 0, 1], 3),
    "skipped_parent": ([-1, 0, 0], 3),
    "sibling": ([-1, 0, 0, 2], 4),
    "cycle_or_forward_parent": ([-1, 2, 1], 3),
    "out_of_range": ([-1, 0, 7], 3),
    "truncated": ([-1, 0], 3),
    "null_n0": ([-1, 0], 0),
    "null_negative": ([-1, 0], 0xFD),
    "too_large": ([-1, 0], 0xFC),
    "too_large_short": ([-1, 0], 0xFE),  # TRUNCATED comes first
    "tree": ([-1, 0, 0, 1, 1, 2, 5], 0xFF),
    "second_root": ([-1, 0, -1], 0xFF),
    "ignored_tail": ([-1, 0, 1, 99, -7], 3),
    "not_integer": ([-1, 0, 2**31 - 2], 0xFF),  # "tagged" container: 1.0 at slot 2
}


def encode(parents: list[int], nbyte: int, container: int) -> bytes:
    return bytes([container, nbyte]) + struct.pack(f"<{len(parents)}i", *parents)


def main() -> None:
    SEEDS_DIR.mkdir(exist_ok=True)
    for name, (parents, nbyte) in CASES.items():
        for index, container in enumerate(CONTAINERS):
            (SEEDS_DIR / f"{name}-{container}.bin").write_bytes(encode(parents, nbyte, index))
    print(f"wrote {len(CASES) * len(CONTAINERS)} seeds to {SEEDS_DIR}")


if __name__ == "__main__":
    main()
