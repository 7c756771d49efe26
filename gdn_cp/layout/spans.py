"""Layouts as span lists, cut by arithmetic on the boundaries.

A *span* is a run of consecutive global packed rows ``[start, start + length)``. In both
layouts a rank's local rows are its spans in increasing global order, so local offsets are
the cumulative lengths.

- zigzag: sequence i of length L is cut into 2*cp *parts* of L/(2*cp) rows; rank r holds
  part r and part 2*cp-1-r of every sequence (Megatron's load-balanced layout).
- contiguous: rank r holds the *slice* ``[r*T/cp, (r+1)*T/cp)``, ignoring sequence boundaries.

Everything works on small int64 numpy arrays whose size is the number of sequences (times
cp at most), where numpy's per-call overhead is below torch's. Nothing is per token except
:func:`expand_spans`, which writes an index tensor once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..checks import as_int
from .boundaries import MAX_ROWS
from .device import is_tensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "ZIGZAG",
    "CONTIGUOUS",
    "LAYOUTS",
    "Spans",
    "zigzag_rank_spans",
    "zigzag_parts_in_range",
    "cut_at_slices",
    "expand_spans",
]

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)


@dataclass(frozen=True)
class Spans:
    """Spans of global rows: ``start``, ``length`` (and ``owner``, a rank) as int64 numpy [n]."""

    start: np.ndarray
    length: np.ndarray
    owner: np.ndarray

    def local_offsets(self) -> np.ndarray:
        """Local row of each span's first row, when the spans are one rank's rows in order."""
        return np.cumsum(self.length) - self.length

    def __len__(self) -> int:
        return len(self.start)


_NO_SPANS = Spans(*(np.zeros(0, np.int64) for _ in range(3)))


def _keep_nonempty(start, length, owner) -> Spans:
    keep = length > 0
    if keep.all():
        return Spans(start, length, owner)
    return Spans(start[keep], length[keep], owner[keep])


def zigzag_rank_spans(cu: np.ndarray, cp: int, rank: int) -> Spans:
    """Rank ``rank``'s zigzag spans in its local order (part r, part 2cp-1-r, next sequence...).

    ``cu``: int64 [n+1] global boundaries. ``owner`` is ``rank``.
    """
    chunk = (cu[1:] - cu[:-1]) // (2 * cp)
    start = np.empty((len(chunk), 2), np.int64)
    start[:, 0] = cu[:-1] + rank * chunk
    start[:, 1] = cu[:-1] + (2 * cp - 1 - rank) * chunk
    return _keep_nonempty(start.ravel(), np.repeat(chunk, 2), np.full(2 * len(chunk), rank, np.int64))


def zigzag_parts_in_range(cu: np.ndarray, cp: int, lo: int, hi: int) -> Spans:
    """The zigzag parts of the rows ``[lo, hi)``, clipped to it, in global order, with owners.

    Only sequences overlapping ``[lo, hi)`` are looked at; an empty range has no parts.
    """
    if hi <= lo:
        return _NO_SPANS
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


def cut_at_slices(spans: Spans, slice_rows: int) -> tuple[Spans, np.ndarray]:
    """Cut spans at multiples of ``slice_rows`` (the contiguous layout's slice edges).

    Returns the cut spans in the same order, ``owner`` = the slice (contiguous rank) each
    lies in, and for each cut span the index of the span it came from.
    """
    first = spans.start // slice_rows
    count = (spans.start + spans.length - 1) // slice_rows - first + 1
    n = len(spans)
    if n == 0 or (count == 1).all():
        return Spans(spans.start, spans.length, first), np.arange(n, dtype=np.int64)
    src = np.repeat(np.arange(n, dtype=np.int64), count)
    owner = first[src] + np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    start = np.maximum(spans.start[src], owner * slice_rows)
    end = np.minimum(spans.start[src] + spans.length[src], (owner + 1) * slice_rows)
    return Spans(start, end - start, owner), src


def _span_array(name: str, x) -> np.ndarray:
    """``x`` (a CPU integer tensor, an integer array, or a list / tuple of ints) as int64 [n]."""
    if is_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU (index math runs on the host), got a tensor on {x.device}")
        x = x.numpy()
    elif isinstance(x, (list, tuple)):
        if any(as_int(v) is None for v in x):
            raise TypeError(f"{name} must hold ints, got {x!r:.80}")
        if any(not 0 <= v <= MAX_ROWS for v in x):
            raise ValueError(f"{name} must hold rows in [0, 2**62], got {x!r:.80}")
        x = np.array(x, dtype=np.int64)
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be a 1-D integer tensor, array or list of ints, got {getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    if len(x) and (x.min() < 0 or x.max() > MAX_ROWS):
        raise ValueError(f"{name} must hold rows in [0, 2**62], got values from {x.min()} to {x.max()}")
    return x.astype(np.int64, copy=False)


def expand_spans(start, length) -> "torch.Tensor":
    """Concatenate ``arange(start[i], start[i] + length[i])`` for all i: an int64 index tensor.

    ``start``, ``length``: 1-D int tensors (CPU), arrays or lists of ints >= 0, of equal length;
    a zero length is an empty span. The result has ``sum(length)`` rows. One full-size buffer,
    cumsum in place: ones, with a jump written at each span start.
    """
    import torch

    start, length = _span_array("start", start), _span_array("length", length)
    if start.shape != length.shape:
        raise ValueError(f"start and length must have the same length, got {len(start)} and {len(length)}")
    # each value is <= 2**62, so start + length fits int64; the float sum cannot wrap around
    if len(length) and (length.sum(dtype=np.float64) > MAX_ROWS or (start + length).max() > MAX_ROWS):
        raise ValueError("start + length must stay within 2**62 rows")
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
