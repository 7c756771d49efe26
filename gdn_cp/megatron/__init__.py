"""Megatron-Core glue: ``linear_cp_mode`` checks and resolution (:mod:`.config`), the patched
GatedDeltaNet forward (:mod:`.gdn`), out_norm's gradient sum over TP (:mod:`.tp_grads`), the
supported megatron-core releases and their adapters (:mod:`.pins`), and installing / checking /
reverting the pinned patch (:mod:`.patching`).

Importing this package imports nothing else: the names below load their module on first use,
so ``gdn_cp.megatron.patching`` (the ``gdn-cp patch`` command) stays free of torch.
"""

from __future__ import annotations

import importlib

__all__ = ["check_linear_cp_mode", "configure_linear_cp_mode", "explain_linear_cp_modes", "resolve_linear_cp_mode"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("gdn_cp.megatron.config"), name)
    raise AttributeError(f"module 'gdn_cp.megatron' has no attribute {name!r}")
