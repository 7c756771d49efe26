"""Per-micro-batch CP plans and the provenance-keyed cache that keeps them fresh.

A :class:`CPPlan` holds everything one rank needs for one micro-batch: the checked global
:class:`Boundaries` (with their cached host and device views) and how the zigzag rows were cut
from them (``split``: per document, or the whole row), routes per direction, the
natural-order maps, the chunkwise plan, other device copies, and a ``backend_cache`` dict
for backend contexts (FLA's cp context). Everything is built lazily on first use and then
reused by every layer, both directions and activation-recompute replays.

:class:`RouteCache` returns the plan for ``(cu_seqlens, cp_size, cp_rank, split)``.

The split only moves rows: routes and natural-order maps are built from
:func:`~gdn_cp.layout.boundaries.zigzag_cut` (the boundaries the parts were cut from: the
sequences themselves, or ``(0, T)`` for a whole-row cut), while the recurrence, the conv and
the chunkwise plan restart at ``cu`` in both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .boundaries import PER_DOCUMENT, Boundaries, check_cp, check_thd_split, validate_cu_seqlens, validate_sbhd, zigzag_cut
from .chunkwise import ChunkwisePlan, build_chunkwise_plan
from .device import host_to_device, is_tensor
from .route import NaturalOrder, Route, build_natural_order, build_thd_route

if TYPE_CHECKING:
    import torch

__all__ = ["CPPlan", "RouteCache", "plan_for_sbhd"]

logger = logging.getLogger(__name__)


@dataclass
class CPPlan:
    """One rank's layout plan for one micro-batch (THD, or SBHD seen as B sequences)."""

    cu: Boundaries  # global sequence boundaries, checked for the zigzag split over cp_size ranks
    cp_size: int
    cp_rank: int
    split: str = PER_DOCUMENT  # how the zigzag rows were cut: PER_DOCUMENT or WHOLE_ROW
    zigzag_cu: Boundaries = field(init=False, repr=False)  # what the zigzag parts were cut from
    routes: dict = field(default_factory=dict)
    backend_cache: dict = field(default_factory=dict)
    _natural: NaturalOrder | None = None
    _chunkwise: dict = field(default_factory=dict)
    _on_device: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_cp(self.cp_size, self.cp_rank)
        # a Boundaries passes with one cheap check
        self.cu = validate_cu_seqlens(self.cu, self.cp_size, split=check_thd_split(self.split))
        self.zigzag_cu = zigzag_cut(self.cu, self.split)

    @property
    def t_global(self) -> int:
        return self.cu.total

    @property
    def t_local(self) -> int:
        return self.t_global // self.cp_size

    @property
    def num_sequences(self) -> int:
        return self.cu.num_sequences

    def route(self, source: str, target: str) -> Route:
        key = (source, target)
        if key not in self.routes:
            self.routes[key] = build_thd_route(self.zigzag_cu, self.cp_size, self.cp_rank, source, target)
        return self.routes[key]

    def natural_order(self) -> NaturalOrder:
        if self._natural is None:
            self._natural = build_natural_order(self.zigzag_cu, self.cp_size, self.cp_rank)
        return self._natural

    def chunkwise(self, conv_width: int) -> ChunkwisePlan:
        if conv_width not in self._chunkwise:
            self._chunkwise[conv_width] = build_chunkwise_plan(
                self.cu, self.cp_size, self.cp_rank, conv_width, split=self.split
            )
        return self._chunkwise[conv_width]

    def cached_on(self, name, device, make) -> torch.Tensor:
        """``make()`` (a CPU tensor) copied to ``device`` once per plan, then reused."""
        import torch

        key = (name, str(torch.device(device)))
        if key not in self._on_device:
            self._on_device[key] = host_to_device(make(), device)
        return self._on_device[key]


class _Entry(NamedTuple):
    source: Any  # the caller's boundaries object (held: its id cannot be reused meanwhile)
    version: int | None  # its tensor version counter when the plan was built
    plan: CPPlan

    def fresh_for(self, cu_seqlens) -> bool:
        """Whether ``cu_seqlens`` (the same object) still holds the plan's boundaries.

        Boundaries cannot change. Host values (lists, CPU tensors) are compared by value,
        which costs no sync, so every write is seen. A device tensor is trusted by its
        version counter: reading its values would synchronize the device.
        """
        if isinstance(cu_seqlens, Boundaries):
            return True
        if is_tensor(cu_seqlens):
            if cu_seqlens._version != self.version:
                return False
            if cu_seqlens.device.type != "cpu":
                return True
            return np.array_equal(cu_seqlens.detach().numpy(), self.plan.cu.numpy())
        return tuple(cu_seqlens) == self.plan.cu


class RouteCache:
    """Cache of :class:`CPPlan` keyed by provenance; attach one to each micro-batch.

    The plan for ``(cu_seqlens, cp_size, cp_rank, split)`` is reused while ``cu_seqlens`` is
    the same object and still holds the same boundaries, and rebuilt otherwise:

    - :class:`Boundaries` are immutable: the same object always hits;
    - host boundaries (a list, a CPU tensor) are compared by value on every call (no sync),
      so any write is seen, even one that bypasses the version counter
      (``t.numpy()[i] = ...``, ``t.data[i] = ...``, a collective into ``t``);
    - a device tensor is remembered by identity and ``_version``: ordinary in-place writes
      bump the version and cause a rebuild, but a write that bypasses the counter
      (``t.data[i] = ...``, ``dist.broadcast(t, ...)`` into the same tensor) cannot be seen
      without reading the tensor back, which would synchronize the device on every layer
      call. Give each micro-batch fresh boundaries (Megatron does), or call :meth:`clear`
      after writing into a device tensor that way.

    A hit reads only host-side attributes (and, for host boundaries, host values): no
    device work, no sync.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self.hits = 0
        self.misses = 0

    def plan(self, cu_seqlens, cp_size: int, cp_rank: int, split: str = PER_DOCUMENT) -> CPPlan:
        """Plan for THD boundaries ``cu_seqlens`` (1-D int tensor on any device, list, or
        Boundaries) whose zigzag rows were cut by ``split`` (``per_document`` or ``whole_row``)."""
        check_cp(cp_size, cp_rank)
        key = (id(cu_seqlens), cp_size, cp_rank, check_thd_split(split))
        entry = self._entries.get(key)
        if entry is not None and entry.source is cu_seqlens and entry.fresh_for(cu_seqlens):
            self.hits += 1
            return entry.plan
        self.misses += 1
        version = getattr(cu_seqlens, "_version", None)  # read before the values, as a hit compares
        cu = validate_cu_seqlens(cu_seqlens, cp_size, split=split)
        plan = CPPlan(cu=cu, cp_size=cp_size, cp_rank=cp_rank, split=split)
        self._entries[key] = _Entry(cu_seqlens, version, plan)
        logger.debug(
            "built CP plan: %d sequences, T=%d, cp=%d, rank=%d, %s split",
            plan.num_sequences, plan.t_global, cp_size, cp_rank, split,
        )  # fmt: skip
        return plan

    def clear(self) -> None:
        self._entries.clear()


def plan_for_sbhd(seq_len: int, batch: int, cp_size: int, cp_rank: int) -> CPPlan:
    """Plan for SBHD input of global length ``seq_len``: batch element b is sequence b."""
    check_cp(cp_size, cp_rank)
    cu = validate_sbhd(seq_len, batch, cp_size)
    return CPPlan(cu=cu, cp_size=cp_size, cp_rank=cp_rank)
