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

from ..installed import log_stack_once
from ..kernel_args import boundaries_of, check_gdr_args, check_initial_state, require_device
from ..varlen import varlen_gated_delta_rule
from .detect import features, fla_import_error, fla_own_gated_delta_rule, has_cp_context, stack_report
from .spec import SPEC

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "FLAFunctions", "fla_api", "kv_heads_for_kernel"]


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
    log_stack_once("FLA", stack_report)
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d

    build_cp_context = None
    if has_cp_context():
        from fla.ops.cp import build_cp_context
    # FLA's own Triton kernel, behind FLA >= 0.6's dispatch (which would hand calls to FlashQLA)
    return FLAFunctions(fla_own_gated_delta_rule()[0], fla_causal_conv1d, build_cp_context)


def expand_kv_groups(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[T, Hk, D] -> [T, Hv, D]``; value head h reads key head h // ratio. FLA 0.4.2's GDN
    kernels take one head count for q/k/v, so grouped heads are expanded here (autograd sums
    the copies)."""
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=1)


def repeats_key_heads() -> bool:
    """Whether :func:`kv_heads_for_kernel` repeats q and k (this FLA has no grouped value heads)."""
    return not features().grouped_value_heads


def kv_heads_for_kernel(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """q or k ``[T, Hk, D]`` as this FLA's chunk_gated_delta_rule takes it: unchanged where it
    takes grouped value heads (FLA >= 0.5: value head h reads key head h // ratio inside the
    kernel, the same rule), else repeated to ``[T, Hv, D]`` (:func:`expand_kv_groups`). Which
    one is logged once with the stack (:func:`gdn_cp.ops.installed.log_stack_once`)."""
    return x if features().grouped_value_heads else expand_kv_groups(x, ratio)


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
    require_device(SPEC, "x", x)
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
    cu = boundaries_of(cu_seqlens, T)
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
    T, Hk, Dk, Hv, Dv = check_gdr_args(SPEC, q, k, v, g, beta)
    ratio = Hv // Hk
    cu = boundaries_of(cu_seqlens, T)
    check_initial_state(initial_state, cu.num_sequences, Hv, Dk, Dv)

    def run(cu_ne, h0):
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
        return o.squeeze(0), fs

    return varlen_gated_delta_rule(run, cu, v, Dk, initial_state, output_final_state)
