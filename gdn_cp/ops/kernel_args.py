"""The argument checks every wrapper of a kernel library shares (FLA's, FlashQLA's), written once.

Each takes the backend's :class:`~gdn_cp.ops.contract.BackendSpec` (its title, devices, head-dim and
dtype rules) and raises TypeError / ValueError naming the argument, its value and the fix, before any
kernel runs and before any collective. Host metadata only: nothing here reads device data.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..layout.boundaries import Boundaries, host_boundaries
from .contract import BackendSpec
from .shape import GDNShape, value_heads_per_key_head

__all__ = ["boundaries_of", "check_core_args", "check_gdr_args", "check_initial_state", "require_device"]


def require_device(spec: BackendSpec, name: str, t, devices: Optional[Sequence[str]] = None) -> None:
    """``t`` is a tensor on one of ``devices`` (default: the backend's)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in (spec.devices if devices is None else devices):
        raise ValueError(f"{name} is on {t.device}; {spec.devices_why}. Fix: move the inputs to "
                         f"{' or '.join(spec.devices)}, or use the reference backend (gdn_cp.ops.reference) on the CPU.")


def check_gdr_args(spec: BackendSpec, q, k, v, g, beta, devices: Optional[Sequence[str]] = None):
    """The gated delta rule's tensors: q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]`` (Hv a multiple of Hk),
    g, beta ``[T, Hv]``, on the backend's devices, head dims and dtypes it takes. Returns
    ``(T, Hk, Dk, Hv, Dv)``."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require_device(spec, name, t, devices)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [T={q.shape[0]}, Hv, Dv]; got {tuple(v.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    value_heads_per_key_head(Hk, Hv)
    spec.check_head_dims(Dk, Dv)
    if spec.dtypes is not None and not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype for {spec.title}; got {q.dtype}, {k.dtype}, {v.dtype}")
    spec.check_dtype(q.dtype)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, Hv={Hv}]; got {tuple(t.shape)}")
    return T, Hk, Dk, Hv, Dv


def boundaries_of(cu_seqlens: Optional[Sequence[int]], total: int) -> Boundaries:
    """The checked boundaries of ``total`` rows (None: one sequence of every row)."""
    return host_boundaries((0, total) if cu_seqlens is None else cu_seqlens, total)


def check_initial_state(initial_state, n_all: int, hv: int, dk: int, dv: int) -> None:
    """``initial_state`` is None or ``[N, Hv, Dk, Dv]``, one state per sequence (empty ones included)."""
    if initial_state is not None and tuple(initial_state.shape) != (n_all, hv, dk, dv):
        raise ValueError(
            f"initial_state must be [N={n_all}, Hv={hv}, Dk={dk}, Dv={dv}] (one state per sequence of "
            f"cu_seqlens, empty ones included); got {tuple(initial_state.shape)}"
        )


def check_core_args(spec: BackendSpec, qkv, g, beta, conv_weight, shape: GDNShape,
                    devices: Optional[Sequence[str]] = None) -> int:
    """A native core's tensors: ``qkv [T_c, C]`` (C the layer's ``[q|k|v]`` channels), ``g, beta
    [T_c, Hv]``, ``conv_weight [C, W]``, on the backend's devices, for head dims and a dtype it takes.
    Returns the conv width W."""
    for name, t in (("qkv", qkv), ("g", g), ("beta", beta), ("conv_weight", conv_weight)):
        require_device(spec, name, t, devices)
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T_c, C] (THD, batch folded into tokens, B == 1); got {tuple(qkv.shape)}")
    spec.check_head_dims(shape.head_k_dim, shape.head_v_dim)
    spec.check_dtype(qkv.dtype)
    t_c, c = qkv.shape
    if c != shape.conv_dim:
        hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
        raise ValueError(f"qkv has {c} channels but [q|k|v] needs 2*{hk}*{dk} + {hv}*{dv} = {shape.conv_dim}. "
                         "Fix: pass the GDNShape of this (TP-local) layer.")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != c:
        raise ValueError(f"conv_weight must be [C={c}, W]; got {tuple(conv_weight.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (t_c, shape.num_v_heads):
            raise ValueError(f"{name} must be [T_c={t_c}, Hv={shape.num_v_heads}]; got {tuple(t.shape)}")
    return conv_weight.shape[1]
