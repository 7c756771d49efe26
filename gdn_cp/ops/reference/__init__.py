"""Plain-torch backend: CPU or GPU, any float dtype, varlen THD. The oracle and the CPU path.

Importing this package imports no torch: it declares the backend (:data:`SPEC`), and :func:`load`
imports its kernels (:mod:`.conv`, :mod:`.gated_delta_rule`). :mod:`.naive` holds the fp64
token-by-token oracles they are checked against.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..contract import Backend, BackendSpec, SelftestCase

__all__ = ["SPEC", "load"]

SPEC = BackendSpec(name="reference", title="the reference backend", devices=("cpu", "cuda"),
                   devices_why="plain torch", preference=2,
                   tolerances={"float32": 5e-3},  # its float32 against itself in float64 (the CPU selftest)
                   selftest=(SelftestCase("conv", "float32"), SelftestCase("gdn", "float32")))


def load(settings: Mapping[str, Any]) -> Backend:
    """The backend's members (it takes no setting): its conv, its chunked scan, and its state summaries
    composed in a tree."""
    from .conv import causal_conv1d
    from .gated_delta_rule import chunk_gated_delta_rule, chunk_state_summary

    return Backend(SPEC, causal_conv1d=causal_conv1d, chunk_gated_delta_rule=chunk_gated_delta_rule,
                   chunk_state_summary=chunk_state_summary)
