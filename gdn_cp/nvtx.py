"""NVTX ranges around gdn-cp's phases (``gdn_cp.route``, ``gdn_cp.halo``, ``gdn_cp.conv``, ``gdn_cp.core``,
``gdn_cp.state``, ``gdn_cp.norm``), so that a user's Nsight Systems trace shows where a GDN layer call spends
its time. Forward only (a backward runs inside autograd). Off CUDA, and where torch has no NVTX, nothing.
A range costs about a microsecond on the host and never synchronizes the device."""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["phase"]


@functools.lru_cache(maxsize=1)
def _enabled() -> bool:
    """Whether ranges are pushed: a CUDA build with a GPU (decided once per process)."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def phase(name: str):
    """``with phase("conv"): ...``: an NVTX range ``gdn_cp.<name>`` around the block."""
    if not _enabled():
        yield
        return
    torch.cuda.nvtx.range_push(f"gdn_cp.{name}")
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
