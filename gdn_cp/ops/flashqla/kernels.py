"""FlashQLA's gated delta rule behind the backend contract, at CP=1 (one rank's rows), with FLA's
causal conv and fused gated norm beside it (FlashQLA has neither).

Tensors are THD packed without a batch dimension (token first). FlashQLA takes FLA's layout
``[1, T, ...]`` with grouped value heads (q/k at the key heads), ``g`` in log space and
``cu_seqlens`` on the device; gdn-cp passes the caller's :class:`~gdn_cp.layout.Boundaries`' cached
int32 device copy (FlashQLA's own boundaries are int32; one dtype keeps TileLang to one kernel
variant, and the same tensor object lets FlashQLA's identity-keyed caches hit across layers).

What FlashQLA 0.1.3 takes (``hopper/*.py`` assert it; gdn-cp refuses anything else before any
collective, naming the fix): head dims ``K == V == 128`` and bf16 / fp16 q, k, v; an even number of
value heads (:func:`~gdn_cp.ops.flashqla.spec.value_heads_problem`): a call with an odd number runs with
zero value heads added to each key head's group (exact, :func:`pad_value_heads`). A value head dim
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

from ..installed import log_stack_once
from ..kernel_args import boundaries_of, check_gdr_args, check_initial_state
from ..varlen import varlen_gated_delta_rule
from .detect import conv_choice, features, flashqla_problem, fused_norm_choice, stack_report
from .native_warnings import quiet_native_warnings, quiet_tilelang_log
from .spec import FLASHQLA_HEAD_DIM, SPEC, first_use_note, padded_value_heads

__all__ = [
    "DEVICE_TYPES",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "FlashQLAFunctions",
    "flashqla_api",
    "fused_gated_rms_norm",
    "pad_value_heads",
    "run_in_value_blocks",
    "unpad_value_heads",
]

DEVICE_TYPES = SPEC.devices
"""The device types the kernels take (the CPU stand-in of the tests, ``tests/ops/fake_flashqla.py``,
widens it to take CPU tensors)."""


@dataclass(frozen=True)
class FlashQLAFunctions:
    """The FlashQLA functions gdn-cp calls (``build_cp_context``: None where it has no inter-card context)."""

    chunk_gated_delta_rule: Callable[..., Any]
    build_cp_context: Optional[Callable[..., Any]]


@functools.lru_cache(maxsize=1)
def flashqla_api() -> FlashQLAFunctions:
    """FlashQLA's functions (imported on first use); RuntimeError with the fix when it cannot run. TileLang's
    compile warnings are kept off stderr from here on (:func:`quiet_native_warnings`: before anything compiles), and
    its INFO lines off stdout (:func:`quiet_tilelang_log`); what the first compile costs and where its cache lives is
    logged once at INFO (``spec.first_use_note``: Megatron-LM logs at INFO by default)."""
    problem = flashqla_problem()
    if problem is not None:
        raise RuntimeError(f"FlashQLA backend unavailable: {problem}. Fix: install it on an sm_90+ GPU machine "
                           "(pip install -e '.[flashqla]'), or use linear_cp_backend='fla' / 'reference'.")
    log_stack_once("FlashQLA", stack_report)
    # once per process, before the first kernel compiles: minutes with nothing printed otherwise (TileLang's own
    # INFO lines, one per kernel, are kept out below)
    logging.getLogger(__name__).info("FlashQLA: %s", first_use_note())
    chunk = importlib.import_module("flash_qla.ops.gated_delta_rule.chunk")
    quiet_native_warnings()
    quiet_tilelang_log()  # after the import above (TileLang's sets its logger to INFO)
    return FlashQLAFunctions(importlib.import_module("flash_qla").chunk_gated_delta_rule,
                             getattr(chunk, "build_cp_context", None) if features().inter_card_cp else None)


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

def pad_value_heads(x: Optional[torch.Tensor], k_heads: int, padded: int) -> Optional[torch.Tensor]:
    """``x [N, Hv, ...]`` (value heads at dim 1, grouped by key head: head h reads key head h // (Hv/Hk), as
    FlashQLA's GVA does) -> ``[N, padded, ...]`` with zero heads added at the end of each key head's group.
    A zero head (v = 0, beta = 0, g = 0, state 0) never changes and outputs zeros: exact for the real heads.
    Returns ``x`` itself where nothing is added (None stays None)."""
    if x is None or x.shape[1] == padded:
        return x
    n, hv, rest = x.shape[0], x.shape[1], x.shape[2:]
    grouped = x.reshape(n, k_heads, hv // k_heads, *rest)
    zeros = grouped.new_zeros(n, k_heads, padded // k_heads - hv // k_heads, *rest)
    return torch.cat([grouped, zeros], dim=2).reshape(n, padded, *rest)


def unpad_value_heads(x: Optional[torch.Tensor], k_heads: int, v_heads: int) -> Optional[torch.Tensor]:
    """Inverse of :func:`pad_value_heads`: the layer's ``v_heads`` of ``x [N, padded, ...]``."""
    if x is None or x.shape[1] == v_heads:
        return x
    n, padded, rest = x.shape[0], x.shape[1], x.shape[2:]
    kept = x.reshape(n, k_heads, padded // k_heads, *rest)[:, :, :v_heads // k_heads]
    return kept.reshape(n, v_heads, *rest)


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
    auto_cp: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over packed THD rows with FlashQLA, the state restarting at every boundary.

    q, k [T, Hk, 128] (bf16 / fp16); v [T, Hv, Dv] (Dv a multiple of 128), Hv a multiple of Hk;
    g [T, Hv] log decay (passed in fp32); beta [T, Hv]; initial_state [N, Hv, 128, Dv] (N =
    len(cu_seqlens) - 1, empty sequences included). Returns (o [T, Hv, Dv] in v's dtype,
    final_state [N, Hv, 128, Dv] fp32 or None). ``auto_cp``: FlashQLA's own split of long sequences
    (:data:`gdn_cp.ops.flashqla.spec.AUTO_CP_ENV`; the backend passes the setting's value).
    """
    T, Hk, Dk, Hv, Dv = check_gdr_args(SPEC, q, k, v, g, beta, DEVICE_TYPES)
    cu = boundaries_of(cu_seqlens, T)
    check_initial_state(initial_state, cu.num_sequences, Hv, Dk, Dv)
    padded = padded_value_heads(Hk, Hv)  # value heads FlashQLA compiles (zero heads added where it does not)

    def run(cu_ne, h0):
        fn = flashqla_api().chunk_gated_delta_rule
        cu_dev = cu_ne.on(q.device, torch.int32)
        q1, k1 = q.unsqueeze(0), k.unsqueeze(0)
        g1, b1 = (pad_value_heads(x, Hk, padded).unsqueeze(0) for x in (g.float(), beta))

        def call(v_block, h0_block):
            o, fs = fn(q=q1, k=k1, v=pad_value_heads(v_block, Hk, padded).unsqueeze(0), g=g1, beta=b1, scale=scale,
                       initial_state=pad_value_heads(h0_block, Hk, padded), output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_dev, auto_cp=auto_cp)
            return unpad_value_heads(o.squeeze(0), Hk, Hv), unpad_value_heads(fs, Hk, Hv)

        o, fs = run_in_value_blocks(call, v, h0, output_final_state)
        return o.to(v.dtype), fs

    return varlen_gated_delta_rule(run, cu, v, Dk, initial_state, output_final_state)
