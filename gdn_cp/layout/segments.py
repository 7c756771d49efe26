"""Layouts as segment lists, cut by arithmetic on the boundaries.

A *segment* is a run of global packed rows ``[start, start + length)``. In both layouts a
rank's local rows are its segments in increasing global order, so local offsets are the
cumulative lengths.

- zigzag: sequence i of length L is cut into 2*cp parts of L/(2*cp) rows; rank r holds
  part r and part 2*cp-1-r of every sequence (Megatron's load-balanced layout).
- contiguous: rank r holds rows ``[r*T/cp, (r+1)*T/cp)``, ignoring sequence boundaries.

Everything works on small int64 numpy arrays whose size is the number of sequences (times
cp at most): numpy's per-call overhead on arrays this small is a fraction of torch's.
Nothing is per token except :func:`expand_runs`, which writes an index tensor once per
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


@dataclass(frozen=True)
class Runs:
    """Runs of global rows: ``start``, ``length`` (and ``owner``, a rank) as int64 numpy [n]."""

    start: np.ndarray
    length: np.ndarray
    owner: np.ndarray

    def local_offsets(self) -> np.ndarray:
        """Local row of each run's first row, when the runs are one rank's rows in order."""
        return np.cumsum(self.length) - self.length

    def __len__(self) -> int:
        return len(self.start)


def _keep_nonempty(start, length, owner) -> Runs:
    keep = length > 0
    if keep.all():
        return Runs(start, length, owner)
    return Runs(start[keep], length[keep], owner[keep])


def zigzag_rank_segments(cu: np.ndarray, cp: int, rank: int) -> Runs:
    """Rank ``rank``'s zigzag segments in its local order (part r, part 2cp-1-r, next sequence...).

    ``cu``: int64 [n+1] global boundaries. ``owner`` is ``rank``.
    """
    chunk = (cu[1:] - cu[:-1]) // (2 * cp)
    start = np.empty((len(chunk), 2), np.int64)
    start[:, 0] = cu[:-1] + rank * chunk
    start[:, 1] = cu[:-1] + (2 * cp - 1 - rank) * chunk
    return _keep_nonempty(start.ravel(), np.repeat(chunk, 2), np.full(2 * len(chunk), rank, np.int64))


def zigzag_parts_in_range(cu: np.ndarray, cp: int, lo: int, hi: int) -> Runs:
    """The zigzag parts of the rows ``[lo, hi)``, clipped to it, in global order, with owners.

    Only sequences overlapping ``[lo, hi)`` are looked at.
    """
    first = int(np.searchsorted(cu[1:], lo, side="right"))
    last = int(np.searchsorted(cu[:-1], hi, side="left"))  # exclusive
    sub = cu[first : last + 1]
    # One entry per (sequence, part), sequence-major; 1-D ops (numpy is slow on [m, 2cp]).
    chunk = np.repeat((sub[1:] - sub[:-1]) // (2 * cp), 2 * cp)
    part = np.tile(np.arange(2 * cp, dtype=np.int64), len(sub) - 1)
    start = np.repeat(sub[:-1], 2 * cp) + part * chunk
    start_c = np.maximum(start, lo)
    length = np.maximum(np.minimum(start + chunk, hi) - start_c, 0)
    return _keep_nonempty(start_c, length, np.minimum(part, 2 * cp - 1 - part))


def cut_by_blocks(runs: Runs, block: int) -> tuple[Runs, np.ndarray]:
    """Cut runs at multiples of ``block`` (the contiguous layout's rank edges).

    Returns the pieces in the same order, ``owner`` = the block (contiguous rank) each lies
    in, and for each piece the index of the run it came from.
    """
    first = runs.start // block
    count = (runs.start + runs.length - 1) // block - first + 1
    n = len(runs)
    if n == 0 or (count == 1).all():
        return Runs(runs.start, runs.length, first), np.arange(n, dtype=np.int64)
    src = np.repeat(np.arange(n, dtype=np.int64), count)
    blk = first[src] + np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    start = np.maximum(runs.start[src], blk * block)
    end = np.minimum(runs.start[src] + runs.length[src], (blk + 1) * block)
    return Runs(start, end - start, blk), src


def host_int64(x) -> np.ndarray:
    """A CPU tensor (zero copy when int64), array or ints as an int64 numpy array."""
    return np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x, dtype=np.int64)


def expand_runs(start, length) -> torch.Tensor:
    """Concatenate ``arange(start[i], start[i] + length[i])`` for all i: an int64 index tensor.

    ``start``, ``length``: int64 tensors or arrays. One full-size buffer, cumsum in place:
    ones, with a jump written at each run start.
    """
    start, length = host_int64(start), host_int64(length)
    keep = length > 0
    if not keep.all():
        start, length = start[keep], length[keep]
    ends = np.cumsum(length)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    steps = torch.ones(total, dtype=torch.int64)  # torch's fill is vectorized, numpy's is not
    jumps = steps.numpy()  # a view: the jumps are written with numpy's cheap small ops
    jumps[0] = start[0]
    jumps[ends[:-1]] = start[1:] - (start[:-1] + length[:-1] - 1)
    return steps.cumsum_(0)
