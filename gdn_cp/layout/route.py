"""All-to-all routes between layouts, built on the CPU by interval intersection.

A :class:`Route` moves one rank's rows ``[T_src_local, ...]`` in layout ``source`` to its
rows ``[T_dst_local, ...]`` in layout ``target`` with one ``all_to_all_single``:

1. ``send = x[send_index]``  rows grouped by destination peer (peer-major, global order inside);
2. exchange with ``send_splits`` / ``recv_splits``;
3. ``y = recv[recv_index]``  received rows put in target local order.

Step 1 or 3 is skipped when its index is the identity; a route whose layouts agree on
every rank (``is_identity``) moves nothing at all. Every rank builds its own route from
the same boundaries, so split sizes agree without any communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .boundaries import validate_cu_seqlens
from .device import host_to_device
from .segments import LAYOUTS, Segments, expand_runs, intersect, partition, rank_segments

__all__ = ["Route", "build_thd_route", "build_sbhd_route", "NaturalOrder", "build_natural_order"]

_I64 = torch.int64


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def _runs_are_arange(start: torch.Tensor, length: torch.Tensor) -> bool:
    """Whether concatenated runs ``[start_i, start_i + length_i)`` are ``0, 1, 2, ...``."""
    return bool(torch.equal(start, torch.cumsum(length, 0) - length))


@dataclass
class Route:
    """One rank's plan for a layout change. Index tensors are int64 on the CPU;
    :meth:`indices_on` returns (and caches) device copies."""

    source: str
    target: str
    cp_size: int
    cp_rank: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    # Runs (start, length) whose concatenation is the index; None = identity order.
    send_runs: tuple[torch.Tensor, torch.Tensor] | None  # local source rows, peer-major
    recv_runs: tuple[torch.Tensor, torch.Tensor] | None  # receive-buffer rows, target local order
    is_identity: bool
    send_pieces: list[tuple[int, int, int, int]]  # (peer, global_start, length, local_src_row)
    recv_pieces: list[tuple[int, int, int, int]]  # (peer, global_start, length, local_dst_row)
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def send_index(self) -> torch.Tensor | None:
        """``[sum(send_splits)]`` local source rows in send order (None: identity)."""
        return self._index("send", self.send_runs)

    @property
    def recv_index(self) -> torch.Tensor | None:
        """``[T_dst_local]`` receive-buffer row of each target row (None: identity)."""
        return self._index("recv", self.recv_runs)

    def _index(self, name, runs):
        if runs is None:
            return None
        if name not in self._device_cache:  # written once per micro-batch, on first use
            self._device_cache[name] = expand_runs(*runs)
        return self._device_cache[name]

    @property
    def rows_in(self) -> int:
        return sum(self.send_splits)

    @property
    def rows_out(self) -> int:
        return sum(self.recv_splits)

    def indices_on(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(send_index, recv_index) on ``device``; copied host->device once, never read back."""
        device = torch.device(device)
        key = str(device)
        if key not in self._device_cache:
            if device.type == "cpu":
                self._device_cache[key] = (self.send_index, self.recv_index)
            else:
                self._device_cache[key] = tuple(
                    None if t is None else host_to_device(t, device) for t in (self.send_index, self.recv_index)
                )
        return self._device_cache[key]

    def summary(self) -> str:
        lines = [
            f"route {self.source} -> {self.target}  cp={self.cp_size} rank={self.cp_rank}"
            + ("  (identity: nothing moves)" if self.is_identity else ""),
            f"  rows in {self.rows_in}, rows out {self.rows_out}",
            f"  send splits {list(self.send_splits)}",
            f"  recv splits {list(self.recv_splits)}",
        ]
        for peer, g, n, loc in self.send_pieces:
            lines.append(f"  send -> rank {peer}: global rows [{g}, {g + n}) from local row {loc}")
        for peer, g, n, loc in self.recv_pieces:
            lines.append(f"  recv <- rank {peer}: global rows [{g}, {g + n}) to local row {loc}")
        return "\n".join(lines)


