"""Plain-torch backend: CPU or GPU, any float dtype, varlen THD. The oracle and the CPU path."""

from .conv import causal_conv1d
from .gated_delta_rule import chunk_gated_delta_rule, chunk_state_summary, l2norm

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "chunk_state_summary", "l2norm", "native_cp_core"]


def native_cp_core(group) -> None:
    """None: no native context-parallel kernel here; the chunkwise mode exchanges halos and
    state summaries itself through ``gdn_cp.comm``."""
    return None
