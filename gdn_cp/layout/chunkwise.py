"""Index math for the chunkwise mode on the contiguous layout.

Rank r holds the slice ``[r*T_local, (r+1)*T_local)`` of the packed rows. Sequence
boundaries cut the slice into local sequences (``local_cu``). Only the first can continue a
sequence from earlier ranks (it then needs a conv halo and an initial state) and only the
last can continue onto later ranks (its state summary is then sent on).

- halo: the W-1 rows before the slice's first row, when in the same sequence. Every such
  row lies in the last W-1 rows (the *tail*) of some earlier rank's slice, so an all-gather
  of all ranks' tails ``[cp, W-1, C]`` serves any halo, even when a rank holds fewer than
  W-1 rows of a sequence.
- state: the last local sequence's affine summary ``S_out = M S_in + S_ext`` (M = 0 when it
  starts on this rank). The first local sequence's initial state composes the summaries of
  the earlier ranks that hold its sequence, in rank order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..checks import as_int
from .boundaries import PER_DOCUMENT, Boundaries, check_cp, validate_cu_seqlens

__all__ = ["ChunkwisePlan", "build_chunkwise_plan"]

MAX_CONV_WIDTH = 1 << 16
"""Largest conv kernel W planned for (GDN uses 4): the plan holds W-1 halo positions."""


@dataclass(frozen=True)
class ChunkwisePlan:
    cp_size: int
    cp_rank: int
    t_local: int
    conv_width: int
    local_cu: Boundaries  # the slice's sequences, local rows 0 .. t_local
    first_continues: bool  # the first local sequence started on an earlier rank
    last_continues: bool  # the last local sequence goes on to a later rank
    last_is_first: bool  # one sequence covers the whole slice (needs M as well as S_ext)
    halo_index: tuple[int, ...]  # W-1 positions in the flat gathered tails; -1 = zero row
    compose_ranks: tuple[int, ...]  # earlier ranks whose summaries give the first sequence's state
    any_straddle: bool  # some sequence crosses some slice edge (same on every rank)
    # The scan's two calls: rows [0, split) (the first sequence, when it continues, waiting for
    # its state) and rows [split, t_local) (the rest), each with its boundaries.
    split: int
    head_cu: Boundaries | None  # (0, split); None when split == 0
    rest_cu: Boundaries | None  # rows [split, t_local) from 0; None when there are none
    # The rest, cut once more so that the summary a later rank waits for comes first: rows
    # [tail_split, t_local) are the last sequence when it starts on this rank and continues onto
    # the next (its final state is the summary), rows [split, tail_split) the sequences between.
    # tail_split == t_local when there is no such tail.
    tail_split: int = 0
    mid_cu: Boundaries | None = None  # rows [split, tail_split) from 0; None when there are none
    tail_cu: Boundaries | None = None  # (0, t_local - tail_split); None when there is no tail

    @property
    def needs_halo(self) -> bool:
        return any(i >= 0 for i in self.halo_index)


def build_chunkwise_plan(
    cu_seqlens, cp_size: int, cp_rank: int, conv_width: int, *, split: str = PER_DOCUMENT
) -> ChunkwisePlan:
    """``cu_seqlens``: global boundaries (checked as by :func:`validate_cu_seqlens` for ``split``:
    the contiguous slices do not depend on how the zigzag rows were cut, but the boundaries must
    be those of a legal cut). ``conv_width``: the conv kernel W."""
    check_cp(cp_size, cp_rank)
    if as_int(conv_width) is None or not 1 <= conv_width <= MAX_CONV_WIDTH:
        raise ValueError(f"conv_width must be an int in [1, {MAX_CONV_WIDTH}] (the conv kernel W), got {conv_width!r}")
    cu = validate_cu_seqlens(cu_seqlens, cp_size, split=split)
    t_local = cu.total // cp_size
    lo, hi = cp_rank * t_local, (cp_rank + 1) * t_local
    # Non-empty sequences overlapping [lo, hi).
    overlapping = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a and a < hi and b > lo]
    # A slice without rows is one empty sequence (boundaries need two entries).
    local_cu = Boundaries([0] + [min(b, hi) - lo for _, b in overlapping] if overlapping else [0, 0])
    first_continues = bool(overlapping) and overlapping[0][0] < lo
    last_continues = bool(overlapping) and overlapping[-1][1] > hi
    last_is_first = len(overlapping) == 1 and first_continues

    edges = [r * t_local for r in range(1, cp_size)]
    # An edge straddles when the last boundary <= edge is < edge (then the next is > edge).
    any_straddle = any(cu[bisect.bisect_right(cu, edge) - 1] < edge for edge in edges)

    halo = [-1] * (conv_width - 1)
    compose: list[int] = []
    if first_continues:
        seq_start = overlapping[0][0]
        for i, g in enumerate(range(lo - (conv_width - 1), lo)):
            if g >= seq_start:
                q = g // t_local
                tail_start = (q + 1) * t_local - (conv_width - 1)
                halo[i] = q * (conv_width - 1) + (g - tail_start)
        compose = list(range(seq_start // t_local, cp_rank))
    split = local_cu[1] if first_continues else 0
    rest = local_cu[1:] if first_continues else local_cu
    tail_split = local_cu[-2] if last_continues and not last_is_first else t_local
    mid = [c - split for c in rest if c <= tail_split]
    return ChunkwisePlan(
        cp_size=cp_size,
        cp_rank=cp_rank,
        t_local=t_local,
        conv_width=conv_width,
        local_cu=local_cu,
        first_continues=first_continues,
        last_continues=last_continues,
        last_is_first=last_is_first,
        halo_index=tuple(halo),
        compose_ranks=tuple(compose),
        any_straddle=any_straddle,
        split=split,
        head_cu=Boundaries((0, split)) if split else None,
        rest_cu=Boundaries([c - split for c in rest]) if split < t_local else None,
        tail_split=tail_split,
        mid_cu=Boundaries(mid) if tail_split > split else None,
        tail_cu=Boundaries((0, t_local - tail_split)) if tail_split < t_local else None,
    )
