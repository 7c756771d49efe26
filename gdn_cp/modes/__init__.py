"""The three CP modes: rank-local zigzag tensors in, rank-local zigzag tensors out.

:func:`gdn_core` is the one entry point; :mod:`gdn_cp.modes.spec` is the registry it
dispatches through (one entry per mode: its cores, layouts and head rule). Nothing here
knows about Megatron. Names are imported on first use, so ``import gdn_cp.modes.spec``
does not import torch.
"""

from __future__ import annotations

import importlib

__all__ = [
    "GDNShape", "gdn_core", "local_core", "sbhd_to_thd", "thd_to_sbhd", "chunkwise_path", "set_chunkwise_path",
    "resolve_chunkwise_path", "chunkwise_swaps_layout", "is_one_zigzag_stream",
]

_HOMES = {
    "GDNShape": "gdn_cp.ops.shape",
    "gdn_core": "gdn_cp.modes.dispatch",
    "local_core": "gdn_cp.modes.common",
    "sbhd_to_thd": "gdn_cp.modes.packing",
    "thd_to_sbhd": "gdn_cp.modes.packing",
    "chunkwise_path": "gdn_cp.modes.chunkwise",
    "set_chunkwise_path": "gdn_cp.modes.chunkwise",
    "resolve_chunkwise_path": "gdn_cp.modes.chunkwise",
    "chunkwise_swaps_layout": "gdn_cp.modes.chunkwise",
    "is_one_zigzag_stream": "gdn_cp.modes.chunkwise",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
