"""FLA's native context parallelism: the chunkwise core on a contiguous slice, with FLA's cp context.

Rank r holds global packed rows ``[r*T/cp, (r+1)*T/cp)`` (sequences may straddle ranks); FLA's
kernels exchange the conv halo and the carried state themselves, through the cp context that
``fla.ops.cp.build_cp_context`` makes from the global boundaries. The context is built from
host values (no device sync), once per plan: it is kept in the plan's ``backend_cache``, keyed
by the boundaries object (immutable), the conv kernel size, the group and the device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...comm import group_backend, group_size
from ...layout.boundaries import Boundaries, check_cp, host_boundaries
from ..shape import GDNShape
from .detect import features, fla_version, has_cp_context
from .kernels import causal_conv1d, check_head_dims, chunk_gated_delta_rule, expand_kv_groups, fla_api, require_cuda

__all__ = ["check_chunkwise_layout", "cp_context_core", "native_cp_core"]

_CACHE_KEY = "fla_cp_context"


def native_cp_core(group):
    """:func:`cp_context_core` when FLA's cp context can run on ``group``, else None.

    FLA's context exchanges halos and states with ``all_gather_into_tensor`` into a
    ``[world, n, ...]`` output, which NCCL takes and gloo rejects; on a gloo group (several
    ranks on one GPU) the chunkwise mode exchanges them itself and runs FLA's kernels per rank.
    """
    if group is None or not has_cp_context() or group_backend(group) != "nccl":
        return None
    return cp_context_core


def check_chunkwise_layout(
    cu_seqlens_global: Sequence[int],
    cp_size: int,
    conv_kernel_size: int,
    *,
    local_rows: int | None = None,
    allow_short_tails: bool = True,
) -> Boundaries:
    """Check global packed boundaries for FLA's contiguous CP partition (host ints, no comm).

    Checks: the Boundaries rules; T_global % cp == 0 (FLA floor-divides silently otherwise);
    ``local_rows`` == T_global / cp; every rank holds >= W-1 rows (FLA exchanges the last W-1
    rows of a rank as the next rank's conv halo); with ``allow_short_tails=False`` also that
    every sequence continuing onto the next rank has >= W-1 rows on this rank. Returns the
    boundaries as Boundaries.
    """
    cu = host_boundaries(cu_seqlens_global, name="cu_seqlens_global")
    check_cp(cp_size)
    total = cu.total
    if total % cp_size != 0:
        raise ValueError(
            f"cu_seqlens_global: T_global={total} is not divisible by {cp_size} (cp={cp_size}); FLA would "
            f"silently drop {total % cp_size} rows. Fix: pad the packed batch to a multiple of {cp_size} rows."
        )
    part = total // cp_size
    if local_rows is not None and local_rows != part:
        raise ValueError(
            f"this rank holds {local_rows} rows but cu_seqlens_global ends at {total}, i.e. "
            f"{part} rows per rank at cp={cp_size}. Fix: pass this rank's contiguous slice "
            f"[r*{part}, (r+1)*{part}) and the global (padded) boundaries."
        )
    w1 = conv_kernel_size - 1
    if cp_size > 1:
        if part < w1:
            raise ValueError(
                f"each rank holds {part} rows (T_global={total} / cp={cp_size}) but the conv halo needs "
                f"W-1={w1} rows from the previous rank. Fix: use more tokens per rank or a smaller cp."
            )
        if not allow_short_tails:
            # Each rank edge b lies strictly inside at most one sequence: look only at that one
            # (O(cp log n) per call, not O(cp * n)); edges in rank order find the lowest i first.
            for r in range(cp_size - 1):
                b = (r + 1) * part
                i = bisect.bisect_left(cu, b) - 1  # the last sequence starting before b
                s, e = cu[i], cu[i + 1]
                if s < b < e and b - max(s, r * part) < w1:
                    raise ValueError(
                        f"sequence {i} (rows [{s}, {e}) of cu_seqlens_global) has only "
                        f"{b - max(s, r * part)} rows on rank {r} and continues onto rank {r + 1}; "
                        f"the conv halo needs W-1={w1}. Fix: pad or re-pack so that no sequence "
                        f"starts within the last {w1 - 1} rows of a rank, or use a FLA whose CP "
                        "context clamps the halo (pre_num_conv_tokens)."
                    )
    return cu


@dataclass(frozen=True)
class _CPContextEntry:
    boundaries: Boundaries
    conv_kernel_size: int
    group: Any
    device: torch.device
    ctx: Any


def _cp_context(cache: dict | None, cu: Boundaries, group, conv_kernel_size: int, device: torch.device):
    """FLA's cp context for these boundaries, group and kernel size, from ``cache`` when it holds it."""
    entry = None if cache is None else cache.get(_CACHE_KEY)
    if (entry is not None and entry.boundaries is cu and entry.group is group
            and entry.conv_kernel_size == conv_kernel_size and entry.device == device):
        return entry.ctx
    found = features()
    cu_ne, _ = cu.nonempty()  # empty sequences hold no rows; FLA's context never sees them
    kwargs: dict[str, Any] = {found.kernel_size_arg: conv_kernel_size}
    if found.takes_cu_seqlens_cpu:
        kwargs["cu_seqlens_cpu"] = cu_ne.cpu().clone()  # FLA keys caches on identity: one per build
    ctx = fla_api()["build_cp_context"](cu_ne.on(device), group, **kwargs)
    if cache is not None:
        cache[_CACHE_KEY] = _CPContextEntry(cu, conv_kernel_size, group, device, ctx)
    return ctx


def cp_context_core(
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
) -> torch.Tensor:
    """Conv (SiLU) + gated delta rule on this rank's contiguous slice, with FLA's native CP.

    qkv [T_c, C] holds channels [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)] before the conv; g, beta
    [T_c, Hv]; conv_weight [C, W]. ``cu_seqlens_global``: global boundaries (pass the same
    Boundaries object on every call, e.g. a plan's, to reuse the cp context kept in ``cache``).
    Everything is checked before the first collective. Returns o [T_c, Hv, Dv].
    """
    for name, t in (("qkv", qkv), ("g", g), ("beta", beta), ("conv_weight", conv_weight)):
        require_cuda(name, t)
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T_c, C] (THD, batch folded into tokens, B == 1); got {tuple(qkv.shape)}")
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    check_head_dims(dk, dv)
    t_c, c = qkv.shape
    if c != shape.conv_dim:
        raise ValueError(
            f"qkv has {c} channels but [q|k|v] needs 2*{hk}*{dk} + {hv}*{dv} = {shape.conv_dim}. "
            "Fix: pass the GDNShape of this (TP-local) layer."
        )
    if conv_weight.dim() != 2 or conv_weight.shape[0] != c:
        raise ValueError(f"conv_weight must be [C={c}, W]; got {tuple(conv_weight.shape)}")
    w = conv_weight.shape[1]
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (t_c, hv):
            raise ValueError(f"{name} must be [T_c={t_c}, Hv={hv}]; got {tuple(t.shape)}")

    cp_size = 1 if group is None else group_size(group)
    cu = check_chunkwise_layout(
        cu_seqlens_global, cp_size, w, local_rows=t_c, allow_short_tails=cp_size == 1 or features().clamps_halo
    )
    if cp_size == 1:
        x = causal_conv1d(qkv, conv_weight, conv_bias, cu_seqlens=cu, activation="silu")
        q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
        o, _ = chunk_gated_delta_rule(
            q.reshape(t_c, hk, dk), k.reshape(t_c, hk, dk), v.reshape(t_c, hv, dv), g, beta,
            cu_seqlens=cu, scale=scale, use_qk_l2norm=shape.qk_l2norm)
        return o

    if not has_cp_context():
        raise RuntimeError(
            f"FLA {fla_version()}: {features().cp_context_error}. Fix: install flash-linear-attention "
            ">= 0.4.2, or use the headwise / all_gather modes."
        )
    ctx = _cp_context(cache, cu, group, w, qkv.device)
    api = fla_api()
    x, _ = api["causal_conv1d"](
        x=qkv.unsqueeze(0), weight=conv_weight, bias=conv_bias, activation="silu", cp_context=ctx)
    x = x.squeeze(0)
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    ratio = hv // hk
    q = expand_kv_groups(q.reshape(t_c, hk, dk), ratio)
    k = expand_kv_groups(k.reshape(t_c, hk, dk), ratio)
    o, _ = api["chunk_gated_delta_rule"](
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.reshape(t_c, hv, dv).unsqueeze(0),
        g=g.float().unsqueeze(0), beta=beta.unsqueeze(0), scale=scale,
        use_qk_l2norm_in_kernel=shape.qk_l2norm, cp_context=ctx)
    return o.squeeze(0)
