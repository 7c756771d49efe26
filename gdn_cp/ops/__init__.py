"""Per-rank math backends behind one contract (:mod:`.contract`: a backend's facts,
:class:`~gdn_cp.ops.contract.BackendSpec`, and members, :class:`~gdn_cp.ops.contract.Backend`).

:mod:`.registry` lists them: ``reference`` is plain torch (any device, any float dtype); ``fla`` and
``flashqla`` are CUDA only (importing them imports no kernel library). Importing this package imports
no torch (the command line reads the registry); the gate rule is :mod:`.gates`.
"""

from __future__ import annotations

from .contract import Backend, BackendSpec, NativeCPCore
from .registry import BACKEND_NAMES, BACKENDS, backend_spec, get_backend
from .shape import GDNShape, value_heads_per_key_head

__all__ = [
    "BACKENDS", "BACKEND_NAMES", "Backend", "BackendSpec", "GDNShape", "NativeCPCore", "backend_spec",
    "get_backend", "value_heads_per_key_head",
]
