"""Layouts as segment lists, and interval intersection between them.

A *segment* is a run of global packed rows ``[start, start + length)``. A layout gives
every rank a list of segments; in both layouts used here a rank's local rows are its
segments in increasing global order, so a segment list sorted by ``start`` also gives
local offsets (the cumulative lengths).

- zigzag: sequence i of length L is cut into 2*cp parts of L/(2*cp) rows; rank r holds
  part r and part 2*cp-1-r of every sequence (Megatron's load-balanced layout).
- contiguous: rank r holds rows ``[r*T/cp, (r+1)*T/cp)``, ignoring sequence boundaries.

All work here is on small int64 CPU tensors, O(cp * number of sequences); nothing is
per token except :func:`expand_runs`, which writes an index tensor once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "ZIGZAG",
    "CONTIGUOUS",
    "LAYOUTS",
    "Segments",
    "partition",
    "rank_segments",
    "intersect",
    "expand_runs",
]

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)

_I64 = torch.int64


@dataclass(frozen=True)
class Segments:
    """Sorted, disjoint, non-empty runs of global rows, each with an owner rank.

    ``start``, ``length``, ``owner``: int64 CPU tensors of shape [n].
    """

    start: torch.Tensor
    length: torch.Tensor
    owner: torch.Tensor

    @property
    def end(self) -> torch.Tensor:
        return self.start + self.length

    def __len__(self) -> int:
        return int(self.start.numel())

    def local_offsets(self) -> torch.Tensor:
        """Local row of each segment's first row, when the segments are one rank's rows."""
        return torch.cumsum(self.length, 0) - self.length

    def as_tuples(self) -> list[tuple[int, int]]:
        return list(zip(self.start.tolist(), self.length.tolist()))


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def partition(layout: str, cu: Sequence[int], cp: int) -> Segments:
    """All ranks' segments of ``layout`` as one sorted partition of ``[0, T_global)``."""
    _check_layout(layout)
    t_global = cu[-1]
    if layout == CONTIGUOUS:
        t_local = t_global // cp
        ranks = torch.arange(cp, dtype=_I64)
        seg = Segments(ranks * t_local, torch.full((cp,), t_local, dtype=_I64), ranks)
        return _drop_empty(seg)
    cu_t = torch.tensor(cu, dtype=_I64)
    chunk = (cu_t[1:] - cu_t[:-1]) // (2 * cp)  # [n]
    part = torch.arange(2 * cp, dtype=_I64)  # [2cp]
    start = (cu_t[:-1, None] + part[None, :] * chunk[:, None]).reshape(-1)
    length = chunk[:, None].expand(-1, 2 * cp).reshape(-1)
    owner = torch.where(part < cp, part, 2 * cp - 1 - part)[None, :].expand(len(chunk), -1).reshape(-1)
    return _drop_empty(Segments(start, length.contiguous(), owner.contiguous()))


def rank_segments(layout: str, cu: Sequence[int], cp: int, rank: int) -> Segments:
    """The segments rank ``rank`` holds, in its local row order."""
    full = partition(layout, cu, cp)
    keep = full.owner == rank
    return Segments(full.start[keep], full.length[keep], full.owner[keep])


def _drop_empty(seg: Segments) -> Segments:
    keep = seg.length > 0
    if bool(keep.all()):
        return seg
    return Segments(seg.start[keep], seg.length[keep], seg.owner[keep])


def intersect(mine: Segments, part: Segments) -> tuple[Segments, torch.Tensor]:
    """Cut ``mine`` (sorted, disjoint) by a partition ``part`` of ``[0, T)``.

    Returns the pieces, in increasing global order, with ``owner`` taken from ``part``,
    and for each piece the index of the segment of ``mine`` it came from.
    O(len(mine) + len(pieces)) after a binary search per segment.
    """
    if len(mine) == 0:
        empty = torch.zeros(0, dtype=_I64)
        return Segments(empty, empty, empty), empty
    first = torch.searchsorted(part.start, mine.start, right=True) - 1
    last = torch.searchsorted(part.start, mine.end, right=False) - 1
    count = last - first + 1
    src = torch.repeat_interleave(torch.arange(len(mine), dtype=_I64), count)
    within = torch.arange(int(count.sum()), dtype=_I64) - torch.repeat_interleave(
        torch.cumsum(count, 0) - count, count
    )
    p = first[src] + within
    start = torch.maximum(mine.start[src], part.start[p])
    end = torch.minimum(mine.end[src], part.end[p])
    return Segments(start, end - start, part.owner[p]), src


def expand_runs(start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Concatenate ``arange(start[i], start[i] + length[i])`` for all i: an index tensor."""
    total = int(length.sum()) if length.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=_I64)
    shift = torch.repeat_interleave(start - (torch.cumsum(length, 0) - length), length)
    return torch.arange(total, dtype=_I64) + shift
