"""FLA backend (CUDA): flash-linear-attention's causal conv and chunked gated delta rule.

Satisfies :class:`gdn_cp.ops.contract.Backend`, with FLA's cp context as its native CP cores
(contiguous, and zigzag on FLA >= 0.6) and FLA's fused gated RMSNorm as its gated norm.
Importing this package does not import FLA.

- :mod:`.detect`: what the installed FLA offers (probed once per process);
- :mod:`.kernels`: the CP=1 kernels behind the backend contract;
- :mod:`.native_cp`: the chunkwise cores with FLA's cp context;
- :mod:`.norm`: the fused gated RMSNorm.
"""

from . import detect, kernels, native_cp, norm
from .detect import (
    FLAFeatures,
    detect_fla_cp,
    features,
    fla_available,
    fla_import_error,
    fla_own_gated_delta_rule,
    fla_version,
    gdn_kernel_backends,
    has_cp_context,
    has_zigzag_layout,
    log_stack_once,
    own_kernel,
    probe,
    stack_report,
)
from .kernels import (
    FLA_MAX_HEAD_K_DIM,
    FLA_MIN_HEAD_DIM,
    FLAFunctions,
    causal_conv1d,
    check_core,
    check_head_dims,
    chunk_gated_delta_rule,
    fla_api,
    kv_heads_for_kernel,
)
from .native_cp import (
    FLA_COLLECTIVE_BACKENDS,
    check_chunkwise_layout,
    check_native_rows,
    check_zigzag_stream,
    context_conv,
    cp_context_core,
    native_cp_core,
    native_cp_problem,
    native_zigzag_cp_core,
    runs_on,
    zigzag_context_core,
)
from .norm import fused_gated_rms_norm, gated_rms_norm

__all__ = [*detect.__all__, *kernels.__all__, *native_cp.__all__, *norm.__all__]
