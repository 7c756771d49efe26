"""Read-only looks at gdn-cp internals that tests and benchmarks report on.

The library keeps these details private on purpose; this module is the one place outside the
library that reads them, so a rename breaks one function (and its test), not every caller.
"""

from __future__ import annotations

__all__ = ["chunkwise_swap_points"]


def chunkwise_swap_points(module) -> list[str]:
    """The chunkwise layout-swap points (``"hidden"`` / ``"core"``) a patched GatedDeltaNet has
    used so far, sorted (empty before its first chunkwise call)."""
    from gdn_cp.megatron import gdn

    return sorted({str(point) for point in module.__dict__.get(gdn._SWAP_ATTR, {}).values()})
