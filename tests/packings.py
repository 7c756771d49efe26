"""Packings used across tests: boundaries (padded, zigzag-divisible) for a given cp."""

from __future__ import annotations

import random


def packings(cp: int) -> dict[str, list[int]]:
    """Named packings whose sequence lengths are multiples of 2*cp."""
    u = 2 * cp

    def cu(lengths):
        out = [0]
        for n in lengths:
            out.append(out[-1] + n * u)
        return out

    return {
        "one_sequence": cu([12]),
        "uneven": cu([1, 7, 2, 5, 3]),
        "straddling": cu([3, 9, 1, 11]),  # long sequences cross contiguous rank boundaries
        "padding_slots": cu([2, 0, 5, 0, 0, 3]),  # duplicate boundaries = empty slots
        "tiny_pieces": cu([1, 1, 1, 1, 1, 1, 1, 1]),
        "trailing_empty": cu([4, 6, 0]),
    }


def random_packing(rng: random.Random, cp: int, max_seqs: int = 12, max_units: int = 6) -> list[int]:
    u = 2 * cp
    lengths = [rng.randint(0, max_units) * u for _ in range(rng.randint(1, max_seqs))]
    if sum(lengths) == 0:
        lengths[0] = u
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
