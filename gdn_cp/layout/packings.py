"""Boundaries made from sequence lengths, and the realistic packed micro-batch that ``gdn-cp run``, the
tests (``gdn_cp_testing``) and the benchmarks feed the modes.

A packing is a list of Python ints ``[0, c_1, ..., T_global]``; sequence i holds global rows
``[cu[i], cu[i+1])``; equal neighbours are empty padding slots.
"""

from __future__ import annotations

import random
from typing import Iterable

__all__ = ["cumsum0", "packed_boundaries"]


def cumsum0(lengths: Iterable[int]) -> list[int]:
    """``[0, l0, l0+l1, ...]``: boundaries from sequence lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def packed_boundaries(num_sequences: int, t_global: int, cp: int, seed: int) -> list[int]:
    """A realistic micro-batch: ``num_sequences`` mixed lengths (short and long), each a multiple
    of ``2*cp``, summing to ``t_global`` (a multiple of ``2*cp``), with two empty padding slots."""
    if num_sequences < 1:
        raise ValueError(f"num_sequences={num_sequences} must be >= 1")
    if t_global <= 0 or t_global % (2 * cp):
        raise ValueError(f"t_global={t_global} must be a positive multiple of 2*cp={2 * cp}")
    rng = random.Random(seed)
    unit = 2 * cp
    units = t_global // unit
    weights = [rng.choice([1, 1, 2, 3, 8, 20]) * rng.random() + 0.05 for _ in range(num_sequences)]
    lengths = [max(0, int(units * w / sum(weights))) for w in weights]
    for i in rng.sample(range(num_sequences), k=min(2, num_sequences)):
        lengths[i] = 0  # empty padding slots
    lengths[max(range(num_sequences), key=lambda i: lengths[i])] += units - sum(lengths)
    return cumsum0(n * unit for n in lengths)
