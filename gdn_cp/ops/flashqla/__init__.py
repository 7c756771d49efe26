"""FlashQLA backend (CUDA, sm_90+): FlashQLA's gated delta rule, FLA's causal conv and fused gated norm,
FlashQLA's inter-card cp context as its native chunkwise core (FlashQLA >= 0.1.3; the conv's halo
through FLA's cp context).

Importing this package imports neither torch, FlashQLA, TileLang nor FLA: it declares the backend
(:data:`SPEC`, from :mod:`.spec`: head dims 128, bf16 / fp16, refused before any collective), and
:func:`load` imports its modules:

- :mod:`.spec`: its facts (devices, head dims, dtypes);
- :mod:`.detect`: whether FlashQLA can run here, and why not (probed once per process);
- :mod:`.kernels`: the CP=1 kernels behind the backend contract;
- :mod:`.native_cp`: chunkwise's native core with FlashQLA's inter-card cp context.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

from ..contract import Backend
from .spec import AUTO_CP_ENV, SPEC

__all__ = ["SPEC", "load"]


def load(settings: Mapping[str, Any]) -> Backend:
    """The backend's members, with FlashQLA's ``auto_cp`` as ``settings`` say (``GDN_CP_FLASHQLA_AUTO_CP``)."""
    from . import kernels, native_cp

    auto_cp = settings[AUTO_CP_ENV] == "1"
    return Backend(
        SPEC, causal_conv1d=kernels.causal_conv1d,
        chunk_gated_delta_rule=partial(kernels.chunk_gated_delta_rule, auto_cp=auto_cp),
        native_cp_core=partial(native_cp.native_cp_core, auto_cp=auto_cp), native_cp_problem=native_cp.native_cp_problem,
        check_native_rows=native_cp.check_native_rows, fused_gated_rms_norm=kernels.fused_gated_rms_norm,
    )
