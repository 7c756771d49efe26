"""The three CP modes: rank-local zigzag tensors in, rank-local zigzag tensors out.

:func:`gdn_core` is the public entry point of the core (it checks its arguments and makes the
call's :class:`CallContext`); the patched Megatron forward makes its own context and hands the
whole layer to the mode (:meth:`Mode.run`). :mod:`.spec` is the registry (one entry per mode: its
head rule and its class), :mod:`.settings` the settings a call carries. Nothing here knows about
Megatron.

This ``__getattr__`` is the package's one lazy face, and the reason is import order: Python runs
this file before any submodule, and :mod:`gdn_cp.modes.spec` must import without torch (the
``gdn-cp`` command line builds its help from it, the patched ``TransformerConfig`` checks with
it). The names below load their modules (and torch) on first use; everything else imports the
submodules directly.
"""

from __future__ import annotations

__all__ = [
    "CallContext", "GDNShape", "LayerFacts", "Mode", "Projected", "Segment", "Settings", "gdn_core", "prepare_mode",
    "sbhd_to_thd", "thd_to_sbhd",
]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ..ops.shape import GDNShape
    from .context import CallContext, LayerFacts, Mode, Projected, Segment
    from .entry import gdn_core, prepare_mode
    from .packing import sbhd_to_thd, thd_to_sbhd
    from .settings import Settings

    public = {
        "CallContext": CallContext, "GDNShape": GDNShape, "LayerFacts": LayerFacts, "Mode": Mode,
        "Projected": Projected, "Segment": Segment, "Settings": Settings, "gdn_core": gdn_core,
        "prepare_mode": prepare_mode, "sbhd_to_thd": sbhd_to_thd, "thd_to_sbhd": thd_to_sbhd,
    }
    globals().update(public)
    return public[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
