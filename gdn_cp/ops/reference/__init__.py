"""Plain-torch backend: CPU or GPU, any float dtype, varlen THD. The oracle and the CPU path."""

from .conv import causal_conv1d
from .gated_delta_rule import chunk_gated_delta_rule, l2norm

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "l2norm"]
