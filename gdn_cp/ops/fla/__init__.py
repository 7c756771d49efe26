"""FLA backend (CUDA): flash-linear-attention's causal conv and chunked gated delta rule.

Satisfies :class:`gdn_cp.ops.contract.Backend`, with FLA's cp context as its native CP core.
Importing this package does not import FLA.

- :mod:`.detect`: what the installed FLA offers (probed once per process);
- :mod:`.kernels`: the CP=1 kernels behind the backend contract;
- :mod:`.native_cp`: the chunkwise core with FLA's cp context.
"""

from . import detect, kernels, native_cp
from .detect import (
    FLAFeatures,
    detect_fla_cp,
    features,
    fla_available,
    fla_import_error,
    fla_version,
    has_cp_context,
    has_zigzag_layout,
    probe,
)
from .kernels import (
    FLA_MAX_HEAD_K_DIM,
    FLA_MIN_HEAD_DIM,
    causal_conv1d,
    check_head_dims,
    chunk_gated_delta_rule,
    fla_api,
)
from .native_cp import check_chunkwise_layout, cp_context_core, native_cp_core

__all__ = [*detect.__all__, *kernels.__all__, *native_cp.__all__]
