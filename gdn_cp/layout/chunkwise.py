"""Index math for the chunkwise mode on the contiguous layout.

Rank r holds global rows ``[r*T_local, (r+1)*T_local)``. Its rows are cut by sequence
boundaries into *pieces*. Only the first piece can continue a sequence from earlier
ranks (it then needs a conv halo and an initial state) and only the last piece can
continue onto later ranks (its state summary is then sent on).

- halo: the W-1 rows before the rank's first row, when in the same sequence. Every such
  row lies in the last W-1 rows (the *tail*) of some earlier rank, so an all-gather of
  all ranks' tails ``[cp, W-1, C]`` serves any halo, even when a rank holds fewer than
  W-1 rows of a sequence.
- state: the last piece's affine summary ``S_out = M S_in + S_ext`` (M = 0 when the
  piece starts on this rank). The first piece's initial state composes the summaries of
  the earlier ranks that hold its sequence, in rank order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

__all__ = ["ChunkwisePlan", "build_chunkwise_plan"]


@dataclass(frozen=True)
class ChunkwisePlan:
    cp_size: int
    cp_rank: int
    t_local: int
    conv_width: int
    local_cu: tuple[int, ...]  # piece boundaries in local rows, 0 .. t_local
    first_continues: bool  # first piece's sequence started on an earlier rank
    last_continues: bool  # last piece's sequence goes on to a later rank
    last_is_first: bool  # one piece spans the whole slice (needs M as well as S_ext)
    halo_index: tuple[int, ...]  # W-1 positions in the flat gathered tails; -1 = zero row
    compose_ranks: tuple[int, ...]  # earlier ranks whose summaries give the first piece's state
    any_straddle: bool  # some sequence crosses some rank boundary (same on every rank)

    @property
    def needs_halo(self) -> bool:
        return any(i >= 0 for i in self.halo_index)


def build_chunkwise_plan(cu: Sequence[int], cp_size: int, cp_rank: int, conv_width: int) -> ChunkwisePlan:
    """``cu``: validated global boundaries (Python ints). ``conv_width``: the conv kernel W."""
    if conv_width < 1:
        raise ValueError(f"conv_width must be >= 1, got {conv_width}")
    t_global = cu[-1]
    t_local = t_global // cp_size
    lo, hi = cp_rank * t_local, (cp_rank + 1) * t_local
    # Non-empty sequences overlapping [lo, hi).
    overlapping = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a and a < hi and b > lo]
    local_cu = [0]
    for a, b in overlapping:
        local_cu.append(min(b, hi) - lo)
    if t_local == 0:
        local_cu = [0]
    first_continues = bool(overlapping) and overlapping[0][0] < lo
    last_continues = bool(overlapping) and overlapping[-1][1] > hi
    last_is_first = len(overlapping) == 1 and first_continues

    boundaries = [r * t_local for r in range(1, cp_size)]
    # An edge straddles when the last boundary <= edge is < edge (then the next is > edge).
    any_straddle = any(cu[bisect.bisect_right(cu, edge) - 1] < edge for edge in boundaries)

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
    return ChunkwisePlan(
        cp_size=cp_size,
        cp_rank=cp_rank,
        t_local=t_local,
        conv_width=conv_width,
        local_cu=tuple(local_cu),
        first_continues=first_continues,
        last_continues=last_continues,
        last_is_first=last_is_first,
        halo_index=tuple(halo),
        compose_ranks=tuple(compose),
        any_straddle=any_straddle,
    )
