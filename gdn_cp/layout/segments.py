"""Layouts as segment lists, cut by arithmetic on the boundaries.

A *segment* is a run of global packed rows ``[start, start + length)``. In both layouts a
rank's local rows are its segments in increasing global order, so local offsets are the
cumulative lengths.

- zigzag: sequence i of length L is cut into 2*cp parts of L/(2*cp) rows; rank r holds
  part r and part 2*cp-1-r of every sequence (Megatron's load-balanced layout).
- contiguous: rank r holds rows ``[r*T/cp, (r+1)*T/cp)``, ignoring sequence boundaries.

Everything works on small int64 CPU tensors whose size is the number of sequences (times
cp at most); nothing is per token except :func:`expand_runs`, which writes an index
tensor once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ZIGZAG",
    "CONTIGUOUS",
    "LAYOUTS",
    "Runs",
    "zigzag_rank_segments",
    "zigzag_parts_in_range",
    "cut_by_blocks",
    "expand_runs",
]

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)

_I64 = torch.int64


@dataclass(frozen=True)
class Runs:
    """Runs of global rows: ``start``, ``length`` (and ``owner``, a rank) as int64 [n]."""

    start: torch.Tensor
    length: torch.Tensor
    owner: torch.Tensor

    def local_offsets(self) -> torch.Tensor:
        """Local row of each run's first row, when the runs are one rank's rows in order."""
        return torch.cumsum(self.length, 0) - self.length

    def __len__(self) -> int:
        return int(self.start.numel())


def _keep_nonempty(start, length, owner) -> Runs:
    keep = length > 0
    return Runs(start[keep], length[keep], owner[keep])


def zigzag_rank_segments(cu: torch.Tensor, cp: int, rank: int) -> Runs:
    """Rank ``rank``'s zigzag segments in its local order (part r, part 2cp-1-r, next sequence...).

    ``cu``: int64 [n+1] global boundaries. ``owner`` is ``rank``.
    """
    chunk = (cu[1:] - cu[:-1]) // (2 * cp)
    first = cu[:-1] + rank * chunk
    second = cu[:-1] + (2 * cp - 1 - rank) * chunk
    start = torch.stack([first, second], 1).reshape(-1)
    length = chunk.repeat_interleave(2)
    return _keep_nonempty(start, length, torch.full_like(start, rank))


def zigzag_parts_in_range(cu: torch.Tensor, cp: int, lo: int, hi: int) -> Runs:
    """The zigzag parts of the rows ``[lo, hi)``, clipped to it, in global order, with owners.

    Only sequences overlapping ``[lo, hi)`` are looked at.
    """
    first = int(torch.searchsorted(cu[1:], torch.tensor(lo, dtype=_I64), right=True))
    last = int(torch.searchsorted(cu[:-1], torch.tensor(hi, dtype=_I64), right=False))  # exclusive
    sub = cu[first : last + 1]
    chunk = (sub[1:] - sub[:-1]) // (2 * cp)  # [m]
    part = torch.arange(2 * cp, dtype=_I64)
    start = (sub[:-1, None] + part[None, :] * chunk[:, None]).reshape(-1)
    end = start + chunk.repeat_interleave(2 * cp)
    owner = torch.where(part < cp, part, 2 * cp - 1 - part).repeat(len(chunk))
    start_c = start.clamp(lo, hi)
    return _keep_nonempty(start_c, end.clamp(lo, hi) - start_c, owner)


def cut_by_blocks(runs: Runs, block: int) -> tuple[Runs, torch.Tensor]:
    """Cut runs at multiples of ``block`` (the contiguous layout's rank edges).

    Returns the pieces in the same order, ``owner`` = the block (contiguous rank) each lies
    in, and for each piece the index of the run it came from.
    """
    first = runs.start // block
    last = (runs.start + runs.length - 1) // block
    count = last - first + 1
    n = len(runs)
    if n == 0 or bool((count == 1).all()):
        return Runs(runs.start, runs.length, first), torch.arange(n, dtype=_I64)
    src = torch.repeat_interleave(torch.arange(n, dtype=_I64), count)
    within = torch.arange(int(count.sum()), dtype=_I64) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    blk = first[src] + within
    start = torch.maximum(runs.start[src], blk * block)
    end = torch.minimum(runs.start[src] + runs.length[src], (blk + 1) * block)
    return Runs(start, end - start, blk), src


def expand_runs(start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Concatenate ``arange(start[i], start[i] + length[i])`` for all i: an index tensor.

    One full-size allocation plus a cumsum: ones, with a jump written at each run start.
    """
    keep = length > 0
    start, length = start[keep], length[keep]
    total = int(length.sum()) if length.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=_I64)
    steps = torch.ones(total, dtype=_I64)
    pos = torch.cumsum(length, 0) - length
    steps[pos[0]] = start[0]
    steps[pos[1:]] = start[1:] - (start[:-1] + length[:-1] - 1)
    return torch.cumsum(steps, 0)
