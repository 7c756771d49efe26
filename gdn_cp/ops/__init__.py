"""Per-rank math backends behind one contract (:class:`~gdn_cp.ops.contract.Backend`).

``reference`` is plain torch (any device, any float dtype); ``fla`` is CUDA only (importing
it does not import flash-linear-attention).
"""

from __future__ import annotations

import functools
import importlib

from .contract import Backend, NativeCPCore
from .gates import check_log_decay
from .shape import GDNShape, value_heads_per_key_head

__all__ = [
    "BACKENDS", "Backend", "GDNShape", "NativeCPCore", "check_log_decay", "get_backend", "value_heads_per_key_head",
]

BACKENDS: dict[str, str] = {"reference": "gdn_cp.ops.reference", "fla": "gdn_cp.ops.fla"}  # name -> module


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (its module, imported on first use, then remembered)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {name!r}")
    return _load_backend(name)


@functools.lru_cache(maxsize=None)
def _load_backend(name: str) -> Backend:
    return importlib.import_module(BACKENDS[name])
