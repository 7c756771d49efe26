"""All-to-all routes between the zigzag and contiguous layouts, built on the CPU.

A :class:`Route` moves one rank's rows ``[T_src_local, ...]`` in layout ``source`` to its
rows ``[T_dst_local, ...]`` in layout ``target`` with one ``all_to_all_single``:

1. ``send = x[send_index]``  rows grouped by destination peer (peer-major, global order inside);
2. exchange with ``send_splits`` / ``recv_splits``;
3. ``y = recv[recv_index]``  received rows put in target local order.

Both layouts order a rank's rows by global position and the contiguous layout's slices
are in global order, so in each direction one of the two indices is the identity:
zigzag -> contiguous needs only the receive gather, contiguous -> zigzag only the send
gather. A route whose layouts agree (cp == 1, or no rows) moves nothing (``is_identity``).

Building a route is interval arithmetic on the boundaries: this rank's zigzag spans
counted per contiguous slice, and the zigzag parts of the sequences that overlap this
rank's slice: O(cp * sequences) at worst, never O(tokens), in numpy on small arrays.
Index tensors are expanded from their spans on first use, the transfers printed by
:meth:`Route.summary` only when asked for. Every rank builds its own route from the same
boundaries, so split sizes agree without any communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np

from .boundaries import check_cp, validate_cu_seqlens, validate_sbhd
from .device import host_to_device
from .spans import (
    LAYOUTS,
    ZIGZAG,
    Spans,
    cut_at_slices,
    expand_spans,
    zigzag_parts_in_range,
    zigzag_rank_spans,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Route", "build_thd_route", "build_sbhd_route", "NaturalOrder", "build_natural_order"]


def _by_owner(owner: np.ndarray, cp: int) -> np.ndarray:
    """Stable argsort of ranks in ``[0, cp)``; as int16 numpy radix-sorts them, O(n)."""
    return np.argsort(owner.astype(np.int16) if cp <= 1 << 15 else owner, kind="stable")


def _spans_or_none(start: np.ndarray, length: np.ndarray):
    """``(start, length)`` (int64 arrays), or None when the spans concatenate to ``0, 1, 2, ...``."""
    if np.array_equal(start, np.cumsum(length) - length):
        return None
    return start, length


def _splits(owner: np.ndarray, length: np.ndarray, cp: int) -> tuple[int, ...]:
    out = np.zeros(cp, np.int64)
    np.add.at(out, owner, length)
    return tuple(out.tolist())


def _rows_per_slice(spans: Spans, slice_rows: int, cp: int) -> tuple[int, ...]:
    """Rows of sorted, disjoint ``spans`` in each slice ``[p*slice_rows, (p+1)*slice_rows)``,
    without cutting them: the rows below edge x are those of the spans starting below x, less
    the part of the last such span that reaches past x."""
    edges = np.arange(0, (cp + 1) * slice_rows, slice_rows, dtype=np.int64)
    k = np.searchsorted(spans.start, edges)  # spans starting below each edge
    cum = np.zeros(len(spans) + 1, np.int64)
    np.cumsum(spans.length, out=cum[1:])
    end = np.zeros(len(spans) + 1, np.int64)
    end[1:] = spans.start + spans.length
    return tuple(np.diff(cum[k] - np.maximum(end[k] - edges, 0)).tolist())


@dataclass
class _Transfers:
    """What one side of a route moves, for printing: spans of global rows with the peer and
    the local row of each (int64 numpy arrays)."""

    peer: np.ndarray
    start: np.ndarray
    length: np.ndarray
    local: np.ndarray

    def as_list(self) -> list[tuple[int, int, int, int]]:
        return list(zip(self.peer.tolist(), self.start.tolist(), self.length.tolist(), self.local.tolist()))


@dataclass
class Route:
    """One rank's plan for a layout change. Index tensors are int64, expanded on first use;
    :meth:`indices_on` returns (and caches) device copies."""

    source: str
    target: str
    cp_size: int
    cp_rank: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    # Spans (start, length), int64 arrays, whose concatenation is the index; None = identity order.
    send_spans: tuple[np.ndarray, np.ndarray] | None  # local source rows, peer-major
    recv_spans: tuple[np.ndarray, np.ndarray] | None  # receive-buffer rows, target local order
    is_identity: bool
    # What each side moves, for printing; a callable is called (and replaced) on first use.
    _send: _Transfers | Callable[[], _Transfers] | None = field(default=None, repr=False)
    _recv: _Transfers | Callable[[], _Transfers] | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def send_index(self) -> torch.Tensor | None:
        """``[sum(send_splits)]`` local source rows in send order (None: identity)."""
        return self._index("send", self.send_spans)

    @property
    def recv_index(self) -> torch.Tensor | None:
        """``[T_dst_local]`` receive-buffer row of each target row (None: identity)."""
        return self._index("recv", self.recv_spans)

    def _index(self, name, spans):
        if spans is None:
            return None
        if name not in self._cache:  # written once per micro-batch, on first use
            self._cache[name] = expand_spans(*spans)
        return self._cache[name]

    @property
    def send_transfers(self) -> list[tuple[int, int, int, int]]:
        """(peer, global_start, length, local source row) in send order."""
        return self._transfers("_send")

    @property
    def recv_transfers(self) -> list[tuple[int, int, int, int]]:
        """(peer, global_start, length, local target row) in receive-buffer order."""
        return self._transfers("_recv")

    def _transfers(self, side: str) -> list[tuple[int, int, int, int]]:
        transfers = getattr(self, side)
        if callable(transfers):
            transfers = transfers()
            setattr(self, side, transfers)
        return [] if transfers is None else transfers.as_list()

    @property
    def rows_in(self) -> int:
        return sum(self.send_splits)

    @property
    def rows_out(self) -> int:
        return sum(self.recv_splits)

    def indices_on(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(send_index, recv_index) on ``device``; copied host->device once, never read back."""
        import torch

        device = torch.device(device)
        key = str(device)
        if key not in self._cache:
            host = (self.send_index, self.recv_index)
            self._cache[key] = host if device.type == "cpu" else tuple(
                None if t is None else host_to_device(t, device) for t in host
            )
        return self._cache[key]

    def send_positions_on(self, device: torch.device) -> torch.Tensor | None:
        """``[rows_in]``: the send-buffer row of each local source row (the inverse of
        ``send_index``; None when that is the identity), on ``device``, cached. For writing rows
        straight into their send-buffer place (``index_copy_``) instead of gathering them."""
        if self.send_spans is None:
            return None
        import torch

        device = torch.device(device)
        key = ("send_positions", str(device))
        if key not in self._cache:
            index = self.send_index
            positions = torch.empty_like(index)
            positions[index] = torch.arange(index.numel(), dtype=index.dtype)
            self._cache[key] = positions if device.type == "cpu" else host_to_device(positions, device)
        return self._cache[key]

    def summary(self) -> str:
        lines = [
            f"route {self.source} -> {self.target}  cp={self.cp_size} rank={self.cp_rank}"
            + ("  (identity: nothing moves)" if self.is_identity else ""),
            f"  rows in {self.rows_in}, rows out {self.rows_out}",
            f"  send splits {list(self.send_splits)}",
            f"  recv splits {list(self.recv_splits)}",
        ]
        for peer, g, n, loc in self.send_transfers:
            lines.append(f"  send -> rank {peer}: global rows [{g}, {g + n}) from local row {loc}")
        for peer, g, n, loc in self.recv_transfers:
            lines.append(f"  recv <- rank {peer}: global rows [{g}, {g + n}) to local row {loc}")
        return "\n".join(lines)


