"""Megatron-Core glue: ``linear_cp_mode`` checks and resolution (:mod:`.config`), the patched
GatedDeltaNet forward (:mod:`.gdn`), the THD cut (:mod:`.thd_split`), where the layout swap happens
(:mod:`.swap`), out_norm's gradient sum over TP (:mod:`.tp_grads`), and the supported
megatron-core releases with their adapters (:mod:`.pins`). Installing / checking / reverting the
pinned patch is a tool of its own, off the forward path: :mod:`gdn_cp.patch`.

Importing this package imports nothing else (the patch tool imports :mod:`.pins` without torch):
the names below load :mod:`.config` on first use.
"""

from __future__ import annotations

__all__ = ["check_linear_cp_mode", "configure_linear_cp_mode", "explain_linear_cp_modes", "resolve_linear_cp_mode"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'gdn_cp.megatron' has no attribute {name!r}")
    from . import config

    return getattr(config, name)
