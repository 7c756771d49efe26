"""FlashQLA's gated delta rule behind the backend contract, at CP=1 (one rank's rows), with FLA's
causal conv and fused gated norm beside it (FlashQLA has neither).

Tensors are THD packed without a batch dimension (token first). FlashQLA takes FLA's layout
``[1, T, ...]`` with grouped value heads (q/k at the key heads), ``g`` in log space and
``cu_seqlens`` on the device; gdn-cp passes the caller's :class:`~gdn_cp.layout.Boundaries`' cached
int32 device copy (FlashQLA's own boundaries are int32; one dtype keeps TileLang to one kernel
variant, and the same tensor object lets FlashQLA's identity-keyed caches hit across layers).

What FlashQLA 0.1.3 takes (``hopper/*.py`` assert it; gdn-cp refuses anything else before any
collective, naming the fix): head dims ``K == V == 128`` and bf16 / fp16 q, k, v. A value head dim
that is a multiple of 128 runs as one call per 128 columns: each column of the state, and of the
output, evolves on its own (``S[:, j]`` only ever reads ``v[:, j]``), so that is exact; chunkwise's
transition summary (values ``[0 | v]``, ``Dk + Dv`` wide) runs that way.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ...layout.boundaries import host_boundaries
from ..shape import GDNShape, value_heads_per_key_head
from ..varlen import all_final_states, kept_initial_states
from .detect import auto_cp_setting, conv_choice, features, flashqla_problem, fused_norm_choice, log_stack_once

__all__ = [
    "FLASHQLA_DTYPES",
    "FLASHQLA_HEAD_DIM",
    "causal_conv1d",
    "check_core",
    "check_dtype",
    "check_head_dims",
    "chunk_gated_delta_rule",
    "FlashQLAFunctions",
    "flashqla_api",
    "fused_gated_rms_norm",
    "run_in_value_blocks",
]

logger = logging.getLogger(__name__)

FLASHQLA_HEAD_DIM = 128
"""The key and value head dim FlashQLA's kernels take (a value head dim that is a multiple of it
runs as one call per block)."""
FLASHQLA_DTYPES = (torch.bfloat16, torch.float16)
_DEVICE_TYPES = ("cuda",)  # the device types the kernels take (a CPU stand-in in tests widens it)


@dataclass(frozen=True)
class FlashQLAFunctions:
    """The FlashQLA functions gdn-cp calls (``build_cp_context``: None where it has no inter-card context)."""

    chunk_gated_delta_rule: Callable[..., Any]
    build_cp_context: Optional[Callable[..., Any]]


@functools.lru_cache(maxsize=1)
def flashqla_api() -> FlashQLAFunctions:
    """FlashQLA's functions (imported on first use); RuntimeError with the fix when it cannot run."""
    problem = flashqla_problem()
    if problem is not None:
        raise RuntimeError(f"FlashQLA backend unavailable: {problem}. Fix: install it on an sm_90+ GPU machine "
                           "(pip install -e '.[flashqla]'), or use linear_cp_backend='fla' / 'reference'.")
    log_stack_once()
    chunk = importlib.import_module("flash_qla.ops.gated_delta_rule.chunk")
    return FlashQLAFunctions(importlib.import_module("flash_qla").chunk_gated_delta_rule,
                             getattr(chunk, "build_cp_context", None) if features().inter_card_cp else None)


def check_head_dims(head_k_dim: int, head_v_dim: int) -> None:
    """ValueError unless FlashQLA's kernels take these head dims."""
    if head_k_dim != FLASHQLA_HEAD_DIM or head_v_dim % FLASHQLA_HEAD_DIM or head_v_dim < FLASHQLA_HEAD_DIM:
        raise ValueError(
            f"head_k_dim={head_k_dim}, head_v_dim={head_v_dim}: FlashQLA's kernels take head dims of "
            f"{FLASHQLA_HEAD_DIM} only (a value head dim that is a multiple of {FLASHQLA_HEAD_DIM} runs in blocks). "
            "Fix: linear_cp_backend='fla' (FLA takes key head dims 16..256), or 'auto' (FlashQLA where it fits)."
        )


def check_dtype(dtype: torch.dtype) -> None:
    """ValueError unless FlashQLA's kernels take ``dtype`` for q, k and v."""
    if dtype not in FLASHQLA_DTYPES:
        raise ValueError(
            f"dtype {dtype}: FlashQLA's kernels take bfloat16 or float16 q, k, v only. Fix: train in bf16 "
            "(Megatron-LM --bf16), or linear_cp_backend='fla' / 'auto' (FLA takes float32 too)."
        )


