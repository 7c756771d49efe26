"""Per-rank math backends behind one contract (:class:`~gdn_cp.ops.contract.Backend`).

:mod:`.registry` lists them: ``reference`` is plain torch (any device, any float dtype); ``fla``
is CUDA only (importing it does not import flash-linear-attention). Importing this package
imports no torch (the command line reads the registry); the gate rule is :mod:`.gates`.
"""

from __future__ import annotations

from .contract import Backend, NativeCPCore
from .registry import BACKEND_NAMES, BACKENDS, BackendSpec, backend_spec, get_backend
from .shape import GDNShape, value_heads_per_key_head

__all__ = [
    "BACKENDS", "BACKEND_NAMES", "Backend", "BackendSpec", "GDNShape", "NativeCPCore", "backend_spec",
    "get_backend", "value_heads_per_key_head",
]