def _build_route(cu: Sequence[int], cp_size: int, cp_rank: int, source: str, target: str) -> Route:
    for name, value in (("source", source), ("target", target)):
        if value not in LAYOUTS:
            raise ValueError(f"{name} layout must be one of {LAYOUTS}, got {value!r}")
    _check_rank(cp_size, cp_rank)
    src_part = partition(source, cu, cp_size)
    dst_part = partition(target, cu, cp_size)
    is_identity = source == target or _same_partition(src_part, dst_part)

    # Send side: my source rows cut by the target partition -> (peer, global order).
    mine_src = rank_segments(source, cu, cp_size, cp_rank)
    pieces, from_seg = intersect(mine_src, dst_part)
    local_src = mine_src.local_offsets()[from_seg] + (pieces.start - mine_src.start[from_seg])
    order = torch.sort(pieces.owner, stable=True).indices
    send_splits = torch.bincount(pieces.owner, weights=pieces.length.double(), minlength=cp_size).long()
    send_runs = (local_src[order], pieces.length[order])

    # Receive side: my target rows cut by the source partition. The buffer holds, per
    # source peer in rank order, that peer's pieces in global order.
    mine_dst = rank_segments(target, cu, cp_size, cp_rank)
    rpieces, rfrom = intersect(mine_dst, src_part)
    local_dst = mine_dst.local_offsets()[rfrom] + (rpieces.start - mine_dst.start[rfrom])
    rorder = torch.sort(rpieces.owner, stable=True).indices
    buf_start = torch.empty_like(rpieces.start)
    ordered_len = rpieces.length[rorder]
    buf_start[rorder] = torch.cumsum(ordered_len, 0) - ordered_len
    recv_splits = torch.bincount(rpieces.owner, weights=rpieces.length.double(), minlength=cp_size).long()
    # Pieces are in global order == target local order, so these runs are the gather for y.
    recv_runs = (buf_start, rpieces.length)

    return Route(
        source=source,
        target=target,
        cp_size=cp_size,
        cp_rank=cp_rank,
        send_splits=tuple(send_splits.tolist()),
        recv_splits=tuple(recv_splits.tolist()),
        send_runs=None if _runs_are_arange(*send_runs) else send_runs,
        recv_runs=None if _runs_are_arange(*recv_runs) else recv_runs,
        is_identity=is_identity,
        send_pieces=list(
            zip(
                pieces.owner[order].tolist(),
                pieces.start[order].tolist(),
                pieces.length[order].tolist(),
                local_src[order].tolist(),
            )
        ),
        recv_pieces=list(
            zip(
                rpieces.owner[rorder].tolist(),
                rpieces.start[rorder].tolist(),
                rpieces.length[rorder].tolist(),
                local_dst[rorder].tolist(),
            )
        ),
    )


def _same_partition(a: Segments, b: Segments) -> bool:
    """Whether two partitions give every rank the same rows (after merging adjacent runs)."""

    def merged(s: Segments) -> tuple[list[int], list[int]]:
        if len(s) == 0:
            return [], []
        boundary = torch.ones(len(s), dtype=torch.bool)
        boundary[1:] = (s.owner[1:] != s.owner[:-1]) | (s.start[1:] != s.end[:-1])
        return s.start[boundary].tolist(), s.owner[boundary].tolist()

    return merged(a) == merged(b)


def build_thd_route(cu_seqlens, cp_size: int, cp_rank: int, source: str, target: str) -> Route:
    """Route for packed (THD) rows from ``source`` to ``target`` layout on ``cp_rank``.

    ``cu_seqlens``: the global padded boundaries (1-D int tensor or list), read to the
    host once. Raises ValueError for any boundary that a zigzag split cannot take.
    """
    cu = validate_cu_seqlens(cu_seqlens, cp_size)
    return _build_route(cu, cp_size, cp_rank, source, target)


def build_sbhd_route(seq_len: int, batch: int, cp_size: int, cp_rank: int, source: str, target: str) -> Route:
    """Route for SBHD rows after ``[S_local, B, ...] -> [B*S_local, ...]`` (b-major):
    each batch element is one packed sequence of length ``seq_len``."""
    from .boundaries import sbhd_cu_seqlens

    cu = validate_cu_seqlens(list(sbhd_cu_seqlens(seq_len, batch)), cp_size, name="sbhd boundaries")
    return _build_route(cu, cp_size, cp_rank, source, target)


@dataclass
class NaturalOrder:
    """Index maps between the rank-major buffer and natural (global) row order.

    After an all-gather or a seq->head all-to-all a rank holds every rank's zigzag rows,
    rank 0's first: the *rank-major buffer* ``[T_global, ...]``.

    - ``to_natural[g]``: buffer row of global row g (``natural = buffer[to_natural]``);
    - ``to_buffer[i]``: global row at buffer row i (``buffer = natural[to_buffer]``);
    - ``own_rows``: this rank's zigzag rows, as global rows, in local order.
    """

    to_natural: torch.Tensor
    to_buffer: torch.Tensor
    own_rows: torch.Tensor
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = str(torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = tuple(
                host_to_device(t, torch.device(device)) for t in (self.to_natural, self.to_buffer, self.own_rows)
            )
        return self._device_cache[key]


def build_natural_order(cu: Sequence[int], cp_size: int, cp_rank: int) -> NaturalOrder:
    _check_rank(cp_size, cp_rank)
    part = partition("zigzag", cu, cp_size)
    t_local = cu[-1] // cp_size
    # Local offset of each piece inside its owner's rows: cumulative per owner.
    order = torch.sort(part.owner, stable=True).indices
    local = torch.empty_like(part.start)
    ordered_owner = part.owner[order]
    ordered_len = part.length[order]
    csum = torch.cumsum(ordered_len, 0) - ordered_len
    owner_first = torch.searchsorted(ordered_owner, ordered_owner, right=False)
    local[order] = csum - csum[owner_first]
    buf_pos = part.owner * t_local + local
    to_natural = expand_runs(buf_pos, part.length)
    to_buffer = expand_runs(part.start[order], ordered_len)
    keep = part.owner == cp_rank
    own_rows = expand_runs(part.start[keep], part.length[keep])
    return NaturalOrder(to_natural=to_natural, to_buffer=to_buffer, own_rows=own_rows)
