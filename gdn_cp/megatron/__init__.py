"""Megatron-Core glue: `linear_cp_mode` validation and resolution, the patched GatedDeltaNet
forward (``gdn_cp.megatron.gdn``) and installing / checking / reverting the pinned patch
(``gdn_cp.megatron.patching``).

Importing this package imports neither Megatron nor torch: the patched ``TransformerConfig``
imports ``gdn_cp.megatron.config`` while it is being constructed.
"""

from gdn_cp.megatron.config import (
    LINEAR_CP_MODES,
    explain_linear_cp_modes,
    resolve_linear_cp_mode,
    validate_linear_cp_mode,
)

__all__ = [
    "LINEAR_CP_MODES",
    "explain_linear_cp_modes",
    "resolve_linear_cp_mode",
    "validate_linear_cp_mode",
]
