"""The per-token glue around the GDN core (gates, conv + SiLU + q/k/v split + l2 norm), one plain-torch
function per step, compiled with ``torch.compile`` on CUDA (:mod:`.glue`)."""

from .glue import L2NORM_EPS, compile_enabled, compile_off_reason, compiles, conv_silu_split, gates, set_compile

__all__ = ["L2NORM_EPS", "compile_enabled", "compile_off_reason", "compiles", "conv_silu_split", "gates", "set_compile"]
