"""FLA backend (CUDA): flash-linear-attention's causal conv and chunked gated delta rule, FLA's cp
context as its native CP cores (contiguous, and zigzag on FLA >= 0.6), FLA's fused gated RMSNorm as
its gated norm.

Importing this package imports neither torch nor FLA: it declares the backend (:data:`SPEC`, from
:mod:`.spec`), and :func:`load` imports its modules (FLA itself loads on a kernel's first call):

- :mod:`.spec`: its facts (devices, the head dims its kernels take);
- :mod:`.detect`: what the installed FLA offers (probed once per process);
- :mod:`.kernels`: the CP=1 kernels behind the backend contract;
- :mod:`.native_cp`: the chunkwise cores with FLA's cp context;
- :mod:`.norm`: the fused gated RMSNorm.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..contract import Backend
from .spec import SPEC

__all__ = ["SPEC", "load"]


def load(settings: Mapping[str, Any]) -> Backend:
    """The backend's members (it takes no setting)."""
    from . import kernels, native_cp, norm

    return Backend(
        SPEC, causal_conv1d=kernels.causal_conv1d, chunk_gated_delta_rule=kernels.chunk_gated_delta_rule,
        native_cp_core=native_cp.native_cp_core, native_zigzag_cp_core=native_cp.native_zigzag_cp_core,
        native_cp_problem=native_cp.native_cp_problem, check_native_rows=native_cp.check_native_rows,
        fused_gated_rms_norm=norm.fused_gated_rms_norm, repeats_key_heads=kernels.repeats_key_heads,
    )
