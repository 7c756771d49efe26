"""Megatron-Core glue: ``linear_cp_mode`` checks, resolution and the settings read from a
``TransformerConfig`` (:mod:`.config`), the patched GatedDeltaNet forward (:mod:`.gdn`), the THD cut
(:mod:`.thd_split`), out_norm's gradient sum over TP (:mod:`.tp_grads`), and the supported
megatron-core releases with their adapters (:mod:`.pins`). Installing / checking / reverting the
pinned patch is a tool of its own, off the forward path: :mod:`gdn_cp.patch`.

Importing this package imports no torch (:mod:`.config` and :mod:`.pins` are torch-free; the patch
tool and the command line read them).
"""

from __future__ import annotations

from .config import check_linear_cp_mode, configure_linear_cp_mode, explain_linear_cp_modes, resolve_linear_cp_mode

__all__ = ["check_linear_cp_mode", "configure_linear_cp_mode", "explain_linear_cp_modes", "resolve_linear_cp_mode"]
