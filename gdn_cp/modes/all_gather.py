"""all_gather: every rank gathers the whole sequence, runs the CP=1 core on it and keeps
its own zigzag rows. Backward reduce-scatters the input gradients.

Costs cp x the compute and O(T_global) activation memory per rank; needs nothing of the
head count. The fallback of last resort.
"""

from __future__ import annotations

from ..comm import all_gather_rows
from ..layout import ZIGZAG
from ..layout.plan import CPPlan
from ..ops.shape import GDNShape
from .call import ModeCall
from .common import local_core, stack_gates, unstack_gates

__all__ = ["all_gather_core", "prepare"]


def all_gather_core(qkv, g, beta, conv_weight, conv_bias, *, shape: GDNShape, plan: CPPlan, group, backend):
    to_natural, _, own_rows = plan.natural_order().on(qkv.device)
    qkv_full = all_gather_rows(qkv, group).index_select(0, to_natural)
    gates = all_gather_rows(stack_gates(g, beta), group).index_select(0, to_natural)
    g_full, beta_full = unstack_gates(gates, g.dtype, beta.dtype)
    o = local_core(
        qkv_full,
        g_full,
        beta_full,
        conv_weight,
        conv_bias,
        shape=shape,
        cu_seqlens=plan.cu,
        backend=backend,
    )
    return o.index_select(0, own_rows)


def prepare(backend, group, plan: CPPlan) -> ModeCall:
    """all_gather decides nothing per call: its one core, on the zigzag rows."""
    return _CALL


_CALL = ModeCall(cores={ZIGZAG: all_gather_core}, path="all_gather")