def _own_spans_by_slice(mine: Spans, slice_rows: int) -> _Transfers:
    """This rank's zigzag spans ``mine`` cut at slice edges, in local (= peer) order."""
    cut, src = cut_at_slices(mine, slice_rows)
    local = mine.local_offsets()[src] + (cut.start - mine.start[src])
    return _Transfers(cut.owner, cut.start, cut.length, local)


def _slice_by_part_owner(cu: np.ndarray, cp: int, rank: int, slice_rows: int) -> tuple[_Transfers, np.ndarray, Spans]:
    """This rank's contiguous slice cut into zigzag parts, in owner-major order; for each
    part (in global order) its position in that owner-major order's concatenation; the parts."""
    lo = rank * slice_rows
    parts = zigzag_parts_in_range(cu, cp, lo, lo + slice_rows)
    order = _by_owner(parts.owner, cp)
    ordered_start, ordered_len = parts.start[order], parts.length[order]
    pos = np.empty_like(parts.start)
    pos[order] = np.cumsum(ordered_len) - ordered_len
    transfers = _Transfers(parts.owner[order], ordered_start, ordered_len, ordered_start - lo)
    return transfers, pos, parts


def build_thd_route(cu_seqlens, cp_size: int, cp_rank: int, source: str, target: str) -> Route:
    """Route for packed (THD) rows from ``source`` to ``target`` layout on ``cp_rank``.

    ``cu_seqlens``: the global padded boundaries (Boundaries, a 1-D int tensor read to the
    host once, or a list). Raises ValueError for any boundary that a zigzag split cannot take.
    """
    for name, value in (("source", source), ("target", target)):
        if not isinstance(value, str) or value not in LAYOUTS:
            raise ValueError(f"{name} layout must be one of {LAYOUTS}, got {value!r}")
    check_cp(cp_size, cp_rank)
    cu = validate_cu_seqlens(cu_seqlens, cp_size)
    t_local = cu.total // cp_size
    if source == target or cp_size == 1 or t_local == 0:
        splits = tuple(t_local if p == cp_rank else 0 for p in range(cp_size))
        return Route(source, target, cp_size, cp_rank, splits, splits, None, None, True)

    cu = cu.numpy()
    mine = zigzag_rank_spans(cu, cp_size, cp_rank)
    zig_splits = _rows_per_slice(mine, t_local, cp_size)  # my zigzag rows per contiguous owner
    zig = partial(_own_spans_by_slice, mine, t_local)  # the transfers themselves: only for printing
    own_slice, pos, parts = _slice_by_part_owner(cu, cp_size, cp_rank, t_local)  # my slice by zigzag owner
    slice_splits = _splits(parts.owner, parts.length, cp_size)
    if source == ZIGZAG:  # send my zigzag rows as they are; gather the slice from the owner-major buffer
        return Route(
            source, target, cp_size, cp_rank,
            send_splits=zig_splits, recv_splits=slice_splits,
            send_spans=None, recv_spans=_spans_or_none(pos, parts.length),
            is_identity=False, _send=zig, _recv=own_slice,
        )
    # contiguous -> zigzag: send my slice owner-major; receive my zigzag rows in order.
    return Route(
        source, target, cp_size, cp_rank,
        send_splits=slice_splits, recv_splits=zig_splits,
        send_spans=_spans_or_none(own_slice.local, own_slice.length), recv_spans=None,
        is_identity=False, _send=own_slice, _recv=zig,
    )


