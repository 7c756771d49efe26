"""headwise: zigzag rows -> all heads' full sequences on 1/cp of the heads -> back.

Two all-to-alls in (channels of q/k/v and the gates, grouped by destination rank), one
out. Each rank runs the CP=1 core on every token of its head group, so heads must
divide cp (and TP*cp upstream): :mod:`gdn_cp.modes.spec` holds that rule, and the boundary
that made the call's context checked it.
"""

from __future__ import annotations

import torch

from ..comm import head_to_seq, seq_to_head
from ..ops.shape import GDNShape
from .local import local_core, stack_gates, unstack_gates
from .context import CallContext, Mode
from .spec import MODES

__all__ = ["Headwise"]


def _channel_index(shape: GDNShape, cp: int, rank: int) -> torch.Tensor:
    """Conv channels of rank ``rank``'s head group, in [q | k | v] order."""
    kq = shape.key_dim // cp
    vq = shape.value_dim // cp
    return torch.cat(
        [
            torch.arange(rank * kq, (rank + 1) * kq),
            shape.key_dim + torch.arange(rank * kq, (rank + 1) * kq),
            2 * shape.key_dim + torch.arange(rank * vq, (rank + 1) * vq),
        ]
    )


def _group_by_rank(qkv: torch.Tensor, shape: GDNShape, cp: int) -> torch.Tensor:
    """``[T, C]`` -> ``[T, cp, C/cp]``: rank p's q, k and v heads side by side."""
    t, kq, vq = qkv.shape[0], shape.key_dim // cp, shape.value_dim // cp  # sizes spelled out: t may be 0
    q, k, v = torch.split(qkv, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    return torch.cat([q.reshape(t, cp, kq), k.reshape(t, cp, kq), v.reshape(t, cp, vq)], dim=-1)


class Headwise(Mode):
    """headwise decides nothing per call: seq -> head all-to-all, the CP=1 core on 1/cp of the
    heads, head -> seq."""

    spec = MODES["headwise"]
    path = "headwise"

    def core(self, ctx: CallContext, qkv, g, beta, conv_weight, conv_bias) -> torch.Tensor:
        plan, shape, group = ctx.plan, ctx.shape, ctx.group
        cp, rank = plan.cp_size, plan.cp_rank
        t_local = qkv.shape[0]
        k_heads, v_heads = shape.num_k_heads // cp, shape.num_v_heads // cp
        to_natural, to_buffer, _ = plan.natural_order().on(qkv.device)
        channels = plan.cached_on(("headwise_channels", shape), qkv.device, lambda: _channel_index(shape, cp, rank))

        qkv_h = seq_to_head(_group_by_rank(qkv, shape, cp), group).index_select(0, to_natural)
        gates = stack_gates(g, beta).reshape(t_local, cp, v_heads * 2)
        gates_h = seq_to_head(gates, group).index_select(0, to_natural).reshape(plan.t_global, v_heads, 2)

        weight = conv_weight.index_select(0, channels)
        bias = None if conv_bias is None else conv_bias.index_select(0, channels)
        g_h, beta_h = unstack_gates(gates_h, g.dtype, beta.dtype)
        o = local_core(qkv_h, g_h, beta_h, weight, bias, shape=shape, cu_seqlens=plan.cu, backend=ctx.backend,
                       glue=ctx.settings.glue, k_heads=k_heads, v_heads=v_heads)  # [T_global, Hv/cp, Dv]
        o = head_to_seq(o.index_select(0, to_buffer), group)  # [T_local, cp, Hv/cp, Dv]
        return o.reshape(t_local, shape.num_v_heads, shape.head_v_dim)
