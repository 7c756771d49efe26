"""Per-rank math backends behind one contract (:class:`~gdn_cp.ops.contract.Backend`).

:mod:`.registry` lists them: ``reference`` is plain torch (any device, any float dtype); ``fla``
is CUDA only (importing it does not import flash-linear-attention). Importing this package
imports no torch (the command line reads the registry): ``check_log_decay`` loads it on first use.
"""

from __future__ import annotations

from .contract import Backend, NativeCPCore
from .registry import BACKEND_NAMES, BACKENDS, BackendSpec, backend_spec, get_backend
from .shape import GDNShape, value_heads_per_key_head

__all__ = [
    "BACKENDS", "BACKEND_NAMES", "Backend", "BackendSpec", "GDNShape", "NativeCPCore", "backend_spec",
    "check_log_decay", "get_backend", "value_heads_per_key_head",
]


def __getattr__(name: str):
    if name != "check_log_decay":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .gates import check_log_decay

    globals()[name] = check_log_decay
    return check_log_decay
