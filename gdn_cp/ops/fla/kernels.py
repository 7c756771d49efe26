"""FLA's CUDA kernels behind the backend contract, at CP=1 (one rank's rows).

Tensors are THD packed without a batch dimension (token first). FLA wants ``[1, T, ...]`` and
``cu_seqlens`` as a device tensor plus a host copy: both come from the caller's
:class:`~gdn_cp.layout.Boundaries`, which caches them (modes pass the plan's boundaries, so
each copy is made once per micro-batch and the same device tensor also lets FLA's
identity-keyed caches hit across layers). No call reads device data back to the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ...layout.boundaries import Boundaries, host_boundaries
from ..shape import value_heads_per_key_head
from ..varlen import all_final_states, kept_initial_states
from .detect import features, fla_import_error, fla_own_gated_delta_rule, has_cp_context, log_stack_once

__all__ = [
    "FLA_MAX_HEAD_K_DIM",
    "FLA_MIN_HEAD_DIM",
    "causal_conv1d",
    "check_core",
    "check_head_dims",
    "chunk_gated_delta_rule",
    "FLAFunctions",
    "fla_api",
    "kv_heads_for_kernel",
]

# chunk_gated_delta_rule_fwd_h asserts K <= 256 (FLA 0.4.2 .. 0.6); tl.dot needs every block dim >= 16.
FLA_MAX_HEAD_K_DIM = 256
FLA_MIN_HEAD_DIM = 16


@dataclass(frozen=True)
class FLAFunctions:
    """The FLA functions gdn-cp calls (``build_cp_context``: None where this FLA has no cp context)."""

    chunk_gated_delta_rule: Callable[..., Any]
    causal_conv1d: Callable[..., Any]
    build_cp_context: Optional[Callable[..., Any]]


@functools.lru_cache(maxsize=1)
def fla_api() -> FLAFunctions:
    """FLA's functions (imported on first use); RuntimeError with the fix when FLA does not import."""
    err = fla_import_error()
    if err is not None:
        raise RuntimeError(
            f"FLA backend unavailable: {err}. Fix: install flash-linear-attention (>= 0.4.2) with a "
            "Triton it supports on a CUDA machine, or use gdn_cp.ops.reference."
        )
    log_stack_once()
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d

    build_cp_context = None
    if has_cp_context():
        from fla.ops.cp import build_cp_context
    # FLA's own Triton kernel, behind FLA >= 0.6's dispatch (which would hand calls to FlashQLA)
    return FLAFunctions(fla_own_gated_delta_rule()[0], fla_causal_conv1d, build_cp_context)


def require_cuda(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}; the FLA backend runs Triton kernels on CUDA tensors only. "
            "Fix: move the inputs to a CUDA device, or use gdn_cp.ops.reference on the CPU."
        )


def check_head_dims(head_k_dim: int, head_v_dim: int) -> None:
    if not (FLA_MIN_HEAD_DIM <= head_k_dim <= FLA_MAX_HEAD_K_DIM):
        raise ValueError(
            f"head_k_dim={head_k_dim} is outside what FLA's GDN kernels support "
            f"[{FLA_MIN_HEAD_DIM}, {FLA_MAX_HEAD_K_DIM}]. Fix: use a key head dim in that range, "
            "or the reference backend."
        )
    if head_v_dim < FLA_MIN_HEAD_DIM:
        raise ValueError(
            f"head_v_dim={head_v_dim} is below FLA's minimum {FLA_MIN_HEAD_DIM}. Fix: use a value head "
            "dim >= 16, or the reference backend."
        )


def check_core(shape, dtype: torch.dtype) -> None:
    """The contract's optional pre-collective check: ValueError where FLA's kernels cannot take this
    layer's head dims (any float dtype is taken)."""
    check_head_dims(shape.head_k_dim, shape.head_v_dim)


