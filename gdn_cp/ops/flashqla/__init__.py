"""FlashQLA backend (CUDA, sm_90+): FlashQLA's gated delta rule, FLA's causal conv and fused gated norm.

Satisfies :class:`gdn_cp.ops.contract.Backend`, with FlashQLA's inter-card cp context as its native
chunkwise core (FlashQLA >= 0.1.3; the conv's halo through FLA's cp context) and ``check_core``,
which refuses head dims and dtypes FlashQLA's kernels do not take before any collective. Importing
this package imports neither FlashQLA, TileLang nor FLA.

- :mod:`.detect`: whether FlashQLA can run here, and why not (probed once per process);
- :mod:`.kernels`: the CP=1 kernels behind the backend contract;
- :mod:`.native_cp`: chunkwise's native core with FlashQLA's inter-card cp context.
"""

from . import detect, kernels, native_cp
from .detect import (
    AUTO_CP_ENV,
    CAPABILITIES,
    CHUNK_GDR_ARGS,
    auto_cp_setting,
    conv_choice,
    fused_norm_choice,
    FlashQLAFeatures,
    features,
    flashqla_problem,
    flashqla_version,
    log_stack_once,
    probe,
    stack_report,
    tilelang_version,
)
from .kernels import (
    FLASHQLA_DTYPES,
    FLASHQLA_HEAD_DIM,
    causal_conv1d,
    check_core,
    check_dtype,
    check_head_dims,
    chunk_gated_delta_rule,
    FlashQLAFunctions,
    flashqla_api,
    fused_gated_rms_norm,
    run_in_value_blocks,
)
from .native_cp import check_native_rows, inter_card_core, native_cp_core, native_cp_problem

__all__ = [*detect.__all__, *kernels.__all__, *native_cp.__all__]
