"""all_gather: every rank gathers the whole sequence, runs the CP=1 core on it and keeps
its own zigzag rows. Backward reduce-scatters the input gradients.

Costs cp x the compute and O(T_global) activation memory per rank; needs nothing of the
head count. The fallback of last resort.
"""

from __future__ import annotations

import torch

from ..comm import all_gather_rows
from .local import local_core, stack_gates, unstack_gates
from .context import CallContext, Mode
from .spec import MODES

__all__ = ["AllGather"]


class AllGather(Mode):
    """all_gather decides nothing per call: gather, the CP=1 core on every row, keep this rank's."""

    spec = MODES["all_gather"]
    path = "all_gather"

    def core(self, ctx: CallContext, qkv, g, beta, conv_weight, conv_bias) -> torch.Tensor:
        plan, group = ctx.plan, ctx.group
        to_natural, _, own_rows = plan.natural_order().on(qkv.device)
        qkv_full = all_gather_rows(qkv, group).index_select(0, to_natural)
        gates = all_gather_rows(stack_gates(g, beta), group).index_select(0, to_natural)
        g_full, beta_full = unstack_gates(gates, g.dtype, beta.dtype)
        o = local_core(qkv_full, g_full, beta_full, conv_weight, conv_bias, shape=ctx.shape, cu_seqlens=plan.cu,
                       backend=ctx.backend, glue=ctx.settings.glue)
        return o.index_select(0, own_rows)
