"""A GatedDeltaNet layer's per-token work around its core, which the mode runs where its rows are
(:class:`gdn_cp.modes.context.Segment`): in_proj and the gates before, the gated norm and out_proj after.

Per CP rank, per TP rank, with T = S * B packed rows (b-major; THD: B == 1):

    hidden [S, B, H] --in_proj--> [S', B, q|k|v|z|beta|alpha] -> packed rows [T, ...]
      -> gates g = -exp(A_log) * softplus(alpha + dt_bias) (fp32), beta = sigmoid(beta)   (project)
    o [T, Hv, Dv] -> gated norm with z -> [T/B, B, Hv*Dv] --out_proj--> [S, B, H]        (finish)

The gates are computed per token with the full A_log and dt_bias, so no mode slices them. Submodules
(in_proj, out_norm, out_proj) are called exactly as the stock forward calls them, so the local and the
TransformerEngine specs both work; the layer is read only through its release's adapter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch

from ..modes.context import Projected
from ..nvtx import phase
from ..modes.packing import sbhd_to_thd, thd_to_sbhd
from ..ops.fused import gated_rms_norm, gates, glue_path
from ..ops.fused.split import split_columns

if TYPE_CHECKING:
    from ..ops.contract import Backend
    from .layer import LayerState

__all__ = ["LayerSegment"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerSegment:
    """The layer's per-token work around the core (:class:`gdn_cp.modes.context.Segment`), as the
    stock forward does it: in_proj and the gates before, the gated norm and out_proj after.
    ``state``: the layer's :class:`~gdn_cp.megatron.layer.LayerState`; ``backend``: the call's."""

    state: LayerState
    backend: Backend

    @property
    def layer(self):
        """The layer's release adapter."""
        return self.state.adapter

    @property
    def conv_weight(self) -> torch.Tensor:
        """``[C, W]``, read on every call (the parameter's current view)."""
        return self.state.adapter.conv_weight

    @property
    def conv_bias(self) -> Optional[torch.Tensor]:
        return self.state.adapter.conv_bias

    def project(self, hidden: torch.Tensor) -> Projected:
        """``hidden [S, B, H]`` -> in_proj -> packed rows ``[T, ...]``: q|k|v, the gates, z."""
        layer, shape = self.layer, self.state.shape
        qkvzba = layer.in_proj(hidden)  # [S', B, D_tp] (S' = S * sp_size)
        rows = sbhd_to_thd(qkvzba)
        qkv, gate, beta, alpha = split_columns(  # backward: into the conv's gradient buffer, where it made one
            rows, [shape.conv_dim, shape.value_dim, shape.num_v_heads, shape.num_v_heads]
        )
        path = glue_path(self.state.settings.glue, alpha)
        g, beta = gates(alpha, beta, layer.A_log, layer.dt_bias, path=path)  # [T, Hv]: g fp32, as stock
        return Projected(qkv, g, beta, gate.reshape(rows.shape[0], shape.num_v_heads, shape.head_v_dim))

    def finish(self, o: torch.Tensor, gate: torch.Tensor, batch: int):
        """``o, z [T, Hv, Dv]`` -> gated norm (the backend's fused kernel where it fits; under
        ``gdn_norm_out`` selective recompute when configured, as stock) -> out_proj ->
        ``(out [T/batch, batch, H], out_bias)``."""
        layer = self.layer
        fused = self._fused_gated_norm()
        own = gated_rms_norm(glue_path(self.state.settings.glue, o)) if fused is not None else None
        if own is not None:  # the glue path's kernel: z read, and its gradient written, where in_proj keeps them
            fused = (own, *fused[1:])
        with phase("norm"):
            if layer.recompute_norm_out:
                norm_fn = partial(_gated_norm_to_rows, layer, batch=batch, fused=fused)
                norm_out = layer.new_norm_out_checkpoint().checkpoint(norm_fn, o, gate)
            else:
                norm_out = _gated_norm_to_rows(layer, o, gate, batch, fused)
        out, out_bias = layer.out_proj(norm_out)
        if layer.recompute_norm_out:
            layer.register_norm_out_recompute(out)
        return out, out_bias

    def _fused_gated_norm(self):
        """``(fn, weight, eps)``: the backend's fused gated RMSNorm for this layer, or None when the
        backend has none or the layer's gated norm is not plain RMSNorm * silu. Decided once per
        (layer, backend, whether out_norm has forward hooks now) and logged."""
        layer, backend = self.layer, self.backend
        # out_norm's forward hooks come and go (Megatron DDP's param-gather pre-hooks): decided per state
        key = (backend, layer.out_norm_hooked)
        choices = self.state.gated_norms
        if key not in choices:
            fn = _heads_to_rows(backend.fused_gated_rms_norm())
            weight, eps, why = layer.plain_rms_gated_norm() if fn is not None else (None, None, None)
            if fn is None:
                why = f"the {backend.name} backend has no fused gated RMSNorm"
            choices[key] = None if weight is None else (fn, eps)
            logger.info("GatedDeltaNet layer %s gated norm: %s", layer.layer_number,
                        "the backend's fused RMSNorm * silu(z) kernel" if weight is not None
                        else f"the layer's own out_norm * act(z) ({why})")
        entry = choices[key]
        return None if entry is None else (entry[0], layer.gated_norm_weight(), entry[1])


def _gated_norm_to_rows(layer, o, gate, batch: int, fused=None):
    """``o, z [T, Hv, Dv]`` -> gated norm -> ``[T/batch, batch, Hv*Dv]``."""
    if fused is None:
        y = layer.gated_norm(o, gate)  # [T*Hv, Dv]
    else:
        fn, weight, eps = fused
        y = fn(o, gate, weight, eps)  # [T*Hv, Dv]
    return thd_to_sbhd(y.reshape(o.shape[0], -1), batch).contiguous()


def _heads_to_rows(fn):
    """A backend's fused gated norm (``x, z [N, D]``) as the segment calls one: ``o, z [T, Hv, Dv]``."""
    if fn is None:
        return None

    def rows_norm(o, z, weight, eps):
        dv = o.shape[-1]
        return fn(o.reshape(-1, dv), z.reshape(-1, dv), weight, eps)
    return rows_norm
