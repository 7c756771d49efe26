"""FlashQLA's own context parallelism as chunkwise's native core (FlashQLA >= 0.1.3).

FlashQLA 0.1.3's ``build_cp_context(cu_seqlens, enable_inter=True, group=...)`` cuts the global
packed stream exactly as chunkwise's contiguous layout does: rank r holds global rows
``[r*T/cp, (r+1)*T/cp)``, sequences may straddle ranks (``_calc_inter_cp_seqs``: ``part_len =
total // world_size``; it asserts ``total % world_size == 0``). Its kernels then exchange what the
scan carries themselves: forward, each rank's prepare-h kernel computes the last local sequence's
final state from zero and its transition matrix in the same pass (``fused_gdr_h`` with warm-up
chunks: ``[S_ext | M]``, in the activations' dtype), one ``all_gather_into_tensor`` (bytes of both,
``[world, n]`` output) brings them to every rank, and a correction kernel composes those of the
ranks that hold the first local sequence into its initial state; backward does the same for the
state gradient in reverse. With ``enable_intra`` it also splits long local sequences inside the
GPU (its ``auto_cp``).

FlashQLA has no conv, so this core takes the conv's halo from FLA's cp context (FLA's conv kernel,
:func:`gdn_cp.ops.fla.native_cp.context_conv`): it runs where FLA's cp context runs (an NCCL group,
or gloo ranks whose collectives a harness adapted: the same ``[world, n]`` all-gather output) and
takes the packings FLA's context takes (:func:`check_native_rows`). FlashQLA has no zigzag layout:
chunkwise routes zigzag rows to the contiguous slices first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch

from ...comm import group_size
from ...layout.boundaries import host_boundaries
from ..fla import detect as fla_detect
from ..fla import native_cp as fla_native
from ..kernel_args import check_core_args
from ..shape import GDNShape
from . import kernels
from .detect import features, flashqla_version
from .kernels import (
    causal_conv1d,
    chunk_gated_delta_rule,
    flashqla_api,
    pad_value_heads,
    run_in_value_blocks,
    unpad_value_heads,
)
from .spec import padded_value_heads
from .spec import SPEC

__all__ = ["check_native_rows", "inter_card_core", "native_cp_core", "native_cp_problem"]

_CACHE_KEY = "flashqla_cp_context"


def native_cp_problem() -> str | None:
    """Why FlashQLA's inter-card core cannot run in this process (None when it can, on a group FLA's
    cp context takes: :func:`native_cp_core`); host-side, for refusals made before any rank starts."""
    found = features()
    if found.problem is not None:
        return found.problem
    if not found.inter_card_cp:
        return (f"flash-qla {flashqla_version()} has no inter-card cp context (build_cp_context(enable_inter=...) "
                "and chunk_gated_delta_rule(cp_context=...), FlashQLA >= 0.1.3)")
    fla = fla_native.native_cp_problem()
    if fla is not None:
        return f"the conv's halo comes from FLA's cp context, which cannot run: {fla}"
    return None


def native_cp_core(group, *, auto_cp: bool = True):
    """:func:`inter_card_core` (with FlashQLA's ``auto_cp``) when FlashQLA's inter-card context and FLA's
    cp context (the conv) can run on ``group``, else None (then chunkwise exchanges halos and state
    summaries itself)."""
    if group is None or native_cp_problem() is not None or not fla_native.runs_on(group):
        return None
    return partial(inter_card_core, auto_cp=auto_cp)


def check_native_rows(cu_seqlens_global: Sequence[int], cp_size: int, conv_kernel_size: int) -> None:
    """ValueError when the native core cannot take this packing at this CP size (FLA's conv context's
    rules: :func:`gdn_cp.ops.fla.native_cp.check_chunkwise_layout`; FlashQLA's are a subset)."""
    fla_native.check_chunkwise_layout(cu_seqlens_global, cp_size, conv_kernel_size,
                                      allow_short_tails=fla_detect.features().clamps_halo)


@dataclass(frozen=True)
class _ContextEntry:
    boundaries: Any  # the caller's boundaries object (held: its id cannot be reused meanwhile)
    group: Any
    key: tuple  # (num_v_heads, device, is_train, auto_cp)
    ctx: Any


def _cp_context(cache: dict | None, cu_seqlens_global, group, num_v_heads: int, device: torch.device, auto_cp: bool):
    """FlashQLA's inter-card context for these boundaries (without empty sequences; their layout was
    checked by FLA's context, built first), kept in ``cache`` (a plan's ``backend_cache``) for the life of
    the plan. Built from host values: no device sync."""
    is_train = torch.is_grad_enabled()
    key = (num_v_heads, device, is_train, auto_cp)
    entry = None if cache is None else cache.get(_CACHE_KEY)
    if entry is not None and entry.boundaries is cu_seqlens_global and entry.group is group and entry.key == key:
        return entry.ctx
    cu_ne, _ = host_boundaries(cu_seqlens_global, name="cu_seqlens_global").nonempty()
    ctx = flashqla_api().build_cp_context(
        cu_ne.on(device, torch.int32), enable_inter=True, enable_intra=auto_cp, group=group,
        num_v_heads=num_v_heads, chunk_size=features().chunk_size, cu_seqlens_cpu=cu_ne.cpu().clone(),
        is_train=is_train)
    if cache is not None:
        cache[_CACHE_KEY] = _ContextEntry(cu_seqlens_global, group, key, ctx)
    return ctx


def inter_card_core(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    *,
    shape: GDNShape,
    cu_seqlens_global: Sequence[int],
    group,
    cache: dict | None = None,
    scale: float | None = None,
    auto_cp: bool = True,
) -> torch.Tensor:
    """Conv (SiLU, FLA's cp context) + FlashQLA's gated delta rule (its inter-card cp context) on this
    rank's contiguous slice ``qkv [T_c, C]`` (channels ``[q | k | v]`` before the conv), ``g, beta
    [T_c, Hv]``, ``conv_weight [C, W]``; ``cu_seqlens_global``: the global boundaries (pass the same
    Boundaries object on every call, e.g. a plan's, so that both contexts kept in ``cache`` are
    reused). The tensors are checked on every call, the rows' layout when FLA's context is built (once
    per plan), all before the first collective. Returns ``o [T_c, Hv, Dv]``."""
    w = check_core_args(SPEC, qkv, g, beta, conv_weight, shape, kernels.DEVICE_TYPES)
    cp_size = 1 if group is None else group_size(group)
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    t_c = qkv.shape[0]
    if cp_size == 1:
        cu = fla_native.check_chunkwise_layout(cu_seqlens_global, 1, w, local_rows=t_c)
        x = causal_conv1d(qkv, conv_weight, conv_bias, cu_seqlens=cu, activation="silu")
    else:
        problem = native_cp_problem()
        if problem is not None:
            raise RuntimeError(f"FlashQLA's native chunkwise core cannot run: {problem}. Fix: chunkwise path "
                               "'generic' (GDN_CP_CHUNKWISE_PATH), or linear_cp_backend='fla'.")
        x = fla_native.context_conv(qkv, conv_weight, conv_bias, cu_seqlens_global=cu_seqlens_global, group=group,
                                    cache=cache)
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t_c, hk, dk), k.reshape(t_c, hk, dk), v.reshape(t_c, hv, dv)
    if cp_size == 1:
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, scale=scale, use_qk_l2norm=shape.qk_l2norm,
                                      auto_cp=auto_cp)
        return o
    padded = padded_value_heads(hk, hv)  # value heads FlashQLA compiles (zero heads added where it does not)
    ctx = _cp_context(cache, cu_seqlens_global, group, padded, qkv.device, auto_cp)
    fn = flashqla_api().chunk_gated_delta_rule
    q1, k1 = q.unsqueeze(0), k.unsqueeze(0)
    g1, b1 = (pad_value_heads(x, hk, padded).unsqueeze(0) for x in (g.float(), beta))

    def call(v_block, _h0):
        o, _ = fn(q=q1, k=k1, v=pad_value_heads(v_block, hk, padded).unsqueeze(0), g=g1, beta=b1, scale=scale,
                  use_qk_l2norm_in_kernel=shape.qk_l2norm, cu_seqlens=ctx.cu_seqlens, auto_cp=auto_cp, cp_context=ctx)
        return unpad_value_heads(o.squeeze(0), hk, hv), None

    o, _ = run_in_value_blocks(call, v, None, False)
    return o.to(v.dtype)
