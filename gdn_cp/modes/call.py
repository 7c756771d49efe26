""":class:`ModeCall`: one layer call's way through a mode, decided once on the host and handed down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

__all__ = ["ModeCall"]


@dataclass(frozen=True)
class ModeCall:
    """How a mode runs one call for a backend, a CP group and a plan: made by the mode's ``prepare``
    (through :meth:`gdn_cp.modes.spec.ModeSpec.prepare`) before any collective, where a setting
    the backend cannot honour is refused, and then only read.

    ``cores``: layout -> ``core(qkv, g, beta, conv_weight, conv_bias, *, shape, plan, group,
    backend)`` for rows in that layout (zigzag always), returning ``o [T_local, Hv, Dv]`` in the
    same rows. ``swap_layout``: the layout the mode moves zigzag rows into (and back out of) around
    its core on this call, or None when it computes on the rows where they are; a caller may make
    that move itself on narrower tensors (hidden_states before in_proj, out_proj's output after)
    and hand ``cores[swap_layout]`` the moved rows. ``path``: how it runs, in words for logs and
    reports (chunkwise: ``native``, ``native-zigzag`` or ``generic``).
    """

    cores: Mapping[str, Callable]
    swap_layout: Optional[str] = None
    path: str = ""

    def core(self, layout: str) -> Callable:
        """The core for rows in ``layout`` (ValueError naming the layouts of this call)."""
        core = self.cores.get(layout)
        if core is None:
            raise ValueError(f"layout={layout!r}: this call's cores take rows in {tuple(self.cores)}")
        return core
