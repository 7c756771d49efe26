"""The three CP modes: rank-local zigzag tensors in, rank-local zigzag tensors out.

:func:`gdn_core` is the one entry point; :mod:`gdn_cp.modes.spec` is the registry it
dispatches through (one entry per mode: its head rule, the layouts it takes, and its file, whose
``prepare`` decides a call's :class:`~gdn_cp.modes.call.ModeCall`). Nothing here knows about
Megatron. The names below load their modules (and torch) on first use, so
``import gdn_cp.modes.spec`` does not import torch.
"""

from __future__ import annotations

__all__ = [
    "GDNShape", "ModeCall", "gdn_core", "local_core", "sbhd_to_thd", "thd_to_sbhd", "chunkwise_path",
    "set_chunkwise_path", "resolve_chunkwise_path", "chunkwise_swaps_layout", "is_one_zigzag_stream",
]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ..ops.shape import GDNShape
    from . import chunkwise, common, packing
    from .call import ModeCall
    from .dispatch import gdn_core

    public = {
        "GDNShape": GDNShape, "ModeCall": ModeCall, "gdn_core": gdn_core, "local_core": common.local_core,
        "sbhd_to_thd": packing.sbhd_to_thd, "thd_to_sbhd": packing.thd_to_sbhd,
        "chunkwise_path": chunkwise.chunkwise_path, "set_chunkwise_path": chunkwise.set_chunkwise_path,
        "resolve_chunkwise_path": chunkwise.resolve_chunkwise_path,
        "chunkwise_swaps_layout": chunkwise.chunkwise_swaps_layout, "is_one_zigzag_stream": chunkwise.is_one_zigzag_stream,
    }
    globals().update(public)
    return public[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
