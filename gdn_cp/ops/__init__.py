"""Per-rank math backends with one interface.

A backend is a module-like object with:

- ``causal_conv1d(x [T, C], weight [C, W], bias, *, cu_seqlens: list[int], halo [W-1, C] | None,
  activation="silu") -> [T, C]``
- ``chunk_gated_delta_rule(q [T, Hk, Dk], k, v [T, Hv, Dv], g [T, Hv], beta [T, Hv], *, cu_seqlens,
  scale=None, initial_state [N, Hv, Dk, Dv] | None, output_final_state=False, use_qk_l2norm=True)
  -> (o [T, Hv, Dv], final_state | None)``
- optionally ``chunkwise_core(...)``: a native context-parallel conv + scan on the contiguous
  layout (FLA's cp context); without it the chunkwise mode exchanges halos and state
  summaries itself through ``gdn_cp.comm``.

``reference`` is plain torch (any device, any float dtype); ``fla`` is CUDA only.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BACKENDS", "get_backend"]

BACKENDS = ("reference", "fla")


def get_backend(name: str) -> ModuleType:
    """The backend module called ``name`` (imported on first use)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference":
        return importlib.import_module("gdn_cp.ops.reference")
    module = importlib.import_module("gdn_cp.ops.fla")
    return module
