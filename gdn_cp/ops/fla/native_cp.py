"""FLA's native context parallelism: the chunkwise core with FLA's cp context.

Two cuts of the global packed stream (``cu_seqlens_global``: the documents' boundaries):

- contiguous (:func:`cp_context_core`): rank r holds global rows ``[r*T/cp, (r+1)*T/cp)``
  (sequences may straddle ranks);
- zigzag (:func:`zigzag_context_core`, FLA >= 0.6's ``build_cp_context(..., layout="zigzag")``):
  the whole stream is cut into 2*cp equal parts and rank r holds part r then part 2*cp-1-r, as
  if it were one sequence, while the state and the conv still restart at every document
  boundary. That is Megatron's SBHD cut at batch 1 and its whole-row THD cut, so chunkwise needs
  no layout all-to-all there.

FLA's kernels exchange the conv halo and the carried state themselves, through the cp context
that ``fla.ops.cp.build_cp_context`` makes from the global boundaries. The context is built from
host values (no device sync), once per plan: it is kept in the plan's ``backend_cache``, keyed
by the boundaries object (immutable), the layout, the conv kernel size, the group and the device.

FLA's context collectives are ``all_gather_into_tensor`` into a ``[world, n, ...]`` output and
``all_reduce``. NCCL takes that output; gloo wants it flat ``[world*n, ...]``. So the native
core runs on groups of the backends in :data:`gdn_cp.ops.fla.spec.FLA_COLLECTIVE_BACKENDS` (NCCL; a test harness that
adapts FLA's collectives for gloo ranks sharing one GPU adds gloo there, and says so); each
backend it runs on is logged once.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch

from ...comm import group_backend, group_size
from ...layout.boundaries import Boundaries, check_cp, host_boundaries
from ..kernel_args import check_core_args
from ..shape import GDNShape
from . import detect
from .detect import features, fla_version, has_cp_context, has_zigzag_layout
from .kernels import causal_conv1d, chunk_gated_delta_rule, fla_api, kv_heads_for_kernel
from . import spec as fla_spec
from .spec import SPEC

__all__ = [
    "check_chunkwise_layout",
    "check_native_rows",
    "check_zigzag_stream",
    "context_conv",
    "cp_context_core",
    "native_cp_core",
    "native_cp_problem",
    "native_zigzag_cp_core",
    "runs_on",
    "zigzag_context_core",
]

logger = logging.getLogger(__name__)

_CACHE_KEY = "fla_cp_context"
_ZIGZAG_CACHE_KEY = "fla_cp_context_zigzag"

_ADMITTED: set = set()  # backends already logged as running FLA's cp context


def runs_on(group) -> bool:
    """Whether FLA's cp context runs on ``group`` in this process: a group of a backend in
    :data:`gdn_cp.ops.fla.spec.FLA_COLLECTIVE_BACKENDS` (logged the first time per backend)."""
    if group is None or not has_cp_context():
        return False
    backend = group_backend(group)
    if backend not in fla_spec.FLA_COLLECTIVE_BACKENDS:
        return False
    if backend not in _ADMITTED:
        _ADMITTED.add(backend)
        logger.info("FLA's cp context runs on a %s group", backend)
    return True


def native_cp_core(group):
    """:func:`cp_context_core` when FLA's cp context can run on ``group``, else None.

    It can on groups of :data:`gdn_cp.ops.fla.spec.FLA_COLLECTIVE_BACKENDS` (NCCL); elsewhere (gloo) the chunkwise mode
    exchanges halos and states itself and runs FLA's kernels per rank.
    """
    return cp_context_core if runs_on(group) else None


def native_zigzag_cp_core(group):
    """:func:`zigzag_context_core` when :func:`native_cp_core` runs on ``group`` and this FLA's
    ``build_cp_context`` takes ``layout="zigzag"`` (FLA >= 0.6), else None."""
    return zigzag_context_core if has_zigzag_layout() and runs_on(group) else None


def native_cp_problem() -> str | None:
    """Why FLA's cp context cannot run in this process (None when it can, on a group it takes:
    :func:`native_cp_core`); host-side, for refusals made before any rank starts."""
    if detect.has_cp_context():
        return None
    return f"FLA {detect.fla_version()}: {detect.features().cp_context_error}"


def check_native_rows(cu_seqlens_global: Sequence[int], cp_size: int, conv_kernel_size: int) -> None:
    """ValueError when FLA's cp context cannot take this packing at this CP size: the checks its
    cores make first (:func:`check_zigzag_stream` where the rows are one zigzag-cut stream and this
    FLA has a zigzag context, else :func:`check_chunkwise_layout`)."""
    cu = host_boundaries(cu_seqlens_global, name="cu_seqlens_global")
    if len(cu.nonempty()[1]) == 1 and detect.has_zigzag_layout():
        check_zigzag_stream(cu, cp_size, conv_kernel_size)
    else:
        check_chunkwise_layout(cu, cp_size, conv_kernel_size, allow_short_tails=detect.features().clamps_halo)


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
    source: Any  # the caller's boundaries object (held: its id cannot be reused meanwhile)
    key: tuple  # (group, conv kernel size, device, rows per rank)
    ctx: Any


def _checked_rows(layout: str, cu_seqlens_global, cp_size: int, conv_kernel_size: int, rows: int) -> Boundaries:
    """The rows' layout checked for FLA's cp context (host ints, no comm): :func:`check_chunkwise_layout`
    or :func:`check_zigzag_stream`."""
    if layout == "zigzag":
        return check_zigzag_stream(cu_seqlens_global, cp_size, conv_kernel_size, local_rows=rows)
    return check_chunkwise_layout(cu_seqlens_global, cp_size, conv_kernel_size, local_rows=rows,
                                  allow_short_tails=cp_size == 1 or features().clamps_halo)


def _cp_context(cache: dict | None, cu_seqlens_global, group, conv_kernel_size: int, device: torch.device, rows: int,
                layout: str = "contiguous"):
    """FLA's cp context for these boundaries, group, kernel size and layout, from ``cache`` when it holds
    it (a plan's ``backend_cache``: the boundaries were checked when it was built, so the plan is trusted
    on every later call of the micro-batch); built otherwise, after the rows' layout is checked, before
    any collective."""
    key = _CACHE_KEY if layout == "contiguous" else _ZIGZAG_CACHE_KEY
    want = (group, conv_kernel_size, device, rows)
    entry = None if cache is None else cache.get(key)
    if entry is not None and entry.source is cu_seqlens_global and entry.key[0] is group and entry.key[1:] == want[1:]:
        return entry.ctx
    cu = _checked_rows(layout, cu_seqlens_global, group_size(group), conv_kernel_size, rows)
    found = features()
    cu_ne, _ = cu.nonempty()  # empty sequences hold no rows; FLA's context never sees them
    kwargs: dict[str, Any] = {found.kernel_size_arg: conv_kernel_size}
    if found.takes_cu_seqlens_cpu:
        kwargs["cu_seqlens_cpu"] = cu_ne.cpu().clone()  # FLA keys caches on identity: one per build
    if layout != "contiguous":
        kwargs["layout"] = layout
    ctx = fla_api().build_cp_context(cu_ne.on(device), group, **kwargs)
    if cache is not None:
        cache[key] = _CPContextEntry(cu_seqlens_global, want, ctx)
    return ctx


def context_conv(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, *,
                 cu_seqlens_global: Sequence[int], group, cache: dict | None = None) -> torch.Tensor:
    """FLA's causal conv (SiLU) of this rank's contiguous rows ``qkv [T_c, C]`` with FLA's cp context
    for ``cu_seqlens_global`` (checked by :func:`check_chunkwise_layout` when the context is built): the
    halo comes from the ranks before, inside FLA's kernels. Returns ``[T_c, C]``. For backends without a
    conv of their own (FlashQLA's native core)."""
    _require_cp_context()
    ctx = _cp_context(cache, cu_seqlens_global, group, conv_weight.shape[1], qkv.device, qkv.shape[0])
    return _conv_with_context(ctx, qkv, conv_weight, conv_bias)


def _conv_with_context(ctx, qkv, conv_weight, conv_bias) -> torch.Tensor:
    x, _ = fla_api().causal_conv1d(
        x=qkv.unsqueeze(0), weight=conv_weight, bias=conv_bias, activation="silu", cp_context=ctx)
    return x.squeeze(0)


def _run_with_context(ctx, qkv, g, beta, conv_weight, conv_bias, shape: GDNShape, scale) -> torch.Tensor:
    """FLA's conv (SiLU) and gated delta rule on this rank's rows with cp context ``ctx``."""
    t_c = qkv.shape[0]
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    api = fla_api()
    x = _conv_with_context(ctx, qkv, conv_weight, conv_bias)
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    ratio = hv // hk
    q = kv_heads_for_kernel(q.reshape(t_c, hk, dk), ratio)
    k = kv_heads_for_kernel(k.reshape(t_c, hk, dk), ratio)
    o, _ = api.chunk_gated_delta_rule(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.reshape(t_c, hv, dv).unsqueeze(0),
        g=g.float().unsqueeze(0), beta=beta.unsqueeze(0), scale=scale,
        use_qk_l2norm_in_kernel=shape.qk_l2norm, cp_context=ctx)
    return o.squeeze(0)


def _local_core(qkv, g, beta, conv_weight, conv_bias, shape: GDNShape, cu: Boundaries, scale) -> torch.Tensor:
    """CP=1: the backend's own kernels on all rows."""
    t_c = qkv.shape[0]
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    x = causal_conv1d(qkv, conv_weight, conv_bias, cu_seqlens=cu, activation="silu")
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    o, _ = chunk_gated_delta_rule(
        q.reshape(t_c, hk, dk), k.reshape(t_c, hk, dk), v.reshape(t_c, hv, dv), g, beta,
        cu_seqlens=cu, scale=scale, use_qk_l2norm=shape.qk_l2norm)
    return o


def _require_cp_context() -> None:
    if not has_cp_context():
        raise RuntimeError(
            f"FLA {fla_version()}: {features().cp_context_error}. Fix: install flash-linear-attention "
            ">= 0.4.2, or use the headwise / all_gather modes."
        )


def _native_core(layout: str, qkv, g, beta, conv_weight, conv_bias, *, shape: GDNShape, cu_seqlens_global, group,
                 cache: dict | None = None, scale: float | None = None) -> torch.Tensor:
    """Conv (SiLU) + gated delta rule on this rank's rows with FLA's cp context of ``layout``: the tensors
    checked on every call, the rows' layout when the context is built (once per plan), all before the
    first collective."""
    w = check_core_args(SPEC, qkv, g, beta, conv_weight, shape)
    if group is None or group_size(group) == 1:
        cu = _checked_rows(layout, cu_seqlens_global, 1, w, qkv.shape[0])
        return _local_core(qkv, g, beta, conv_weight, conv_bias, shape, cu, scale)
    _require_cp_context()
    if layout == "zigzag" and not has_zigzag_layout():
        raise RuntimeError(
            f"FLA {fla_version()}: build_cp_context takes no layout= (FLA >= 0.6 does). Fix: upgrade FLA, "
            "or let chunkwise route the rows to the contiguous layout (cp_context_core)."
        )
    ctx = _cp_context(cache, cu_seqlens_global, group, w, qkv.device, qkv.shape[0], layout)
    return _run_with_context(ctx, qkv, g, beta, conv_weight, conv_bias, shape, scale)


cp_context_core = partial(_native_core, "contiguous")
cp_context_core.__doc__ = """Conv (SiLU) + gated delta rule on this rank's contiguous slice, with FLA's native CP
(a :class:`~gdn_cp.ops.contract.NativeCPCore`).

qkv [T_c, C] holds channels [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)] before the conv; g, beta [T_c, Hv];
conv_weight [C, W]. ``cu_seqlens_global``: global boundaries (pass the same object on every call,
e.g. a plan's, to reuse the cp context kept in ``cache``). Everything is checked before the first
collective. Returns o [T_c, Hv, Dv]."""


def check_zigzag_stream(cu_seqlens_global: Sequence[int], cp_size: int, conv_kernel_size: int, *,
                        local_rows: int | None = None) -> Boundaries:
    """Check global boundaries for FLA's zigzag cut of the whole stream (host ints, no comm).

    Checks: the Boundaries rules; T_global % (2*cp) == 0 (FLA refuses it otherwise, after
    nothing moved, but with a message about its own arguments); ``local_rows`` == T_global / cp;
    each of the 2*cp parts holds >= W-1 rows (FLA's zigzag conv takes its halo from the part
    before). Returns the boundaries as Boundaries.
    """
    cu = host_boundaries(cu_seqlens_global, name="cu_seqlens_global")
    check_cp(cp_size)
    total, parts = cu.total, 2 * cp_size
    if total % parts:
        raise ValueError(
            f"cu_seqlens_global: T_global={total} is not divisible by 2*cp={parts}: the zigzag cut takes "
            f"2*cp equal parts. Fix: pad the packed row to a multiple of {parts} rows."
        )
    if local_rows is not None and local_rows != total // cp_size:
        raise ValueError(
            f"this rank holds {local_rows} rows but cu_seqlens_global ends at {total}, i.e. "
            f"{total // cp_size} rows per rank at cp={cp_size}. Fix: pass this rank's zigzag rows "
            "(parts r and 2*cp-1-r of the whole stream) and the global (padded) boundaries."
        )
    if cp_size > 1 and total // parts < conv_kernel_size - 1:
        raise ValueError(
            f"each zigzag part holds {total // parts} rows (T_global={total} / 2*cp={parts}) but the conv halo "
            f"needs W-1={conv_kernel_size - 1} rows from the part before. Fix: use more tokens per rank or a smaller cp."
        )
    return cu


zigzag_context_core = partial(_native_core, "zigzag")
zigzag_context_core.__doc__ = """Conv (SiLU) + gated delta rule on this rank's zigzag rows of the whole stream,
with FLA's zigzag cp context (FLA >= 0.6): no layout all-to-all.

Rows: part r then part 2*cp-1-r of the global packed stream cut into 2*cp equal parts
(``[T_local, ...]``, T_local = T_global/cp), the documents' boundaries ``cu_seqlens_global`` (the
state and the conv restart there). Tensors as in :func:`cp_context_core`. Everything is checked
before the first collective. Returns o [T_local, Hv, Dv] in the same rows."""
