"""Per-micro-batch CP plans and the provenance-keyed cache that keeps them fresh.

A :class:`CPPlan` holds everything one rank needs for one micro-batch: the boundaries as
Python ints, routes per direction, the natural-order maps, the chunkwise plan, device
copies of these, and a ``backend_cache`` dict for backend contexts (FLA's cp context).
Everything is built lazily on first use and then reused by every layer, both
directions and activation-recompute replays.

:class:`RouteCache` returns the plan for ``(cu_seqlens, cp_size, cp_rank)``; it
remembers the boundaries tensor by identity (it holds a reference, so the id cannot be
recycled) and by ``_version`` (any in-place write bumps it), and rebuilds when any of
these differ. A hit reads only host-side attributes: no device work, no sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .boundaries import sbhd_cu_seqlens, validate_cu_seqlens
from .device import host_to_device
from .chunkwise import ChunkwisePlan, build_chunkwise_plan
from .route import NaturalOrder, Route, _build_route, _check_rank, build_natural_order

__all__ = ["CPPlan", "RouteCache", "plan_for_sbhd"]

logger = logging.getLogger(__name__)


@dataclass
class CPPlan:
    """One rank's layout plan for one micro-batch (THD, or SBHD seen as B sequences)."""

    cu_cpu: torch.Tensor  # int64 [n+1] global boundaries on the host
    cp_size: int
    cp_rank: int
    cu_device: torch.Tensor | None = None  # the caller's boundaries tensor, if on a device
    routes: dict = field(default_factory=dict)
    backend_cache: dict = field(default_factory=dict)
    _natural: NaturalOrder | None = None
    _chunkwise: dict = field(default_factory=dict)
    _cu_tensors: dict = field(default_factory=dict)
    builds: int = 0  # how many routes/maps were built (tests and benchmarks read it)
    _cu: tuple[int, ...] | None = None

    @property
    def cu(self) -> tuple[int, ...]:
        """The global boundaries as Python ints (made on first use)."""
        if self._cu is None:
            self._cu = tuple(self.cu_cpu.tolist())
        return self._cu

    @property
    def t_global(self) -> int:
        return int(self.cu_cpu[-1])

    @property
    def t_local(self) -> int:
        return self.t_global // self.cp_size

    @property
    def num_sequences(self) -> int:
        return self.cu_cpu.numel() - 1

    def route(self, source: str, target: str) -> Route:
        key = (source, target)
        if key not in self.routes:
            self.routes[key] = _build_route(self.cu_cpu, self.cp_size, self.cp_rank, source, target)
            self.builds += 1
        return self.routes[key]

    def natural_order(self) -> NaturalOrder:
        if self._natural is None:
            self._natural = build_natural_order(self.cu_cpu, self.cp_size, self.cp_rank)
            self.builds += 1
        return self._natural

    def chunkwise(self, conv_width: int) -> ChunkwisePlan:
        if conv_width not in self._chunkwise:
            self._chunkwise[conv_width] = build_chunkwise_plan(self.cu, self.cp_size, self.cp_rank, conv_width)
            self.builds += 1
        return self._chunkwise[conv_width]

    def cu_tensor(self, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """Global boundaries on ``device`` (host->device copy once; never read back)."""
        key = (str(torch.device(device)), dtype)
        if key not in self._cu_tensors:
            self._cu_tensors[key] = host_to_device(self.cu_cpu.to(dtype), device)
        return self._cu_tensors[key]

    def cached_on(self, name, device, make) -> torch.Tensor:
        """``make()`` (a CPU tensor) copied to ``device`` once per plan, then reused."""
        key = (name, str(torch.device(device)))
        if key not in self._cu_tensors:
            self._cu_tensors[key] = host_to_device(make(), device)
        return self._cu_tensors[key]


class RouteCache:
    """Cache of :class:`CPPlan` keyed by provenance; attach one to each micro-batch."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, int, CPPlan]] = {}
        self.hits = 0
        self.misses = 0

    def plan(self, cu_seqlens, cp_size: int, cp_rank: int) -> CPPlan:
        """Plan for THD boundaries ``cu_seqlens`` (1-D int tensor, any device, or list)."""
        _check_rank_args(cp_size, cp_rank)
        key = (id(cu_seqlens), cp_size, cp_rank)
        version = getattr(cu_seqlens, "_version", None)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is cu_seqlens and entry[1] == version and not isinstance(
            cu_seqlens, list
        ):
            self.hits += 1
            return entry[2]
        self.misses += 1
        cu = validate_cu_seqlens(cu_seqlens, cp_size, as_tensor=True)
        device_cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None
        plan = CPPlan(cu_cpu=cu, cp_size=cp_size, cp_rank=cp_rank, cu_device=device_cu)
        # Keep a reference to the boundaries: its id cannot be reused while we hold it.
        self._entries[key] = (cu_seqlens, version, plan)
        logger.debug("built CP plan: %d sequences, T=%d, cp=%d, rank=%d", plan.num_sequences, plan.t_global, cp_size, cp_rank)
        return plan

    def clear(self) -> None:
        self._entries.clear()


def _check_rank_args(cp_size: int, cp_rank: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    _check_rank(cp_size, cp_rank)


def plan_for_sbhd(seq_len: int, batch: int, cp_size: int, cp_rank: int) -> CPPlan:
    """Plan for SBHD input of global length ``seq_len``: batch element b is sequence b."""
    _check_rank_args(cp_size, cp_rank)
    cu = validate_cu_seqlens(list(sbhd_cu_seqlens(seq_len, batch)), cp_size, name="sbhd sequence length", as_tensor=True)
    return CPPlan(cu_cpu=cu, cp_size=cp_size, cp_rank=cp_rank)