def expand_kv_groups(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[T, Hk, D] -> [T, Hv, D]``; value head h reads key head h // ratio. FLA 0.4.2's GDN
    kernels take one head count for q/k/v, so grouped heads are expanded here (autograd sums
    the copies)."""
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=1)


def kv_heads_for_kernel(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """q or k ``[T, Hk, D]`` as this FLA's chunk_gated_delta_rule takes it: unchanged where it
    takes grouped value heads (FLA >= 0.5: value head h reads key head h // ratio inside the
    kernel, the same rule), else repeated to ``[T, Hv, D]`` (:func:`expand_kv_groups`). Which
    one is logged once with the stack (:func:`gdn_cp.ops.fla.detect.log_stack_once`)."""
    return x if features().grouped_value_heads else expand_kv_groups(x, ratio)


def _boundaries(cu_seqlens: Sequence[int] | None, total: int) -> Boundaries:
    return host_boundaries((0, total) if cu_seqlens is None else cu_seqlens, total)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: Sequence[int] | None = None,
    halo: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over packed THD rows, restarting at every boundary.

    x [T, C], weight [C, W], bias [C] or None; ``halo`` [W-1, C] holds the W-1 rows that precede
    row 0 and belong to the sequence that starts at row 0 (zeros where there is no such row).
    Returns [T, C] in x's dtype (SiLU applied when ``activation`` is "silu"/"swish").
    """
    require_cuda("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C] (THD, no batch dim); got shape {tuple(x.shape)}. "
                         "Fix: flatten the batch into the token dim and pass cu_seqlens.")
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C={C}, W]; got shape {tuple(weight.shape)}. "
                         "Fix: squeeze nn.Conv1d's [C, 1, W] weight to [C, W].")
    W = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must be [C={C}]; got shape {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r} is not supported; use 'silu' or None")
    if halo is not None and tuple(halo.shape) != (W - 1, C):
        raise ValueError(f"halo must be [W-1={W - 1}, C={C}]; got shape {tuple(halo.shape)}. "
                         "Fix: pass the W-1 rows preceding row 0 (zeros where absent).")
    cu = _boundaries(cu_seqlens, T)
    if T == 0:
        return x.new_empty(0, C)
    cu_ne, _ = cu.nonempty()
    n = cu_ne.num_sequences

    initial_state = None
    if halo is not None and W > 1:
        # FLA's conv state is [N, C, W]; column W-1 is the row just before the sequence start and
        # column 0 is never read. Only the sequence starting at row 0 continues from the halo.
        first = torch.cat([halo.new_zeros(C, 1), halo.to(x.dtype).t()], dim=1).unsqueeze(0)
        if n > 1:
            first = torch.cat([first, first.new_zeros(n - 1, C, W)], dim=0)
        initial_state = first.contiguous()

    y, _ = fla_api().causal_conv1d(
        x=x.unsqueeze(0),
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        output_final_state=False,
        activation=activation,
        cu_seqlens=cu_ne.on(x.device),
        cu_seqlens_cpu=cu_ne.cpu(),
    )
    return y.squeeze(0)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: Sequence[int] | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over packed THD rows, the state restarting at every boundary.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] log-decay (computed in fp32); beta [T, Hv];
    initial_state [N, Hv, Dk, Dv] (N = len(cu_seqlens) - 1, empty sequences included).
    Returns (o [T, Hv, Dv] in v's dtype, final_state [N, Hv, Dk, Dv] fp32 or None).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require_cuda(name, t)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [T={q.shape[0]}, Hv, Dv]; got {tuple(v.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    ratio = value_heads_per_key_head(Hk, Hv)
    check_head_dims(Dk, Dv)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, Hv={Hv}]; got {tuple(t.shape)}")
    cu = _boundaries(cu_seqlens, T)
    n_all = cu.num_sequences
    if initial_state is not None and tuple(initial_state.shape) != (n_all, Hv, Dk, Dv):
        raise ValueError(
            f"initial_state must be [N={n_all}, Hv={Hv}, Dk={Dk}, Dv={Dv}] (one state per sequence of "
            f"cu_seqlens, empty ones included); got {tuple(initial_state.shape)}"
        )
    if cu.total == 0:  # no rows at all (every sequence empty)
        o = v.new_empty(0, Hv, Dv)
        if not output_final_state:
            return o, None
        fs = (initial_state.float() if initial_state is not None
              else v.new_zeros(n_all, Hv, Dk, Dv, dtype=torch.float32))
        return o, fs

    cu_ne, keep = cu.nonempty()
    h0 = kept_initial_states(initial_state, keep, n_all)

    o, fs = fla_api().chunk_gated_delta_rule(
        q=kv_heads_for_kernel(q, ratio).unsqueeze(0),
        k=kv_heads_for_kernel(k, ratio).unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0),
        scale=scale,
        initial_state=h0,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_ne.on(q.device),
        cu_seqlens_cpu=cu_ne.cpu(),
    )
    o = o.squeeze(0)
    if not output_final_state:
        return o, None
    return o, all_final_states(fs, keep, n_all, initial_state)  # empty sequences pass their state through