def build_sbhd_route(seq_len: int, batch: int, cp_size: int, cp_rank: int, source: str, target: str) -> Route:
    """Route for SBHD rows after ``[S_local, B, ...] -> [B*S_local, ...]`` (b-major):
    each batch element is one packed sequence of length ``seq_len``."""
    check_cp(cp_size, cp_rank)
    cu = validate_sbhd(seq_len, batch, cp_size)
    return build_thd_route(cu, cp_size, cp_rank, source, target)


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
        import torch

        key = str(torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = tuple(
                host_to_device(t, torch.device(device)) for t in (self.to_natural, self.to_buffer, self.own_rows)
            )
        return self._device_cache[key]


def build_natural_order(cu_seqlens, cp_size: int, cp_rank: int) -> NaturalOrder:
    """The natural-order maps of ``cp_rank`` for the global boundaries ``cu_seqlens``
    (Boundaries, tensor or list, checked as by :func:`validate_cu_seqlens`)."""
    check_cp(cp_size, cp_rank)
    cu = validate_cu_seqlens(cu_seqlens, cp_size)
    t_global = cu.total
    if cp_size == 1:  # one rank: its rows are the natural order (sequences of any length)
        import torch

        rows = torch.arange(t_global, dtype=torch.int64)
        return NaturalOrder(to_natural=rows, to_buffer=rows, own_rows=rows)
    t_local = t_global // cp_size
    part = zigzag_parts_in_range(cu.numpy(), cp_size, 0, t_global)  # every part, global order
    # Local offset of each part inside its owner's rows: cumulative per owner.
    order = _by_owner(part.owner, cp_size)
    local = np.empty_like(part.start)
    ordered_owner = part.owner[order]
    ordered_len = part.length[order]
    csum = np.cumsum(ordered_len) - ordered_len
    owner_first = np.searchsorted(ordered_owner, ordered_owner, side="left")
    local[order] = csum - csum[owner_first]
    buf_pos = part.owner * t_local + local
    to_natural = expand_spans(buf_pos, part.length)
    to_buffer = expand_spans(part.start[order], ordered_len)
    keep = part.owner == cp_rank
    own_rows = expand_spans(part.start[keep], part.length[keep])
    return NaturalOrder(to_natural=to_natural, to_buffer=to_buffer, own_rows=own_rows)