def check_core(shape: GDNShape, dtype: torch.dtype) -> None:
    """The contract's optional pre-collective check: ValueError where FlashQLA cannot take this
    layer's head dims or the dtype of its activations (``gdn_core`` asks before any collective)."""
    check_head_dims(shape.head_k_dim, shape.head_v_dim)
    check_dtype(dtype)


def require_device(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in _DEVICE_TYPES:
        raise ValueError(
            f"{name} is on {t.device}; the FlashQLA backend runs TileLang kernels on CUDA tensors only. "
            "Fix: move the inputs to an sm_90+ GPU, or use gdn_cp.ops.reference on the CPU."
        )


# --------------------------------------------------------------------------------------------
# what FlashQLA does not have: the causal conv and the fused gated norm
# --------------------------------------------------------------------------------------------

def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Sequence[int],
    halo: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv ``x [T, C]``, ``weight [C, W]`` -> ``[T, C]``, restarting at every
    boundary; ``halo [W-1, C]``: the rows before row 0 in row 0's sequence. :func:`conv_choice`'s kernel."""
    return conv_choice()[0](x, weight, bias, cu_seqlens=cu_seqlens, halo=halo, activation=activation)


@functools.lru_cache(maxsize=1)
def fused_gated_rms_norm() -> Optional[Callable]:
    """The contract's optional fused gated norm: FLA's, where FLA has it (FlashQLA has none)."""
    return fused_norm_choice()[0]


# --------------------------------------------------------------------------------------------
# the gated delta rule
# --------------------------------------------------------------------------------------------

def run_in_value_blocks(call: Callable, v: torch.Tensor, initial_state: Optional[torch.Tensor],
                        output_final_state: bool):
    """``call(v_block [.., 128], h0_block [.., Dk, 128] | None) -> (o_block, final_block | None)``
    over ``v [..., Dv]`` in 128-wide blocks (one call when Dv == 128); outputs and final states put
    side by side again. Exact: column j of the state only ever reads column j of v."""
    dv, block = v.shape[-1], FLASHQLA_HEAD_DIM
    if dv == block:
        return call(v, initial_state)
    outs, finals = [], []
    for j in range(0, dv, block):
        h0 = None if initial_state is None else initial_state[..., j:j + block]
        o, fs = call(v[..., j:j + block], h0)
        outs.append(o)
        finals.append(fs)
    return torch.cat(outs, dim=-1), (torch.cat(finals, dim=-1) if output_final_state else None)


def _check_gdr_inputs(q, k, v, g, beta) -> tuple[int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require_device(name, t)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [T={q.shape[0]}, Hv, Dv]; got {tuple(v.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    value_heads_per_key_head(Hk, Hv)
    check_head_dims(Dk, Dv)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype for FlashQLA; got {q.dtype}, {k.dtype}, {v.dtype}")
    check_dtype(q.dtype)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, Hv={Hv}]; got {tuple(t.shape)}")
    return T, Hk, Dk, Hv, Dv


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
    """Gated delta rule over packed THD rows with FlashQLA, the state restarting at every boundary.

    q, k [T, Hk, 128] (bf16 / fp16); v [T, Hv, Dv] (Dv a multiple of 128), Hv a multiple of Hk;
    g [T, Hv] log decay (passed in fp32); beta [T, Hv]; initial_state [N, Hv, 128, Dv] (N =
    len(cu_seqlens) - 1, empty sequences included). Returns (o [T, Hv, Dv] in v's dtype,
    final_state [N, Hv, 128, Dv] fp32 or None).
    """
    T, Hk, Dk, Hv, Dv = _check_gdr_inputs(q, k, v, g, beta)
    cu = host_boundaries((0, T) if cu_seqlens is None else cu_seqlens, T)
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
        return o, (initial_state.float() if initial_state is not None
                   else v.new_zeros(n_all, Hv, Dk, Dv, dtype=torch.float32))
    cu_ne, keep = cu.nonempty()
    h0 = kept_initial_states(initial_state, keep, n_all)
    fn, auto_cp = flashqla_api().chunk_gated_delta_rule, auto_cp_setting()
    cu_dev = cu_ne.on(q.device, torch.int32)
    q1, k1, g1, b1 = q.unsqueeze(0), k.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0)

    def call(v_block, h0_block):
        o, fs = fn(q=q1, k=k1, v=v_block.unsqueeze(0), g=g1, beta=b1, scale=scale, initial_state=h0_block,
                   output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm,
                   cu_seqlens=cu_dev, auto_cp=auto_cp)
        return o.squeeze(0), fs

    o, fs = run_in_value_blocks(call, v, h0, output_final_state)
    o = o.to(v.dtype)
    if not output_final_state:
        return o, None
    return o, all_final_states(fs.float(), keep, n_all, initial_state)
