"""The local (CP=1) core, the mode of a call without CP (:class:`Local`), and what the other modes share
of the core: the fused conv + split, gate packing.

Tensors are THD-packed rank-local rows (token dim first, no batch dim):
``qkv [T, C]`` with channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` before the conv,
``g [T, Hv]`` (log decay, fp32), ``beta [T, Hv]``; output ``o [T, Hv, Dv]``. The head
shape is :class:`~gdn_cp.ops.shape.GDNShape`. Everything here trusts its arguments: they were
checked where the call came in (:mod:`gdn_cp.modes.context`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import torch

from ..layout.boundaries import host_boundaries
from ..nvtx import phase
from ..ops.fused import conv_silu_split, glue_path
from ..ops.fused import glue as fused_glue
from ..ops.shape import GDNShape
from .context import CallContext, Mode

__all__ = ["ConvSplit", "Local", "conv_split", "kv_repeat", "local_core", "split_qkv", "stack_gates", "unstack_gates",
           "log_once"]

logger = logging.getLogger(__name__)


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


class ConvSplit(NamedTuple):
    """What :func:`conv_split` hands the scan: contiguous ``q, k [T, k_heads, Dk]`` (``[T, v_heads, Dk]`` where the
    glue repeated them for the backend: :func:`kv_repeat`), ``v [T, v_heads, Dv]``, and whether the kernel must
    still l2-normalize q and k (``use_qk_l2norm``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kernel_l2norm: bool


def conv_split(qkv, conv_weight, conv_bias, *, shape: GDNShape, cu_seqlens: Sequence[int], backend, glue: str,
               halo=None, k_heads: int | None = None, v_heads: int | None = None) -> ConvSplit:
    """Conv (SiLU) of pre-conv rows ``qkv [T, C]``, split into q, k, v heads, q and k l2-normalized when
    the layer asks (``shape.qk_l2norm``). ``halo [W-1, C]``: the rows before row 0 in row 0's sequence
    (chunkwise), or None. ``glue``: ``Settings.glue``, resolved for this device and dtype by
    :func:`gdn_cp.ops.fused.glue_path`:

    - ``unfused``: the backend's conv kernel, the split as views, the l2 norm left to the scan kernel;
    - ``triton`` / ``compiled`` / ``eager``: one fused step (:func:`gdn_cp.ops.fused.conv_silu_split`),
      contiguous q, k, v, the l2 norm in it.

    The same values either way (the same rounding points)."""
    cu = host_boundaries(cu_seqlens, qkv.shape[0])
    k_heads = shape.num_k_heads if k_heads is None else k_heads
    v_heads = shape.num_v_heads if v_heads is None else v_heads
    path = glue_path(glue, qkv)
    if qkv.device.type != "cpu":
        log_once(logger, ("glue", glue, path), "GatedDeltaNet glue (GDN_CP_GLUE=%s): %s", glue, _GLUE_WORDS[path])
    with phase("conv"):
        if path == "unfused":
            x = backend.causal_conv1d(qkv, conv_weight, conv_bias, cu_seqlens=cu, halo=halo, activation="silu")
            return ConvSplit(*split_qkv(x, shape, k_heads, v_heads), kernel_l2norm=shape.qk_l2norm)
        q, k, v = conv_silu_split(qkv, conv_weight, conv_bias, cu.positions(qkv.device), halo, k_heads=k_heads,
                                  v_heads=v_heads, head_k_dim=shape.head_k_dim, head_v_dim=shape.head_v_dim,
                                  qk_l2norm=shape.qk_l2norm, path=path, kv_repeat=kv_repeat(path, backend, k_heads, v_heads))
    return ConvSplit(q, k, v, kernel_l2norm=False)


def kv_repeat(path: str, backend, k_heads: int, v_heads: int) -> int:
    """How many copies of each key head the glue ``path`` writes: on a fused path, the value heads' share where the
    backend would repeat q and k for its kernel anyway and ``REPEAT_KEY_HEADS_IN_CONV`` is on (the kernel then reads
    ``Hk = Hv``); else 1 (``unfused``: the backend's conv, and the backend repeats them)."""
    if path != "unfused" and fused_glue.REPEAT_KEY_HEADS_IN_CONV and v_heads > k_heads and backend.repeats_key_heads():
        return v_heads // k_heads
    return 1


_GLUE_WORDS = {
    "unfused": "the backend's conv kernel, then the split; the scan kernel normalizes q and k",
    "triton": "gdn-cp's Triton kernels (conv + SiLU + split + l2 norm, gates)",
    "triton_one_pass": "gdn-cp's Triton kernels (conv + SiLU + split + l2 norm, gates), the conv's backward in one pass",
    "triton_norm": "gdn-cp's Triton kernels (conv + SiLU + split + l2 norm, gates, the gated norm), the conv's "
                   "backward in one pass, z and its gradient where in_proj keeps them",
    "triton_norm_dz_copy": "gdn-cp's Triton kernels (conv + SiLU + split + l2 norm, gates, the gated norm), the "
                           "conv's backward in one pass, z read where in_proj keeps it",
    "triton_norm_dz_copy_scan": "gdn-cp's Triton kernels (conv + SiLU + split + l2 norm, gates, the gated norm), "
                                "the conv's backward as a scan down the rows, z read where in_proj keeps it",
    "compiled": "gdn-cp's fused conv + SiLU + split + l2 norm and gates, compiled with torch.compile",
    "eager": "gdn-cp's fused conv + SiLU + split + l2 norm and gates in plain torch (fp64)",
}


_LOGGED: set = set()


def log_once(log: logging.Logger, key, message: str, *args) -> None:
    """``log.info(message, *args)`` the first time ``key`` is seen in this process (a mode's choices:
    each outcome once, at start-up)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(message, *args)


def local_core(qkv, g, beta, conv_weight, conv_bias, *, shape: GDNShape, cu_seqlens: Sequence[int], backend,
               glue: str, k_heads: int | None = None, v_heads: int | None = None) -> torch.Tensor:
    """Conv (SiLU) then gated delta rule on rows already in sequence order: the CP=1 core.

    ``cu_seqlens``: boundaries of these rows, passed on to the backend as they are (a plan's
    Boundaries keep their device copies). Returns ``o [T, v_heads, Dv]``. ``k_heads`` / ``v_heads``
    default to all heads (headwise passes its share); ``glue``: ``Settings.glue`` (:func:`conv_split`).
    """
    x = conv_split(qkv, conv_weight, conv_bias, shape=shape, cu_seqlens=cu_seqlens, backend=backend, glue=glue,
                   k_heads=k_heads, v_heads=v_heads)
    with phase("core"):
        o, _ = backend.chunk_gated_delta_rule(x.q, x.k, x.v, g, beta, cu_seqlens=cu_seqlens,
                                              use_qk_l2norm=x.kernel_l2norm)
    return o


class Local(Mode):
    """A call without CP (a CP group of one rank, or none): the CP=1 core on the rows as they are,
    whatever ``linear_cp_mode`` says (every mode computes the same thing there)."""

    path = "local"

    def core(self, ctx: CallContext, qkv, g, beta, conv_weight, conv_bias) -> torch.Tensor:
        return local_core(qkv, g, beta, conv_weight, conv_bias, shape=ctx.shape, cu_seqlens=ctx.plan.cu,
                          backend=ctx.backend, glue=ctx.settings.glue)
