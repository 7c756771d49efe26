"""The local (CP=1) core, the mode of a call without CP (:class:`Local`), and what the other modes share
of the core: the fused conv + split, gate packing.

Tensors are THD-packed rank-local rows (token dim first, no batch dim):
``qkv [T, C]`` with channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` before the conv,
``g [T, Hv]`` (log decay, fp32), ``beta [T, Hv]``; output ``o [T, Hv, Dv]``. The head
shape is :class:`~gdn_cp.ops.shape.GDNShape`. Everything here trusts its arguments: they were
checked where the call came in (:mod:`gdn_cp.modes.context`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout.boundaries import host_boundaries
from ..ops.fused import conv_silu_split
from ..ops.shape import GDNShape
from .context import CallContext, Mode

__all__ = ["Local", "conv_split", "local_core", "split_qkv", "stack_gates", "unstack_gates"]


def stack_gates(g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``g, beta [T, Hv]`` -> ``[T, Hv, 2]`` in the wider of the two dtypes (one collective
    moves both, and neither loses precision)."""
    dtype = torch.promote_types(g.dtype, beta.dtype)
    return torch.stack([g.to(dtype), beta.to(dtype)], dim=-1)


def unstack_gates(gates: torch.Tensor, g_dtype: torch.dtype, beta_dtype: torch.dtype):
    """Inverse of :func:`stack_gates`: back to the callers' dtypes."""
    return gates[..., 0].to(g_dtype), gates[..., 1].to(beta_dtype)


def split_qkv(x: torch.Tensor, shape: GDNShape, k_heads: int, v_heads: int):
    """``[T, C]`` post-conv channels -> q, k ``[T, k_heads, Dk]`` and v ``[T, v_heads, Dv]``."""
    kd, vd = k_heads * shape.head_k_dim, v_heads * shape.head_v_dim
    q, k, v = torch.split(x, [kd, kd, vd], dim=-1)
    t = x.shape[0]
    return (
        q.reshape(t, k_heads, shape.head_k_dim),
        k.reshape(t, k_heads, shape.head_k_dim),
        v.reshape(t, v_heads, shape.head_v_dim),
    )


def conv_split(qkv, conv_weight, conv_bias, *, shape: GDNShape, cu_seqlens: Sequence[int], halo=None,
               k_heads: int | None = None, v_heads: int | None = None):
    """Conv (SiLU) of pre-conv rows ``qkv [T, C]``, split into contiguous ``q, k [T, k_heads, Dk]``
    and ``v [T, v_heads, Dv]``, q and k l2-normalized when the layer asks (``shape.qk_l2norm``): one
    fused step (:func:`gdn_cp.ops.fused.conv_silu_split`, compiled on CUDA), so the kernels take q
    and k as they are (``use_qk_l2norm=False``). ``halo [W-1, C]``: the rows before row 0 in row
    0's sequence (chunkwise), or None."""
    cu = host_boundaries(cu_seqlens, qkv.shape[0])
    return conv_silu_split(
        qkv, conv_weight, conv_bias, cu.positions(qkv.device), halo,
        k_heads=shape.num_k_heads if k_heads is None else k_heads,
        v_heads=shape.num_v_heads if v_heads is None else v_heads,
        head_k_dim=shape.head_k_dim, head_v_dim=shape.head_v_dim, qk_l2norm=shape.qk_l2norm,
    )


def local_core(qkv, g, beta, conv_weight, conv_bias, *, shape: GDNShape, cu_seqlens: Sequence[int], backend,
               k_heads: int | None = None, v_heads: int | None = None) -> torch.Tensor:
    """Conv (SiLU) then gated delta rule on rows already in sequence order: the CP=1 core.

    ``cu_seqlens``: boundaries of these rows, passed on to the backend as they are (a plan's
    Boundaries keep their device copies). Returns ``o [T, v_heads, Dv]``. ``k_heads`` / ``v_heads``
    default to all heads (headwise passes its share).
    """
    q, k, v = conv_split(qkv, conv_weight, conv_bias, shape=shape, cu_seqlens=cu_seqlens, k_heads=k_heads,
                         v_heads=v_heads)
    o, _ = backend.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm=False)
    return o


class Local(Mode):
    """A call without CP (a CP group of one rank, or none): the CP=1 core on the rows as they are,
    whatever ``linear_cp_mode`` says (every mode computes the same thing there)."""

    path = "local"

    def core(self, ctx: CallContext, qkv, g, beta, conv_weight, conv_bias) -> torch.Tensor:
        return local_core(qkv, g, beta, conv_weight, conv_bias, shape=ctx.shape, cu_seqlens=ctx.plan.cu,
                          backend=ctx.backend)
