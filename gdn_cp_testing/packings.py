"""Packed micro-batches (global padded boundaries ``cu``) for tests and benchmarks (``gdn-cp run``'s
own is :func:`gdn_cp.layout.packings.packed_boundaries`).

A packing is a list of Python ints ``[0, c_1, ..., T_global]``; sequence i holds global rows
``[cu[i], cu[i+1])``; equal neighbours are empty padding slots. Megatron's per-document zigzag split
needs every length divisible by ``2*cp``, so those builders take ``cp`` and return such lengths; its
whole-row split (:func:`document_packings`) needs only the row divisible by ``2*cp``.

:func:`zigzag_rows` writes Megatron's load-balanced split out independently of ``gdn_cp.layout``
(per document, or the whole row with ``whole_row=True``), so tests can check the library against it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from gdn_cp.layout.packings import cumsum0

__all__ = ["document_packings", "named_packings", "thd_case", "zigzag_rows"]


def named_packings(cp: int) -> dict[str, list[int]]:
    """Packings with a name for what each exercises; lengths are multiples of ``2*cp``."""
    u = 2 * cp

    def cu(units):
        return cumsum0(n * u for n in units)

    return {
        "one_sequence": cu([12]),
        "uneven": cu([1, 7, 2, 5, 3]),
        "straddling": cu([3, 9, 1, 11]),  # long sequences cross contiguous rank boundaries
        "padding_slots": cu([2, 0, 5, 0, 0, 3]),  # duplicate boundaries = empty slots
        "tiny_pieces": cu([1, 1, 1, 1, 1, 1, 1, 1]),
        "trailing_empty": cu([4, 6, 0]),
    }


def document_packings(cp: int) -> dict[str, list[int]]:
    """Packings of a whole-row zigzag cut (Megatron's ``--dataloader-inter-document-masking``):
    document lengths of any size (odd, shorter than a part, longer than a rank's share), the row
    ``T_global`` a multiple of ``2*cp``."""
    u = 2 * cp
    return {
        "odd_documents": cumsum0([3, 7 * u - 4, 1, u + 2, 2 * u - 2]),  # 10*u rows
        "one_document": cumsum0([6 * u]),
        "document_per_part": cumsum0([u // 2] * 2 * u),  # a boundary inside every part
        "long_then_short": cumsum0([9 * u - 1, 0, 1, u]),  # an empty slot; a one-row document
    }


def thd_case(cp: int) -> tuple[list[int], list[int]]:
    """``(padded, actual)`` global boundaries of a Megatron THD micro-batch at CP=cp: sequences that
    straddle the contiguous rank boundaries, an empty padding slot, actual lengths shorter than
    padded (24 * 2*cp rows in all)."""
    u = 2 * cp
    padded = [5 * u, 0, 11 * u, 2 * u, 6 * u]
    actual = [5 * u - 3, 0, 11 * u, 2 * u - 1, 6 * u - 2]
    return cumsum0(padded), cumsum0(actual)


def zigzag_rows(cu: Sequence[int], cp: int, rank: int, device: Optional[torch.device | str] = None, *,
                whole_row: bool = False) -> torch.Tensor:
    """Global rows of ``rank`` under Megatron's zigzag split, ``[T_global / cp]`` int64: every
    sequence is cut in 2*cp parts, the rank holds parts ``rank`` and ``2*cp-1-rank``, sequence
    after sequence. ``whole_row=True``: the whole row ``[0, T_global)`` is cut as one sequence
    (the sequence boundaries do not matter to which rows a rank holds)."""
    if whole_row:
        cu = [0, cu[-1]]
    rows: list[int] = []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        part, rest = divmod(b - a, 2 * cp)
        if rest:
            raise ValueError(f"sequence {i} of cu has length {b - a}, not divisible by 2*cp={2 * cp}")
        for j in (rank, 2 * cp - 1 - rank):
            rows.extend(range(a + j * part, a + (j + 1) * part))
    return torch.tensor(rows, dtype=torch.long, device=device)
