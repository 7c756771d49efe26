"""What every mode shares: input checks, gate packing and the CP=1 core.

Tensors are THD-packed rank-local rows (token dim first, no batch dim):
``qkv [T, C]`` with channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` before the conv,
``g [T, Hv]`` (log decay, fp32), ``beta [T, Hv]``; output ``o [T, Hv, Dv]``. The head
shape is :class:`~gdn_cp.ops.shape.GDNShape` (re-exported from ``gdn_cp.modes``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..checks import as_int
from ..layout.plan import CPPlan
from ..ops.contract import check_backend
from ..ops.gates import check_log_decay
from ..ops.shape import GDNShape, value_heads_per_key_head

__all__ = ["check_inputs", "local_core", "split_qkv", "stack_gates", "unstack_gates"]


def _check_tensor(name: str, t, device: torch.device | None = None) -> None:
    """A floating-point tensor with values (not meta), on ``device`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values; pass tensors on the CPU or a GPU")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but qkv is on {device}; put every input on one device")


def check_inputs(qkv, g, beta, conv_weight, conv_bias, shape: GDNShape, plan: CPPlan, group_world: int) -> None:
    """Raise before any collective when tensors, plan and group do not fit together."""
    if not isinstance(shape, GDNShape):
        raise TypeError(f"shape must be a GDNShape, got {type(shape).__name__}")
    if not isinstance(plan, CPPlan):
        raise TypeError(
            f"plan must be a CPPlan (RouteCache().plan(cu_seqlens, cp, rank) or plan_for_sbhd), got {type(plan).__name__}"
        )
    if plan.cp_size != group_world:
        raise ValueError(
            f"the plan was built for cp={plan.cp_size} but the process group has {group_world} ranks; "
            f"build the plan with the group's size (dynamic CP: PackedSeqParams.local_cp_size)"
        )
    t_local = plan.t_local
    _check_tensor("qkv", qkv)
    device = qkv.device
    expect = {
        "qkv": (qkv, (t_local, shape.conv_dim)),
        "g": (g, (t_local, shape.num_v_heads)),
        "beta": (beta, (t_local, shape.num_v_heads)),
    }
    for name, (tensor, want) in expect.items():
        _check_tensor(name, tensor, device)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {want} "
                f"(T_local = T_global/cp = {plan.t_global}/{plan.cp_size} of the plan; heads from GDNShape)"
            )
    _check_tensor("conv_weight", conv_weight, device)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != shape.conv_dim or conv_weight.shape[1] < 1:
        raise ValueError(
            f"conv_weight has shape {tuple(conv_weight.shape)}, expected [{shape.conv_dim}, W] with W >= 1 "
            f"(reshape Megatron's [C, 1, W] weight to [C, W])"
        )
    if conv_bias is not None:
        _check_tensor("conv_bias", conv_bias, device)
        if tuple(conv_bias.shape) != (shape.conv_dim,):
            raise ValueError(f"conv_bias has shape {tuple(conv_bias.shape)}, expected ({shape.conv_dim},)")
    if g.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"g (log decay) must be float32 or float64, got {g.dtype}")
    if g.device.type == "cpu" and group_world == 1:  # host values: free to read; no collective follows
        check_log_decay(g)


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


def _check_local_inputs(qkv, g, beta, conv_weight, conv_bias, shape, backend, k_heads, v_heads) -> None:
    """What :func:`local_core` needs beyond the backend's own checks (cheap, host-side), so that
    messages use its own argument names."""
    check_backend(backend)
    for name, heads, total in (("k_heads", k_heads, shape.num_k_heads), ("v_heads", v_heads, shape.num_v_heads)):
        if as_int(heads) is None or not 1 <= heads <= total:
            raise ValueError(f"{name} must be an int in [1, {total}] (this rank's share of the heads), got {heads!r}")
    value_heads_per_key_head(k_heads, v_heads)
    conv_dim = 2 * k_heads * shape.head_k_dim + v_heads * shape.head_v_dim
    _check_tensor("qkv", qkv)
    for name, t, width in (("qkv", qkv, conv_dim), ("g", g, v_heads), ("beta", beta, v_heads)):
        _check_tensor(name, t, qkv.device)
        if t.dim() != 2 or t.shape[1] != width or t.shape[0] != qkv.shape[0]:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected [T, {width}] with T = qkv.shape[0] "
                f"(k_heads={k_heads}, v_heads={v_heads} of GDNShape)"
            )
    _check_tensor("conv_weight", conv_weight, qkv.device)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != conv_dim or conv_weight.shape[1] < 1:
        raise ValueError(f"conv_weight has shape {tuple(conv_weight.shape)}, expected [{conv_dim}, W] with W >= 1")
    if conv_bias is not None:
        _check_tensor("conv_bias", conv_bias, qkv.device)
        if tuple(conv_bias.shape) != (conv_dim,):
            raise ValueError(f"conv_bias has shape {tuple(conv_bias.shape)}, expected ({conv_dim},)")


def local_core(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias,
    *,
    shape: GDNShape,
    cu_seqlens: Sequence[int],
    backend,
    k_heads: int | None = None,
    v_heads: int | None = None,
    halo: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
):
    """Conv (SiLU) then gated delta rule on rows already in sequence order.

    ``cu_seqlens``: boundaries of these rows, passed on to the backend as they are (a plan's
    Boundaries keep their device copies). Returns ``o [T, v_heads, Dv]``. ``k_heads``/``v_heads``
    default to all heads (headwise passes its share).
    """
    if not isinstance(shape, GDNShape):
        raise TypeError(f"shape must be a GDNShape, got {type(shape).__name__}")
    k_heads = shape.num_k_heads if k_heads is None else k_heads
    v_heads = shape.num_v_heads if v_heads is None else v_heads
    _check_local_inputs(qkv, g, beta, conv_weight, conv_bias, shape, backend, k_heads, v_heads)
    x = backend.causal_conv1d(qkv, conv_weight, conv_bias, cu_seqlens=cu_seqlens, halo=halo, activation="silu")
    q, k, v = split_qkv(x, shape, k_heads, v_heads)
    o, _ = backend.chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state, use_qk_l2norm=shape.qk_l2norm
    )
    return o
