"""FLA backend (CUDA): flash-linear-attention's causal conv and chunked gated delta rule.

Same interface as ``gdn_cp.ops.reference`` plus :func:`chunkwise_core`, the hook the chunkwise
mode uses for FLA's native context parallelism. Importing this package does not import FLA.
"""

from .backend import (
    FLA_MAX_HEAD_K_DIM,
    FLA_MIN_HEAD_DIM,
    causal_conv1d,
    check_chunkwise_layout,
    chunk_gated_delta_rule,
    chunkwise_core,
    fla_available,
    fla_version,
    has_cp_context,
    has_zigzag_layout,
    native_cp_available,
)

__all__ = [
    "FLA_MAX_HEAD_K_DIM",
    "FLA_MIN_HEAD_DIM",
    "causal_conv1d",
    "check_chunkwise_layout",
    "chunk_gated_delta_rule",
    "chunkwise_core",
    "fla_available",
    "fla_version",
    "has_cp_context",
    "has_zigzag_layout",
    "native_cp_available",
]
