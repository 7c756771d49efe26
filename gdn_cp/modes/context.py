"""One call's context, and the shape of a mode: what every mode is handed and what it does with it.

A :class:`CallContext` is made at one of the two public boundaries, after that boundary checked
everything it was given, before any collective: :func:`gdn_cp.modes.gdn_core` (tensors in, the
core alone) and the patched Megatron forward (:mod:`gdn_cp.megatron.gdn`, the whole layer). Below
them nothing is checked again: a mode trusts its context.

A :class:`Mode` is one call's way through a CP mode: its class method ``prepare(ctx)`` decides,
host-side and before any collective, how the call runs (chunkwise: which halo/state exchange, where
the layout swap goes; a setting the backend cannot honour is a ValueError there), and the instance
runs it:

- :meth:`Mode.core`: the GDN core (conv + SiLU + gated delta rule) on rank-local zigzag rows,
  ``qkv [T_local, C]``, ``g, beta [T_local, Hv]`` -> ``o [T_local, Hv, Dv]`` in the same rows;
- :meth:`Mode.run`: the whole layer segment around the core (a :class:`Segment`: in_proj, the
  gates, the gated norm, out_proj), so that a mode that moves rows to another layout may move the
  narrower tensors (chunkwise: hidden_states) instead of the core's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from ..layout.plan import CPPlan
    from ..ops.contract import Backend
    from ..ops.shape import GDNShape
    from .settings import Settings

__all__ = ["CallContext", "LayerFacts", "Mode", "Projected", "Segment"]


@dataclass(frozen=True)
class LayerFacts:
    """What a mode may need of the layer around its core (the Megatron forward has one; a
    :func:`gdn_core` call has none): the sizes that decide where chunkwise swaps layouts."""

    label: str  # how logs name the layer: "GatedDeltaNet layer 3"
    hidden_size: int  # H of hidden_states [S, B, H]
    tp: int  # tensor-parallel size
    sequence_parallel: bool  # hidden_states split along S over TP (in_proj gathers them)
    act_bytes: int  # bytes of one activation element


@dataclass(frozen=True)
class CallContext:
    """One call, checked: the settings, the TP-local head shape, this micro-batch's plan, the CP
    group (None at CP=1: no collective at all), the backend, and the layer when there is one."""

    settings: Settings
    shape: GDNShape
    plan: CPPlan
    group: Any
    backend: Backend
    layer: Optional[LayerFacts] = None


class Projected(NamedTuple):
    """What a layer's per-token work hands the core, as packed rows (b-major for SBHD)."""

    qkv: torch.Tensor  # [T, C] pre-conv q | k | v
    g: torch.Tensor  # [T, Hv] fp32 log decay
    beta: torch.Tensor  # [T, Hv]
    gate: torch.Tensor  # z [T, Hv, Dv]: the gated norm's gate


class Segment(Protocol):
    """A layer's per-token work around its core, which a mode may run on rows it moved."""

    conv_weight: torch.Tensor  # [C, W]
    conv_bias: Optional[torch.Tensor]  # [C]

    def project(self, hidden: torch.Tensor) -> Projected:
        """``hidden [S, B, H]`` (S split over TP under sequence parallelism) -> packed rows."""
        ...

    def finish(self, o: torch.Tensor, gate: torch.Tensor, batch: int) -> tuple[torch.Tensor, Any]:
        """``o, gate [T, Hv, Dv]`` -> ``(out [T/batch, batch, H], out_bias)``."""
        ...


class Mode:
    """One call's way through a CP mode (see the module docstring). Subclasses name their registry
    entry (``spec``: a :class:`~gdn_cp.modes.spec.ModeSpec`), set ``path`` (how logs and reports name
    the way: ``headwise``, ``native``, ``native-zigzag``, ``generic``, ...) and define :meth:`core`;
    :meth:`run` computes on the zigzag rows where they are."""

    path: str

    @classmethod
    def prepare(cls, ctx: CallContext) -> Mode:
        """This call's way through the mode (host-side, before any collective)."""
        return cls()

    def core(self, ctx: CallContext, qkv, g, beta, conv_weight, conv_bias) -> torch.Tensor:
        raise NotImplementedError

    def run(self, ctx: CallContext, hidden: torch.Tensor, segment: Segment) -> tuple[torch.Tensor, Any]:
        """``hidden [S, B, H]`` -> ``(out [S, B, H], out_bias)``: project, core, finish."""
        x = segment.project(hidden)
        o = self.core(ctx, x.qkv, x.g, x.beta, segment.conv_weight, segment.conv_bias)
        return segment.finish(o, x.gate, hidden.shape[1])
